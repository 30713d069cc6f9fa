// test_tp: tensor parallelism (Megatron-LM's) gives the run of one process.
// First, without MPI: a t-way rank's initial slices are exactly the slices
// of the one-process model (initialise whole, then slice: Megatron's
// test_initialization.py), with GPT-2's c_attn split by heads within each
// of Q, K and V and the vocabulary padded to 128 x t. Then, under mpirun
// (CTest's tp_np2 and tp_np4), training: every rank also runs the
// one-process reference itself and compares its slices with the
// reference's. AdaLomo's checkpoints also resume across layouts (t to one
// process and back), training on as the run that never stopped.
//
// Tolerances (fp32): losses and final weights within 1.3e-6 relative,
// Megatron's bound for model-parallel gradients (about 10.6 x fp32 epsilon,
// test_optimizer_grads_match.py): the row-parallel products are sums of t
// partial GEMMs, the only difference. AdamW runs at eps 1e-6: at 1e-8 it
// turns the rounding noise of near-zero gradients into steps of up to lr,
// which took the weights to 2e-6 of each other where SGD's are 1e-9 apart
// (the gradients agree; test_dist.c meets the same with data parallelism).
// bf16 and fp16: within the 16-bit runs' gap to fp32 as test_dist bounds it
// (losses 2e-3, weights 1e-2).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/comm.h"
#include "fitlm/io.h"
#include "fitlm/profile.h"
#include "fitlm/run.h"
#include "fitlm/train.h"
#include "testlib.h"

enum { B = 2, T = 16, STEPS = 12, V = 257 };

// ----------------------------------------------------------------------------
// the slices

static fl_model_config shape_of(fl_arch_kind arch, int tied) {
    fl_model_config c = {0};
    c.arch = arch;
    c.n_layer = 2;
    c.n_head = 8;
    c.n_embd = 32;
    c.vocab_size = V;
    c.max_seq_len = T;
    if (arch == FL_ARCH_LLAMA) {
        c.n_kv_head = 4; // grouped-query: 2 query heads per KV head
        c.intermediate_size = 48;
        c.tie_embeddings = tied;
    }
    return c;
}

// Rank `rank` of a t-way split of a random start (no collectives: a model
// only computes with them).
static void init_rank(fl_model *m, const fl_model_config *c, int t, int rank) {
    fl_weight_source s;
    fl_weight_source_random(&s, c, 7);
    fl_tp tp = {t, rank, 0, NULL};
    fl_model_init_tp(m, &s, FL_F32, NULL, 0, SIZE_MAX, &tp, NULL);
    fl_weight_source_close(&s);
}

// Local element -> whole element, written out per layout (not through
// fl_params_blocks): what the slices must be.
static long whole_index(const fl_param_view *v, const fl_param_view *w, int t, int rank, size_t e) {
    if (v->tp_dim < 0) return (long)e;
    size_t inner = v->numel / v->shape[0];
    size_t i = e / inner, j = e % inner;
    if (v->tp_dim == 1) { // columns [rank * in/t, (rank + 1) * in/t) of each row
        size_t cols = v->shape[1];
        return (long)(i * w->shape[1] + (size_t)rank * cols + j);
    }
    size_t per = v->shape[0] / (size_t)v->tp_parts, gper = w->shape[0] / (size_t)v->tp_parts;
    size_t p = i / per, k = (size_t)rank * per + i % per;
    if (k >= gper) return -1; // vocabulary padding
    (void)t;
    return (long)((p * gper + k) * inner + j);
}

