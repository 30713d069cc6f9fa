// test_dist: data parallelism (DDP and ZeRO stages 1-3) gives the run of one
// process with the same global batch. CTest starts it under mpirun with 2
// and 4 ranks (and once over TCP), and once alone (one rank: the shards are
// the whole buffer). Every rank also runs the one-process reference itself,
// so each rank checks its own result without any exchange but the strategy's.
// First, the texts a run's ranks agree on (every option, the parameter
// table) and the description of their first difference, and the agreement
// over groups of ranks (the ranks that differ are test_failures' cases).
//
// Tolerances: fp32 losses within 1e-6 relative and final weights within
// 1e-6 relative (norm of the difference over the norm); the strategy sums
// each gradient over ranks in another order than one GEMM does, which is the
// only difference. bf16 and fp16: 16-bit gradients are rounded per rank
// before the fp32 sum instead of once, and weights are compared after their
// rounding to 16 bits: losses within 2e-3 relative, weights within 1e-2.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/comm.h"
#include "fitlm/run.h"
#include "fitlm/train.h"
#include "testlib.h"

enum { B = 2, T = 16, STEPS = 20, V = 97 };
#define LR 2e-3f

typedef struct {
    const char *name;
    fl_arch_kind arch;
    fl_dtype dt;
    int stage, accum;
    fl_recompute recompute;
    // zero_optimization overrides (0: defaults)
    float bucket, prefetch, live, persistence;
    int no_overlap, no_reduce_scatter, no_reuse, tied;
    fl_optim_kind kind; // AdamW unless set
    float clip;         // gradient clipping (default 1.0; -1: none)
} dist_case;

// learning rates at which 20 steps lower the loss: AdamW's, plain SGD's
// (LOMO) and AdaLomo's (a multiple of each tensor's RMS). Pure bf16 LOMO
// takes the lower one: at 0.5 its loss oscillates from step to step, which
// grew bf16 rounding differences between the runs to 0.3-0.5% by step 20
// on an Intel CPU (0.03% at step 10).
static float lr_of(const dist_case *c) {
    if (c->kind == FL_OPT_LOMO) return c->clip < 0 || c->dt != FL_F32 ? 0.2f : 0.5f;
    return c->kind == FL_OPT_ADALOMO ? 0.05f : LR;
}

// The case as `fitlm train`'s flags: its shape (a vocabulary of V, from a
// tokenizer.json of V tokens: every id the batches use, so no row of the LM
// head is trained only towards zero, where AdamW would turn the ranks' other
// summation order into steps of lr), precision, optimizer
// and zero_optimization keys. The one-process reference (dist 0) takes the
// whole global batch per micro-batch, alone, with no strategy.
static void open_run(const dist_case *c, int dist, fl_run *run) {
    char flags[2048];
    int n = snprintf(
        flags, sizeof flags,
        "--model tiny --arch %s --n-layer 3 --n-head 4 --n-embd 32 --max-seq-len %d "
        "--tokenizer hf --tokenizer-path %s --precision %s --batch %d --seq-len %d --grad-accum %d "
        "--zero-stage %d --optimizer %s --lr %g --scheduler constant --warmup 0 "
        "--grad-clip %g --activation-checkpointing %s --seed 42 --threads 1 "
        "--sample-tokens 0 --out= --comm-timeout 60",
        fl_arch_name(c->arch), T, t_source_path("tests/fixtures/hf_tokenizer_97"),
        fl_dtype_name(c->dt), dist ? B : B * fl_comm_size(), T, c->accum, dist ? c->stage : 0,
        c->kind == FL_OPT_LOMO      ? "lomo"
        : c->kind == FL_OPT_ADALOMO ? "adalomo"
                                    : "adamw",
        lr_of(c),
        c->clip < 0 ? 0.0f
        : c->clip   ? c->clip
                    : 1.0f,
        c->recompute == FL_RECOMPUTE_BLOCK ? "block" : "none");
    // AdaLomo at the eps its tolerance was set with, the general default
    // (through the config AdaLomo's own default is 1e-30)
    if (c->kind == FL_OPT_ADALOMO)
        n += snprintf(flags + n, sizeof flags - (size_t)n, " --eps 1e-8");
    if (c->arch == FL_ARCH_LLAMA)
        n += snprintf(flags + n, sizeof flags - (size_t)n,
                      " --n-kv-head 2 --intermediate-size 48 --tie-word-embeddings=%s",
                      c->tied ? "true" : "false");
    // the keys' settings the case changes from DeepSpeed's defaults (the
    // reference has no strategy for them)
    const struct {
        float set;
        const char *flag;
    } keys[] = {{c->bucket, "--reduce-bucket-size"},
                {c->bucket, "--allgather-bucket-size"},
                {c->prefetch, "--prefetch-bucket-size"},
                {c->live, "--max-live-parameters"},
                {c->persistence, "--param-persistence-threshold"}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0] && dist; i++)
        if (keys[i].set)
            n += snprintf(flags + n, sizeof flags - (size_t)n, " %s %g", keys[i].flag, keys[i].set);
    if (dist)
        snprintf(flags + n, sizeof flags - (size_t)n, "%s%s%s",
                 c->no_overlap ? " --overlap-comm=false" : "",
                 c->no_reduce_scatter ? " --reduce-scatter=false" : "",
                 c->no_reuse ? " --max-reuse-distance 0" : "");
    t_run_open(run, NULL, flags, !dist);
}

