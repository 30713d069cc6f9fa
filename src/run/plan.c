// plan.c: memory planning (see plan.h).
//
// What the engine runs is planned exactly: the model, the optimizer and the
// data-parallel strategy each report the sizes they allocate
// (fl_model_memory, fl_optimizer_memory_table, fl_dist_memory), and the few
// buffers a training run adds are listed here. DDP and ZeRO 1-3 are planned
// for one rank (`rank`, by default rank 0, whose shard is the largest):
//
//   the model, whole on every rank; ZeRO-2/3 keep one unit's gradients at a
//   time (unit_grads) instead of a whole gradient buffer
//   the optimizer over the rank's range: the whole buffer (DDP) or its shard
//   (ZeRO), without a whole fp32 gradient sum under ZeRO-2/3 (sharded_grads)
//   fl_dist_memory: the reduced fp32 gradient of the range, two reduction
//   buckets, and under ZeRO-3 the shard of the 16-bit weights, the units kept
//   gathered and the gather ring. Over several ranks, ZeRO-3 initialises (or
//   resumes) only the shard; pretrained weights load whole on every rank, and
//   are freed once it keeps its shard: they count in the peak of tag params
//   (what decides whether a run fits), and are reported as freed after set-up.
//
// What the engine does not run (a raw parameter count; LoRA, NF4 or a fused
// optimizer with several ranks or a ZeRO stage, which fl_dist_attach
// refuses; the formula-only --lomo) is planned per rank from the published
// formulas, starting from the exact per-tag figures for one rank and moving
// bytes as the strategy would:
//
//   ZeRO (Rajbhandari et al. 2020), Psi parameters over N ranks, with
//   params/grads of the model's dtype and K = master + optimizer bytes per
//   parameter (K = 12 for mixed-precision AdamW: fp32 master, m and v):
//     stage 0 (DDP)  params + grads + master + optim, all whole     (2+2+K)Psi
//     stage 1        master and optim sharded                       4Psi + K Psi/N
//     stage 2        grads sharded too                              2Psi + (2+K)Psi/N
//     stage 3        params sharded too                             (2+2+K)Psi/N
//   A shard is ceil(bytes / N). The fp32 gradient sum of bf16/fp16 runs with
//   accumulation counts as gradients. Communication buffers (counted under
//   FL_MEM_COMM): stage 2 reduce-scatters each gradient as the backward pass
//   completes it, so it needs the largest tensor's whole gradient; stage 3
//   gathers one unit at a time (a block or the largest tensor), so it needs
//   that unit's whole weights and gradient (DeepSpeed's estimator: 4 x largest
//   layer in fp16). For a run the engine does plan exactly, the formula's
//   model states are printed beside the exact ones for comparison.
//
//   LOMO (Lv et al. 2023): the update is fused into the backward pass, so
//   there is no optimizer state, no fp32 master copy (the 16-bit weights are
//   updated in place, as in the paper), no gradient accumulation and only the
//   largest tensor's gradient alive at a time. (`--optimizer lomo` is run by
//   the engine and planned exactly; `fitlm plan --lomo` is this formula.)
//
//   Activation checkpointing is run by the engine, so it is planned exactly:
//   the model's slot lists say which activations each policy keeps.
//
// Tensor parallelism over t ranks (ranks = t x d) is planned exactly too:
// the model with tp_size t sizes the rank's slices and buffers itself; the
// optimizer and ZeRO cover the rank's table over its data-parallel group of
// d; the TP group's one scratch buffer is sized by the largest collective
// the model calls (fl_tp_scratch_bytes, which sizes it in the engine too).
//
// Pipeline parallelism over p stages (ranks = t x p x d) is planned stage by
// stage: the model's fl_model_memory with the stage (its rows as its own
// table beside the whole one, the row maps, its chunks' activation sets),
// the optimizer and ZeRO-1/DDP over the stage's table, the executor's
// buffers (fl_pipeline_memory) and the pipeline group's table, which the
// gradient norm sums over. Every stage is planned; the largest decides.
#include "fitlm/plan.h"
#include "fitlm/comm.h"
#include "fitlm/dist.h"
#include "fitlm/train.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

void fl_plan_request_init(fl_plan_request *r) {
    memset(r, 0, sizeof *r);
    r->dtype = FL_F32;
    r->optim.kind = FL_OPT_ADAMW;
    r->optim.beta1 = 0.9f;
    r->optim.beta2 = 0.95f;
    r->optim.eps = 1e-8f;
    r->optim.grad_accum = 1;
    r->ranks = 1;
    r->random_init = 1;
    r->tensor_parallel = 1;
    r->pipeline_parallel = 1;
    r->virtual_stages = 1;
    r->pipeline_schedule = FL_PP_1F1B;
    r->pipeline_split = FL_PP_SPLIT_PARAMETERS;
    fl_train_config defaults; // zero_optimization's defaults, from the config's own table
    fl_config_defaults(&defaults);
    r->zero = defaults.zero;
}

void fl_plan_request_from_config(fl_plan_request *r, const fl_train_config *cfg,
                                 size_t data_bytes) {
    fl_plan_request_init(r);
    r->model = cfg->model;
    r->dtype = cfg->dtype;
    r->optim = fl_config_optimizer(cfg);
    r->B = cfg->micro_batch;
    r->T = cfg->seq_len;
    r->threads = cfg->threads;
    r->recompute = cfg->recompute;
    r->data_bytes = data_bytes;
    r->sample_tokens = cfg->sample_tokens;
    if (cfg->lora_enabled) r->lora = cfg->lora;
    if (cfg->lora_enabled && cfg->lora.train_base) r->base_optim = fl_config_base_optimizer(cfg);
    r->quant = cfg->quant;
    r->zero = cfg->zero;
    r->zero_stage = cfg->zero.stage;
    r->tensor_parallel = cfg->tensor_parallel;
    r->sequence_parallel = cfg->sequence_parallel;
    r->pipeline_parallel = cfg->pipeline_parallel;
    r->virtual_stages = cfg->virtual_stages;
    r->pipeline_schedule = fl_pp_schedule_kind(cfg->pipeline_schedule);
    FL_ASSERT(r->pipeline_schedule >= 0); // a checked choice
    int list[FL_PP_MAX_VIRTUAL], n_list;
    r->pipeline_split =
        fl_pp_split_parse(cfg->pipeline_split, "pipeline_parallel.split", list, &n_list);
    fl_pp_config_split(cfg, &cfg->model, r->stage_blocks);
    r->whole_weights_first = *cfg->init_from != 0;
    // run.c's init_model: drawn unless loaded (a resume's frozen LoRA base is drawn again)
    r->random_init =
        !*cfg->init_from && (!*cfg->resume || (cfg->lora_enabled && !cfg->lora.train_base));
    r->offload = fl_offload_config_of(cfg);
    r->dev = fl_device_get(cfg->device);
    // on a device --mem-limit is its budget; the host keeps its available memory
    if (*cfg->mem_limit && !r->dev->host)
        r->device_cap = fl_parse_bytes(cfg->mem_limit, "mem_limit");
    r->dev_offload = !r->dev->host && strcmp(cfg->zero_extra.offload_optimizer, "none");
    r->dev_weights = fl_dev_weights_offloaded(cfg);
    if (!r->dev->host) r->zero_stage = 0; // one process on a device: the plain path (run.c)
}

// ----------------------------------------------------------------------------
// computing a plan

static size_t ceil_div(size_t a, size_t b) {
    return a / b + (a % b != 0);
}

