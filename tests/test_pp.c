// test_pp: pipeline parallelism gives the run of one process. Under mpirun
// (CTest's pp_np2, pp_np4 and pp_np8) every case trains split and compares
// its stage's rows, by name, with a one-process reference fed the same
// micro-batches (the references are shared out over the ranks and
// broadcast, so np 8 does not train eight of each).
//
// Pipeline-only runs are one process's bit for bit (issue 45): the
// same micro-batches go through the same kernels, each stage sums its
// gradients in one process's order, the tied head's weight gradient is
// computed on stage 0 as one process computes it, and the gradient norm
// adds per-tensor squares in the whole table's order. So losses, gradient
// norms and final weights are compared with memcmp under 1F1B, GPipe,
// interleaved 1F1B, every split method, m below p, and activation
// checkpointing (against the same policy in one process), and in bf16 and
// fp16 (with its loss scaling) too. With tensor or data parallelism beside
// the pipeline: within test_tp's fp32 bound (1.3e-6 relative, Megatron's),
// the data-parallel micro-batches split as test_tp's TP x DP case does.
// Also: evaluation (fl_run_evaluate on the validation data) equal to one
// process's, the last stage's copy of a tied embedding equal to stage 0's
// row after training, and a stage's memory: its rows only, and on the
// first stage under 1F1B min(p, m) activation sets.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/comm.h"
#include "fitlm/run.h"
#include "fitlm/train.h"
#include "testlib.h"

enum { B = 2, T = 16, STEPS = 6, V = 257, MAX_REFS = 32, COPY_TAG = 32000 };

enum {
    SLOW = 1, // left out of the quick lists (FITLM_TEST_QUICK)
    EVAL = 2, // also trains on the data and evaluates (check_evaluate)
    TIED = 4, // LLaMA with tied embeddings
    NVME = 8, // the split run's optimizer state offloaded to files (ZeRO-1)
};

typedef struct {
    const char *name;
    int np; // the world it runs in
    fl_arch_kind arch;
    fl_dtype dt;
    int pp, tp, sp, zero, accum, layers;
    const char *schedule; // "1f1b" unless set
    int virt;             // virtual stages (interleaved)
    const char *split;    // --pipeline-split ("parameters" unless set)
    fl_recompute recompute;
    int more;              // SLOW, EVAL, TIED
    const char *optimizer; // with its options ("adamw --eps 1e-6" unless set)
} pp_case;

static int tied(const pp_case *c) {
    return c->arch == FL_ARCH_GPT2 || (c->more & TIED); // LLaMA grouped-query, untied unless TIED
}

// The tiny shapes: GPT-2 and LLaMA (grouped-query: 2 query heads a KV head).
static fl_model_config shape_of(fl_arch_kind arch, int layers, int is_tied) {
    fl_model_config c = {0};
    c.arch = arch;
    c.n_layer = layers;
    c.n_head = 8;
    c.n_embd = 32;
    c.vocab_size = V;
    c.max_seq_len = T;
    c.tie_embeddings = is_tied;
    if (arch == FL_ARCH_LLAMA) c.n_kv_head = 4, c.intermediate_size = 48;
    fl_model_config_finish(&c);
    return c;
}

static int replicas(const pp_case *c) {
    return c->np / (c->pp * c->tp);
}

// Bitwise: nothing but the pipeline (16-bit runs too: each micro-batch's
// gradients are summed in fp32 per chunk as one process sums them).
static int exact(const pp_case *c) {
    return c->tp == 1 && replicas(c) == 1;
}

static const char *recompute_name(fl_recompute r) {
    return r == FL_RECOMPUTE_BLOCK ? "block" : r == FL_RECOMPUTE_SELECTIVE ? "selective" : "none";
}