// The global batch of a step: micro-batch k holds world*B sequences, rank r
// takes the r-th B of them.
static void batch(int step, int accum, int world, int *inputs, int *targets) {
    size_t n = (size_t)accum * world * B * T;
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(step + 1);
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        inputs[i] = (int)(s % V);
        // a learnable rule, and a few masked targets, so that ranks hold
        // different numbers of target tokens
        targets[i] = (s >> 20) % 11 == 0 ? -1 : (inputs[i] * 7 + 3) % V;
    }
}

typedef struct {
    float loss[STEPS];
    float *weights;        // whole, fp32, table order
    fl_model_config shape; // the run's
} run_result;

// Trains STEPS steps: with a strategy over the world (dist), or alone on the
// whole global batch.
static void train(const dist_case *c, int dist, run_result *out) {
    int world = fl_comm_size(), rank = fl_comm_rank();
    fl_run run;
    open_run(c, dist, &run);
    int Bm = run.cfg.micro_batch; // sequences per forward here
    size_t global = (size_t)c->accum * world * B * T;
    int *gi = malloc(global * sizeof(int)), *gt = malloc(global * sizeof(int));
    for (int step = 0; step < STEPS; step++) {
        batch(step, c->accum, world, gi, gt);
        // this process's micro-batches: rank r's slice of each global one
        for (int k = 0; k < c->accum; k++) {
            size_t from = ((size_t)k * world + (dist ? rank : 0)) * B * T;
            size_t len = (size_t)Bm * T;
            memcpy(run.inputs + k * len, gi + from, len * sizeof(int));
            memcpy(run.targets + k * len, gt + from, len * sizeof(int));
        }
        fl_train_result r = fl_run_step_batch(&run, run.inputs, run.targets, lr_of(c));
        out->loss[step] = r.loss;
    }
    // the final weights, whole (stage 3 gathers them row by row)
    out->weights = t_weights_f32(&run.model, run.strategy);
    out->shape = run.cfg.model;
    free(gi);
    free(gt);
    fl_run_close(&run);
}

static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0.0, s = 0.0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        s += (double)b[i] * b[i];
    }
    return sqrt(d / s);
}

