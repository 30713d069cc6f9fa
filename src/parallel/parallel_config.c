// parallel_config.c: the parallel sections of a run's config: DeepSpeed's
// batch rule over the data-parallel replicas, the tensor-parallel layout
// against the model, ZeRO's keys by stage, and what the engine cannot run
// yet. The ranks are the communicator's (a plan's: cfg->ranks).
#include <stdio.h>
#include <string.h>

#include "fitlm/comm.h"
#include "fitlm/dist.h"
#include "fitlm/pipeline.h"

#define ZERO "zero_optimization."

static int world_of(const fl_train_config *cfg) {
    return cfg->ranks > 0 ? cfg->ranks : fl_comm_size();
}

// What t x p names in messages: "tensor_parallel.size 4", "pipeline_parallel.size
// 2" or "tensor_parallel.size 2 x pipeline_parallel.size 2".
static void model_parallel_text(const fl_train_config *cfg, char *text, size_t n) {
    int t = cfg->tensor_parallel, p = cfg->pipeline_parallel;
    if (p == 1)
        snprintf(text, n, "tensor_parallel.size %d", t);
    else if (t == 1)
        snprintf(text, n, "pipeline_parallel.size %d", p);
    else
        snprintf(text, n, "tensor_parallel.size %d x pipeline_parallel.size %d", t, p);
}

// The data-parallel size d = world / (t p): the model replicas the batch is
// split over, each of t x p ranks (Megatron's order: rank = tp + t x dp +
// t x d x pp).
static int data_parallel_size(const fl_train_config *cfg) {
    int world = world_of(cfg), t = cfg->tensor_parallel, p = cfg->pipeline_parallel;
    long long tp = (long long)t * p;
    if (world % tp) {
        char what[96];
        model_parallel_text(cfg, what, sizeof what);
        fl_die("%s does not divide the world of %d rank%s (%d %% %lld = %lld): the ranks form "
               "d = world / %s data-parallel replicas of %lld ranks each; run a multiple of %lld "
               "ranks (a checkpoint resumes under any layout: %s for one process)",
               what, world, world == 1 ? "" : "s", world, tp, world % tp,
               p == 1   ? "t"
               : t == 1 ? "p"
                        : "(t p)",
               tp, tp,
               p == 1   ? "--tensor-parallel 1"
               : t == 1 ? "--pipeline-parallel 1"
                        : "--tensor-parallel 1 --pipeline-parallel 1");
    }
    return (int)(world / tp);
}

// DeepSpeed's batch rule (runtime/config.py, _set_batch_related_parameters):
// train_batch_size = micro x accum x replicas, and any two of the three set
// the third; train_batch_size alone means no accumulation. The replicas are
// the data-parallel size d = world / (t p) (Megatron: global_batch = micro x
// m x d): the t x p ranks of a replica read one micro-batch (its first
// pipeline stage the inputs, its last the targets). Run after MPI has
// started: the world is fl_comm_size's (or cfg->ranks, a plan's).
void fl_parallel_check_batch(fl_train_config *cfg) {
    int d = data_parallel_size(cfg), total_given = cfg->train_batch_size; // 0: not given
    int has_micro = fl_config_given(cfg, "train_micro_batch_size_per_gpu");
    int has_accum = fl_config_given(cfg, "gradient_accumulation_steps");
    char ranks[160], what[96]; // what d counts
    model_parallel_text(cfg, what, sizeof what);
    int both = cfg->tensor_parallel > 1 && cfg->pipeline_parallel > 1;
    if (cfg->tensor_parallel == 1 && cfg->pipeline_parallel == 1)
        snprintf(ranks, sizeof ranks, "%s", d == 1 ? "rank" : "ranks");
    else
        snprintf(ranks, sizeof ranks, "data-parallel replica%s (%d ranks / %s%s%s)",
                 d == 1 ? "" : "s", world_of(cfg), both ? "(" : "", what, both ? ")" : "");
    if (total_given && !has_micro) {
        int accum = has_accum ? cfg->grad_accum : 1;
        if (total_given % ((long long)accum * d))
            fl_die("train_batch_size %d is not a multiple of gradient_accumulation_steps %d x %d "
                   "%s: it cannot set train_micro_batch_size_per_gpu",
                   total_given, accum, d, ranks);
        cfg->grad_accum = accum;
        cfg->micro_batch = (int)(total_given / ((long long)accum * d));
    } else if (total_given && !has_accum) {
        if (total_given % ((long long)cfg->micro_batch * d))
            fl_die("train_batch_size %d is not a multiple of train_micro_batch_size_per_gpu %d x "
                   "%d %s: it cannot set gradient_accumulation_steps",
                   total_given, cfg->micro_batch, d, ranks);
        cfg->grad_accum = (int)(total_given / ((long long)cfg->micro_batch * d));
    }
    long long total = (long long)cfg->micro_batch * cfg->grad_accum * d;
    if (total_given && total != total_given)
        fl_die("train_batch_size %d != train_micro_batch_size_per_gpu %d x "
               "gradient_accumulation_steps %d x %d %s",
               total_given, cfg->micro_batch, cfg->grad_accum, d, ranks);
    if (total > 1 << 30)
        fl_die("train_micro_batch_size_per_gpu %d x gradient_accumulation_steps %d x %d %s is "
               "more than 2^30 sequences per step",
               cfg->micro_batch, cfg->grad_accum, d, ranks);
    cfg->train_batch_size = (int)total;
}