// The run's flags: split (the case's layout) or the one-process reference,
// whose micro-batches hold every replica's B sequences.
static void flags_of(const pp_case *c, int split, char *flags, size_t size) {
    int n = snprintf(flags, size,
                     "--model tiny --arch %s --n-layer %d --n-head 8 --n-embd 32 --max-seq-len %d "
                     "--tokenizer byte --precision %s --batch %d --seq-len %d --grad-accum %d "
                     "--optimizer %s --scheduler constant --warmup 0 "
                     "--grad-clip 1.0 --activation-checkpointing %s --seed 42 --threads 1 "
                     "--sample-tokens 0 --comm-timeout 60 --out=",
                     fl_arch_name(c->arch), c->layers, T, fl_dtype_name(c->dt),
                     split ? B : B * replicas(c), T, c->accum,
                     c->optimizer ? c->optimizer : "adamw --eps 1e-6 --lr 2e-3",
                     recompute_name(c->recompute));
    if (c->arch == FL_ARCH_LLAMA)
        n += snprintf(flags + n, size - (size_t)n,
                      " --n-kv-head 4 --intermediate-size 48 --tie-word-embeddings=%s",
                      tied(c) ? "true" : "false");
    if (split)
        snprintf(flags + n, size - (size_t)n,
                 " --pipeline-parallel %d --pipeline-schedule %s --pipeline-split %s "
                 "--virtual-stages %d --tensor-parallel %d --zero-stage %d%s",
                 c->pp, c->schedule ? c->schedule : "1f1b", c->split ? c->split : "parameters",
                 c->virt ? c->virt : 1, c->tp, c->zero, c->sp ? " --sequence-parallel" : "");
}

// The global batch of a step: micro-batch k holds d*B sequences, data rank
// r takes the r-th B of them (every stage and TP rank of a replica alike).
static void batch(int step, const pp_case *c, int *inputs, int *targets) {
    t_rule_batch(0x9E3779B97F4A7C15ull * (uint64_t)(step + 1),
                 (size_t)c->accum * replicas(c) * B * T, V, inputs, targets);
}

typedef struct {
    float loss[STEPS], norm[STEPS];
    float *weights; // fp32: this rank's stage rows (the reference's: the whole table)
    fl_param_table table;
    int *row_global;    // stage row -> whole row (NULL: the whole table)
    int copy_matches;   // the last stage's tied copy equals stage 0's row (1 elsewhere)
    size_t param_bytes; // FL_MEM_PARAMS the run's model holds
    int pp_rank, sets0; // the stage, and its chunk 0's activation sets
} run_result;

// The last stage's tied copy against stage 0's row (weights: this rank's
// fp32 rows), point to point over the pipeline group (a tag above the
// executor's, whose messages are all in by now).
static int copy_matches(const fl_run *run, const float *weights) {
    const fl_model *m = &run->model;
    if (!m->config.tie_embeddings || m->pp.size < 2) return 1;
    const fl_param_view *v = &m->table.views[0]; // the embedding's row, or its copy
    size_t bytes = v->numel * sizeof(float);
    int p = m->pp.size, ok = 1;
    if (m->pp.rank == 0)
        fl_comm_wait(fl_comm_isend(run->layout.pp_group, p - 1, weights, bytes, COPY_TAG));
    if (m->pp.rank == p - 1) {
        float *row = malloc(bytes);
        fl_comm_wait(fl_comm_irecv(run->layout.pp_group, 0, row, bytes, COPY_TAG));
        ok = (v->flags & FL_PARAM_TIED_COPY) && !memcmp(row, weights + v->offset, bytes);
        free(row);
    }
    return ok;
}