static void note_add(fl_plan *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note_add(fl_plan *p, const char *fmt, ...) {
    size_t n = strlen(p->note);
    if (n + 3 >= sizeof p->note) return;
    if (n) {
        strcpy(p->note + n, "; ");
        n += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->note + n, sizeof p->note - n, fmt, ap);
    va_end(ap);
}

static const fl_lora_config *lora_of(const fl_plan_request *r) {
    return r->lora.r ? &r->lora : NULL;
}

// The adapters' parameters on the model's table.
static size_t lora_numel(const fl_plan_request *r, const fl_model_config *c) {
    fl_param_table t, lt;
    fl_model_table(&t, c);
    fl_lora_table(&lt, &t, c, &r->lora, NULL);
    size_t n = lt.numel;
    fl_params_free(&lt);
    fl_params_free(&t);
    return n;
}

// whether the model keeps one unit's gradients at a time (fused optimizers)
static int unit_grads_of(const fl_plan_request *r) {
    if (lora_of(r)) return r->lora.train_base && fl_optimizer_unit_grads(&r->base_optim);
    return fl_optimizer_unit_grads(&r->optim);
}

// The layout: t tensor-parallel ranks (1: none) times d data-parallel
// replicas times p pipeline stages; the rank's index in each (Megatron's
// order: TP fastest, then DP, then PP).
static int tp_of(const fl_plan_request *r) {
    return r->tensor_parallel > 1 ? r->tensor_parallel : 1;
}

static int pp_of(const fl_plan_request *r) {
    return r->pipeline_parallel > 1 ? r->pipeline_parallel : 1;
}

static int dp_of(const fl_plan_request *r) {
    return r->ranks / (tp_of(r) * pp_of(r));
}

static int pp_rank_of(const fl_plan_request *r) {
    return r->rank / (tp_of(r) * dp_of(r));
}

// Pipeline rank s's stage: its chunks' blocks and activation sets.
static void stage_of(const fl_plan_request *r, int s, fl_pp_stage *out) {
    fl_pp_stage_of(out, r->pipeline_schedule, pp_of(r), r->virtual_stages, r->optim.grad_accum, s,
                   r->stage_blocks);
}

static int dp_rank_of(const fl_plan_request *r) {
    return r->rank / tp_of(r) % dp_of(r);
}

// Whether sequence parallelism, if on, splits the micro-batch's B x T
// tokens evenly over the t ranks, as it must.
static int tokens_split(const fl_plan_request *r) {
    return !r->sequence_parallel || ((size_t)r->B * r->T) % (size_t)tp_of(r) == 0;
}

// What `fitlm train` refuses under tensor parallelism (run.c, the model), or NULL.
static const char *tp_refused(const fl_plan_request *r) {
    if (tp_of(r) == 1) return NULL;
    if (r->lora.r) return "LoRA adapters";
    if (r->quant.enabled) return "NF4 base weights";
    return NULL;
}

// Pipeline parallelism: what the executor runs, over a model shape.
static void check_pipeline(const fl_plan_request *r) {
    const int p = r->pipeline_parallel, t = tp_of(r), v = r->virtual_stages;
    if (r->ranks % (t * p))
        fl_die("plan: tensor parallel %d x pipeline parallel %d = %d does not divide the %d ranks",
               t, p, t * p, r->ranks);
    if (p > FL_PLAN_MAX_STAGES)
        fl_die("plan: pipeline parallel %d: at most %d stages are planned", p, FL_PLAN_MAX_STAGES);
    if (r->num_params)
        fl_die("plan: pipeline parallelism needs a model shape (its stages hold blocks), not a raw "
               "parameter count");
    char why[256];
    if (fl_pp_schedule_check(r->pipeline_schedule, p, r->optim.grad_accum, v, why, sizeof why))
        fl_die("plan: %s", why);
    fl_model_config c = r->model;
    fl_model_config_finish(&c);
    fl_pp_split_check(c.n_layer, p * v, r->stage_blocks);
}

static void check_request(const fl_plan_request *r) {
    if (r->ranks < 1) fl_die("plan: ranks must be >= 1 (got %d)", r->ranks);
    if (r->tensor_parallel < 1 || r->ranks % tp_of(r))
        fl_die("plan: the tensor-parallel size %d must be >= 1 and divide the %d ranks",
               r->tensor_parallel, r->ranks);
    if (pp_of(r) > 1) check_pipeline(r);
    if (r->sequence_parallel && tp_of(r) == 1)
        fl_die("plan: sequence parallelism needs a tensor-parallel size above 1");
    if (tp_refused(r))
        fl_die("plan: tensor parallelism (%d ranks) with %s is not supported", tp_of(r),
               tp_refused(r));
    if (r->zero_stage < 0 || r->zero_stage > 3)
        fl_die("plan: ZeRO stage must be 0, 1, 2 or 3 (got %d)", r->zero_stage);
    if (r->rank < 0 || r->rank >= r->ranks)
        fl_die("plan: rank must be in [0, %d) (got %d)", r->ranks, r->rank);
    if (r->B < 0 || r->T < 0)
        fl_die("plan: micro-batch and sequence length must not be negative (B=%d, T=%d)", r->B,
               r->T);
    if (r->optim.grad_accum < 1)
        fl_die("plan: gradient accumulation steps must be >= 1 (got %d)", r->optim.grad_accum);
    if (!tokens_split(r))
        fl_die("plan: sequence parallelism: B x T = %d x %d tokens do not split over %d "
               "tensor-parallel ranks",
               r->B, r->T, tp_of(r));
}

// Whether the run is data-parallel: several replicas, or a ZeRO stage on
// one training the whole model, as fl_run_open decides (fl_dist_engine:
// LoRA on one rank takes the plain path).
static int dist_of(const fl_plan_request *r) {
    return dp_of(r) > 1 || (r->zero_stage > 0 && !r->lora.r);
}

// The model's parameters on this rank: its slices under tensor parallelism
// (every rank's are the same size), of its pipeline stage's rows.
static void rank_table(const fl_plan_request *r, const fl_model_config *c, fl_param_table *t) {
    fl_model_rank_table(t, c, r->rank % tp_of(r));
    if (pp_of(r) == 1) return;
    fl_pp_stage s;
    stage_of(r, pp_rank_of(r), &s);
    fl_param_table rank = *t;
    fl_model_stage_table(t, &rank, c, &s, NULL);
    fl_params_free(&rank);
}

// Of a table: the largest row, and the largest unit (a block, or the
// largest row when that is more): what LOMO's and ZeRO's formulas gather.
static void table_sizes(const fl_param_table *t, int n_layer, size_t *largest, size_t *unit) {
    size_t *per = fl_alloc(FL_MEM_OTHER, ((size_t)n_layer + 2) * sizeof(size_t));
    *largest = *unit = 0;
    for (int k = 0; k < t->count; k++) {
        const fl_param_view *v = &t->views[k];
        if (v->numel > *largest) *largest = v->numel;
        per[v->unit + 1] += v->numel;
    }
    for (int u = 1; u <= n_layer; u++) // the blocks
        if (per[u] > *unit) *unit = per[u];
    if (*largest > *unit) *unit = *largest;
    fl_free(per);
}

// What fl_dist_attach refuses to run over several ranks or under a ZeRO
// stage (its check_supported), or NULL; then the figures are formulas.
static const char *dist_refused(const fl_plan_request *r) {
    if (lora_of(r)) return "LoRA";
    if (r->quant.enabled) return "NF4 base weights";
    if (r->lomo) return "LOMO";
    return NULL;
}

static fl_zero_config zero_of(const fl_plan_request *r) {
    fl_zero_config z = r->zero;
    z.stage = r->zero_stage;
    fl_dist_derive(&z, &r->optim); // as fl_config_finish does
    return z;
}

// A data-parallel run the engine runs, planned exactly: the optimizer over
// this rank's range (opt) and what fl_dist_attach allocates (dist, of which
// ZeRO-3 frees *params_freed bytes of the model's weights after set-up).
static void plan_dist_exact(const fl_plan_request *r, const fl_model_config *c,
                            size_t opt[FL_MEM_NTAGS], size_t dist[FL_MEM_NTAGS],
                            size_t *params_freed, size_t *disk, size_t unpaged[FL_MEM_NTAGS]) {
    fl_zero_config z = zero_of(r);
    fl_param_table t;
    rank_table(r, c, &t);
    // fl_dist_range's: the whole buffer under DDP, the rank's shard under ZeRO
    // (over its data-parallel group)
    const int d = dp_of(r), dp_rank = dp_rank_of(r);
    size_t begin, end;
    fl_dist_shard(&z, &t, d, dp_rank, &begin, &end);
    fl_optimizer_config o = r->optim;
    o.sharded_grads = z.stage >= 2; // as `fitlm train` sets it
    fl_optimizer_memory_table(&o, r->dtype, &t, begin, end, opt);
    if (o.paged) { // NVMe offload: chunk buffers in RAM, the rest on disk
        size_t pb[FL_MEM_NTAGS];
        fl_offload_memory(&r->offload, end - begin, fl_optimizer_paged_tensors(&o, r->dtype),
                          z.offload_params ? fl_dtype_size(r->dtype) : 0, pb, disk);
        for (int k = 0; k < FL_MEM_NTAGS; k++) opt[k] += pb[k];
        o.paged = 0;
        fl_optimizer_memory_table(&o, r->dtype, &t, begin, end, unpaged);
        if (z.offload_params) unpaged[FL_MEM_PARAMS] = (end - begin) * fl_dtype_size(r->dtype);
    }
    // the optimizer's whole fp32 gradient sum (16-bit weights, accumulation)
    int accum_buffer = opt[FL_MEM_GRADS] != 0;
    fl_dist_memory(&z, &t, c->n_layer, r->dtype, accum_buffer, d, dp_rank, dist, params_freed);
    fl_params_free(&t);
}

// ZeRO's published formulas (see the top of this file), applied to the
// per-rank bytes b of the one-rank plan.
static void zero_by_formula(const fl_plan_request *r, size_t *b, size_t largest, size_t unit,
                            fl_plan *out) {
    size_t N = (size_t)dp_of(r), ds = fl_dtype_size(r->dtype);
    if (r->zero_stage >= 1) {
        b[FL_MEM_MASTER] = ceil_div(b[FL_MEM_MASTER], N);
        b[FL_MEM_OPTIM] = ceil_div(b[FL_MEM_OPTIM], N);
    }
    if (r->zero_stage >= 2) {
        if (!r->lomo) b[FL_MEM_GRADS] = ceil_div(b[FL_MEM_GRADS], N);
        if (r->zero_stage == 2) b[FL_MEM_COMM] += largest * ds; // one whole gradient
    }
    if (r->zero_stage == 3) {
        b[FL_MEM_PARAMS] = ceil_div(b[FL_MEM_PARAMS], N);
        b[FL_MEM_COMM] += 2 * unit * ds; // one gathered unit: weights and gradient
    }
    if (r->zero_stage >= 2 && !largest)
        note_add(out, "communication buffers not counted (tensor sizes unknown)");
}

static size_t model_states_of(const size_t *b) {
    return b[FL_MEM_PARAMS] + b[FL_MEM_GRADS] + b[FL_MEM_MASTER] + b[FL_MEM_OPTIM];
}

// The ZeRO paper's model states for an exactly planned data-parallel run:
// its formula applied to the same run's one-rank plan.
static size_t formula_model_states(const fl_plan_request *r, size_t largest, size_t unit) {
    fl_plan_request one = *r; // the rank's model-parallel group alone (its stage)
    one.ranks = tp_of(r) * pp_of(r);
    one.rank = r->rank % tp_of(r) + tp_of(r) * pp_rank_of(r);
    one.one_stage = 1;
    one.zero_stage = 0;
    fl_plan p;
    fl_plan_compute(&one, &p);
    zero_by_formula(r, p.bytes, largest, unit, &p);
    return model_states_of(p.bytes);
}

// The TP group's scratch: its largest call in a step of BT positions
// (evaluation and generation run no more). The linear unit's and the
// embedding's sums of (BT, n_embd) in the dtype: all-reduces, or under
// sequence parallelism reduce-scatters to BT/t positions (GPT-2's embedding
// all-reduce of BT positions takes the same, t dividing BT); there also the
// sum of one unit's token-wise gradients (norm weights, row-parallel
// biases); the vocabulary-parallel loss's (BT, 2) fp32 sums (on the stage
// that holds the head).
static size_t tp_scratch_of(const fl_model_config *c, const fl_param_table *rows, fl_dtype dt,
                            size_t BT, int head) {
    const int t = c->tp_size;
    const size_t C = (size_t)c->n_embd;
    size_t most = head ? fl_tp_scratch_bytes(t, FL_TP_ALL_REDUCE, FL_F32, 2 * BT) : 0;
    size_t hidden = c->sequence_parallel
                        ? fl_tp_scratch_bytes(t, FL_TP_REDUCE_SCATTER, dt, BT / (size_t)t * C)
                        : fl_tp_scratch_bytes(t, FL_TP_ALL_REDUCE, dt, BT * C);
    if (hidden > most) most = hidden;
    if (c->sequence_parallel) {
        size_t *per = fl_alloc(FL_MEM_OTHER, ((size_t)c->n_layer + 2) * sizeof(size_t));
        for (int k = 0; k < rows->count; k++)
            if (rows->views[k].flags & FL_PARAM_TOKENWISE)
                per[rows->views[k].unit + 1] += rows->views[k].numel;
        for (int u = 0; u < c->n_layer + 2; u++) {
            size_t b = fl_tp_scratch_bytes(t, FL_TP_ALL_REDUCE, dt, per[u]);
            if (b > most) most = b;
        }
        fl_free(per);
    }
    return most;
}

// fl_model_generate's workspace at its peak, the sampler's sort inside it:
// an fp32 row of the vocabulary's logits (under tensor parallelism every
// rank's columns gathered, t x the columns per rank, and this rank's; under
// sequence parallelism a context of T ids) and the (logit, id) sort buffer.
static size_t generate_bytes(const fl_model_config *c, int T) {
    const int t = c->tp_size > 1 ? c->tp_size : 1;
    size_t V = (size_t)c->vocab_size, row = V;
    if (t > 1) {
        size_t cols = fl_params_vocab_rows(V, t);
        row = (size_t)t * cols + cols;
    }
    size_t context = c->sequence_parallel ? (size_t)T * sizeof(int) : 0;
    return row * sizeof(float) + V * 8 + context;
}

// The plan of one rank (under pipeline parallelism, of its stage).
static void plan_rank(const fl_plan_request *r, fl_plan *out) {
    memset(out, 0, sizeof *out);
    size_t *b = out->bytes;
    const fl_dtype dt = r->dtype;
    const size_t ds = fl_dtype_size(dt);
    const int shaped = r->num_params == 0;
    const int dist = dist_of(r);
    const char *refused = dist ? dist_refused(r) : NULL;
    const int dist_exact = dist && shaped && !refused;
    const fl_zero_config zero = zero_of(r);
    const size_t BT = (size_t)r->B * (size_t)r->T;
    fl_model_config c = r->model;
    size_t numel, largest, unit; // parameters; largest tensor; largest ZeRO-3 gather unit
    size_t opt[FL_MEM_NTAGS] = {0}, dist_bytes[FL_MEM_NTAGS] = {0};
    const int tp = tp_of(r), pp = pp_of(r);
    fl_pp_stage stage, *st = NULL; // the rank's pipeline stage (NULL: the whole model)
    if (pp > 1) stage_of(r, pp_rank_of(r), st = &stage);
    size_t tp_scratch = 0; // the TP group's, the largest call's (comm)
    // the step's gradient norm under pipeline parallelism: a sum of squares
    // per row of the whole model, in its order (beside the gate's per row of
    // the stage, the optimizer's)
    size_t norm_rows = 0, whole_rows = 0;
    size_t init_bytes = 0; // the random start's drawing buffer (fl_params_init_each)
    int stage_rows = 0;    // the rank's rows (of its stage)
    if (shaped) {
        c.tp_size = tp;
        c.sequence_parallel = tp > 1 && r->sequence_parallel;
        fl_model_config_finish(&c);
        if (r->T > c.max_seq_len)
            fl_die("plan: sequence length %d exceeds the model's max_seq_len %d", r->T,
                   c.max_seq_len);
        fl_param_table rows;
        rank_table(r, &c, &rows);
        numel = rows.numel;
        stage_rows = rows.count;
        table_sizes(&rows, c.n_layer, &largest, &unit);
        if (tp > 1 && BT)
            tp_scratch =
                tp_scratch_of(&c, &rows, dt, BT, !st || fl_pp_has_head(st, st->chunks - 1));
        fl_params_free(&rows);
        fl_param_table whole;
        fl_model_table(&whole, &c);
        whole_rows = (size_t)whole.count;
        if (pp > 1) norm_rows = whole_rows; // the norm's sums in the whole table's order
        int threads = r->threads > 0 ? r->threads : fl_threads();
        if (r->random_init) init_bytes = fl_params_init_bytes(whole.numel, threads);
        fl_params_free(&whole);
        // B = 0 tells the model to leave out activations (and its inputs/targets)
        fl_model_memory(r->dev, &c, dt, r->T > 0 ? r->B : 0, r->T, threads, r->recompute,
                        dist_exact                      ? fl_dist_unit_grads(&zero)
                        : r->dev_offload && !lora_of(r) ? FL_GRADS_HOOK
                                                        : unit_grads_of(r),
                        lora_of(r), &r->quant, st, b);
    } else {
        // a raw count split evenly over the TP ranks (what stays whole,
        // norms and row-layer biases, is not known)
        numel = ceil_div(r->num_params, (size_t)tp);
        largest = unit = ceil_div(r->largest_tensor, (size_t)tp);
        if (tp > 1)
            note_add(out, "tensor parallel %d: the raw count split evenly over its ranks", tp);
        b[FL_MEM_PARAMS] = numel * ds;
        b[FL_MEM_GRADS] = numel * ds;
    }
    // each optimizer's step gate (the verdict and a sum of squares per row)
    size_t gates = shaped ? fl_optimizer_gate_bytes(stage_rows) : 0;
    if (dist_exact) {
        plan_dist_exact(r, &c, opt, dist_bytes, &out->freed[FL_MEM_PARAMS], &out->disk,
                        out->unpaged);
        if (r->zero_stage == 3 && dp_of(r) > 1 && !r->whole_weights_first) {
            // the model is the shard from the start: the whole never exists;
            // with offload_params the shard itself lives until the file takes it
            b[FL_MEM_PARAMS] -= out->freed[FL_MEM_PARAMS];
            out->freed[FL_MEM_PARAMS] = zero.offload_params ? out->unpaged[FL_MEM_PARAMS] : 0;
            b[FL_MEM_PARAMS] += out->freed[FL_MEM_PARAMS];
        }
    } else if (shaped && lora_of(r)) {
        // the adapters' optimizer over their table; under LoRA + LOMO the
        // base's fused one over the base's
        fl_param_table t, lt;
        fl_model_table(&t, &c);
        fl_lora_table(&lt, &t, &c, &r->lora, NULL);
        fl_optimizer_memory_table(&r->optim, dt, &lt, 0, lt.numel, opt);
        gates = fl_optimizer_gate_bytes(lt.count);
        if (r->lora.train_base) {
            gates += fl_optimizer_gate_bytes(t.count);
            size_t base[FL_MEM_NTAGS] = {0};
            fl_optimizer_memory_table(&r->base_optim, dt, &t, 0, t.numel, base);
            for (int k = 0; k < FL_MEM_NTAGS; k++) opt[k] += base[k];
        }
        fl_params_free(&lt);
        fl_params_free(&t);
    } else if (shaped && fl_optim_in_backward(&r->optim)) {
        // AdaLomo's state is per row; a fused step keeps a sum of squares per row
        fl_param_table rows;
        rank_table(r, &c, &rows);
        fl_optimizer_memory_table(&r->optim, dt, &rows, 0, rows.numel, opt);
        fl_params_free(&rows);
    } else {
        fl_optimizer_memory(&r->optim, dt, numel, opt);
        if (r->dev_offload && r->optim.paged) { // NVMe under it: chunk buffers, the rest on disk
            size_t pb[FL_MEM_NTAGS];
            // (with offload_param nvme the 16-bit weights too)
            size_t paged_weights = r->zero.offload_params ? ds : 0;
            fl_offload_memory(&r->offload, numel, fl_optimizer_paged_tensors(&r->optim, dt),
                              paged_weights, pb, &out->disk);
            for (int k = 0; k < FL_MEM_NTAGS; k++) opt[k] += pb[k];
            fl_optimizer_config unpaged = r->optim;
            unpaged.paged = 0;
            fl_optimizer_memory(&unpaged, dt, numel, out->unpaged);
            if (paged_weights) out->unpaged[FL_MEM_PARAMS] = numel * ds;
        }
    }
    for (int k = 0; k < FL_MEM_NTAGS; k++) b[k] += opt[k] + dist_bytes[k];
    b[FL_MEM_WORKSPACE] += gates;
    if (r->dev_offload && lora_of(r)) { // the adapters' (device_adapters.c): as below, whole
        size_t *state = r->optim.pin_memory ? out->pinned : out->hosted;
        static const int tags[] = {FL_MEM_PARAMS, FL_MEM_MASTER, FL_MEM_OPTIM, FL_MEM_GRADS};
        for (int k = 0; k < 4; k++) state[tags[k]] = opt[tags[k]];
        state[FL_MEM_WORKSPACE] += gates;
        size_t copy = shaped ? lora_numel(r, &c) * ds : 0;
        out->pinned[FL_MEM_PARAMS] += copy;
        out->pinned[FL_MEM_GRADS] += copy;
        b[FL_MEM_PARAMS] += copy;
        b[FL_MEM_GRADS] += copy;
    } else if (r->dev_offload) { // the host copies of weights and gradients, pinned, and the
                                 // optimizer's bytes, pinned with pin_memory (device_offload.c)
        size_t *state = r->optim.pin_memory ? out->pinned : out->hosted;
        // the fp32 sum: pinned too where the device's sum is downloaded into it
        size_t *sum = r->optim.accumulate_on_device ? out->pinned : state;
        static const int tags[] = {FL_MEM_PARAMS, FL_MEM_MASTER, FL_MEM_OPTIM};
        for (int k = 0; k < 3; k++) state[tags[k]] = opt[tags[k]]; // (not NVMe's buffers)
        sum[FL_MEM_GRADS] = opt[FL_MEM_GRADS];
        state[FL_MEM_WORKSPACE] += gates; // the host optimizer's
        out->pinned[FL_MEM_PARAMS] += numel * ds;
        b[FL_MEM_PARAMS] += numel * ds;
        // the host copy of the gradients, pinned, each unit's going down to
        // it; accumulate_on_device: the fp32 sum on the device, which 16-bit
        // gradients are added into (only the sum comes down, into the
        // optimizer's: no host copy) and fp32 ones are bound to in place
        int devsum = r->optim.accumulate_on_device, in_place = devsum && dt == FL_F32;
        size_t host_grads = devsum && !in_place ? 0 : numel * ds;
        out->pinned[FL_MEM_GRADS] += host_grads;
        b[FL_MEM_GRADS] += host_grads + (devsum ? numel * sizeof(float) : 0);
        // the delayed update: a second buffer of what it reads, of its memory
        // (the fp32 sum, where there is one, else the pinned gradients)
        if (r->optim.delayed_update) {
            size_t spare = opt[FL_MEM_GRADS] ? opt[FL_MEM_GRADS] : numel * ds;
            (opt[FL_MEM_GRADS] ? sum : out->pinned)[FL_MEM_GRADS] += spare;
            b[FL_MEM_GRADS] += spare;
        }
        // the device holds no whole gradient (but that sum): a ring of two
        // units' (and the tied embedding's) buffers, none for fp32 in place;
        // a raw count's whole gradient stands for none on the device
        if (shaped && !in_place) {
            fl_param_table rows;
            rank_table(r, &c, &rows);
            b[FL_MEM_GRADS] += fl_dev_offload_grad_bytes(&rows, c.tie_embeddings, dt);
            fl_params_free(&rows);
        }
        if (!shaped)
            b[FL_MEM_GRADS] = b[FL_MEM_GRADS] - numel * ds + (in_place ? 0 : 2 * unit * ds);
    }
    // weight offload (device_weights.c): the whole weights are built in
    // the pinned copy (run.c: the optimizer's, counted above, under NVMe
    // freed once the file holds them; under LoRA the frozen base's own) and
    // the device only ever holds the resident units and the ring; under
    // NVMe a unit goes up through the pinned staging buffers
    if (r->dev_weights && shaped) {
        fl_param_table rows;
        rank_table(r, &c, &rows);
        size_t held = fl_dev_weights_bytes(&r->zero, &rows, c.n_layer, dt);
        size_t staging =
            r->zero.offload_params
                ? fl_dev_weights_staging_bytes(&r->offload, &r->zero, &rows, c.n_layer, dt)
                : 0;
        fl_params_free(&rows);
        b[FL_MEM_PARAMS] = b[FL_MEM_PARAMS] - numel * ds + held;
        b[FL_MEM_OFFLOAD] += staging;
        out->pinned[FL_MEM_OFFLOAD] += staging;
        if (lora_of(r)) {
            out->pinned[FL_MEM_PARAMS] += numel * ds;
            b[FL_MEM_PARAMS] += numel * ds;
        }
    }
    // tensor parallelism: the TP group's table and its scratch, which stays
    // at the size of the largest call
    if (tp > 1) {
        b[FL_MEM_OTHER] += fl_tp_ops_bytes(tp);
        b[FL_MEM_COMM] += tp_scratch;
    }
    // pipeline parallelism: the executor's buffers and lists, and the
    // pipeline group's table (the gradient norm's sum over the stages)
    if (st && shaped) {
        size_t pipe[FL_MEM_NTAGS];
        fl_pipeline_memory(&c, dt, st, r->optim.grad_accum, r->B, r->T, pipe);
        for (int k = 0; k < FL_MEM_NTAGS; k++) b[k] += pipe[k];
        b[FL_MEM_OTHER] += fl_tp_ops_bytes(pp);
    }

    // What `fitlm train` allocates besides the model and the optimizer: the
    // data loaders' tables and the tokenizer (measured), the inputs and targets
    // of a step's micro-batches, and at the end, with all of that still allocated, the
    // sampled tokens and fl_model_generate's buffers: an fp32 row of logits
    // (V floats) and, inside it, the sampler's (logit, id) sort buffer (V x 8).
    b[FL_MEM_OTHER] += r->data_bytes + 2 * BT * (size_t)r->optim.grad_accum * sizeof(int);
    if (r->dev && !r->dev->host) // the step's tokens in pinned memory (run.c)
        out->pinned[FL_MEM_OTHER] += 2 * BT * (size_t)r->optim.grad_accum * sizeof(int);
    if (b[FL_MEM_OTHER] < r->data_peak) b[FL_MEM_OTHER] = r->data_peak;
    // transient workspace, one at a time: the step's row sums (a fused
    // step's over its rows), the sampler's, the random start's
    size_t sampler = shaped && r->sample_tokens > 0 ? generate_bytes(&c, r->T) : 0;
    size_t sums = norm_rows * sizeof(double);
    size_t transient = sampler > sums ? sampler : sums; // host buffers on any device
    if (r->dev && !r->dev->host) {
        // the model's workspace is the device's: the host's holds the
        // transients alone and, from the first backward pass on, the
        // device's pinned staging (cuda: the embedding's buckets, where the
        // embedding trains), which the random start's buffer never meets
        size_t staged =
            r->dev->host_scratch_bytes && shaped && r->B > 0 && (!r->lora.r || r->lora.train_base)
                ? r->dev->host_scratch_bytes((int)BT)
                : 0;
        size_t peak = transient + staged;
        if (peak < init_bytes) peak = init_bytes;
        b[FL_MEM_WORKSPACE] += peak;
        out->pinned[FL_MEM_WORKSPACE] += staged;
        out->hosted[FL_MEM_WORKSPACE] += peak - staged; // besides what is pinned
    } else {
        // the random start's buffer is freed before the model's workspace is made
        b[FL_MEM_WORKSPACE] += transient;
        if (b[FL_MEM_WORKSPACE] < init_bytes) b[FL_MEM_WORKSPACE] = init_bytes;
    }
    if (shaped && r->sample_tokens > 0) {
        b[FL_MEM_OTHER] += ((size_t)r->sample_tokens + 4) * sizeof(int);
    }
    if (st && shaped) {
        // the model's set-up of a stage (model.c's stage_rows) holds the
        // rank's table and the whole one (whole_rows rows each), the stage's
        // table, a map of the rank's rows and the stage's row offsets at once, over what the run
        // holds before the model (the data, the TP group's table)
        size_t setup = r->data_bytes + (tp > 1 ? fl_tp_ops_bytes(tp) : 0) +
                       (2 * whole_rows + (size_t)stage_rows) * sizeof(fl_param_view) +
                       whole_rows * sizeof(int) + (size_t)stage_rows * sizeof(size_t);
        if (b[FL_MEM_OTHER] < setup) b[FL_MEM_OTHER] = setup;
    }

    if (out->disk) snprintf(out->disk_dir, sizeof out->disk_dir, "%s", r->offload.dir);
    out->num_params = numel;
    out->runnable = shaped && !r->lomo && (!dist || dist_exact);
    if (tp > 1 && shaped)
        note_add(out, "tensor parallel %d%s: this rank's slices of the model's %zu parameters", tp,
                 c.sequence_parallel ? " with sequence parallelism" : "", fl_model_num_params(&c));
    static const char *const stages[] = {"data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3"};
    if (!out->runnable) {
        char what[200] = "";
        size_t n = 0;
#define WHAT(...)                                                                                  \
    n += (size_t)snprintf(what + n, n < sizeof what ? sizeof what - n : 0, __VA_ARGS__)
        if (!shaped) WHAT("%s", "a raw parameter count (model states by formula)");
        if (dist)
            WHAT("%s%s%s%s over %d rank%s", n ? ", " : "", refused ? refused : "",
                 refused ? " with " : "", stages[r->zero_stage], dp_of(r), dp_of(r) > 1 ? "s" : "");
        else if (r->lomo)
            WHAT("%sLOMO", n ? ", " : "");
        if (dist && refused) WHAT("%s", " (fl_dist_attach refuses it; ZeRO formulas)");
#undef WHAT
        note_add(out, "not runnable yet: %s", what);
    } else if (dist) {
        note_add(out, "%s, %srank %d of %d%s", stages[r->zero_stage],
                 tp * pp > 1 ? "data-parallel " : "", dp_rank_of(r), dp_of(r),
                 r->zero_stage > 0 && dp_rank_of(r) == 0 ? " (the largest shard)" : "");
    }

    if (r->lomo) {
        b[FL_MEM_MASTER] = 0;
        b[FL_MEM_OPTIM] = 0;
        b[FL_MEM_GRADS] = largest * ds;
        if (!largest)
            note_add(out, "LOMO's one live gradient not counted (largest tensor unknown)");
        if (r->optim.grad_accum > 1) note_add(out, "LOMO cannot accumulate gradients");
    }
    if (dist && !dist_exact) zero_by_formula(r, b, largest, unit, out);
    if (!shaped) note_add(out, "no activations (no model shape)");
    if (shaped && (lora_of(r) || r->quant.enabled)) {
        fl_param_table t, lt = {0};
        fl_model_table(&t, &c);
        if (lora_of(r)) {
            fl_lora_table(&lt, &t, &c, &r->lora, NULL);
            note_add(out, "LoRA: %zu adapter parameters (%.3f%%)%s", lt.numel,
                     100.0 * lt.numel / numel,
                     r->lora.train_base ? ", base trained by a fused optimizer" : ", base frozen");
        }
        size_t nq;
        double per = r->quant.enabled ? fl_quant_bytes_per_param(&t, &r->quant, &nq) : 0.0;
        if (r->quant.enabled) note_add(out, "NF4: %zu parameters at %.4f bytes each", nq, per);
        fl_params_free(&lt);
        fl_params_free(&t);
    }

    for (int k = 0; k < FL_MEM_NTAGS; k++) out->total += b[k];
    out->model_states = model_states_of(b);
    if (dist_exact) out->formula_model_states = formula_model_states(r, largest, unit);
    if (st) {
        int blocks = 0;
        for (int k = 0; k < st->chunks; k++) blocks += st->count[k];
        out->stages = 1;
        out->peak_stage = st->rank;
        out->stage[0] = (fl_plan_stage){st->rank, blocks, numel, b[FL_MEM_ACTS], out->total};
        note_add(out, "pipeline stage %d of %d: %d block%s", st->rank, pp, blocks,
                 blocks == 1 ? "" : "s");
    }
}

// The placement rule: on a device other than the cpu, the model's and the
// optimizer's buffers of these tags are the device's; comm, offload and
// other stay on the host.
static int on_device(const fl_plan_request *r, int tag) {
    return r->dev && !r->dev->host &&
           (tag == FL_MEM_PARAMS || tag == FL_MEM_GRADS || tag == FL_MEM_MASTER ||
            tag == FL_MEM_OPTIM || tag == FL_MEM_ACTS || tag == FL_MEM_WORKSPACE);
}

static void place(const fl_plan_request *r, fl_plan *p) {
    p->device_total = p->pinned_total = 0;
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        p->device[t] = on_device(r, t) ? p->bytes[t] - p->pinned[t] - p->hosted[t] : 0;
        p->device_total += p->device[t];
        p->pinned_total += p->pinned[t];
    }
}