static void check_slices(fl_arch_kind arch, int tied, int t) {
    fl_model_config c = shape_of(arch, tied);
    fl_model whole;
    init_rank(&whole, &c, 1, 0);
    for (int rank = 0; rank < t; rank++) {
        fl_model m;
        init_rank(&m, &c, t, rank);
        int bad = 0;
        size_t local_total = 0;
        for (int r = 0; r < m.table.count && !bad; r++) {
            const fl_param_view *v = &m.table.views[r], *w = &whole.table.views[r];
            t_check(!strcmp(v->name, w->name), "row %d keeps its name", r);
            for (size_t e = 0; e < v->numel; e++) {
                long g = whole_index(v, w, t, rank, e);
                float want = g < 0 ? 0.0f : ((float *)whole.params)[w->offset + (size_t)g];
                float got = ((float *)m.params)[v->offset + e];
                if (memcmp(&got, &want, sizeof got)) {
                    bad = 1;
                    t_check(0, "%s t=%d rank %d: %s element %zu is the whole one's %ld (%g vs %g)",
                            fl_arch_name(arch), t, rank, v->name, e, g, got, want);
                    break;
                }
            }
            local_total += v->numel;
        }
        t_check(!bad, "%s%s t=%d rank %d: every slice equals the one-process model's slice",
                fl_arch_name(arch), tied ? " tied" : "", t, rank);
        t_check(local_total == m.table.numel, "the rows fill the rank's buffer");
        // the split rows are 1/t, the vocabulary padded to 128 x t
        int q = fl_params_find(&m.table, arch == FL_ARCH_GPT2 ? "h.0.attn.c_attn.weight"
                                                              : "layers.0.self_attn.k_proj.weight");
        size_t want_rows = arch == FL_ARCH_GPT2 ? 3 * 32 / (size_t)t : 4 * 4 / (size_t)t;
        t_check(m.table.views[q].shape[0] == want_rows, "%s is split to %zu rows (%zu)",
                m.table.views[q].name, want_rows, m.table.views[q].shape[0]);
        size_t vocab_rows = (V + 128 * (size_t)t - 1) / (128 * (size_t)t) * 128;
        t_check(m.table.views[0].shape[0] == vocab_rows, "t=%d: %zu vocabulary rows per rank (%zu)",
                t, vocab_rows, m.table.views[0].shape[0]);
        fl_model_free(&m);
    }
    fl_model_free(&whole);
}

// fl_params_blocks against the explicit mapping, over sub-ranges that cut
// runs (a ZeRO shard's range inside a row).
typedef struct {
    const fl_param_view *v, *w;
    int t, rank, bad;
    size_t next; // the next local element expected
} block_check;

static void on_block(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                     size_t count) {
    block_check *b = ctx;
    if (local < b->next || count % run || stride < run) b->bad = 1;
    for (size_t k = 0; k < count / run; k++)
        for (size_t j = 0; j < run; j++) {
            long g = whole_index(b->v, b->w, b->t, b->rank, local + k * run + j);
            if (g != (long)(first + k * stride + j)) b->bad = 1;
        }
    b->next = local + count;
}

static void check_blocks(void) {
    fl_model_config c = shape_of(FL_ARCH_GPT2, 1);
    fl_param_table whole, local;
    fl_model_table(&whole, &c);
    int bad = 0;
    for (int t = 2; t <= 4; t += 2)
        for (int rank = 0; rank < t; rank++) {
            fl_params_slice(&local, &whole, t, rank);
            for (int r = 0; r < local.count; r++) {
                const fl_param_view *v = &local.views[r];
                size_t cuts[][2] = {{0, v->numel}, {3, v->numel - 5}, {v->numel / 3, v->numel / 2}};
                for (int k = 0; k < 3; k++) {
                    block_check b = {v, &whole.views[r], t, rank, 0, cuts[k][0]};
                    fl_params_blocks(&local, r, cuts[k][0], cuts[k][1], on_block, &b);
                    bad |= b.bad;
                }
            }
            fl_params_free(&local);
        }
    fl_params_free(&whole);
    t_check(!bad, "fl_params_blocks maps every local element of every row (ranges cutting runs "
                  "too) to its whole-row element");
}

// ----------------------------------------------------------------------------
// training against one process

typedef struct {
    const char *name;
    fl_arch_kind arch;
    fl_dtype dt;
    int tp, sp, stage, accum, tied;
    fl_recompute recompute;
    fl_optim_kind kind; // AdamW unless set
} tp_case;

static float lr_of(const tp_case *c) {
    return c->kind == FL_OPT_LOMO ? 0.2f : c->kind == FL_OPT_ADALOMO ? 0.05f : 2e-3f;
}

