// test_dist: data parallelism (DDP and ZeRO stages 1-3) gives the run of one
// process with the same global batch. CTest starts it under mpirun with 2
// and 4 ranks (and once over TCP), and once alone (one rank: the shards are
// the whole buffer). Every rank also runs the one-process reference itself,
// so each rank checks its own result without any exchange but the strategy's.
// First, the texts a run's ranks agree on (every option, the parameter
// table) and the description of their first difference, and the agreement
// over groups of ranks (the ranks that differ are test_failures' cases);
// then Megatron's layout of the ranks into groups, point-to-point messages
// and tensor parallelism's collectives, each exactly.
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
    t_rule_batch(0x9E3779B97F4A7C15ull * (uint64_t)(step + 1), (size_t)accum * world * B * T, V,
                 inputs, targets);
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
    double wd = t_rel_diff(got.weights, want.weights, n);
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

static void layout_of(void *arg) {
    const int *w = arg;
    int tp, dp, pp;
    fl_layout_coords(w[0], w[1], w[2], 0, &tp, &dp, &pp);
}

// The layout's coordinates, without MPI: parallel.md's example (world 16,
// t = 2, p = 4: TP {0,1},{2,3}..., DP {0,2},{1,3},{4,6}..., PP
// {0,4,8,12},{1,5,9,13}...), and for several layouts every rank's
// coordinates giving it back by rank = tp + t*dp + t*d*pp, each once.
static void check_layout_coords(void) {
    int tp, dp, pp;
    const int example[][4] = {{0, 0, 0, 0}, {1, 1, 0, 0}, {2, 0, 1, 0},  {3, 1, 1, 0},
                              {4, 0, 0, 1}, {6, 0, 1, 1}, {13, 1, 0, 3}, {15, 1, 1, 3}};
    for (size_t i = 0; i < sizeof example / sizeof example[0]; i++) {
        fl_layout_coords(16, 2, 4, example[i][0], &tp, &dp, &pp);
        t_check(tp == example[i][1] && dp == example[i][2] && pp == example[i][3],
                "world 16, t 2, p 4: rank %d is tp %d dp %d pp %d (got %d %d %d)", example[i][0],
                example[i][1], example[i][2], example[i][3], tp, dp, pp);
    }
    // the groups of rank 1 in the example: ranks sharing two coordinates
    const int want[3][4] = {{0, 1, -1, -1}, {1, 3, -1, -1}, {1, 5, 9, 13}}; // TP, DP, PP
    int c1[3];
    fl_layout_coords(16, 2, 4, 1, &c1[0], &c1[1], &c1[2]);
    for (int k = 0; k < 3; k++) {
        int got[16] = {0}, n = 0, ok = 1;
        for (int r = 0; r < 16; r++) {
            int c[3];
            fl_layout_coords(16, 2, 4, r, &c[0], &c[1], &c[2]);
            // in the group varying coordinate k: the other two equal rank 1's
            if (c[(k + 1) % 3] == c1[(k + 1) % 3] && c[(k + 2) % 3] == c1[(k + 2) % 3])
                got[n++] = r;
        }
        for (int i = 0; i < 4; i++) ok &= i < n ? got[i] == want[k][i] : want[k][i] < 0;
        t_check(ok && n <= 4, "world 16, t 2, p 4: rank 1's %s group is parallel.md's",
                k == 0   ? "TP"
                : k == 1 ? "DP"
                         : "PP");
    }
    const int layouts[][3] = {{1, 1, 1}, {8, 2, 2}, {8, 4, 1}, {8, 1, 8}, {12, 2, 3}, {12, 3, 2}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        int world = layouts[i][0], t = layouts[i][1], p = layouts[i][2], d = world / (t * p);
        int ok = 1, seen[16] = {0};
        for (int r = 0; r < world; r++) {
            fl_layout_coords(world, t, p, r, &tp, &dp, &pp);
            ok &= tp >= 0 && tp < t && dp >= 0 && dp < d && pp >= 0 && pp < p &&
                  tp + t * dp + t * d * pp == r && !seen[tp + t * dp + t * d * pp]++;
        }
        t_check(ok, "world %d, t %d, p %d: rank = tp + t*dp + t*d*pp, every rank once", world, t,
                p);
    }
    if (fl_comm_size() == 1) { // a child of an MPI rank that dies would end the job
        t_dies("16 ranks, t = 3", layout_of, (int[]){16, 3, 1},
               "16 ranks do not split into tensor-parallel groups of 3 times pipeline stages of "
               "1: the world must be a multiple of 3");
        t_dies("t = 0", layout_of, (int[]){8, 0, 1},
               "tensor-parallel size 0 and pipeline-parallel size 1 must each be at least 1");
    }
}