void fl_plan_compute(const fl_plan_request *r, fl_plan *out) {
    check_request(r);
    if (pp_of(r) == 1 || r->one_stage) {
        plan_rank(r, out);
        place(r, out);
        return;
    }
    // every stage, the rank's tensor- and data-parallel place on each; the
    // largest total decides
    const int p = pp_of(r), td = tp_of(r) * dp_of(r);
    fl_plan_request q = *r;
    q.one_stage = 1;
    fl_plan one;
    fl_plan_stage all[FL_PLAN_MAX_STAGES] = {{0}};
    for (int s = 0; s < p; s++) {
        q.rank = r->rank % td + s * td;
        plan_rank(&q, &one);
        all[s] = one.stage[0];
        if (s == 0 || one.total > out->total) *out = one;
    }
    out->stages = p;
    memcpy(out->stage, all, (size_t)p * sizeof all[0]);
    place(r, out);
}

// ----------------------------------------------------------------------------
// printing

size_t fl_plan_offloaded(const fl_plan *p) {
    return p->unpaged[FL_MEM_MASTER] + p->unpaged[FL_MEM_OPTIM] + p->unpaged[FL_MEM_PARAMS];
}

// On a device, each tag's host and device bytes beside its sum.
static void print_placed(const fl_plan *p, FILE *out) {
    fprintf(out, "%-14s %16s %16s %16s %12s\n", "tag (per rank)", "host bytes", "device bytes",
            "bytes", "MiB");
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        fprintf(out, "  %-12s %16zu %16zu %16zu %12.2f\n", fl_mem_tag_name(t),
                p->bytes[t] - p->device[t], p->device[t], p->bytes[t], p->bytes[t] / 1048576.0);
    fprintf(out, "  %-12s %16zu %16zu %16zu %12.2f  (%.2f GB)\n", "total",
            p->total - p->device_total, p->device_total, p->total, p->total / 1048576.0,
            p->total / 1e9);
    if (!p->pinned_total) return;
    fprintf(out, "%-14s %16s\n", "of the host's", "pinned bytes");
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        if (p->pinned[t]) fprintf(out, "  %-12s %16zu\n", fl_mem_tag_name(t), p->pinned[t]);
    fprintf(out, "  %-12s %16zu\n", "total", p->pinned_total);
}