static const char *optimizer_flags(const tp_case *c) {
    // AdaLomo at test_dist's eps (its lr a multiple of each tensor's RMS)
    return c->kind == FL_OPT_LOMO      ? "lomo"
           : c->kind == FL_OPT_ADALOMO ? "adalomo --eps 1e-8"
                                       : "adamw --eps 1e-6";
}

// out: the run's output directory (NULL: none)
static void open_run(const tp_case *c, int tp, const char *out, fl_run *run) {
    int dp = tp ? fl_comm_size() / c->tp : 1;
    char flags[2048];
    int n = snprintf(flags, sizeof flags,
                     "--model tiny --arch %s --n-layer 2 --n-head 8 --n-embd 32 --max-seq-len %d "
                     "--tokenizer byte --precision %s --batch %d --seq-len %d --grad-accum %d "
                     "--zero-stage %d --optimizer %s --lr %g --scheduler constant --warmup 0 "
                     "--grad-clip 1.0 --activation-checkpointing %s --seed 42 --threads 1 "
                     "--sample-tokens 0 --out=%s --comm-timeout 60 --tensor-parallel %d%s",
                     fl_arch_name(c->arch), T, fl_dtype_name(c->dt),
                     tp ? B : B * fl_comm_size() / c->tp, T, c->accum, tp ? c->stage : 0,
                     optimizer_flags(c), lr_of(c),
                     c->recompute == FL_RECOMPUTE_BLOCK       ? "block"
                     : c->recompute == FL_RECOMPUTE_SELECTIVE ? "selective"
                                                              : "none",
                     out ? out : "", tp ? c->tp : 1, tp && c->sp ? " --sequence-parallel" : "");
    (void)dp;
    if (c->arch == FL_ARCH_LLAMA)
        snprintf(flags + n, sizeof flags - (size_t)n,
                 " --n-kv-head 4 --intermediate-size 48 --tie-word-embeddings=%s",
                 c->tied ? "true" : "false");
    t_run_open(run, NULL, flags, !tp);
}

// The global batch of a step: micro-batch k holds dp*B sequences, data
// rank d takes the d-th B of them (every rank of a TP group the same).
static void batch(int step, int accum, int dp, int *inputs, int *targets) {
    t_rule_batch(0x9E3779B97F4A7C15ull * (uint64_t)(step + 1), (size_t)accum * dp * B * T, V,
                 inputs, targets);
}

typedef struct {
    float loss[STEPS], norm[STEPS];
    float *weights; // this rank's flat buffer (the reference's: whole), fp32
    fl_param_table table;
} run_result;

// Steps [from, to) of the case (tp: split; else the one-process
// reference): first restored from the checkpoint `resume` (NULL: none);
// after step save_at saved to `save` (NULL: not saved), as fl_run_save
// does (the test's own batches: no loader position).
static void train_steps(const tp_case *c, int tp, int from, int to, const char *resume,
                        const char *save, int save_at, run_result *out) {
    int dp = fl_comm_size() / c->tp, drank = fl_comm_rank() / c->tp;
    fl_run run;
    open_run(c, tp, save, &run);
    fl_loader_state at = {0};
    if (resume) {
        fl_ckpt *ck = fl_ckpt_open(resume);
        fl_train_ckpt_restore(ck, &run.model, &run.optim, NULL, &at, run.tok_files.name);
        fl_ckpt_close(ck);
    }
    if (tp)
        t_check(run.model.tp.size == c->tp &&
                    run.model.table.numel < fl_model_whole_table(&run.model)->numel,
                "%s: the run is split %d ways (%d)", c->name, c->tp, run.model.tp.size);
    int Bm = run.cfg.micro_batch;
    size_t global = (size_t)c->accum * dp * B * T;
    int *gi = malloc(global * sizeof(int)), *gt = malloc(global * sizeof(int));
    for (int step = from; step < to; step++) {
        batch(step, c->accum, dp, gi, gt);
        for (int k = 0; k < c->accum; k++) {
            size_t from = ((size_t)k * dp + (tp ? drank : 0)) * B * T, len = (size_t)Bm * T;
            memcpy(run.inputs + k * len, gi + from, len * sizeof(int));
            memcpy(run.targets + k * len, gt + from, len * sizeof(int));
        }
        fl_train_result r = fl_run_step_batch(&run, run.inputs, run.targets, lr_of(c));
        out->loss[step] = r.loss;
        out->norm[step] = r.grad_norm;
        if (save && step + 1 == save_at) {
            if (tp)
                fl_train_ckpt_save_dist(save, save_at, &run.model, &run.optim, &at, &run.tok_files,
                                        run.config_json, 1, run.run_id);
            else
                fl_train_ckpt_save_run(save, save_at, &run.model, &run.optim, NULL, &at,
                                       &run.tok_files, run.config_json, 1, run.run_id);
        }
    }
    out->weights = t_weights_f32(&run.model, run.strategy);
    fl_params_slice(&out->table, fl_model_whole_table(&run.model), run.model.tp.size,
                    run.model.tp.rank);
    free(gi);
    free(gt);
    fl_run_close(&run);
}