void fl_tp_check(const fl_train_config *cfg, const fl_model_config *model) {
    int t = cfg->tensor_parallel;
    if (cfg->sequence_parallel && t == 1)
        fl_die("sequence_parallel splits the tokens over the tensor-parallel ranks: it needs "
               "tensor_parallel.size above 1, which is 1 (--sequence-parallel=false turns it off)");
    data_parallel_size(cfg);
    if (t == 1) return;
    fl_model_tp_check(model, t);
    long long tokens = (long long)cfg->micro_batch * cfg->seq_len;
    if (cfg->sequence_parallel && tokens % t)
        fl_die("sequence_parallel: train_micro_batch_size_per_gpu %d x seq_len %d = %lld tokens "
               "do not split over tensor_parallel.size %d (%lld %% %d = %lld)",
               cfg->micro_batch, cfg->seq_len, tokens, t, tokens, t, tokens % t);
}

// ----------------------------------------------------------------------------
// pipeline parallelism

#define FIRST_KEY "decoder_first_pipeline_num_layers"
#define LAST_KEY  "decoder_last_pipeline_num_layers"

// Megatron's rule under virtual stages: a stage's blocks split evenly over
// its v chunks.
static void check_chunks(const char *keys, const char *which, int blocks, int v) {
    if (blocks % v)
        fl_die("%s: the %s stage's %d blocks do not split over its pipeline_parallel."
               "virtual_stages %d chunks (%d %% %d = %d); Megatron requires each stage's blocks "
               "to be a multiple of the virtual stages",
               keys, which, blocks, v, blocks, v, blocks % v);
}