void fl_plan_print(const fl_plan *p, FILE *out) {
    if (p->device_total) {
        print_placed(p, out);
    } else {
        fprintf(out, "%-14s %16s %12s %10s\n", "tag (per rank)", "bytes", "MiB", "GiB");
        for (int t = 0; t < FL_MEM_NTAGS; t++)
            fprintf(out, "  %-12s %16zu %12.2f %10.3f\n", fl_mem_tag_name(t), p->bytes[t],
                    p->bytes[t] / 1048576.0, p->bytes[t] / 1073741824.0);
        fprintf(out, "  %-12s %16zu %12.2f %10.3f  (%.2f GB)\n", "total", p->total,
                p->total / 1048576.0, p->total / 1073741824.0, p->total / 1e9);
    }
    if (p->num_params) {
        fprintf(out,
                "model states (params+grads+master+optim): %zu bytes (%.2f GB) = %.2f bytes/param "
                "over %zu parameters; total %.2f bytes/param\n",
                p->model_states, p->model_states / 1e9, (double)p->model_states / p->num_params,
                p->num_params, (double)p->total / p->num_params);
    }
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        if (p->freed[t])
            fprintf(out,
                    "%s: the peak holds weights (%zu bytes) that set-up frees (the whole "
                    "weights a rank initialises before keeping its shard, or a shard handed to "
                    "the NVMe offload file); from the first step on: %zu bytes\n",
                    fl_mem_tag_name(t), p->freed[t], p->bytes[t] - p->freed[t]);
    if (p->formula_model_states)
        fprintf(out,
                "ZeRO paper's formula (Rajbhandari et al. 2020) for the same run: model states "
                "%zu bytes (%.2f bytes/param), the engine's %+.1f%% from it\n",
                p->formula_model_states, (double)p->formula_model_states / p->num_params,
                100.0 * ((double)p->model_states - (double)p->formula_model_states) /
                    (double)p->formula_model_states);
    if (p->disk) {
        size_t moved = fl_plan_offloaded(p);
        fprintf(out,
                "NVMe offload: %zu bytes (%.2f GB) of master weights and optimizer state%s on "
                "disk under %s; without offload they would add %.2f GiB of RAM (total %.2f GiB)\n",
                p->disk, p->disk / 1e9, p->unpaged[FL_MEM_PARAMS] ? " and weights" : "",
                p->disk_dir, moved / 1073741824.0,
                (p->total - p->bytes[FL_MEM_OFFLOAD] + moved) / 1073741824.0);
    }
    if (p->stages > 1) { // every pipeline stage's
        fprintf(out, "pipeline stages (per rank; the tags above are stage %d's, the largest):\n",
                p->peak_stage);
        fprintf(out, "  %5s %6s %14s %14s %14s\n", "stage", "blocks", "params", "acts bytes",
                "total bytes");
        for (int s = 0; s < p->stages; s++) {
            const fl_plan_stage *g = &p->stage[s];
            fprintf(out, "  %5d %6d %14zu %14zu %14zu%s\n", g->stage, g->blocks, g->params, g->acts,
                    g->total, g->stage == p->peak_stage ? "  (peak)" : "");
        }
    }
    if (p->runnable)
        fprintf(out, "runnable: yes (the engine's exact allocation sizes)%s%s\n",
                *p->note ? "; " : "", p->note);
    else
        fprintf(out, "runnable: no (%s)\n", p->note);
}