static void train(const tp_case *c, int tp, run_result *out) {
    train_steps(c, tp, 0, STEPS, NULL, NULL, 0, out);
}

// The reference's weights as this rank's slices (padding rows zero).
static float *slice_of(const float *whole, const fl_param_table *wt, const fl_param_table *lt) {
    float *out = calloc(lt->numel, sizeof(float));
    for (int r = 0; r < lt->count; r++) {
        t_slice_row(lt, r, whole + wt->views[r].offset, out + lt->views[r].offset);
    }
    return out;
}

// A run's steps [from, STEPS) and final weights (got: its slices) against
// the one-process reference's (want); frees got's.
static void compare(const tp_case *c, const char *name, run_result *got, const run_result *want,
                    int from) {
    double tol = c->dt == FL_F32 ? 1.3e-6 : 2e-3, w_tol = c->dt == FL_F32 ? 1.3e-6 : 1e-2;
    double worst = 0.0, worst_norm = 0.0;
    for (int s = from; s < STEPS; s++) {
        double r = fabs((double)got->loss[s] - want->loss[s]) / fabs((double)want->loss[s]);
        double g = fabs((double)got->norm[s] - want->norm[s]) / fabs((double)want->norm[s]);
        worst = r > worst ? r : worst;
        worst_norm = g > worst_norm ? g : worst_norm;
    }
    fl_param_table whole;
    fl_model_config mc = shape_of(c->arch, c->tied);
    fl_model_table(&whole, &mc);
    float *ref = slice_of(want->weights, &whole, &got->table);
    // GPT-2's key bias has an exact gradient of zero: AdamW turns its rounding
    // noise into steps of up to lr (test_dist.c), so it is left out
    for (int r = 0; r < got->table.count; r++)
        if (strstr(got->table.views[r].name, "c_attn.bias"))
            for (size_t i = 0; i < got->table.views[r].numel; i++)
                got->weights[got->table.views[r].offset + i] = ref[got->table.views[r].offset + i];
    double wd = t_rel_diff(got->weights, ref, got->table.numel);
    if (getenv("FITLM_TEST_VERBOSE") && fl_comm_rank() == 0)
        for (int r = 0; r < got->table.count; r++) {
            const fl_param_view *v = &got->table.views[r];
            double d = t_rel_diff(got->weights + v->offset, ref + v->offset, v->numel);
            if (d > 1e-6) printf("  row %s: %.3g\n", v->name, d);
        }
    int rank = fl_comm_rank(), world = fl_comm_size();
    if (getenv("FITLM_TEST_VERBOSE"))
        printf("rank %d %s: loss %.3g norm %.3g weights %.3g (loss %.4f -> %.4f)\n", rank, name,
               worst, worst_norm, wd, got->loss[from], got->loss[STEPS - 1]);
    t_check(worst <= tol, "rank %d/%d %s: losses within %g relative of one process (worst %.3g)",
            rank, world, name, tol, worst);
    t_check(worst_norm <= (c->dt == FL_F32 ? 1e-5 : 2e-2),
            "rank %d/%d %s: gradient norms as one process's (worst %.3g)", rank, world, name,
            worst_norm);
    t_check(wd <= w_tol, "rank %d/%d %s: final weights within %g relative (%.3g)", rank, world,
            name, w_tol, wd);
    // (GPT-2 under LOMO, plain SGD clipped at 1, falls slowly in 12 steps)
    t_check(got->loss[STEPS - 1] <
                got->loss[from] - (c->kind == FL_OPT_LOMO || from ? 0.0f : 0.05f),
            "rank %d/%d %s: the loss falls (%.4f -> %.4f)", rank, world, name, got->loss[from],
            got->loss[STEPS - 1]);
    free(ref);
    free(got->weights);
    fl_params_free(&got->table);
    fl_params_free(&whole);
}