// fl_layout_init over this job's ranks, for each (t, p) that divides it:
// every group holds the ranks its coordinates say, numbered by the one that
// varies, and a sum over it adds exactly their values (2^rank).
static void check_layout_groups(void) {
    int world = fl_comm_size(), rank = fl_comm_rank();
    const int tps[][2] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}};
    for (size_t i = 0; i < sizeof tps / sizeof tps[0]; i++) {
        int t = tps[i][0], p = tps[i][1];
        if (world % (t * p)) continue;
        fl_layout l;
        fl_layout_init(&l, t, p);
        int mine[3] = {l.tp_rank, l.dp_rank, l.pp_rank};
        const fl_comm_group *groups[4] = {l.tp_group, l.dp_group, l.pp_group, l.mp_group};
        const char *names[4] = {"TP", "DP", "PP", "model-parallel"};
        t_check(l.world == world && l.rank == rank && l.tp == t && l.pp == p &&
                    l.dp == world / (t * p),
                "rank %d/%d, t %d p %d: the layout's sizes", rank, world, t, p);
        for (int k = 0; k < 4; k++) {
            double sum = (double)(1 << rank), want = 0.0;
            int size = 0, grank = -1, ok = 1;
            for (int r = 0; r < world; r++) {
                int c[3];
                fl_layout_coords(world, t, p, r, &c[0], &c[1], &c[2]);
                // TP, DP, PP: the other two coordinates equal; model-parallel: dp
                int in = k < 3 ? c[(k + 1) % 3] == mine[(k + 1) % 3] &&
                                     c[(k + 2) % 3] == mine[(k + 2) % 3]
                               : c[1] == mine[1];
                if (!in) continue;
                if (r == rank) grank = size;
                ok &= fl_comm_group_world_rank(groups[k], size) == r;
                want += (double)(1 << r);
                size++;
            }
            fl_comm_sum(groups[k], &sum, 1);
            t_check(ok && sum == want && fl_comm_group_size(groups[k]) == size &&
                        fl_comm_group_rank(groups[k]) == grank && (k == 3 || grank == mine[k]),
                    "rank %d/%d, t %d p %d: its %s group (rank %d of %d, sum %g, want %g)", rank,
                    world, t, p, names[k], fl_comm_group_rank(groups[k]),
                    fl_comm_group_size(groups[k]), sum, want);
        }
        fl_layout_free(&l);
    }
}

// A ring exchange of 20 KB (past the eager limit of shared memory and
// TCP): each rank sends to the next and receives from the previous; the
// send counts its bytes and no elements.
static void check_point_to_point(void) {
    int world = fl_comm_size(), rank = fl_comm_rank();
    if (world == 1) return;
    enum { N = 5000 };
    int *out = malloc(N * sizeof(int)), *in = malloc(N * sizeof(int));
    for (int i = 0; i < N; i++) {
        out[i] = rank * 100000 + i;
        in[i] = -1;
    }
    const fl_comm_group *g = fl_comm_world();
    int next = (rank + 1) % world, prev = (rank + world - 1) % world, ok = 1;
    fl_comm_stats before = fl_comm_get_stats();
    fl_comm_req rr = fl_comm_irecv(g, prev, in, N * sizeof(int), 3);
    fl_comm_req rs = fl_comm_isend(g, next, out, N * sizeof(int), 3);
    fl_comm_wait(rs);
    fl_comm_wait(rr);
    fl_comm_stats after = fl_comm_get_stats();
    for (int i = 0; i < N; i++) ok &= in[i] == prev * 100000 + i;
    t_check(ok, "rank %d/%d: received rank %d's message", rank, world, prev);
    t_check(after.bytes - before.bytes == N * sizeof(int) && after.elements == before.elements,
            "rank %d/%d: the send counts %d bytes (counted %g) and no elements", rank, world,
            (int)(N * sizeof(int)), after.bytes - before.bytes);
    free(out);
    free(in);
}