// ----------------------------------------------------------------------------
// what would fit

// The bytes a limit is checked against: the host's, or (device) the device's.
static size_t plan_total(const fl_plan_request *r, int device, int *runnable) {
    fl_plan p;
    fl_plan_compute(r, &p);
    if (runnable) *runnable = p.runnable;
    return device ? p.device_total : p.total - p.device_total;
}

// Tries v at micro-batch B, then halving it, with gradient accumulation set
// to keep the base's sequences per optimizer step (B x grad_accum x ranks;
// LOMO cannot accumulate). Leaves v at the first fit and returns its total,
// or returns 0 (v at B = 1) when nothing fits.
static size_t fit_by_batch(const fl_plan_request *base, fl_plan_request *v, int B, size_t limit,
                           int device, int *runnable) {
    const size_t seqs = (size_t)base->B * base->optim.grad_accum * dp_of(base);
    for (v->B = B;; v->B /= 2) {
        size_t per_step = (size_t)v->B * dp_of(v);
        if (v->lomo || v->optim.kind == FL_OPT_LOMO) // (it cannot accumulate)
            v->optim.grad_accum = 1;
        else if (per_step)
            v->optim.grad_accum = per_step >= seqs ? 1 : (int)ceil_div(seqs, per_step);
        // interleaved 1F1B takes the micro-batches in groups of p
        if (pp_of(v) > 1 && v->pipeline_schedule == FL_PP_INTERLEAVED)
            v->optim.grad_accum =
                (int)ceil_div((size_t)v->optim.grad_accum, (size_t)pp_of(v)) * pp_of(v);
        size_t total = tokens_split(v) ? plan_total(v, device, runnable) : SIZE_MAX;
        if (total <= limit) return total;
        if (v->B <= 1) return 0;
    }
}