// Trains the case STEPS steps (split: its layout; else the one-process
// reference).
static void train(const pp_case *c, int split, run_result *out) {
    char flags[2048];
    flags_of(c, split, flags, sizeof flags);
    fl_run run;
    size_t before = fl_mem_current(FL_MEM_PARAMS);
    // each stage's optimizer pages its own state (zero_optimization's offload)
    char json[256];
    snprintf(json, sizeof json,
             "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"%s\"}}}",
             "/tmp");
    t_run_open(&run, split && (c->more & NVME) ? json : NULL, flags, !split);
    out->param_bytes = fl_mem_current(FL_MEM_PARAMS) - before;
    if (split && (c->more & NVME))
        t_check(run.offload != NULL, "%s: the stage's optimizer state is in its file", c->name);
    out->pp_rank = run.model.pp.rank;
    out->sets0 = run.model.pp.sets[0];
    int d = replicas(c), drank = split ? run.rank : 0;
    if (split)
        t_check(run.model.pp.size == c->pp && run.model.tp.size == c->tp && run.world == d,
                "%s: the run is %d x %d x %d (t x p x d: %d x %d x %d)", c->name, c->tp, c->pp, d,
                run.model.tp.size, run.model.pp.size, run.world);
    size_t global = (size_t)c->accum * d * B * T, len = (size_t)run.cfg.micro_batch * T;
    int *gi = malloc(global * sizeof(int)), *gt = malloc(global * sizeof(int));
    for (int step = 0; step < STEPS; step++) {
        batch(step, c, gi, gt);
        for (int k = 0; k < c->accum; k++) {
            size_t from = ((size_t)k * d + (size_t)drank) * B * T;
            memcpy(run.inputs + k * len, gi + from, len * sizeof(int));
            memcpy(run.targets + k * len, gt + from, len * sizeof(int));
        }
        fl_train_result r = fl_run_step_batch(&run, run.inputs, run.targets, 2e-3f);
        out->loss[step] = r.loss;
        out->norm[step] = r.grad_norm;
    }
    out->weights = t_weights_f32(&run.model, run.strategy);
    out->copy_matches = split ? copy_matches(&run, out->weights) : 1;
    int *keep = malloc((size_t)run.model.table.count * sizeof(int));
    for (int r = 0; r < run.model.table.count; r++) keep[r] = 1;
    fl_params_select(&out->table, &run.model.table, keep); // a copy
    free(keep);
    out->row_global = NULL;
    if (split) {
        out->row_global = malloc((size_t)run.model.table.count * sizeof(int));
        memcpy(out->row_global, run.model.row_global, (size_t)run.model.table.count * sizeof(int));
    }
    free(gi);
    free(gt);
    fl_run_close(&run);
}

static void free_result(run_result *r) {
    free(r->weights);
    free(r->row_global);
    fl_params_free(&r->table);
}

// ----------------------------------------------------------------------------
// the stages' rows, without MPI: each row of the whole table on exactly one
// stage, by name, the blocks the stage's chunks hold, the last stage's
// copy of a tied embedding marked so that it has no gradient of its own

static void check_stage_tables(fl_arch_kind arch, int is_tied) {
    enum { LAYERS = 6 };
    fl_model_config cfg = shape_of(arch, LAYERS, is_tied);
    fl_param_table whole;
    fl_model_table(&whole, &cfg);
    const int layouts[][2] = {{2, 1}, {3, 1}, {4, 1}, {6, 1}, {2, 2}, {3, 2}}; // p, v
    int bad = 0;
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++) {
        int p = layouts[k][0], v = layouts[k][1], m = 2 * p, counts[FL_PP_MAX_VIRTUAL];
        int kind = v > 1 ? FL_PP_INTERLEAVED : FL_PP_1F1B;
        fl_pp_split(FL_PP_SPLIT_UNIFORM, LAYERS, p * v, NULL, 1, 1, 1, counts);
        int *held = calloc((size_t)whole.count, sizeof(int)),
            *global = malloc((size_t)whole.count * sizeof(int));
        for (int rank = 0; rank < p; rank++) {
            fl_pp_stage s;
            fl_pp_stage_of(&s, kind, p, v, m, rank, counts);
            fl_param_table local;
            fl_model_stage_table(&local, &whole, &cfg, &s, global);
            int copies = 0;
            for (int r = 0; r < local.count; r++) {
                const fl_param_view *lv = &local.views[r], *w = &whole.views[global[r]];
                int u = w->unit, in_chunk = 0;
                for (int c = 0; c < s.chunks; c++)
                    in_chunk |= u == FL_UNIT_EMBED ? fl_pp_has_embed(&s, c)
                                : u == FL_UNIT_HEAD(LAYERS)
                                    ? fl_pp_has_head(&s, c)
                                    : u >= s.first[c] && u < s.first[c] + s.count[c];
                if (strcmp(lv->name, w->name) || lv->numel != w->numel) bad = 1;
                if (lv->flags & FL_PARAM_TIED_COPY) {
                    copies++;
                    if (!(lv->flags & FL_PARAM_FROZEN) || global[r] != 0 || rank != p - 1) bad = 1;
                } else if (in_chunk) {
                    held[global[r]]++;
                } else {
                    bad = 1;
                }
            }
            if (copies != (is_tied && rank == p - 1)) bad = 1;
            if (v == 1 && s.sets[0] != p - rank) bad = 1; // 1F1B: min(p - rank, m)
            fl_params_free(&local);
        }
        for (int r = 0; r < whole.count; r++) bad |= held[r] != 1;
        t_check(!bad,
                "%s%s p %d v %d: every row on exactly one stage, in a chunk of its blocks (1F1B: "
                "min(p - r, m) activation sets on stage r)",
                fl_arch_name(arch), is_tied ? " tied" : "", p, v);
        free(held);
        free(global);
    }
    fl_params_free(&whole);
}