static void check_case(const dist_case *c) {
    run_result got, want;
    train(c, 1, &got);
    train(c, 0, &want);
    double loss_tol = c->dt == FL_F32 ? 1e-6 : 2e-3, w_tol = c->dt == FL_F32 ? 1e-6 : 1e-2;
    double worst = 0.0;
    for (int s = 0; s < STEPS; s++) {
        double r = fabs((double)got.loss[s] - want.loss[s]) / fabs((double)want.loss[s]);
        if (r > worst) worst = r;
    }
    fl_model_config mc = got.shape;
    size_t n = fl_model_num_params(&mc);
    // GPT-2's key bias has an exact gradient of zero (softmax does not see a
    // shift of every score), so AdamW turns its rounding noise into steps of
    // up to lr: it is compared apart, within lr per step
    double key_bias = 0.0;
    if (c->arch == FL_ARCH_GPT2) {
        fl_param_table t;
        fl_model_table(&t, &mc);
        size_t C = (size_t)mc.n_embd;
        for (int r = 0; r < t.count; r++)
            if (strstr(t.views[r].name, "c_attn.bias"))
                for (size_t i = t.views[r].offset + C; i < t.views[r].offset + 2 * C; i++) {
                    double e = fabs((double)got.weights[i] - want.weights[i]);
                    key_bias = e > key_bias ? e : key_bias;
                    got.weights[i] = want.weights[i];
                }
        fl_params_free(&t);
    }
    double wd = rel_diff(got.weights, want.weights, n);
    int world = fl_comm_size(), rank = fl_comm_rank();
    t_check(worst <= loss_tol,
            "rank %d/%d %s: losses within %g relative of one process (worst %.3g)", rank, world,
            c->name, loss_tol, worst);
    t_check(wd <= w_tol, "rank %d/%d %s: final weights within %g relative (%.3g)", rank, world,
            c->name, w_tol, wd);
    t_check(key_bias <= lr_of(c) * STEPS, "rank %d/%d %s: the key bias within lr x steps (%.3g)",
            rank, world, c->name, key_bias);
    t_check(got.loss[STEPS - 1] < got.loss[0] - 0.05f,
            "rank %d/%d %s: the loss falls (%.4f -> %.4f)", rank, world, c->name, got.loss[0],
            got.loss[STEPS - 1]);
    free(got.weights);
    free(want.weights);
}

// ----------------------------------------------------------------------------
// what the ranks agree on

// A finished config of the base flags and then `more` (a --config file
// among them, say).
static void finished(fl_train_config *cfg, const char *more) {
    char flags[1024], *argv[64];
    snprintf(flags, sizeof flags,
             "--model tiny --tokenizer byte --data data/brown_byte --seq-len 32 --sample-tokens 0 "
             "--val-data none %s",
             more);
    int argc = 0;
    for (char *w = strtok(flags, " "); w && argc < 64; w = strtok(NULL, " ")) argv[argc++] = w;
    fl_config_defaults(cfg);
    fl_config_parse_args(cfg, argc, argv);
    fl_config_finish(cfg, fl_tokenizer_vocab_of(cfg->tokenizer, cfg->tokenizer_path));
}

// Its canonical text.
static char *settings_of(const char *more) {
    fl_train_config cfg;
    finished(&cfg, more);
    return fl_config_canonical(&cfg);
}

// Every option of the table is in the text once, in a line of its own,
// except the five that describe the machine.
static void check_every_option_agreed(void) {
    char *help = NULL, *text = settings_of("");
    size_t n = 0;
    FILE *f = open_memstream(&help, &n);
    fl_config_print_help(f);
    fclose(f);
    int keys = 0, lines = 0;
    for (const char *p = text; *p; p += strcspn(p, "\n") + 1) lines++;
    for (const char *p = help; (p = strstr(p, "  [")); p++) {
        char key[128], line[140];
        if (sscanf(p + 3, "%127[^]]", key) != 1) continue;
        keys++;
        int machine = !strcmp(key, "threads") || !strcmp(key, "mem_limit") ||
                      !strcmp(key, "peak_tflops") || strstr(key, ".nvme_path");
        snprintf(line, sizeof line, "\n%s=", key);
        const char *at = !strncmp(text, line + 1, strlen(line + 1)) ? text : strstr(text, line);
        t_check(machine ? at == NULL : at != NULL, "option %s is %s the ranks' settings", key,
                machine ? "left out of" : "in");
    }
    t_check(keys > 100 && lines == keys - 5,
            "the settings hold every option but the machine's: %d lines for %d options", lines,
            keys);
    free(help);
    free(text);
}