// Rank r's test values: x(r, i) with a fractional part (fp32 sums that
// depend on their order), or integers (exact sums, for the adjoint checks).
static float tp_value(int r, size_t i, int integer) {
    uint32_t h = (uint32_t)(r + 1) * 2654435761u ^ (uint32_t)(i + 7) * 40503u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    float v = (float)(int)(h % 2001) - 1000.0f;
    return integer ? v : v / 7.0f + (float)(h % 97) * 1e-5f;
}

// n values of rank r (from index `from`) in dtype dt at out
static void tp_fill(fl_dtype dt, void *out, int r, size_t from, size_t n, int integer) {
    float *f = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) f[i] = tp_value(r, from + i, integer);
    fl_store_f32(dt, out, f, n);
    free(f);
}

// The group's sum of element `from + i`, i < n, of every rank's values in
// dt: summed in fp32 in rank order, rounded once to dt, at out.
static void tp_expected_sum(fl_dtype dt, void *out, int t, size_t from, size_t n) {
    size_t D = fl_dtype_size(dt);
    float *sum = calloc(n, sizeof(float)), *one = malloc(n * sizeof(float));
    void *x = malloc(n * D);
    for (int r = 0; r < t; r++) {
        tp_fill(dt, x, r, from, n, 0);
        fl_convert(FL_F32, one, dt, x, n);
        for (size_t i = 0; i < n; i++) sum[i] = r ? sum[i] + one[i] : one[i];
    }
    fl_store_f32(dt, out, sum, n);
    free(sum);
    free(one);
    free(x);
}

// Each TP collective over g exactly (tp.h): all_reduce of fp32, bf16 and
// fp16 (n dividing t or not) the rank-order fp32 sum rounded once, the
// same bits on every rank; all_reduce_max; all_gather; reduce_scatter.
static void check_tp_ops_exact(const fl_comm_group *g, const char *name) {
    const fl_tp_ops *ops = fl_tp_ops_group(g);
    int t = fl_comm_group_size(g), me = fl_comm_group_rank(g), rank = fl_comm_rank();
    t_check(ops == fl_tp_ops_group(g), "rank %d %s: one table per group", rank, name);
    const fl_dtype dts[3] = {FL_F32, FL_BF16, FL_F16};
    const size_t sizes[2] = {37, 4096 + 12};
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 2; s++) {
            fl_dtype dt = dts[k];
            size_t n = sizes[s], D = fl_dtype_size(dt);
            char *buf = malloc(t * n * D), *want = malloc(t * n * D), *more = malloc(t * n * D);
            // all_reduce
            tp_fill(dt, buf, me, 0, n, 0);
            tp_expected_sum(dt, want, t, 0, n);
            ops->all_reduce(ops->ctx, dt, buf, n);
            t_check(!memcmp(buf, want, n * D), "rank %d %s t=%d: all_reduce of %zu %s", rank, name,
                    t, n, fl_dtype_name(dt));
            // all_gather: rank r's values at [r*n, (r+1)*n)
            tp_fill(dt, buf, me, 0, n, 0);
            for (int r = 0; r < t; r++) tp_fill(dt, want + r * n * D, r, 0, n, 0);
            ops->all_gather(ops->ctx, dt, buf, more, n);
            t_check(!memcmp(more, want, t * n * D), "rank %d %s t=%d: all_gather of %zu %s", rank,
                    name, t, n, fl_dtype_name(dt));
            // reduce_scatter: this rank's n of the sum of t*n
            tp_fill(dt, more, me, 0, t * n, 0);
            tp_expected_sum(dt, want, t, (size_t)me * n, n);
            ops->reduce_scatter(ops->ctx, dt, more, buf, n);
            t_check(!memcmp(buf, want, n * D), "rank %d %s t=%d: reduce_scatter to %zu %s", rank,
                    name, t, n, fl_dtype_name(dt));
            free(buf);
            free(want);
            free(more);
        }
    size_t n = 1000;
    float *x = malloc(n * sizeof(float)), *want = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        x[i] = tp_value(me, i, 0);
        want[i] = tp_value(0, i, 0);
        for (int r = 1; r < t; r++) want[i] = fmaxf(want[i], tp_value(r, i, 0));
    }
    ops->all_reduce_max(ops->ctx, x, n);
    t_check(!memcmp(x, want, n * sizeof(float)), "rank %d %s t=%d: all_reduce_max", rank, name, t);
    free(x);
    free(want);
}