static void free_result(run_result *r) {
    free(r->weights);
    fl_params_free(&r->table);
}

// One step's collectives, as --profile counts them in its communication
// slot: Megatron's two all-reduces per block forward (after the row-parallel
// attention and MLP projections) and two backward (before the
// column-parallel QKV and MLP inputs), plus the embedding's sum and the
// loss's max and sums forward, and the LM head's input gradient backward.
static void check_collectives(const tp_case *c) {
    fl_run run;
    open_run(c, 1, NULL, &run);
    batch(0, 1, fl_comm_size() / c->tp, run.inputs, run.targets);
    fl_profile_enable(1);
    fl_profile_reset();
    fl_run_step_batch(&run, run.inputs, run.targets, lr_of(c));
    const fl_op_stats *s = fl_profile_stats(FL_OP_COMM);
    int L = run.cfg.model.n_layer;
    t_check(s->calls[FL_FWD] == 2 * L + 3 && s->calls[FL_BWD] == 2 * L + 1,
            "%s: %lld collectives forward (2L + 3 = %d), %lld backward (2L + 1 = %d)", c->name,
            s->calls[FL_FWD], 2 * L + 3, s->calls[FL_BWD], 2 * L + 1);
    fl_profile_enable(0);
    fl_run_close(&run);
}

static void check_case(const tp_case *c) {
    // TP x DP cases on 4 ranks only (t = 2 alone is the first cases' on 2)
    if (fl_comm_size() % c->tp || (c->tp < fl_comm_size() && fl_comm_size() != 4)) return;
    run_result got, want;
    train(c, 1, &got);
    train(c, 0, &want);
    compare(c, c->name, &got, &want, 0);
    free_result(&want);
}

// A checkpoint of a split run resumes in one process, and one of one
// process resumes split, each then training as the run that was never
// stopped: the optimizer's state (AdaLomo's row and column statistics,
// split apart from their rows) is saved as the whole tensors' and read back
// as any layout's. dir: a scratch directory of all ranks'.
static void check_resume(const tp_case *c, const char *dir, int i) {
    enum { H = STEPS / 2 };
    char one[512], split[512], name[256];
    snprintf(one, sizeof one, "%s/%d-one", dir, i);
    snprintf(split, sizeof split, "%s/%d-tp", dir, i);
    run_result want, half, got;
    train_steps(c, 0, 0, STEPS, NULL, fl_comm_rank() == 0 ? one : NULL, H, &want);
    train_steps(c, 1, 0, H, NULL, split, H, &half);
    free_result(&half);
    fl_comm_barrier(fl_comm_world()); // rank 0's one-process checkpoint is written
    train_steps(c, 0, H, STEPS, split, NULL, 0, &got);
    snprintf(name, sizeof name, "%s, resumed from t = %d on one process", c->name, c->tp);
    compare(c, name, &got, &want, H);
    train_steps(c, 1, H, STEPS, one, NULL, 0, &got);
    snprintf(name, sizeof name, "%s, resumed from one process at t = %d", c->name, c->tp);
    compare(c, name, &got, &want, H);
    free_result(&want);
}