// Two runs started with settings that differ in one place: the description
// names its key and both values (so every rank agrees with its own).
static void check_difference_named(void) {
    char json[] = "/tmp/fitlm_agree_XXXXXX";
    int fd = mkstemp(json);
    if (fd >= 0) close(fd);
    t_write_text(json, "{\"optimizer\": {\"params\": {\"betas\": [0.9, 0.99]}}}");
    char config_flag[64];
    snprintf(config_flag, sizeof config_flag, "--config %s", json);
    const struct {
        const char *flags, *says;
    } cases[] = {
        {"--n-layer 3", "key model.n_layer: 2 (rank 0) vs 3 (rank 5)"},
        {"--n-embd 32", "key model.n_embd: 64 (rank 0) vs 32 (rank 5)"},
        {"--lr 0.002", "key optimizer.params.lr: 0.003 (rank 0) vs 0.002 (rank 5)"},
        {"--lr 0.0030000003", "key optimizer.params.lr: 0.003 (rank 0) vs 0.0030000"}, // 1 ulp
        {"--seed 1338", "key seed: 1337 (rank 0) vs 1338 (rank 5)"},
        {"--precision bf16", "key precision: fp32 (rank 0) vs bf16 (rank 5)"},
        {"--optimizer sgd", "key optimizer.type: adamw (rank 0) vs sgd (rank 5)"},
        {"--batch 8", "key train_micro_batch_size_per_gpu: 16 (rank 0) vs 8 (rank 5)"},
        {"--seq-len 16", "key seq_len: 32 (rank 0) vs 16 (rank 5)"},
        {"--grad-accum 2", "key gradient_accumulation_steps: 1 (rank 0) vs 2 (rank 5)"},
        {"--grad-clip 0.5", "key gradient_clipping: 1 (rank 0) vs 0.5 (rank 5)"},
        {"--weight-decay 0.01", "key optimizer.params.weight_decay: 0.1 (rank 0) vs 0.01 (rank 5)"},
        {"--save-every 5", "key save_every: 0 (rank 0) vs 5 (rank 5)"},
        {"--zero-stage 1", "key zero_optimization.stage: 0 (rank 0) vs 1 (rank 5)"},
        {config_flag, "key optimizer.params.betas: 0.9,0.95 (rank 0) vs 0.9,0.99 (rank 5)"},
        {"--out a\nb", "key out_dir: out (rank 0) vs a\\x0ab (rank 5)"},
    };
    char *base = settings_of("");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *other = settings_of(cases[i].flags), says[1024];
        int differ = fl_agree_describe(base, 0, other, 5, says, sizeof says);
        t_check(differ && fl_agree_hash(base) != fl_agree_hash(other) &&
                    strstr(says, cases[i].says) && strstr(says, "ranks 0 and 5 differ at "),
                "%s: the ranks differ at \"%s\"; got \"%s\"", cases[i].flags, cases[i].says, says);
        free(other);
    }
    char says[256];
    t_check(!fl_agree_describe(base, 0, base, 5, says, sizeof says), "the same settings agree: %s",
            says);
    free(base);
    remove(json);
}

// The parameter tables of two shapes: the totals differ first; a text that
// ends early or holds another key is named as such.
static void check_tables_named(void) {
    fl_train_config a, b;
    finished(&a, "");
    finished(&b, "--n-layer 3");
    fl_param_table ta = {0}, tb = {0};
    fl_model_table(&ta, &a.model);
    fl_model_table(&tb, &b.model);
    char *x = fl_params_canonical(&ta, FL_F32), *y = fl_params_canonical(&tb, FL_F32),
         *z = fl_params_canonical(&ta, FL_BF16), says[1024];
    t_check(fl_agree_describe(x, 0, y, 1, says, sizeof says) && strstr(says, "key params.numel: "),
            "another depth differs at the parameter count: %s", says);
    t_check(fl_agree_describe(x, 0, z, 1, says, sizeof says) &&
                strstr(says, "key params.dtype: fp32 (rank 0) vs bf16 (rank 1)"),
            "another dtype differs at params.dtype: %s", says);
    t_check(strstr(x, "\nparam.wte.weight=shape ") != NULL, "the rows are named: %.200s", x);
    t_check(fl_agree_describe("a=1\nb=2\n", 0, "a=1\n", 3, says, sizeof says) &&
                !strcmp(says, "ranks 0 and 3 differ at key b: rank 0 has it (2), rank 3 not"),
            "a key only rank 0 has: %s", says);
    t_check(fl_agree_describe("a=1\n", 0, "a=1\nc=4\n", 3, says, sizeof says) &&
                !strcmp(says, "ranks 0 and 3 differ at key c: rank 3 has it (4), rank 0 not"),
            "a key only rank 3 has: %s", says);
    t_check(fl_agree_describe("a=1\nb=2\n", 0, "a=1\nc=2\n", 3, says, sizeof says) &&
                !strcmp(says, "ranks 0 and 3 differ at key b: rank 0 has b = 2 where rank 3 has "
                              "c = 2"),
            "another key in the same place: %s", says);
    free(x);
    free(y);
    free(z);
    fl_params_free(&ta);
    fl_params_free(&tb);
}