// Megatron's pairs as adjoints (test_mappings.py), exactly in fp32 with
// integer values, dot products summed over the group's ranks:
//   f (identity forward, all-reduce backward): <f(x), y> = <x, AR(y)> for
//     a replicated x, the left side summed over ranks;
//   g (all-reduce forward, identity backward): <AR(x), y> = <x, y> summed
//     over ranks, for a replicated y;
//   all-gather and reduce-scatter: <AG(x), y> = <x, RS(y)>, both summed.
static void check_tp_ops_adjoint(const fl_comm_group *g, const char *name) {
    const fl_tp_ops *ops = fl_tp_ops_group(g);
    int t = fl_comm_group_size(g), me = fl_comm_group_rank(g), rank = fl_comm_rank();
    size_t n = 96;
    float *x = malloc(t * n * sizeof(float)), *y = malloc(t * n * sizeof(float));
    float *z = malloc(t * n * sizeof(float));
    double dots[6] = {0};
    // f: x replicated (rank 0's values on every rank), y this rank's
    tp_fill(FL_F32, x, 0, 0, n, 1);
    tp_fill(FL_F32, y, me, 0, n, 1);
    for (size_t i = 0; i < n; i++) dots[0] += (double)x[i] * y[i]; // <f(x), y> on this rank
    memcpy(z, y, n * sizeof(float));
    ops->all_reduce(ops->ctx, FL_F32, z, n);                                  // f's backward
    for (size_t i = 0; i < n; i++) dots[1] += me ? 0.0 : (double)x[i] * z[i]; // once
    // g: x this rank's, y replicated
    tp_fill(FL_F32, x, me, 1000, n, 1);
    tp_fill(FL_F32, y, 0, 1000, n, 1);
    memcpy(z, x, n * sizeof(float));
    ops->all_reduce(ops->ctx, FL_F32, z, n); // g's forward
    for (size_t i = 0; i < n; i++) {
        dots[2] += me ? 0.0 : (double)z[i] * y[i]; // the replicated output once
        dots[3] += (double)x[i] * y[i];            // g's backward: y to every rank
    }
    // all-gather of n per rank against y of t*n; reduce-scatter of y
    tp_fill(FL_F32, x, me, 2000, n, 1);
    tp_fill(FL_F32, y, me, 3000, t * n, 1);
    ops->all_gather(ops->ctx, FL_F32, x, z, n);
    for (size_t i = 0; i < t * n; i++) dots[4] += (double)z[i] * y[i];
    ops->reduce_scatter(ops->ctx, FL_F32, y, z, n);
    for (size_t i = 0; i < n; i++) dots[5] += (double)x[i] * z[i];
    fl_comm_sum(g, dots, 6);
    t_check(dots[0] == dots[1] && dots[0] != 0,
            "rank %d %s t=%d: f's backward is its adjoint (%g, %g)", rank, name, t, dots[0],
            dots[1]);
    t_check(dots[2] == dots[3] && dots[2] != 0,
            "rank %d %s t=%d: g's backward is its adjoint (%g, %g)", rank, name, t, dots[2],
            dots[3]);
    t_check(dots[4] == dots[5] && dots[4] != 0,
            "rank %d %s t=%d: reduce-scatter is all-gather's adjoint (%g, %g)", rank, name, t,
            dots[4], dots[5]);
    free(x);
    free(y);
    free(z);
}