int main(int argc, char **argv) {
    fl_comm_init(&argc, &argv);
    fl_set_threads(1); // ranks share the cores
    if (chdir(t_source_path("")) != 0) return t_check(0, "cd to the source tree"), t_report();
    if (fl_comm_rank() == 0) {
        for (int t = 2; t <= 4; t += 2) {
            check_slices(FL_ARCH_GPT2, 1, t);
            check_slices(FL_ARCH_LLAMA, 0, t);
            check_slices(FL_ARCH_LLAMA, 1, t);
        }
        check_blocks();
    }
    if (fl_comm_size() > 1) {
        const fl_arch_kind G = FL_ARCH_GPT2, L = FL_ARCH_LLAMA;
        const fl_recompute none = FL_RECOMPUTE_NONE;
        int w = fl_comm_size();
        const fl_recompute sel = FL_RECOMPUTE_SELECTIVE, blk = FL_RECOMPUTE_BLOCK;
        const fl_optim_kind A = FL_OPT_ADAMW, D = FL_OPT_ADALOMO;
        // t = the world; then, on 4 ranks, 2 x 2 (TP x DP) under DDP and ZeRO-1/2/3
        const tp_case cases[] = {
            {"gpt2 fp32 TP", G, FL_F32, w, 0, 0, 1, 1, none, A},
            {"llama fp32 TP (GQA, untied)", L, FL_F32, w, 0, 0, 1, 0, none, A},
            {"llama fp32 TP (tied), accumulation", L, FL_F32, w, 0, 0, 2, 1, none, A},
            {"gpt2 fp32 TP+SP, accumulation", G, FL_F32, w, 1, 0, 2, 1, none, A},
            {"llama fp32 TP+SP, selective recompute", L, FL_F32, w, 1, 0, 1, 0, sel, A},
            {"gpt2 fp32 TP+SP, block recompute", G, FL_F32, w, 1, 0, 1, 1, blk, A},
            {"gpt2 fp32 TP, LOMO", G, FL_F32, w, 0, 0, 1, 1, none, FL_OPT_LOMO},
            {"llama fp32 TP+SP, LOMO", L, FL_F32, w, 1, 0, 1, 0, none, FL_OPT_LOMO},
            {"gpt2 fp32 TP, AdaLomo", G, FL_F32, w, 0, 0, 1, 1, none, D},
            {"llama fp32 TP+SP, AdaLomo", L, FL_F32, w, 1, 0, 1, 0, none, D},
            {"llama fp32 TP (tied), AdaLomo, accumulation", L, FL_F32, w, 0, 0, 2, 1, none, D},
            {"gpt2 bf16 TP, block recompute", G, FL_BF16, w, 0, 0, 1, 1, blk, A},
            {"llama fp16 TP+SP", L, FL_F16, w, 1, 0, 2, 0, none, A},
            {"gpt2 fp32 TP x DDP", G, FL_F32, 2, 0, 0, 2, 1, none, A},
            {"llama fp32 TP+SP x ZeRO-1", L, FL_F32, 2, 1, 1, 2, 0, none, A},
            {"gpt2 fp32 TP x ZeRO-2", G, FL_F32, 2, 0, 2, 2, 1, none, A},
            {"llama fp32 TP x ZeRO-3", L, FL_F32, 2, 0, 3, 1, 1, none, A},
            {"gpt2 fp32 TP+SP x ZeRO-3, block recompute", G, FL_F32, 2, 1, 3, 1, 1, blk, A},
            {"gpt2 fp32 TP x ZeRO-1, AdaLomo", G, FL_F32, 2, 0, 1, 1, 1, none, D},
            {"llama fp32 TP+SP x ZeRO-3, AdaLomo", L, FL_F32, 2, 1, 3, 1, 0, none, D},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
        check_collectives(&cases[0]);
        char dir[64] = "/tmp/fitlm_test_tp_XXXXXX";
        if (fl_comm_rank() == 0 && !mkdtemp(dir)) t_check(0, "a scratch directory");
        fl_comm_bcast(fl_comm_world(), dir, sizeof dir, 0);
        const tp_case resumed[] = {
            {"gpt2 fp32 TP, AdaLomo", G, FL_F32, w, 0, 0, 1, 1, none, D},
            {"llama fp32 TP+SP, AdaLomo", L, FL_F32, w, 1, 0, 1, 0, none, D},
        };
        for (int i = 0; i < 2; i++) check_resume(&resumed[i], dir, i);
        fl_comm_barrier(fl_comm_world());
        char rm[128];
        snprintf(rm, sizeof rm, "rm -rf %s", dir);
        if (fl_comm_rank() == 0 && system(rm) != 0) t_check(0, "%s", rm);
    }
    return fl_comm_finalize(t_report());
}