// Ranks that agree pass, over the world and over groups whose texts differ
// from each other's (a split by parity); the groups number their ranks.
static void check_groups(void) {
    int rank = fl_comm_rank(), world = fl_comm_size();
    fl_comm_agree(fl_comm_world(), "test texts", "a=1\nb=2\n");
    fl_comm_group *half = fl_comm_split(fl_comm_world(), rank % 2);
    char text[64];
    snprintf(text, sizeof text, "parity=%d\n", rank % 2);
    fl_comm_agree(half, "test texts of a group", text);
    t_check(fl_comm_group_rank(half) == rank / 2 &&
                fl_comm_group_size(half) == (world - rank % 2 + 1) / 2,
            "rank %d of %d is rank %d of %d in its half", rank, world, fl_comm_group_rank(half),
            fl_comm_group_size(half));
    fl_comm_group_free(half);
}

// The spike guard under a strategy: every rank judges the all-reduced loss
// and norm, so all skip the same step, and a skipped step changes no
// weight; a normal step after it is applied on every rank. The window is
// filled with values far below the batch's, so the first real step is a
// spike: for the plain step, ZeRO-3's and the fused ones (two passes, and
// one pass, which judges the loss alone).
static void check_spike_guard(const dist_case *c) {
    int world = fl_comm_size(), rank = fl_comm_rank();
    fl_run run;
    open_run(c, 1, &run);
    fl_spike_guard *g = run.base ? &run.base->spike : &run.optim.spike;
    for (int i = 0; i < 20; i++) fl_spike_judge(g, 1e-3 * (1 + i % 2), 1e-4 * (1 + i % 2));
    size_t global = (size_t)c->accum * world * B * T, len = (size_t)run.cfg.micro_batch * T;
    int *gi = malloc(global * sizeof(int)), *gt = malloc(global * sizeof(int));
    batch(0, c->accum, world, gi, gt);
    for (int k = 0; k < c->accum; k++) {
        memcpy(run.inputs + k * len, gi + ((size_t)k * world + rank) * B * T, len * sizeof(int));
        memcpy(run.targets + k * len, gt + ((size_t)k * world + rank) * B * T, len * sizeof(int));
    }
    float *before = t_weights_f32(&run.model, run.strategy);
    fl_train_result r = fl_run_step_batch(&run, run.inputs, run.targets, lr_of(c));
    float *after = t_weights_f32(&run.model, run.strategy);
    size_t n = run.model.table.numel;
    double flagged = r.spike.outlier;
    fl_comm_sum(&flagged, 1);
    t_check(flagged == world && !memcmp(before, after, n * sizeof(float)),
            "rank %d/%d %s: every rank skips the spike (%g of %d), no weight changes", rank, world,
            c->name, flagged, world);
    // the guard off: the same step is applied everywhere
    g->cfg.loss_z = g->cfg.grad_z = 0;
    r = fl_run_step_batch(&run, run.inputs, run.targets, lr_of(c));
    free(after);
    after = t_weights_f32(&run.model, run.strategy);
    flagged = r.spike.outlier;
    fl_comm_sum(&flagged, 1);
    t_check(flagged == 0 && memcmp(before, after, n * sizeof(float)),
            "rank %d/%d %s: without the guard the step updates", rank, world, c->name);
    free(before);
    free(after);
    free(gi);
    free(gt);
    fl_run_close(&run);
}