typedef struct {
    char *buf;
    size_t size, n;
    int lines;
} sink;

static void put(sink *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sink *s, const char *fmt, ...) {
    if (s->n >= s->size) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(s->buf + s->n, s->size - s->n, fmt, ap);
    va_end(ap);
    if (k > 0) s->n += (size_t)k;
    if (s->n >= s->size) s->n = s->size - 1;
}

// One line for a variant that fits: "  <flags> [--batch b --grad-accum a]: X".
static void put_fit(sink *s, const char *flags, const fl_plan_request *base,
                    const fl_plan_request *v, size_t total, int runnable, const char *per) {
    char h[FL_SIZE_TEXT], batch[32] = "", accum[32] = "";
    if (v->B != base->B) snprintf(batch, sizeof batch, "%s--batch %d", *flags ? " " : "", v->B);
    if (v->optim.grad_accum != base->optim.grad_accum && !v->lomo)
        snprintf(accum, sizeof accum, " --grad-accum %d", v->optim.grad_accum);
    put(s, "  %s%s%s: %s%s%s\n", flags, batch, accum, fl_size_text(total, h), per,
        runnable ? "" : " (not runnable yet)");
    s->lines++;
}

// Whether ZeRO-3's gathered weights fit in stage3_max_live_parameters, which
// the engine (and fl_dist_memory) refuses otherwise: the embedding and the
// units under the persistence threshold stay gathered, plus the largest
// other unit in the ring (zero.c's stage3_layout).
static int stage3_live_ok(const fl_plan_request *r) {
    fl_model_config c = r->model;
    c.tp_size = tp_of(r);
    fl_model_config_finish(&c);
    fl_param_table t;
    rank_table(r, &c, &t);
    int n_units = c.n_layer + 2;
    size_t *per = fl_alloc(FL_MEM_OTHER, (size_t)n_units * sizeof(size_t));
    for (int k = 0; k < t.count; k++) per[t.views[k].unit + 1] += t.views[k].numel;
    double resident = 0.0, ring = 0.0;
    for (int u = 0; u < n_units; u++) {
        double n = (double)per[u];
        if (u == 0 || n < r->zero.param_persistence_threshold)
            resident += n;
        else if (n > ring)
            ring = n;
    }
    fl_free(per);
    fl_params_free(&t);
    return !ring || resident + ring <= r->zero.max_live_parameters;
}