// ----------------------------------------------------------------------------
// the references: one per distinct one-process run, each trained on one
// rank (in turn) and broadcast

typedef struct {
    char flags[2048];
    run_result r;
} reference;

static reference refs[MAX_REFS];
static int n_refs;

static const run_result *reference_of(const pp_case *c) {
    char flags[2048];
    flags_of(c, 0, flags, sizeof flags);
    for (int i = 0; i < n_refs; i++)
        if (!strcmp(refs[i].flags, flags)) return &refs[i].r;
    t_check(0, "%s: no reference was trained for it", c->name);
    return NULL;
}

// Trains the references of the cases run in this world.
static void train_references(const pp_case *cases, int n) {
    const pp_case *of[MAX_REFS];
    for (int i = 0; i < n; i++) {
        char flags[2048];
        flags_of(&cases[i], 0, flags, sizeof flags);
        int k = 0;
        while (k < n_refs && strcmp(refs[k].flags, flags)) k++;
        if (k == n_refs && t_check(n_refs < MAX_REFS, "at most %d references", MAX_REFS)) {
            snprintf(refs[n_refs].flags, sizeof refs[n_refs].flags, "%s", flags);
            of[n_refs++] = &cases[i];
        }
    }
    int rank = fl_comm_rank(), world = fl_comm_size();
    for (int i = 0; i < n_refs; i++)
        if (i % world == rank) train(of[i], 0, &refs[i].r);
    for (int i = 0; i < n_refs; i++) {
        run_result *r = &refs[i].r;
        int owner = i % world;
        fl_param_table whole;
        fl_model_config shape = shape_of(of[i]->arch, of[i]->layers, tied(of[i]));
        fl_model_table(&whole, &shape);
        if (owner == rank) {
            t_check(r->table.count == whole.count && r->table.numel == whole.numel,
                    "reference %d: the whole table (%d rows, %zu elements)", i, whole.count,
                    whole.numel);
            fl_params_free(&r->table);
        } else {
            memset(r, 0, sizeof *r);
            r->weights = malloc(whole.numel * sizeof(float));
        }
        r->table = whole;
        fl_comm_bcast(fl_comm_world(), r->loss, sizeof r->loss, owner);
        fl_comm_bcast(fl_comm_world(), r->norm, sizeof r->norm, owner);
        fl_comm_bcast(fl_comm_world(), r->weights, whole.numel * sizeof(float), owner);
    }
}

// ----------------------------------------------------------------------------
// comparisons

// The reference's weights as this rank's rows (its stage's, its TP slices;
// padding and the tied copy zero).
static float *rows_of(const run_result *want, const run_result *got) {
    const fl_param_table *lt = &got->table, *wt = &want->table;
    float *out = calloc(lt->numel, sizeof(float));
    for (int r = 0; r < lt->count; r++) {
        const fl_param_view *v = &lt->views[r];
        if (v->flags & FL_PARAM_TIED_COPY) continue;
        const fl_param_view *w = &wt->views[got->row_global[r]];
        t_check(!strcmp(v->name, w->name), "stage row %d is the whole table's %s (%s)", r, w->name,
                v->name);
        t_slice_row(lt, r, want->weights + w->offset, out + v->offset);
    }
    return out;
}