int main(int argc, char **argv) {
    fl_comm_init(&argc, &argv);
    fl_set_threads(1); // ranks share the cores
    if (chdir(t_source_path("")) != 0) return t_check(0, "cd to the source tree"), t_report();
    check_every_option_agreed();
    check_difference_named();
    check_tables_named();
    check_groups();
    const fl_arch_kind G = FL_ARCH_GPT2, L = FL_ARCH_LLAMA;
    const fl_recompute none = FL_RECOMPUTE_NONE, blk = FL_RECOMPUTE_BLOCK;
    const dist_case cases[] = {
        {.name = "gpt2 fp32 DDP",
         .arch = G,
         .dt = FL_F32,
         .stage = 0,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 fp32 ZeRO-1",
         .arch = G,
         .dt = FL_F32,
         .stage = 1,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 fp32 ZeRO-2",
         .arch = G,
         .dt = FL_F32,
         .stage = 2,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 fp32 ZeRO-3",
         .arch = G,
         .dt = FL_F32,
         .stage = 3,
         .accum = 2,
         .recompute = none},
        {.name = "llama fp32 DDP",
         .arch = L,
         .dt = FL_F32,
         .stage = 0,
         .accum = 2,
         .recompute = none},
        {.name = "llama fp32 ZeRO-1",
         .arch = L,
         .dt = FL_F32,
         .stage = 1,
         .accum = 2,
         .recompute = none},
        {.name = "llama fp32 ZeRO-2",
         .arch = L,
         .dt = FL_F32,
         .stage = 2,
         .accum = 2,
         .recompute = none},
        {.name = "llama fp32 ZeRO-3",
         .arch = L,
         .dt = FL_F32,
         .stage = 3,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 bf16 DDP",
         .arch = G,
         .dt = FL_BF16,
         .stage = 0,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 bf16 ZeRO-1",
         .arch = G,
         .dt = FL_BF16,
         .stage = 1,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 bf16 ZeRO-2",
         .arch = G,
         .dt = FL_BF16,
         .stage = 2,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 bf16 ZeRO-3",
         .arch = G,
         .dt = FL_BF16,
         .stage = 3,
         .accum = 2,
         .recompute = none},
        {.name = "llama bf16 DDP",
         .arch = L,
         .dt = FL_BF16,
         .stage = 0,
         .accum = 1,
         .recompute = none},
        {.name = "llama bf16 ZeRO-1",
         .arch = L,
         .dt = FL_BF16,
         .stage = 1,
         .accum = 2,
         .recompute = none},
        {.name = "llama bf16 ZeRO-2",
         .arch = L,
         .dt = FL_BF16,
         .stage = 2,
         .accum = 2,
         .recompute = none},
        {.name = "llama bf16 ZeRO-3",
         .arch = L,
         .dt = FL_BF16,
         .stage = 3,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 fp16 ZeRO-2",
         .arch = G,
         .dt = FL_F16,
         .stage = 2,
         .accum = 2,
         .recompute = none},
        {.name = "gpt2 fp32 ZeRO-3 + checkpointing",
         .arch = G,
         .dt = FL_F32,
         .stage = 3,
         .accum = 2,
         .recompute = blk},
        {.name = "llama bf16 ZeRO-3 + checkpointing",
         .arch = L,
         .dt = FL_BF16,
         .stage = 3,
         .accum = 2,
         .recompute = blk},
        // the keys' other settings: small buckets split units, no overlap,
        // all-reduce instead of reduce-scatter, no prefetch, no reuse,
        // no persistent units, a tied LLaMA head
        {.name = "gpt2 fp32 DDP small buckets",
         .arch = G,
         .dt = FL_F32,
         .stage = 0,
         .accum = 2,
         .recompute = none,
         .bucket = 1000},
        {.name = "gpt2 bf16 ZeRO-1 small buckets, no overlap",
         .arch = G,
         .dt = FL_BF16,
         .stage = 1,
         .accum = 2,
         .recompute = none,
         .bucket = 777,
         .no_overlap = 1},
        {.name = "llama fp32 ZeRO-2 all-reduce, small buckets",
         .arch = L,
         .dt = FL_F32,
         .stage = 2,
         .accum = 2,
         .recompute = none,
         .bucket = 900,
         .no_reduce_scatter = 1},
        {.name = "llama fp32 ZeRO-2 no overlap",
         .arch = L,
         .dt = FL_F32,
         .stage = 2,
         .accum = 1,
         .recompute = none,
         .no_overlap = 1},
        {.name = "llama fp32 ZeRO-3 no prefetch, no reuse, nothing persistent",
         .arch = L,
         .dt = FL_F32,
         .stage = 3,
         .accum = 2,
         .recompute = none,
         .prefetch = 1,
         .persistence = 1,
         .no_reuse = 1},
        // LOMO and AdaLomo, fused into the backward pass (one micro-batch),
        // with and without clipping's first pass, and through the
        // accumulation path
        {.name = "gpt2 fp32 DDP lomo",
         .arch = G,
         .dt = FL_F32,
         .stage = 0,
         .accum = 1,
         .recompute = none,
         .kind = FL_OPT_LOMO},
        {.name = "llama fp32 ZeRO-3 lomo",
         .arch = L,
         .dt = FL_F32,
         .stage = 3,
         .accum = 1,
         .recompute = none,
         .kind = FL_OPT_LOMO},
        {.name = "gpt2 fp32 ZeRO-2 lomo, no clipping",
         .arch = G,
         .dt = FL_F32,
         .stage = 2,
         .accum = 1,
         .recompute = none,
         .kind = FL_OPT_LOMO,
         .clip = -1},
        {.name = "gpt2 bf16 ZeRO-3 lomo",
         .arch = G,
         .dt = FL_BF16,
         .stage = 3,
         .accum = 1,
         .recompute = none,
         .kind = FL_OPT_LOMO},
        {.name = "llama fp32 ZeRO-3 adalomo",
         .arch = L,
         .dt = FL_F32,
         .stage = 3,
         .accum = 1,
         .recompute = none,
         .kind = FL_OPT_ADALOMO},
        {.name = "gpt2 fp32 ZeRO-1 adalomo, no clipping",
         .arch = G,
         .dt = FL_F32,
         .stage = 1,
         .accum = 1,
         .recompute = none,
         .kind = FL_OPT_ADALOMO,
         .clip = -1},
        {.name = "llama fp32 ZeRO-2 lomo with accumulation",
         .arch = L,
         .dt = FL_F32,
         .stage = 2,
         .accum = 2,
         .recompute = none,
         .kind = FL_OPT_LOMO},
        {.name = "llama bf16 ZeRO-3 tied head, deep prefetch",
         .arch = L,
         .dt = FL_BF16,
         .stage = 3,
         .accum = 2,
         .recompute = none,
         .prefetch = 1e9f,
         .tied = 1},
    };
    // --quick (the TCP run): the four stages once
    int quick = argc > 1 && !strcmp(argv[1], "--quick");
    for (size_t i = 0; i < (quick ? 4 : sizeof cases / sizeof cases[0]); i++) check_case(&cases[i]);
    // the spike guard: DDP, ZeRO-3, LOMO in two passes (clipping) and in one
    const dist_case guarded[] = {
        {.name = "gpt2 fp32 DDP", .arch = G, .dt = FL_F32, .accum = 2, .recompute = none},
        {.name = "gpt2 fp32 ZeRO-3", .arch = G, .dt = FL_F32, .stage = 3, .accum = 1},
        {.name = "gpt2 fp32 ZeRO-1 lomo",
         .arch = G,
         .dt = FL_F32,
         .stage = 1,
         .accum = 1,
         .kind = FL_OPT_LOMO},
        {.name = "gpt2 fp32 DDP lomo one pass",
         .arch = G,
         .dt = FL_F32,
         .accum = 1,
         .kind = FL_OPT_LOMO,
         .clip = -1}};
    for (size_t i = 0; i < (quick ? 1 : sizeof guarded / sizeof guarded[0]); i++)
        check_spike_guard(&guarded[i]);
    return fl_comm_finalize(t_report());
}