// What would fit under limit: the host's bytes, or (device) the device's.
// For a device's run only what a device runs is tried (no LOMO, no ZeRO
// over ranks), and for its host bytes under ZeRO-Offload the state on NVMe.
static void alternatives(const fl_plan_request *r, size_t limit, int device, char *buf,
                         size_t size) {
    sink s = {buf, size, 0, 0};
    if (size) buf[0] = 0;
    const int shaped = r->num_params == 0;
    const char *per = r->ranks > 1 ? " per rank" : "";
    fl_plan_request v;
    size_t total;
    int runnable;
    char h[FL_SIZE_TEXT];

    // a smaller micro-batch, the same sequences per step
    if (shaped && r->B > 1) {
        v = *r;
        total = fit_by_batch(r, &v, r->B / 2, limit, device, &runnable);
        if (total)
            put_fit(&s, "", r, &v, total, runnable, per);
        else if (tokens_split(&v))
            put(&s, "  (no micro-batch fits: --batch 1 --grad-accum %d needs %s%s)\n",
                v.optim.grad_accum, fl_size_text(plan_total(&v, device, NULL), h), per);
    }
    // 16-bit weights, gradients and activations
    if (shaped && r->dtype == FL_F32) {
        v = *r;
        v.dtype = FL_BF16;
        if ((total = fit_by_batch(r, &v, r->B, limit, device, &runnable)))
            put_fit(&s, "--precision bf16", r, &v, total, runnable, per);
    }
    // recompute blocks in the backward pass
    if (shaped && r->recompute != FL_RECOMPUTE_BLOCK && r->B > 0) {
        v = *r;
        v.recompute = FL_RECOMPUTE_BLOCK;
        if ((total = fit_by_batch(r, &v, r->B, limit, device, &runnable)))
            put_fit(&s, "--activation-checkpointing block", r, &v, total, runnable, per);
    }
    // the LM head and loss over chunks of positions: a chunk's logits
    size_t BT = (size_t)r->B * (size_t)r->T;
    if (shaped && !r->model.logits_chunk && tp_of(r) == 1 && pp_of(r) == 1 && BT >= 64) {
        v = *r;
        v.model.logits_chunk = BT > 4096 ? 1024 : (int)(BT / 4);
        if ((total = fit_by_batch(r, &v, r->B, limit, device, &runnable))) {
            char flags[48];
            snprintf(flags, sizeof flags, "--logits-chunk %d", v.model.logits_chunk);
            put_fit(&s, flags, r, &v, total, runnable, per);
        }
    }
    // a device's run on the device: the optimizer in host memory
    // (ZeRO-Offload), and the weights too (ZeRO-3's weight offload), where
    // the run could take them (AdamW or SGD, not in the backward pass; under
    // LoRA the dense frozen base's weights alone, the adapters' state being
    // small), with the host bytes they move there
    int on_device = r->dev && !r->dev->host;
    int offloadable = (r->optim.kind == FL_OPT_ADAMW || r->optim.kind == FL_OPT_SGD) &&
                      !fl_optim_in_backward(&r->optim) &&
                      (!lora_of(r) || (!r->lora.train_base && !r->quant.enabled));
    static const char *const offloads[3] = {
        "zero_optimization.offload_optimizer.device cpu (ZeRO-Offload",
        "zero_optimization.stage 3, offload_param and offload_optimizer device cpu (weight "
        "offload",
        "zero_optimization.stage 3, offload_param device cpu (LoRA's frozen base offloaded"};
    for (int k = lora_of(r) ? 1 : 0; shaped && device && on_device && offloadable && k < 2; k++) {
        if (k == 0 ? r->dev_offload : r->dev_weights) continue; // what the run does already
        v = *r;
        v.dev_offload = lora_of(r) ? r->dev_offload : 1;
        v.dev_weights = k == 1;
        if (!(total = fit_by_batch(r, &v, r->B, limit, device, &runnable))) continue;
        char flags[192], hb[FL_SIZE_TEXT];
        snprintf(flags, sizeof flags, "%s; host %s)", offloads[lora_of(r) ? 2 : k],
                 fl_size_text(plan_total(&v, 0, NULL), hb));
        put_fit(&s, flags, r, &v, total, runnable, per);
    }
    // LOMO's update in the backward pass, which keeps no state and one
    // unit's gradient (no accumulation: the micro-batch alone halves), on
    // one process (cpu or device; elsewhere its formula, below)
    int lomo_runs = shaped && offloadable && !lora_of(r) && !r->dev_offload && !r->lomo &&
                    dp_of(r) == 1 && tp_of(r) == 1 && pp_of(r) == 1;
    if (lomo_runs && (device || !on_device)) {
        v = *r;
        v.optim.kind = FL_OPT_LOMO;
        if ((total = fit_by_batch(r, &v, r->B, limit, device, &runnable)))
            put_fit(&s, "--optimizer lomo", r, &v, total, runnable, per);
    }
    // a device's run on the host: ZeRO-Offload's state on NVMe instead
    // (its chunk buffers at the request's sub_group_size, else at 1e8
    // elements: DeepSpeed's 1e9 makes 12 GB of them a buffer under AdamW)
    int try_nvme = !device && on_device && r->dev_offload && !r->optim.paged && !lora_of(r);
    if (try_nvme) {
        v = *r;
        v.optim.paged = 1;
        const char *flags = "offload_optimizer.device nvme (the master weights and state on disk)";
        total = fit_by_batch(r, &v, r->B, limit, device, &runnable);
        if (!total && r->offload.chunk > 1e8) {
            v = *r;
            v.optim.paged = 1;
            v.offload.chunk = 1e8;
            flags = "offload_optimizer.device nvme, sub_group_size 1e8 (the master weights and "
                    "state on disk)";
            total = fit_by_batch(r, &v, r->B, limit, device, &runnable);
        }
        if (total) put_fit(&s, flags, r, &v, total, runnable, per);
    }
    if (device || on_device) { // (one process there: no ZeRO over ranks; LOMO with no offload)
        if (!s.lines)
            put(&s,
                "  (none of: a smaller micro-batch, bf16, activation checkpointing, the LM "
                "head in chunks%s)\n",
                try_nvme                             ? ", the optimizer's state on NVMe"
                : device && on_device && offloadable ? ", the optimizer or weights offloaded, LOMO"
                                                     : "");
        return;
    }
    // formula-only strategies
    if (!r->lomo && !lomo_runs) {
        v = *r;
        v.lomo = 1;
        if ((total = fit_by_batch(r, &v, r->B, limit, device, &runnable)))
            put_fit(&s, "--lomo", r, &v, total, runnable, per);
    }
    // ZeRO: for each stage above the request's, the fewest ranks (each with
    // `limit` bytes: one per machine, as the ranks of one machine share its
    // memory) that fit; a higher stage only when it needs fewer ranks. Under
    // tensor and pipeline parallelism the data-parallel replicas grow, t p
    // ranks each (ZeRO-2/3 are refused with pipeline parallelism).
    int fewest = 0, t = tp_of(r) * pp_of(r);
    for (int stage = r->zero_stage + 1; stage <= (pp_of(r) > 1 ? 1 : 3); stage++) {
        if (stage == 3 && shaped && !stage3_live_ok(r)) continue;
        for (int N = r->ranks > t ? r->ranks : 2 * t; N <= 4096 && (!fewest || N < fewest);
             N *= 2) {
            v = *r;
            v.ranks = N;
            v.rank = 0;
            v.zero_stage = stage;
            if ((total = fit_by_batch(r, &v, r->B, limit, device, &runnable))) {
                char flags[64];
                snprintf(flags, sizeof flags, "--ranks %d --zero-stage %d", N, stage);
                put_fit(&s, flags, r, &v, total, runnable, " per rank, one rank per machine");
                fewest = N;
                break;
            }
        }
    }
    if (!s.lines)
        put(&s, "  (none of: a smaller micro-batch, bf16, activation checkpointing, the LM head "
                "in chunks, LOMO, ZeRO-1/2/3 up to 4096 ranks)\n");
}