static void compare(const pp_case *c, const run_result *got, const run_result *want) {
    int rank = fl_comm_rank(), world = fl_comm_size();
    float *ref = rows_of(want, got);
    int same_rows = 1;
    for (int r = 0; r < got->table.count; r++) {
        const fl_param_view *v = &got->table.views[r];
        if (v->flags & FL_PARAM_TIED_COPY) { // checked against stage 0's row instead
            memcpy(got->weights + v->offset, ref + v->offset, v->numel * sizeof(float));
            continue;
        }
        if (memcmp(got->weights + v->offset, ref + v->offset, v->numel * sizeof(float))) {
            if (exact(c))
                t_check(0, "rank %d %s: %s differs from one process's (%.3g relative)", rank,
                        c->name, v->name,
                        t_rel_diff(got->weights + v->offset, ref + v->offset, v->numel));
            same_rows = 0;
        }
    }
    t_check(got->copy_matches, "rank %d %s: the last stage's tied copy is stage 0's row, bitwise",
            rank, c->name);
    double worst = 0.0, worst_norm = 0.0;
    for (int s = 0; s < STEPS; s++) {
        double l = fabs((double)got->loss[s] - want->loss[s]) / fabs((double)want->loss[s]);
        double g = fabs((double)got->norm[s] - want->norm[s]) / fabs((double)want->norm[s]);
        worst = l > worst ? l : worst;
        worst_norm = g > worst_norm ? g : worst_norm;
    }
    if (exact(c)) {
        t_check(!memcmp(got->loss, want->loss, sizeof got->loss),
                "rank %d/%d %s: the losses are one process's, bitwise (%.3g)", rank, world, c->name,
                worst);
        t_check(!memcmp(got->norm, want->norm, sizeof got->norm),
                "rank %d/%d %s: the gradient norms are one process's, bitwise (%.3g)", rank, world,
                c->name, worst_norm);
        t_check(same_rows, "rank %d/%d %s: the stage's final weights are one process's, bitwise",
                rank, world, c->name);
    } else { // fp32 beside tensor or data parallelism
        // GPT-2's key bias has an exact gradient of zero: AdamW turns its
        // rounding noise into steps of up to lr (test_tp.c), so it is left out
        for (int r = 0; r < got->table.count; r++)
            if (strstr(got->table.views[r].name, "c_attn.bias"))
                memcpy(got->weights + got->table.views[r].offset, ref + got->table.views[r].offset,
                       got->table.views[r].numel * sizeof(float));
        double wd = t_rel_diff(got->weights, ref, got->table.numel);
        if (getenv("FITLM_TEST_VERBOSE"))
            printf("rank %d %s: losses %.3g, norms %.3g, weights %.3g relative\n", rank, c->name,
                   worst, worst_norm, wd);
        t_check(worst <= 1.3e-6,
                "rank %d/%d %s: losses within 1.3e-6 relative of one process (%.3g)", rank, world,
                c->name, worst);
        t_check(worst_norm <= 1e-5, "rank %d/%d %s: gradient norms as one process's (%.3g)", rank,
                world, c->name, worst_norm);
        t_check(wd <= 1.3e-6, "rank %d/%d %s: final weights within 1.3e-6 relative (%.3g)", rank,
                world, c->name, wd);
    }
    // (AdamW's: LOMO's and AdaLomo's steps on these random tokens need not
    // lower it in a few steps, one process's no more than the pipeline's)
    if (!c->optimizer)
        t_check(got->loss[STEPS - 1] < got->loss[0] - 0.02f,
                "rank %d %s: the loss falls (%.4f -> %.4f)", rank, c->name, got->loss[0],
                got->loss[STEPS - 1]);
    free(ref);
}

// A stage holds its rows only (with a tied head, the copy of the
// embedding's row too), and under 1F1B stage r min(p - r, m) micro-batches'
// activations: the first min(p, m), the last one.
static void check_memory(const pp_case *c, const run_result *got, const run_result *want) {
    int rank = fl_comm_rank();
    size_t D = fl_dtype_size(c->dt), whole = want->table.numel;
    t_check(got->param_bytes == got->table.numel * D && got->table.numel < whole,
            "rank %d %s: the stage's parameters are its rows only: %zu bytes for %zu of the "
            "model's %zu elements",
            rank, c->name, got->param_bytes, got->table.numel, whole);
    if (c->schedule) return; // 1F1B's bound
    int left = c->pp - got->pp_rank, want_sets = left < c->accum ? left : c->accum;
    t_check(got->sets0 == want_sets, "rank %d %s: stage %d keeps %d activation sets (%d)", rank,
            c->name, got->pp_rank, want_sets, got->sets0);
}