void fl_pp_finish_split(fl_train_config *cfg) {
    int first = cfg->pp_first_layers, last = cfg->pp_last_layers;
    if (!first && !last) return;
    char keys[128];
    if (first && last)
        snprintf(keys, sizeof keys, FIRST_KEY " %d and " LAST_KEY " %d", first, last);
    else if (first)
        snprintf(keys, sizeof keys, FIRST_KEY " %d", first);
    else
        snprintf(keys, sizeof keys, LAST_KEY " %d", last);
    int p = cfg->pipeline_parallel, v = cfg->virtual_stages, L = cfg->model.n_layer;
    if (p < 2)
        fl_die("%s: the first and last pipeline stages' blocks need pipeline_parallel.size 2 "
               "or more, which is %d",
               keys, p);
    int middle = p - (first > 0) - (last > 0), rest = L - first - last;
    if (middle == 0 && rest != 0)
        fl_die("%s: the first and last stages are all of pipeline_parallel.size %d's, so they "
               "must hold the model's %d blocks (n_layer), not %d",
               keys, p, L, first + last);
    if (middle > 0 && rest < middle)
        fl_die("%s: %d of the model's %d blocks (n_layer) are left to the %d middle pipeline "
               "stages: every stage needs at least one block",
               keys, rest, L, middle);
    if (middle > 0 && rest % middle)
        fl_die("%s: the %d blocks left to the %d middle pipeline stages (n_layer %d) do not "
               "split evenly (%d %% %d = %d), as Megatron requires",
               keys, rest, middle, L, rest, middle, rest % middle);
    int mid = middle ? rest / middle : 0;
    if (first) check_chunks(keys, "first", first, v);
    if (last) check_chunks(keys, "last", last, v);
    if (middle) check_chunks(keys, "middle", mid, v);
    if ((long long)p * v > FL_PP_MAX_VIRTUAL)
        fl_die("%s: pipeline_parallel.size %d x virtual_stages %d is more than %d virtual "
               "stages",
               keys, p, v, FL_PP_MAX_VIRTUAL);
    // virtual stage c p + r is chunk c of rank r
    char list[sizeof cfg->pipeline_split];
    size_t at = 0;
    for (int s = 0; s < p * v; s++) {
        int r = s % p, blocks = r == 0 && first ? first : r == p - 1 && last ? last : mid;
        int n = snprintf(list + at, sizeof list - at, "%s%d", s ? "," : "", blocks / v);
        if (n < 0 || (size_t)n >= sizeof list - at)
            fl_die("%s: the list of %d virtual stages is longer than pipeline_parallel.split "
                   "holds (%zu characters)",
                   keys, p * v, sizeof list - 1);
        at += (size_t)n;
    }
    if (fl_config_given(cfg, "pipeline_parallel.split") && strcmp(cfg->pipeline_split, list))
        fl_die("%s: their split %s contradicts pipeline_parallel.split (--pipeline-split) %s: "
               "give one of them",
               keys, list, cfg->pipeline_split);
    strcpy(cfg->pipeline_split, list);
}

void fl_pp_config_split(const fl_train_config *cfg, const fl_model_config *model, int *count) {
    int list[FL_PP_MAX_VIRTUAL], n_list;
    int method = fl_pp_split_parse(cfg->pipeline_split,
                                   "pipeline_parallel.split (--pipeline-split)", list, &n_list);
    long long n = (long long)cfg->pipeline_parallel * cfg->virtual_stages;
    if (method == FL_PP_SPLIT_EXPLICIT && n_list != n)
        fl_die("pipeline_parallel.split (--pipeline-split) %s has %d entr%s; pipeline_parallel."
               "size %d x virtual_stages %d = %lld virtual stages need one each",
               cfg->pipeline_split, n_list, n_list == 1 ? "y" : "ies", cfg->pipeline_parallel,
               cfg->virtual_stages, n);
    if (n > FL_PP_MAX_VIRTUAL)
        fl_die("pipeline_parallel.size %d x virtual_stages %d is more than %d virtual stages",
               cfg->pipeline_parallel, cfg->virtual_stages, FL_PP_MAX_VIRTUAL);
    if (n == 1 && method != FL_PP_SPLIT_EXPLICIT) { // one stage holds every block
        count[0] = model->n_layer;
        return;
    }
    size_t block = 0, embed = 0, head = 0;
    if (method == FL_PP_SPLIT_PARAMETERS) { // the units' sizes from the table
        fl_param_table t;
        fl_model_table(&t, model);
        for (int r = 0; r < t.count; r++) {
            int u = t.views[r].unit;
            size_t numel = t.views[r].numel;
            if (u == FL_UNIT_EMBED)
                embed += numel;
            else if (u == FL_UNIT_HEAD(model->n_layer))
                head += numel;
            else if (u == 0)
                block += numel;
        }
        fl_params_free(&t);
        // tied: the last stage holds a copy of the token embedding for its head
        if (model->tie_embeddings) head += (size_t)model->padded_vocab_size * model->n_embd;
    }
    fl_pp_split(method, model->n_layer, (int)n, list, block, embed, head, count);
}