// The TP collectives over the world, and over the TP groups of a t = 2
// layout where the world splits into several.
static void check_tp_ops(void) {
    check_tp_ops_exact(fl_comm_world(), "world");
    check_tp_ops_adjoint(fl_comm_world(), "world");
    if (fl_comm_size() >= 4 && fl_comm_size() % 2 == 0) {
        fl_layout l;
        fl_layout_init(&l, 2, 1);
        check_tp_ops_exact(l.tp_group, "TP group");
        check_tp_ops_adjoint(l.tp_group, "TP group");
        fl_layout_free(&l);
    }
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
    fl_comm_sum(fl_comm_world(), &flagged, 1);
    t_check(flagged == world && !memcmp(before, after, n * sizeof(float)),
            "rank %d/%d %s: every rank skips the spike (%g of %d), no weight changes", rank, world,
            c->name, flagged, world);
    // the guard off: the same step is applied everywhere
    g->cfg.loss_z = g->cfg.grad_z = 0;
    r = fl_run_step_batch(&run, run.inputs, run.targets, lr_of(c));
    free(after);
    after = t_weights_f32(&run.model, run.strategy);
    flagged = r.spike.outlier;
    fl_comm_sum(fl_comm_world(), &flagged, 1);
    t_check(flagged == 0 && memcmp(before, after, n * sizeof(float)),
            "rank %d/%d %s: without the guard the step updates", rank, world, c->name);
    free(before);
    free(after);
    free(gi);
    free(gt);
    fl_run_close(&run);
}

// For test_failures (`test_dist --p2p-hang send|receive` under mpirun -np
// 2, a 1 s deadline): rank 0 sends 1 MiB to rank 1, which never receives
// it, or rank 1 waits for a message from rank 0, which never sends; the
// other rank sleeps. Under -np 4 the same runs in the group of the odd
// ranks {1, 3} (as a pipeline's group of stages is), whose ranks 0 and 1
// are world ranks 1 and 3. The wait must end the job naming the operation
// and the peer by its world rank; returning at all is a failure.
static int p2p_hang(const char *kind) {
    fl_comm_set_timeout(1.0);
    int sending = !strcmp(kind, "send"), rank = fl_comm_rank(), size = fl_comm_size();
    fl_comm_group *odd = size == 4 ? fl_comm_split(fl_comm_world(), rank % 2) : NULL;
    const fl_comm_group *g = odd && rank % 2 ? odd : fl_comm_world();
    size_t bytes = 1 << 20;
    char *buf = calloc(bytes, 1);
    if ((size == 2 || g == odd) && fl_comm_group_rank(g) == (sending ? 0 : 1)) {
        fl_comm_wait(sending ? fl_comm_isend(g, 1, buf, bytes, 5)
                             : fl_comm_irecv(g, 0, buf, bytes, 5));
    } else {
        for (unsigned left = 60; left;) left = sleep(left);
    }
    free(buf);
    fl_comm_group_free(odd);
    fprintf(stderr, "test_dist --p2p-hang %s: rank %d was not stopped\n", kind, rank);
    return 1;
}

int main(int argc, char **argv) {
    fl_comm_init(&argc, &argv);
    if (argc > 2 && !strcmp(argv[1], "--p2p-hang")) return p2p_hang(argv[2]);
    fl_set_threads(1); // ranks share the cores
    if (chdir(t_source_path("")) != 0) return t_check(0, "cd to the source tree"), t_report();
    check_every_option_agreed();
    check_difference_named();
    check_tables_named();
    check_groups();
    check_layout_coords();
    check_layout_groups();
    check_point_to_point();
    check_tp_ops();
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