// Opens the case's run (split, or the one-process reference) on the data,
// as fitlm train does: the training and validation windows of
// data/brown_byte.
static void open_on_data(const pp_case *c, int split, fl_run *run) {
    char flags[2048], *argv[128];
    flags_of(c, split, flags, sizeof flags);
    size_t n = strlen(flags);
    snprintf(flags + n, sizeof flags - n, " --data data/brown_byte --eval-iters 2");
    int argc = 0;
    for (char *w = strtok(flags, " "); w && argc < 128; w = strtok(NULL, " ")) argv[argc++] = w;
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    fl_config_parse_args(&cfg, argc, argv);
    fl_run_options opt = {.alone = !split};
    fl_run_open(run, &cfg, &opt);
}

// Two steps on the training data, then the validation loss
// (fl_run_evaluate): one process's.
static void check_evaluate(const pp_case *c) {
    float loss[2][3];
    for (int split = 0; split < 2; split++) {
        fl_run run;
        open_on_data(c, split, &run);
        for (int step = 0; step < 2; step++) loss[split][step] = fl_run_step(&run, step).loss;
        loss[split][2] = fl_run_evaluate(&run, 2);
        fl_run_close(&run);
    }
    int rank = fl_comm_rank();
    if (exact(c)) {
        t_check(!memcmp(loss[1], loss[0], sizeof loss[0]),
                "rank %d %s: two steps on the data and the validation loss are one process's, "
                "bitwise (%.7g vs %.7g)",
                rank, c->name, loss[1][2], loss[0][2]);
    } else {
        double worst = 0.0;
        for (int k = 0; k < 3; k++) {
            double d = fabs((double)loss[1][k] - loss[0][k]) / fabs((double)loss[0][k]);
            worst = d > worst ? d : worst;
        }
        t_check(worst <= 1.3e-6,
                "rank %d %s: two steps on the data and the validation loss within 1.3e-6 of one "
                "process's (%.3g)",
                rank, c->name, worst);
    }
}

static void check_case(const pp_case *c) {
    run_result got;
    train(c, 1, &got);
    const run_result *want = reference_of(c);
    if (!want) return free_result(&got);
    compare(c, &got, want);
    check_memory(c, &got, want);
    if (c->more & EVAL) check_evaluate(c);
    free_result(&got);
}