// What the engine refuses with p > 1, or NULL.
static const char *pp_fused_optimizer(const fl_train_config *cfg) {
    if (!strcmp(cfg->optimizer, "lomo")) return "optimizer.type lomo";
    if (!strcmp(cfg->optimizer, "adalomo")) return "optimizer.type adalomo";
    if (cfg->optimizer_in_backward) return "optimizer_in_backward";
    return NULL;
}

void fl_pp_check(const fl_train_config *cfg, const fl_model_config *model) {
    int p = cfg->pipeline_parallel, v = cfg->virtual_stages, m = cfg->grad_accum;
    data_parallel_size(cfg); // world % (t p)
    int kind = fl_pp_schedule_kind(cfg->pipeline_schedule);
    if (kind < 0)
        fl_die("pipeline_parallel.schedule (--pipeline-schedule) must be gpipe, 1f1b or "
               "interleaved, got '%s'",
               cfg->pipeline_schedule);
    if (v > 1 && kind != FL_PP_INTERLEAVED)
        fl_die("pipeline_parallel.virtual_stages %d: several chunks a rank are run by the "
               "interleaved schedule, and pipeline_parallel.schedule is %s (give "
               "--pipeline-schedule interleaved, or --virtual-stages 1)",
               v, cfg->pipeline_schedule);
    if (kind == FL_PP_INTERLEAVED && v < 2)
        fl_die("pipeline_parallel.schedule interleaved runs 2 or more chunks a rank; "
               "pipeline_parallel.virtual_stages is %d (give --virtual-stages 2 or more)",
               v);
    char why[256];
    if (fl_pp_schedule_check(kind, p, m, v, why, sizeof why))
        fl_die("pipeline_parallel.schedule %s with pipeline_parallel.size %d, "
               "gradient_accumulation_steps %d (m, the micro-batches a step) and virtual_stages "
               "%d: %s",
               cfg->pipeline_schedule, p, m, v, why);
    int count[FL_PP_MAX_VIRTUAL];
    fl_pp_config_split(cfg, model, count);
    if (p == 1) return;
    if (cfg->zero.stage >= 2)
        fl_die("zero_optimization.stage %d (--zero-stage) with pipeline_parallel.size %d is "
               "refused, as DeepSpeed refuses pipeline parallelism with ZeRO-2 and ZeRO-3: a "
               "stage's gradients live across all the micro-batches of a step, which stage 2's "
               "gradient sharding (and stage 3's weight gathers) would repeat for every "
               "micro-batch; use --zero-stage 1 (the optimizer state sharded within each "
               "data-parallel group) or 0",
               cfg->zero.stage, p);
    if (cfg->lora_enabled || cfg->quant.enabled)
        fl_die("pipeline parallelism (--pipeline-parallel %d) with %s is not supported: train "
               "the adapters without it, or the whole model with it",
               p, cfg->quant.enabled ? "NF4 base weights (QLoRA)" : "LoRA adapters");
    if (pp_fused_optimizer(cfg) && m > 1)
        fl_die("%s updates each block in the backward pass of a step's one micro-batch: under "
               "pipeline parallelism (--pipeline-parallel %d) gradient_accumulation_steps "
               "(--grad-accum) must be 1, not %d (the stages then run one after the other: the "
               "pipeline splits the memory, not the time)",
               pp_fused_optimizer(cfg), p, m);
}

// Keys named stage3_* do nothing below stage 3: an error, as an fp16 key
// without fp16 is (saving gathered weights is the exception: DeepSpeed's
// save_16bit_model reads it at stage 2 too).
static void check_stage3_keys(const fl_train_config *cfg) {
    static const char *const fields[] = {"prefetch_bucket_size",
                                         "max_live_parameters",
                                         "max_reuse_distance",
                                         "param_persistence_threshold",
                                         "model_persistence_threshold",
                                         "module_granularity_threshold",
                                         "use_all_reduce_for_fetch_params"};
    char key[96];
    for (size_t i = 0; i < sizeof fields / sizeof fields[0] && cfg->zero.stage != 3; i++)
        for (int field_name = 0; field_name < 2; field_name++) { // or DeepSpeed's field name
            snprintf(key, sizeof key, ZERO "%s%s", field_name ? "" : "stage3_", fields[i]);
            if (fl_config_given(cfg, key))
                fl_die("%s applies to ZeRO stage 3; zero_optimization.stage is %d", key,
                       cfg->zero.stage);
        }
}