void fl_plan_alternatives(const fl_plan_request *r, size_t limit, char *buf, size_t size) {
    alternatives(r, limit, 0, buf, size);
}

void fl_plan_device_alternatives(const fl_plan_request *r, size_t limit, char *buf, size_t size) {
    alternatives(r, limit, 1, buf, size);
}

// --mem-limit stands for a card's total memory: the blocks' budget is what
// the device does not hold itself (its context), at least a byte (0 reads
// as no limit)
static size_t device_budget(const fl_plan_request *r) {
    size_t held = r->dev->reserved(r->dev);
    return r->device_cap > held ? r->device_cap - held : 1;
}

size_t fl_plan_device_limit(const fl_plan_request *r) {
    if (!r->dev || r->dev->host) return 0;
    size_t free_ = r->dev->available ? r->dev->available(r->dev) : 0;
    if (!r->device_cap) return free_;
    size_t budget = device_budget(r);
    return free_ && free_ < budget ? free_ : budget;
}

// Dies unless need (the host's bytes, or the device's) fits limit, naming
// the three largest tags there and what would fit.
static void check_fit(const fl_plan_request *r, const fl_plan *p, size_t limit, int device) {
    size_t need = device ? p->device_total : p->total - p->device_total;
    if (limit == 0 || need <= limit) return; // 0: the limit is unknown
    size_t bytes[FL_MEM_NTAGS];
    int order[FL_MEM_NTAGS];
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        bytes[t] = device ? p->device[t] : p->bytes[t] - p->device[t];
        order[t] = t;
    }
    for (int i = 0; i < 3; i++) // the three largest tags, largest first
        for (int j = i + 1; j < FL_MEM_NTAGS; j++)
            if (bytes[order[j]] > bytes[order[i]]) {
                int tmp = order[i];
                order[i] = order[j];
                order[j] = tmp;
            }
    char largest[160] = "", h[FL_SIZE_TEXT];
    size_t n = 0;
    for (int i = 0; i < 3 && bytes[order[i]]; i++)
        n += (size_t)snprintf(largest + n, sizeof largest - n, "%s%s %s", i ? ", " : "",
                              fl_mem_tag_name(order[i]), fl_size_text(bytes[order[i]], h));
    char alt[2048];
    alternatives(r, limit, device, alt, sizeof alt);
    size_t len = strlen(alt);
    if (len && alt[len - 1] == '\n') alt[len - 1] = 0;
    char needs[FL_SIZE_TEXT], lim[FL_SIZE_TEXT], what[448];
    fl_size_text_pair(need, limit, needs, lim);
    if (device) {
        char desc[256];
        r->dev->describe(r->dev, desc, sizeof desc);
        if (r->device_cap && limit == device_budget(r))
            snprintf(what, sizeof what,
                     "device memory (planned before allocating), more than the device budget of "
                     "%s (--mem-limit%s) on %s",
                     lim, r->dev->reserved(r->dev) ? ", less what the device holds itself" : "",
                     desc);
        else
            snprintf(what, sizeof what,
                     "device memory (planned before allocating), more than the %s free on %s", lim,
                     desc);
    } else {
        snprintf(what, sizeof what,
                 "memory (planned before allocating), more than the limit of %s (--mem-limit; "
                 "default, and on a device: the available memory)",
                 lim);
    }
    fl_die("this run needs %s%s of %s.\n"
           "Largest: %s.\n"
           "What would fit ('fitlm plan' with the same options prints the whole plan):\n%s",
           needs, r->ranks > 1 ? " per rank" : "", what, largest, alt);
}

void fl_plan_check_fits(const fl_plan_request *r, const fl_plan *p, size_t limit) {
    if (p->disk)
        fl_offload_check_path("zero_optimization.offload_optimizer.nvme_path", p->disk_dir,
                              p->disk);
    if (limit && p->pinned_total > limit) { // locked pages: the host must hold them all
        char need[FL_SIZE_TEXT], lim[FL_SIZE_TEXT];
        fl_size_text_pair(p->pinned_total, limit, need, lim);
        int all = r->optim.pin_memory;
        fl_die("ZeRO-Offload (zero_optimization.offload_optimizer) needs %s of pinned host "
               "memory (the host copies of the weights and gradients%s), more than the %s the "
               "host has available: use fewer parameters%s, "
               "offload_optimizer.device nvme, or none",
               need,
               all ? ", the master weights and optimizer state: offload_optimizer.pin_memory" : "",
               lim, all ? ", offload_optimizer.pin_memory false" : "");
    }
    check_fit(r, p, limit, 0);
    if (p->device_total) check_fit(r, p, fl_plan_device_limit(r), 1);
}

size_t fl_plan_parse_count(const char *text, const char *what) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    double scale = 1.0;
    switch (toupper((unsigned char)*end)) {
    case 'K':
        scale = 1e3;
        end++;
        break;
    case 'M':
        scale = 1e6;
        end++;
        break;
    case 'B':
    case 'G':
        scale = 1e9;
        end++;
        break;
    case 'T':
        scale = 1e12;
        end++;
        break;
    default:
        break;
    }
    v *= scale;
    if (end == text || *end || errno || !isfinite(v) || v < 1 || v > 1e18 || v != floor(v))
        fl_die("%s expects a whole number of parameters such as 124439808, 7e9, 7B or 350M, "
               "got '%s'",
               what, text);
    return (size_t)v;
}