int main(int argc, char **argv) {
    fl_comm_init(&argc, &argv);
    fl_set_threads(1); // ranks share the cores
    if (chdir(t_source_path("")) != 0) return t_check(0, "cd to the source tree"), t_report();
    const fl_arch_kind G = FL_ARCH_GPT2, L = FL_ARCH_LLAMA;
    const fl_dtype F = FL_F32;
    const fl_recompute none = FL_RECOMPUTE_NONE, blk = FL_RECOMPUTE_BLOCK,
                       sel = FL_RECOMPUTE_SELECTIVE;
    const pp_case all[] = {
        // p = 2
        {"gpt2 fp32 p2 1f1b", 2, G, F, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, none, EVAL, NULL},
        {"llama fp32 p2 1f1b (GQA, untied)", 2, L, F, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, none, 0,
         NULL},
        {"llama fp32 p2 1f1b (tied)", 2, L, F, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, none, TIED, NULL},
        {"gpt2 fp32 p2 gpipe", 2, G, F, 2, 1, 0, 0, 4, 4, "gpipe", 0, NULL, none, 0, NULL},
        {"gpt2 fp32 p2 interleaved v2", 2, G, F, 2, 1, 0, 0, 4, 4, "interleaved", 2, NULL, none, 0,
         NULL},
        {"llama fp32 p2 interleaved v2", 2, L, F, 2, 1, 0, 0, 4, 4, "interleaved", 2, NULL, none,
         EVAL, NULL},
        {"gpt2 fp32 p2 split 1,3", 2, G, F, 2, 1, 0, 0, 4, 4, NULL, 0, "1,3", none, 0, NULL},
        {"llama fp32 p2 split uniform, m 8", 2, L, F, 2, 1, 0, 0, 8, 4, NULL, 0, "uniform", none,
         SLOW, NULL},
        {"gpt2 fp32 p2 block recompute", 2, G, F, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, blk, 0, NULL},
        {"llama fp32 p2 selective recompute", 2, L, F, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, sel, 0,
         NULL},
        {"gpt2 bf16 p2", 2, G, FL_BF16, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, none, SLOW, NULL},
        {"gpt2 bf16 p2, ZeRO-1's state offloaded (NVMe)", 2, G, FL_BF16, 2, 1, 0, 1, 4, 4, NULL, 0,
         NULL, none, NVME, NULL},
        // optimizers fused into the backward pass: one micro-batch a step
        {"gpt2 fp32 p2 lomo", 2, G, F, 2, 1, 0, 0, 1, 4, NULL, 0, NULL, none, 0, "lomo --lr 0.2"},
        {"llama fp32 p2 adalomo (tied)", 2, L, F, 2, 1, 0, 0, 1, 4, NULL, 0, NULL, none, TIED,
         "adalomo --eps 1e-8 --lr 0.05"},
        {"gpt2 fp16 p2 lomo", 2, G, FL_F16, 2, 1, 0, 0, 1, 4, NULL, 0, NULL, blk, SLOW,
         "lomo --lr 0.2"},
        {"llama fp16 p2", 2, L, FL_F16, 2, 1, 0, 0, 4, 4, NULL, 0, NULL, none, SLOW, NULL},
        // p = 4, and 2 x 2 with tensor or data parallelism
        {"gpt2 fp32 p4 1f1b", 4, G, F, 4, 1, 0, 0, 4, 4, NULL, 0, NULL, none, 0, NULL},
        {"llama fp32 p4 1f1b", 4, L, F, 4, 1, 0, 0, 4, 4, NULL, 0, NULL, none, SLOW | EVAL, NULL},
        {"gpt2 fp32 p4 m 2", 4, G, F, 4, 1, 0, 0, 2, 4, NULL, 0, NULL, none, 0, NULL},
        {"llama fp32 p4 interleaved v2", 4, L, F, 4, 1, 0, 0, 4, 8, "interleaved", 2, NULL, none, 0,
         NULL},
        {"gpt2 fp32 p4 interleaved v2", 4, G, F, 4, 1, 0, 0, 4, 8, "interleaved", 2, NULL, none,
         SLOW, NULL},
        {"gpt2 fp32 p4 split 1,2,2,1", 4, G, F, 4, 1, 0, 0, 4, 6, NULL, 0, "1,2,2,1", none, SLOW,
         NULL},
        {"gpt2 fp32 p4 gpipe, block recompute", 4, G, F, 4, 1, 0, 0, 4, 4, "gpipe", 0, NULL, blk,
         SLOW, NULL},
        {"gpt2 fp32 TP x PP (2 x 2)", 4, G, F, 2, 2, 0, 0, 4, 4, NULL, 0, NULL, none, EVAL, NULL},
        {"gpt2 fp32 p4 lomo", 4, G, F, 4, 1, 0, 0, 1, 4, NULL, 0, NULL, none, 0, "lomo --lr 0.2"},
        {"llama fp32 TP+SP x PP (2 x 2)", 4, L, F, 2, 2, 1, 0, 4, 4, NULL, 0, NULL, none, 0, NULL},
        {"gpt2 fp32 PP x DP ZeRO-1 (2 x 2)", 4, G, F, 2, 1, 0, 1, 4, 4, NULL, 0, NULL, none, EVAL,
         NULL},
        {"llama fp32 PP x DP ZeRO-1 (2 x 2)", 4, L, F, 2, 1, 0, 1, 4, 4, NULL, 0, NULL, none, SLOW,
         NULL},
        // 3D
        {"gpt2 fp32 TP x PP x DP ZeRO-1 (2 x 2 x 2)", 8, G, F, 2, 2, 0, 1, 4, 4, NULL, 0, NULL,
         none, 0, NULL},
        {"llama fp32 TP+SP x PP x DP ZeRO-1 (2 x 2 x 2)", 8, L, F, 2, 2, 1, 1, 4, 4, NULL, 0, NULL,
         none, SLOW, NULL},
    };
    pp_case cases[sizeof all / sizeof all[0]];
    int n = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i].np == fl_comm_size() && !((all[i].more & SLOW) && t_quick()))
            cases[n++] = all[i];
    if (fl_comm_rank() == 0) {
        check_stage_tables(G, 1);
        check_stage_tables(L, 0);
        check_stage_tables(L, 1);
    }
    if (fl_comm_size() > 1) {
        train_references(cases, n);
        for (int i = 0; i < n; i++) check_case(&cases[i]);
    }
    for (int i = 0; i < n_refs; i++) free_result(&refs[i].r);
    return fl_comm_finalize(t_report());
}