// What the data-parallel engine (src/parallel) cannot run yet, said before
// anything loads, naming the keys (LOMO and AdaLomo it runs: fused_units):
// LoRA and QLoRA (NF4 comes with LoRA) over several ranks. One rank does
// not need it: a ZeRO stage there partitions nothing, and the plain path
// runs (fl_dist_engine), the adapters' state where the model is (offload
// device cpu: in RAM on the cpu, host memory beside a device).
static void check_unsupported(const fl_train_config *cfg) {
    int world = fl_comm_size(), stage = cfg->zero.stage;
    if (!cfg->lora_enabled) return;
    if (world == 1) {
        const fl_zero_extra *x = &cfg->zero_extra;
        if (!strcmp(x->offload_optimizer, "nvme") || !strcmp(x->offload_param, "nvme"))
            fl_die("zero_optimization.%s.device nvme with LoRA adapters is not supported: a "
                   "LoRA run's optimizer state is the adapters', a small part of the model's "
                   "(use device cpu, or none)",
                   !strcmp(x->offload_optimizer, "nvme") ? "offload_optimizer" : "offload_param");
        return;
    }
    char with[96];
    if (stage)
        snprintf(with, sizeof with, "zero_optimization.stage %d over %d ranks", stage, world);
    else
        snprintf(with, sizeof with, "%d ranks (data parallelism)", world);
    if (cfg->quant.enabled)
        fl_die("quantization_config.bnb_4bit_quant_type nf4 with %s is not supported yet: train "
               "QLoRA on one rank (at any ZeRO stage)",
               with);
    fl_die("lora.enabled (LoRA%s) with %s is not supported yet: train adapters on one rank (at "
           "any ZeRO stage)",
           *cfg->adapter ? ", from --adapter" : "", with);
}

int fl_dist_engine(const fl_train_config *cfg, int world) {
    return world > 1 || (cfg->zero.stage > 0 && !cfg->lora_enabled);
}

// Whether a stage 3 key is "auto" under its name or DeepSpeed's field name
// (the name without stage3_).
static int stage3_auto(const fl_train_config *cfg, const char *field) {
    char key[96];
    snprintf(key, sizeof key, ZERO "stage3_%s", field);
    int by_name = fl_config_auto(cfg, key);
    snprintf(key, sizeof key, ZERO "%s", field);
    return by_name || fl_config_auto(cfg, key);
}

// Hugging Face's Trainer fills these "auto"s from the model's hidden size
// (transformers' trainer_config_finalize): the reduction bucket n_embd^2
// elements, and at stage 3 the prefetch bucket 0.9 n_embd^2 and the
// persistence threshold 10 n_embd.
static void fill_auto_buckets(fl_train_config *cfg) {
    double h = cfg->model.n_embd;
    if (fl_config_auto(cfg, ZERO "reduce_bucket_size"))
        cfg->zero.reduce_bucket_size = (float)(h * h);
    if (cfg->zero.stage != 3) return;
    if (stage3_auto(cfg, "prefetch_bucket_size"))
        cfg->zero.prefetch_bucket_size = (float)(0.9 * h * h);
    if (stage3_auto(cfg, "param_persistence_threshold"))
        cfg->zero.param_persistence_threshold = (float)(10 * h);
}

void fl_parallel_check_config(fl_train_config *cfg) {
    fill_auto_buckets(cfg);
    // DeepSpeed's default depends on the stage (zero/config.py); stage 0 is
    // not ZeRO there, and DDP overlaps its all-reduce with the backward pass
    if (!fl_config_given(cfg, ZERO "overlap_comm"))
        cfg->zero.overlap_comm = cfg->zero.stage == 3 || cfg->zero.stage == 0;
    check_stage3_keys(cfg);
    check_unsupported(cfg);
}
