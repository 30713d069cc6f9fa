// test_plan.c: memory planning. The formulas against the published figures
// (ZeRO, LOMO), and the exact plan against what the engine really allocates:
// each runnable configuration is built and trained for one step in a child
// process (the allocator's counters are process-global), and the peak per
// tag is compared with the prediction. Data parallelism (DDP, ZeRO 1-3) is
// measured through the real binary: `mpirun -np 2 fitlm train --mem-report`
// against `fitlm plan --ranks 2`, every rank and every tag.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fitlm/comm.h"
#include "fitlm/io.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "fitlm/plan.h"
#include "fitlm/safetensors.h"
#include "testlib.h"

static fl_optimizer_config adamw_config(int grad_accum);

// LOMO or AdaLomo, fused into the backward pass unless accumulating
static fl_optimizer_config fused_config(fl_optim_kind kind, int grad_accum) {
    fl_optimizer_config o = adamw_config(grad_accum);
    o.kind = kind;
    o.eps = 1e-30f;
    o.eps2 = 1e-3f;
    o.clip_threshold = 1.0f;
    o.decay_rate = -0.8f;
    o.stochastic_rounding = 1;
    return o;
}

static fl_optimizer_config adamw_config(int grad_accum) {
    fl_optimizer_config o = {0};
    o.kind = FL_OPT_ADAMW;
    o.beta1 = 0.9f;
    o.beta2 = 0.95f;
    o.eps = 1e-8f;
    o.weight_decay = 0.1f;
    o.max_grad_norm = 1.0f;
    o.grad_accum = grad_accum;
    o.initial_scale_power = 16;
    o.loss_scale_window = 1000;
    o.hysteresis = 2;
    o.min_loss_scale = 1.0f;
    return o;
}

static fl_optimizer_config sgd_config(float momentum) {
    fl_optimizer_config o = adamw_config(1);
    o.kind = FL_OPT_SGD;
    o.momentum = momentum;
    o.weight_decay = 0.0f;
    return o;
}

// A raw parameter count, formula-only.
static fl_plan raw_plan(size_t numel, fl_dtype dt, fl_optimizer_config o, int ranks, int stage) {
    fl_plan_request r;
    fl_plan_request_init(&r);
    r.num_params = numel;
    r.dtype = dt;
    r.optim = o;
    r.ranks = ranks;
    r.zero_stage = stage;
    fl_plan p;
    fl_plan_compute(&r, &p);
    return p;
}

// ----------------------------------------------------------------------------
// published figures

// ZeRO paper, Figure 1 / section 5: Psi = 7.5B on 64 ranks, and the 7B figures
// of the issue on 8 ranks; mixed-precision AdamW is 16 bytes/param (K = 12).
static void test_zero_published_figures(void) {
    const size_t psi = 7000000000u;
    const struct {
        int ranks, stage;
        size_t want;
    } cases[] = {
        {1, 0, 112000000000u}, {8, 0, 112000000000u}, {8, 1, 38500000000u},
        {8, 2, 26250000000u},  {8, 3, 14000000000u},
    };
    for (int dt = FL_BF16; dt <= FL_F16; dt++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            fl_plan p =
                raw_plan(psi, (fl_dtype)dt, adamw_config(1), cases[i].ranks, cases[i].stage);
            printf("  7B %s AdamW, %d rank(s), ZeRO-%d: model states %.4f GB (published %.4f)\n",
                   fl_dtype_name((fl_dtype)dt), cases[i].ranks, cases[i].stage,
                   p.model_states / 1e9, cases[i].want / 1e9);
            t_check(p.model_states == cases[i].want,
                    "7B %s ZeRO-%d over %d: model states %zu, want %zu",
                    fl_dtype_name((fl_dtype)dt), cases[i].stage, cases[i].ranks, p.model_states,
                    cases[i].want);
            t_check(!p.runnable && strstr(p.note, "not runnable yet"),
                    "a raw count is marked not runnable (note: %s)", p.note);
        }
    // Psi = 7.5B, N_d = 64: 120 GB -> 31.4 -> 16.6 -> 1.9 GB (ZeRO paper, Figure 1)
    const double want75[4] = {120.0, 31.4, 16.6, 1.9};
    for (int stage = 0; stage <= 3; stage++) {
        fl_plan p = raw_plan(7500000000u, FL_BF16, adamw_config(1), 64, stage);
        t_check(fabs(p.model_states / 1e9 - want75[stage]) < 0.05,
                "7.5B over 64 ranks, ZeRO-%d: %.2f GB, published %.1f GB", stage,
                p.model_states / 1e9, want75[stage]);
    }
}

// LOMO paper, Table 1 (LLaMA-7B, 6,738,415,616 parameters, fp16 weights, in
// GiB): AdamW params 12.55, grads 12.55, optimizer states (fp32 master, m, v)
// 75.31; SGD 25.10 (the master copy); LOMO grads 0.24 (the 32000 x 4096
// embedding) and no optimizer state.
static void test_lomo_published_figures(void) {
    const size_t psi = 6738415616u, embedding = 32000u * 4096u;
    const double GiB = 1073741824.0;
    fl_plan a = raw_plan(psi, FL_F16, adamw_config(1), 1, 0);
    fl_plan s = raw_plan(psi, FL_F16, sgd_config(0.0f), 1, 0);
    fl_plan_request r;
    fl_plan_request_init(&r);
    r.num_params = psi;
    r.largest_tensor = embedding;
    r.dtype = FL_F16;
    r.optim = sgd_config(0.0f);
    r.lomo = 1;
    fl_plan l;
    fl_plan_compute(&r, &l);
    const struct {
        const char *what;
        double got, want;
    } rows[] = {
        {"AdamW params", a.bytes[FL_MEM_PARAMS] / GiB, 12.55},
        {"AdamW grads", a.bytes[FL_MEM_GRADS] / GiB, 12.55},
        {"AdamW optimizer states", (a.bytes[FL_MEM_MASTER] + a.bytes[FL_MEM_OPTIM]) / GiB, 75.31},
        {"SGD optimizer states", (s.bytes[FL_MEM_MASTER] + s.bytes[FL_MEM_OPTIM]) / GiB, 25.10},
        {"LOMO params", l.bytes[FL_MEM_PARAMS] / GiB, 12.55},
        {"LOMO grads", l.bytes[FL_MEM_GRADS] / GiB, 0.24},
        {"LOMO optimizer states", (l.bytes[FL_MEM_MASTER] + l.bytes[FL_MEM_OPTIM]) / GiB, 0.0},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        printf("  LOMO Table 1, %-24s %6.2f GiB (published %.2f)\n", rows[i].what, rows[i].got,
               rows[i].want);
        t_check(fabs(rows[i].got - rows[i].want) < 0.005, "LLaMA-7B %s: %.3f GiB, published %.2f",
                rows[i].what, rows[i].got, rows[i].want);
    }
}

// Model-state bytes per parameter with the engine's real sizes.
static void test_bytes_per_param(void) {
    const size_t n = 1000000;
    const struct {
        const char *what;
        fl_dtype dt;
        fl_optimizer_config o;
        size_t want;
    } cases[] = {
        {"fp32 AdamW: 4 params + 4 grads + 8 m,v", FL_F32, adamw_config(1), 16},
        {"fp32 AdamW, grad accum 4 (accumulates in place)", FL_F32, adamw_config(4), 16},
        {"bf16 AdamW: 2 + 2 + 4 master + 8 m,v (ZeRO's K=12)", FL_BF16, adamw_config(1), 16},
        {"bf16 AdamW, grad accum 2: + 4 fp32 gradient sum", FL_BF16, adamw_config(2), 20},
        {"fp32 SGD momentum: 4 + 4 + 4", FL_F32, sgd_config(0.9f), 12},
        {"bf16 SGD momentum: 2 + 2 + 4 master + 4", FL_BF16, sgd_config(0.9f), 12},
        {"fp32 SGD without momentum: 4 + 4", FL_F32, sgd_config(0.0f), 8},
        {"bf16 SGD without momentum: 2 + 2 + 4 master", FL_BF16, sgd_config(0.0f), 8},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_plan p = raw_plan(n, cases[i].dt, cases[i].o, 1, 0);
        printf("  %-52s %5.2f bytes/param\n", cases[i].what, (double)p.model_states / n);
        t_check(p.model_states == cases[i].want * n, "%s: %zu bytes/param, want %zu", cases[i].what,
                p.model_states / n, cases[i].want);
    }
}

// ----------------------------------------------------------------------------
// strategies on a real shape

static fl_plan_request small_request(fl_dtype dt, fl_optimizer_config o, int B, int T) {
    fl_plan_request r;
    fl_plan_request_init(&r);
    r.model = (fl_model_config){
        .max_seq_len = 64, .vocab_size = 256, .n_layer = 2, .n_head = 4, .n_embd = 64};
    r.dtype = dt;
    r.optim = o;
    r.B = B;
    r.T = T;
    r.threads = 2;
    return r;
}

static void test_strategies_on_a_shape(void) {
    fl_plan_request r = small_request(FL_F32, adamw_config(1), 8, 64);
    r.model = (fl_model_config){
        .max_seq_len = 1024, .vocab_size = 50257, .n_layer = 12, .n_head = 12, .n_embd = 768};
    r.T = 1024;
    fl_plan base, one, ckpt, lomo, z3;
    fl_plan_compute(&r, &base);
    r.model.n_layer = 1;
    fl_plan_compute(&r, &one);
    r.model.n_layer = 12;
    t_check(base.runnable && base.num_params == 124475904,
            "gpt2 124M (padded vocab 50304) fp32 is runnable, %zu params", base.num_params);
    r.recompute = FL_RECOMPUTE_BLOCK;
    fl_plan_compute(&r, &ckpt);
    r.recompute = FL_RECOMPUTE_NONE;
    r.lomo = 1;
    fl_plan_compute(&r, &lomo);
    r.lomo = 0;
    r.ranks = 8;
    r.zero_stage = 3;
    fl_plan_compute(&r, &z3);
    printf("  gpt2 124M fp32 B=8 T=1024: acts %.1f MiB, with checkpointing %.1f MiB\n",
           base.bytes[FL_MEM_ACTS] / 1048576.0, ckpt.bytes[FL_MEM_ACTS] / 1048576.0);
    t_check(ckpt.runnable, "block checkpointing is runnable (%s)", ckpt.note);
    t_check(ckpt.bytes[FL_MEM_ACTS] == one.bytes[FL_MEM_ACTS] + (size_t)11 * 8 * 1024 * 768 * 4 &&
                ckpt.bytes[FL_MEM_ACTS] * 2 < base.bytes[FL_MEM_ACTS],
            "checkpointing: a one-block model's activations + 11 block inputs (%zu; without: %zu)",
            ckpt.bytes[FL_MEM_ACTS], base.bytes[FL_MEM_ACTS]);
    t_check(lomo.bytes[FL_MEM_GRADS] == (size_t)50304 * 768 * 4 && !lomo.bytes[FL_MEM_OPTIM] &&
                !lomo.bytes[FL_MEM_MASTER],
            "LOMO keeps one gradient, the embedding's (%zu bytes), and no optimizer state",
            lomo.bytes[FL_MEM_GRADS]);
    // ZeRO-3 as the engine runs it: every rank initialises only its shard
    // (124475904 / 8 elements) and keeps the embedding (wte + wpe: gathered
    // for the whole step); pretrained weights load whole first (the peak),
    // freed once the rank keeps its shard
    const size_t shard = 124475904u / 8 * 4, embedding = (size_t)(50304 + 1024) * 768 * 4;
    fl_plan z3w;
    r.whole_weights_first = 1;
    fl_plan_compute(&r, &z3w);
    r.whole_weights_first = 0;
    t_check(z3w.freed[FL_MEM_PARAMS] == base.bytes[FL_MEM_PARAMS] &&
                z3w.bytes[FL_MEM_PARAMS] - z3w.freed[FL_MEM_PARAMS] == z3.bytes[FL_MEM_PARAMS],
            "ZeRO-3 from pretrained weights: the whole weights at the peak (%zu), then %zu",
            z3w.bytes[FL_MEM_PARAMS], z3w.bytes[FL_MEM_PARAMS] - z3w.freed[FL_MEM_PARAMS]);
    t_check(z3.runnable && z3.freed[FL_MEM_PARAMS] == 0 &&
                z3.bytes[FL_MEM_PARAMS] >= shard + embedding &&
                z3.bytes[FL_MEM_PARAMS] < 2 * (shard + embedding) && z3.bytes[FL_MEM_COMM] > 0 &&
                z3.bytes[FL_MEM_ACTS] == base.bytes[FL_MEM_ACTS] &&
                z3.bytes[FL_MEM_OPTIM] == base.bytes[FL_MEM_OPTIM] / 8,
            "ZeRO-3 over 8: params peak %zu, %zu after set-up (shard %zu + embedding %zu), optim "
            "%zu, comm %zu (%s)",
            z3.bytes[FL_MEM_PARAMS], z3.bytes[FL_MEM_PARAMS] - z3.freed[FL_MEM_PARAMS], shard,
            embedding, z3.bytes[FL_MEM_OPTIM], z3.bytes[FL_MEM_COMM], z3.note);
    t_check(z3.formula_model_states == (size_t)124475904 * 16 / 8,
            "the ZeRO paper's formula for comparison: %zu", z3.formula_model_states);
    // LOMO under ZeRO-3 runs: no gradient buffer, one unit's reduction at a time
    fl_plan lomo3;
    r.optim.kind = FL_OPT_LOMO;
    r.optim.grad_accum = 1;
    fl_plan_compute(&r, &lomo3);
    t_check(lomo3.runnable && lomo3.bytes[FL_MEM_OPTIM] == 0 && lomo3.bytes[FL_MEM_MASTER] == 0,
            "LOMO with ZeRO-3 is runnable, no optimizer state (%s)", lomo3.note);
    // what fl_dist_attach refuses is said, and planned by the formulas
    fl_plan refused;
    r.optim.kind = FL_OPT_ADAMW;
    r.lora = (fl_lora_config){.r = 8, .alpha = 8};
    fl_plan_compute(&r, &refused);
    t_check(!refused.runnable && strstr(refused.note, "not runnable yet: LoRA with "
                                                      "ZeRO-3 over 8 ranks"),
            "LoRA with ZeRO-3 is not runnable: %s", refused.note);
    r.optim = adamw_config(1);
    r.zero_stage = 0;
    r.ranks = 2;
    fl_lora_config_defaults(&r.lora);
    r.lora.r = 8;
    fl_plan_compute(&r, &refused);
    t_check(!refused.runnable &&
                strstr(refused.note, "not runnable yet: LoRA with data parallel over 2 ranks"),
            "LoRA over 2 ranks is not runnable: %s", refused.note);
}

// The TP group's scratch (one buffer, the largest call's): t parts of the
// values, rounded up to 16 bytes, then the fp32 sums; an all-reduce is a
// reduce-scatter to ceil(n/t) values plus, when t does not divide n, the
// padded copy it sends.
static void test_tp_scratch(void) {
    t_check(fl_tp_scratch_bytes(1, FL_TP_ALL_REDUCE, FL_F32, 100) == 0, "t = 1 takes none");
    t_check(fl_tp_scratch_bytes(2, FL_TP_ALL_REDUCE, FL_F32, 10) == 48 + 20,
            "all-reduce of 10 floats over 2: %zu",
            fl_tp_scratch_bytes(2, FL_TP_ALL_REDUCE, FL_F32, 10));
    t_check(fl_tp_scratch_bytes(2, FL_TP_ALL_REDUCE, FL_F32, 11) == 48 + 24 + 48,
            "all-reduce of 11 floats over 2 (padded to 12): %zu",
            fl_tp_scratch_bytes(2, FL_TP_ALL_REDUCE, FL_F32, 11));
    t_check(fl_tp_scratch_bytes(4, FL_TP_REDUCE_SCATTER, FL_BF16, 5) == 48 + 20,
            "reduce-scatter to 5 bf16 over 4: %zu",
            fl_tp_scratch_bytes(4, FL_TP_REDUCE_SCATTER, FL_BF16, 5));
}

// GPT-2 124M under tensor parallelism: this rank's slices, the optimizer
// over them (TP x DP 2 x 2: DDP over the data-parallel pair, ZeRO-1 its
// shard of the slices), the TP scratch of one (B*T, C) all-reduce (sequence
// parallelism: a reduce-scatter to B*T/t positions), activations split.
static void test_tensor_parallel_plan(void) {
    fl_plan_request r = small_request(FL_F32, adamw_config(1), 8, 1024);
    r.model = (fl_model_config){
        .max_seq_len = 1024, .vocab_size = 50257, .n_layer = 12, .n_head = 12, .n_embd = 768};
    fl_plan one, tp2, sp2, z1, sp4;
    fl_plan_compute(&r, &one);
    r.ranks = 4;
    r.tensor_parallel = 2;
    fl_plan_compute(&r, &tp2);
    r.zero_stage = 1;
    r.rank = 3; // data-parallel rank 1: the second shard
    fl_plan_compute(&r, &z1);
    r.zero_stage = 0;
    r.rank = 0;
    r.sequence_parallel = 1;
    fl_plan_compute(&r, &sp2);
    r.tensor_parallel = 4;
    fl_plan_compute(&r, &sp4);
    // per rank: wte's 50432/2 vocabulary rows (padded to 128 x 2), wpe, and
    // each block's split matrices and biases (6C^2 + 19C/2), ln_f
    const size_t C = 768, BT = 8 * 1024;
    const size_t rank_params = 25216 * C + 1024 * C + 12 * (6 * C * C + 19 * C / 2) + 2 * C;
    t_check(tp2.runnable && tp2.num_params == rank_params &&
                tp2.bytes[FL_MEM_PARAMS] == rank_params * 4 &&
                tp2.bytes[FL_MEM_OPTIM] == rank_params * 8 && strstr(tp2.note, "tensor parallel 2"),
            "t = 2 over 4 ranks: %zu parameters on this rank (want %zu), params %zu, optim %zu "
            "(%s)",
            tp2.num_params, rank_params, tp2.bytes[FL_MEM_PARAMS], tp2.bytes[FL_MEM_OPTIM],
            tp2.note);
    t_check(z1.bytes[FL_MEM_OPTIM] == rank_params / 2 * 8 && strstr(z1.note, "rank 1 of 2"),
            "TP x DP 2 x 2, ZeRO-1, world rank 3: the optimizer over half the slices (%zu; %s)",
            z1.bytes[FL_MEM_OPTIM], z1.note);
    t_check(tp2.bytes[FL_MEM_COMM] == fl_tp_scratch_bytes(2, FL_TP_ALL_REDUCE, FL_F32, BT * C) &&
                sp2.bytes[FL_MEM_COMM] ==
                    fl_tp_scratch_bytes(2, FL_TP_REDUCE_SCATTER, FL_F32, BT / 2 * C),
            "the TP scratch: one (B*T, C) all-reduce (%zu), under SP a reduce-scatter (%zu)",
            tp2.bytes[FL_MEM_COMM], sp2.bytes[FL_MEM_COMM]);
    t_check(sp2.bytes[FL_MEM_ACTS] < tp2.bytes[FL_MEM_ACTS] &&
                tp2.bytes[FL_MEM_ACTS] < one.bytes[FL_MEM_ACTS] &&
                sp4.bytes[FL_MEM_ACTS] < sp2.bytes[FL_MEM_ACTS],
            "activations: t = 1 %zu > t = 2 %zu > t = 2 SP %zu > t = 4 SP %zu",
            one.bytes[FL_MEM_ACTS], tp2.bytes[FL_MEM_ACTS], sp2.bytes[FL_MEM_ACTS],
            sp4.bytes[FL_MEM_ACTS]);
    printf("  gpt2 124M fp32 B=8 T=1024 per rank: t=1 %.1f MiB, t=2 %.1f MiB (acts %.1f), t=2 SP "
           "%.1f MiB (acts %.1f), t=4 SP %.1f MiB (acts %.1f)\n",
           one.total / 1048576.0, tp2.total / 1048576.0, tp2.bytes[FL_MEM_ACTS] / 1048576.0,
           sp2.total / 1048576.0, sp2.bytes[FL_MEM_ACTS] / 1048576.0, sp4.total / 1048576.0,
           sp4.bytes[FL_MEM_ACTS] / 1048576.0);
}

// One layer's activations per rank (the plan of 12 layers less that of 11)
// against Korthikanti et al. 2022 (2205.05198, Table 2), per layer in bytes
// of 2-byte activations: sbh(34 + 5as/h) without TP, sbh(10 + 24/t +
// 5as/ht) with it, sbh(34 + 5as/h)/t with sequence parallelism. fitlm's
// attention keeps no a x s x s scores (flash-style: a log-sum-exp per head,
// 4a/t bytes per token) and its models have no dropout (Megatron keeps two
// sbh masks): 32 sbh where Megatron counts 34 (their selective-recompute
// column), of which 8 sbh (the norms' and the column layers' inputs) are
// replicated without sequence parallelism; plus the norms' fp32 mean and
// rstd, 16 bytes per token (/t under SP). GPT-2 124M, bf16, b = 1, s = 1024.
static void test_activations_against_korthikanti(void) {
    const double s = 1024, b = 1, h = 768, a = 12, sbh = s * b * h;
    printf("  GPT-2 124M bf16, b=1, s=1024: one layer's activations per rank (MiB)\n"
           "    %-8s %10s %12s %14s %8s\n",
           "layout", "fitlm", "Korthikanti", "(no 5as/h)", "sbh");
    const struct { int t, sp; } layouts[] = {{1, 0}, {2, 0}, {2, 1}, {4, 0}, {4, 1}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        int t = layouts[i].t, sp = layouts[i].sp;
        fl_plan_request r = small_request(FL_BF16, adamw_config(1), 1, 1024);
        r.model = (fl_model_config){
            .max_seq_len = 1024, .vocab_size = 50257, .n_layer = 12, .n_head = 12, .n_embd = 768};
        r.ranks = r.tensor_parallel = t;
        r.sequence_parallel = sp;
        fl_plan p12, p11;
        fl_plan_compute(&r, &p12);
        r.model.n_layer = 11;
        fl_plan_compute(&r, &p11);
        size_t layer = p12.bytes[FL_MEM_ACTS] - p11.bytes[FL_MEM_ACTS];
        double scores = 5 * a * s / h, kept = sp || t == 1 ? 34.0 / t : 10 + 24.0 / t;
        double korthikanti = sbh * (kept + scores / t);
        size_t want = (size_t)(sbh * (sp || t == 1 ? 32.0 / t : 8 + 24.0 / t) +
                               s * b * (4 * a / t + (sp ? 16.0 / t : 16.0)));
        printf("    t=%d%-4s %10.2f %12.2f %14.2f %8.2f\n", t, sp ? " SP" : "", layer / 1048576.0,
               korthikanti / 1048576.0, sbh * kept / 1048576.0, layer / sbh);
        t_check(layer == want, "t = %d%s: one layer's activations %zu bytes, want %zu", t,
                sp ? " SP" : "", layer, want);
    }
}

// A raw count under tensor parallelism: split evenly over the t ranks, then
// ZeRO's formula over the d replicas (7B, t = 2 over 16 ranks, ZeRO-1 over
// 8: (4 + 12/8) x 3.5B).
static void test_tensor_parallel_raw_count(void) {
    fl_plan_request r;
    fl_plan_request_init(&r);
    r.num_params = 7000000000u;
    r.dtype = FL_BF16;
    r.ranks = 16;
    r.tensor_parallel = 2;
    r.zero_stage = 1;
    fl_plan p;
    fl_plan_compute(&r, &p);
    t_check(p.model_states == 19250000000u && !p.runnable && strstr(p.note, "split evenly"),
            "7B, t = 2 x ZeRO-1 over 8: model states %zu (%s)", p.model_states, p.note);
}

static fl_plan_request tp_refused;

// arg: the request whose plan must die
static void plan_dies(void *arg) {
    fl_plan p;
    fl_plan_compute(arg, &p);
}

static void test_tensor_parallel_refusals(void) {
    tp_refused = small_request(FL_F32, adamw_config(1), 2, 32);
    tp_refused.ranks = 4;
    tp_refused.tensor_parallel = 3;
    t_dies("t must divide the ranks", plan_dies, &tp_refused, "divide the 4 ranks");
    tp_refused.tensor_parallel = 2;
    tp_refused.lora.r = 8;
    t_dies("TP with LoRA is refused as train refuses it", plan_dies, &tp_refused,
           "with LoRA adapters");
}

static void test_parse_count(void) {
    const struct {
        const char *text;
        size_t want;
    } cases[] = {{"124439808", 124439808u}, {"7e9", 7000000000u}, {"7B", 7000000000u},
                 {"1.5b", 1500000000u},     {"350M", 350000000u}, {"64k", 64000u}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        t_check(fl_plan_parse_count(cases[i].text, "test") == cases[i].want, "parse '%s'",
                cases[i].text);
}

// ----------------------------------------------------------------------------
// prediction against measurement

typedef struct {
    const char *name;
    fl_dtype dt;
    fl_optimizer_config o; // under LoRA: the adapters'
    fl_arch_kind arch;
    fl_recompute recompute;
} run_case;

// LoRA on a run_case; base.kind LOMO or AdaLomo: the base is trained too
// (LoRA + LOMO); nf4: QLoRA on a Hugging Face base (block 64, double quant).
typedef struct {
    int r;
    const char *targets;
    float dropout;
    fl_optimizer_config base;
    int nf4;
} lora_case;

static char scratch[] = "/tmp/fitlm_test_plan_XXXXXX";
static char hf_base[160]; // QLoRA's base: NF4 rows are quantised as they load

// The base optimizer of a LoRA + LOMO run, as fl_config_base_optimizer makes
// it: the run's settings, the fused kind, no weight decay.
static fl_optimizer_config base_config(fl_optim_kind kind) {
    fl_optimizer_config o = fused_config(kind, 1);
    o.weight_decay = 0.0f;
    return o;
}

// In a child, so that this process's allocator stays untouched for the
// measurements.
static void write_shard(const char *path, size_t n) {
    pid_t pid = fork();
    if (pid == 0) {
        int32_t *tokens = malloc(n * sizeof(int32_t));
        for (size_t i = 0; i < n; i++)
            tokens[i] = "the quick brown fox jumps over a lazy dog\n"[i % 42];
        fl_shard_write(path, "byte", 257, tokens, n, n);
        free(tokens);
        _exit(0);
    }
    waitpid(pid, NULL, 0);
}

// The LLaMA shape the measured runs use, written as a Hugging Face
// directory (in a child, as above).
static void write_hf_base(const char *path) {
    pid_t pid = fork();
    if (pid == 0) {
        fl_plan_request r = small_request(FL_F32, adamw_config(1), 1, 1);
        r.model.arch = FL_ARCH_LLAMA;
        fl_model m;
        fl_model_init(&m, &r.model, FL_F32, 7);
        fl_hf_export(path, &m, m.params, FL_F32, 0);
        fl_model_free(&m);
        _exit(0);
    }
    waitpid(pid, NULL, 0);
}

// In a fresh child: does what `fitlm train` does (texts, model, activations,
// optimizer, batch buffers, grad_accum micro-batches and a step, then a
// sample), then compares the peak per tag with the plan. Exits 0 when every
// tag is within 3%.
static int measure(const run_case *c, const lora_case *l) {
    const int B = 4, T = 32, sample_tokens = 8;
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        if (fl_mem_peak(t) != 0) {
            printf("  %s: the allocator was used before the measurement\n", c->name);
            return 1;
        }
    fl_plan_request r = small_request(c->dt, c->o, B, T);
    r.threads = fl_threads();
    r.sample_tokens = sample_tokens;
    r.model.arch = c->arch;
    r.recompute = c->recompute;
    // as `fitlm train` sets a LoRA run up (src/cli/train.c)
    int lora = l != NULL, train_base = lora && fl_optim_kind_fused(l->base.kind);
    if (lora) {
        fl_lora_config_defaults(&r.lora);
        r.lora.r = l->r;
        r.lora.dropout = l->dropout;
        snprintf(r.lora.target_modules, sizeof r.lora.target_modules, "%s", l->targets);
        r.lora.train_base = train_base;
        if (train_base) r.base_optim = l->base;
    }
    fl_weight_source base_weights; // the HF base, or random
    if (lora && l->nf4) {
        r.quant = (fl_quant_config){.enabled = 1, .blocksize = 64, .double_quant = 1};
        fl_weight_source_open(&base_weights, hf_base);
        r.model = base_weights.config;
    }

    fl_loader train, val;
    fl_loader_open(&train, scratch, "train", T, 7, 1, 0, 1);
    fl_loader_open(&val, scratch, "val", T, 0, 0, 0, 1);
    r.data_bytes = fl_mem_current(FL_MEM_OTHER); // what the loaders keep: their shard tables
    fl_model model;
    if (!(lora && l->nf4)) fl_weight_source_random(&base_weights, &r.model, 1337);
    fl_model_init_from(&model, &base_weights, c->dt, &r.quant, 0, SIZE_MAX);
    fl_weight_source_close(&base_weights);
    if (lora) fl_model_add_lora(&model, &r.lora, 1337);
    fl_model_alloc_acts(&model, B, T, c->recompute,
                        lora ? train_base && fl_optimizer_unit_grads(&l->base)
                             : fl_optimizer_unit_grads(&c->o));
    fl_optimizer opt, base;
    if (lora)
        fl_optimizer_init(&opt, &c->o, &model.lora.table, c->dt, model.lora.params,
                          model.lora.grads);
    else
        fl_optimizer_init(&opt, &c->o, &model.table, c->dt, model.params, model.grads);
    if (train_base)
        fl_optimizer_init(&base, &l->base, &model.table, c->dt, model.params, model.grads);
    size_t step_tokens = (size_t)c->o.grad_accum * B * T;
    int *inputs = fl_alloc(FL_MEM_OTHER, step_tokens * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, step_tokens * sizeof(int));
    fl_rng rng;
    fl_rng_seed(&rng, 7);
    for (int micro = 0; micro < c->o.grad_accum; micro++)
        fl_loader_next(&train, inputs + micro * B * T, targets + micro * B * T, B);
    if (train_base)
        fl_lora_lomo_step(&model, &opt, &base, inputs, targets, B, T, 1e-3f, 1e-3f);
    else
        fl_train_step(&model, &opt, inputs, targets, c->o.grad_accum, B, T, 1e-3f);
    int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(sample_tokens + 4) * sizeof(int));
    tokens[0] = 'T';
    fl_model_generate(&model, tokens, 1, sample_tokens, 0.8f, 40, &rng, NULL, NULL);

    size_t measured[FL_MEM_NTAGS];
    for (int t = 0; t < FL_MEM_NTAGS; t++) measured[t] = fl_mem_peak(t);
    size_t total_peak = fl_mem_total_peak();
    fl_plan p; // after measuring: planning builds a throwaway parameter table
    fl_plan_compute(&r, &p);
    int bad = 0;
    printf("  %s (B=%d, T=%d, %d threads): %s\n", c->name, B, T, r.threads,
           p.runnable ? "runnable" : "NOT runnable");
    printf("    %-10s %12s %12s %8s\n", "tag", "predicted", "measured", "diff");
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        double pred = (double)p.bytes[t], meas = (double)measured[t];
        double rel = pred == meas ? 0.0 : fabs(pred - meas) / fmax(pred, meas);
        printf("    %-10s %12zu %12zu %7.3f%%\n", fl_mem_tag_name(t), p.bytes[t], measured[t],
               100.0 * rel);
        // what the model and the optimizer allocate is planned from their own size lists:
        // exactly (the other tags hold the data loaders' and the runtime's bookkeeping)
        int exact = t == FL_MEM_PARAMS || t == FL_MEM_GRADS || t == FL_MEM_MASTER ||
                    t == FL_MEM_OPTIM || t == FL_MEM_ACTS || t == FL_MEM_WORKSPACE;
        if (rel > 0.03 || (exact && rel != 0.0)) bad = 1;
    }
    size_t sum = 0;
    for (int t = 0; t < FL_MEM_NTAGS; t++) sum += measured[t];
    printf("    %-10s %12zu %12zu (peak of the sum %zu)\n", "total", p.total, sum, total_peak);
    fflush(stdout);
    return bad || !p.runnable;
}

static void test_prediction_matches_measurement(void) {
    if (!mkdtemp(scratch)) {
        t_check(0, "mkdtemp %s", scratch);
        return;
    }
    char path[128];
    snprintf(path, sizeof path, "%s/train_000000.bin", scratch);
    write_shard(path, 20000);
    snprintf(path, sizeof path, "%s/val_000000.bin", scratch);
    write_shard(path, 3000);
    snprintf(hf_base, sizeof hf_base, "%s/hf", scratch);
    write_hf_base(hf_base);
    const run_case cases[] = {
        {"fp32 AdamW", FL_F32, adamw_config(1), FL_ARCH_GPT2, FL_RECOMPUTE_NONE},
        {"bf16 AdamW, grad accum 2", FL_BF16, adamw_config(2), FL_ARCH_GPT2, FL_RECOMPUTE_NONE},
        {"fp32 SGD momentum 0.9", FL_F32, sgd_config(0.9f), FL_ARCH_GPT2, FL_RECOMPUTE_NONE},
        {"fp16 AdamW (dynamic loss scale)", FL_F16, adamw_config(1), FL_ARCH_GPT2,
         FL_RECOMPUTE_NONE},
        {"bf16 SGD without momentum", FL_BF16, sgd_config(0.0f), FL_ARCH_GPT2, FL_RECOMPUTE_NONE},
        {"fp32 AdamW, selective recompute", FL_F32, adamw_config(1), FL_ARCH_GPT2,
         FL_RECOMPUTE_SELECTIVE},
        {"bf16 AdamW, block recompute", FL_BF16, adamw_config(1), FL_ARCH_GPT2, FL_RECOMPUTE_BLOCK},
        {"LLaMA fp32 AdamW", FL_F32, adamw_config(1), FL_ARCH_LLAMA, FL_RECOMPUTE_NONE},
        {"LLaMA bf16 AdamW, selective recompute", FL_BF16, adamw_config(1), FL_ARCH_LLAMA,
         FL_RECOMPUTE_SELECTIVE},
        {"LLaMA fp32 AdamW, block recompute, grad accum 2", FL_F32, adamw_config(2), FL_ARCH_LLAMA,
         FL_RECOMPUTE_BLOCK},
        {"LLaMA bf16 LOMO (one unit's gradients)", FL_BF16, fused_config(FL_OPT_LOMO, 1),
         FL_ARCH_LLAMA, FL_RECOMPUTE_NONE},
        {"GPT-2 fp16 LOMO, block recompute", FL_F16, fused_config(FL_OPT_LOMO, 1), FL_ARCH_GPT2,
         FL_RECOMPUTE_BLOCK},
        {"LLaMA bf16 AdaLomo", FL_BF16, fused_config(FL_OPT_ADALOMO, 1), FL_ARCH_LLAMA,
         FL_RECOMPUTE_SELECTIVE},
        {"LLaMA bf16 LOMO, grad accum 2 (whole gradient)", FL_BF16, fused_config(FL_OPT_LOMO, 2),
         FL_ARCH_LLAMA, FL_RECOMPUTE_NONE},
    };
    // LoRA: the adapters' table, gradients and optimizer; a frozen base has none
    const struct {
        run_case run;
        lora_case lora;
    } lora_cases[] = {
        {{"LLaMA fp32 LoRA r=4 q_proj,v_proj", FL_F32, adamw_config(1), FL_ARCH_LLAMA,
          FL_RECOMPUTE_NONE},
         {.r = 4, .targets = "q_proj,v_proj"}},
        {{"LLaMA bf16 LoRA all-linear r=8, dropout 0.1, selective recompute", FL_BF16,
          adamw_config(1), FL_ARCH_LLAMA, FL_RECOMPUTE_SELECTIVE},
         {.r = 8, .targets = "all-linear", .dropout = 0.1f}},
        {{"GPT-2 fp32 LoRA c_attn, grad accum 2", FL_F32, adamw_config(2), FL_ARCH_GPT2,
          FL_RECOMPUTE_NONE},
         {.r = 8, .targets = "c_attn"}},
        {{"LLaMA bf16 QLoRA (NF4, double quant) all-linear", FL_BF16, adamw_config(1),
          FL_ARCH_LLAMA, FL_RECOMPUTE_NONE},
         {.r = 8, .targets = "all-linear", .nf4 = 1}},
        {{"LLaMA bf16 LoRA + LOMO", FL_BF16, adamw_config(1), FL_ARCH_LLAMA, FL_RECOMPUTE_NONE},
         {.r = 8, .targets = "q_proj,v_proj", .base = base_config(FL_OPT_LOMO)}},
        {{"LLaMA bf16 LoRA + AdaLomo", FL_BF16, adamw_config(1), FL_ARCH_LLAMA, FL_RECOMPUTE_NONE},
         {.r = 8, .targets = "q_proj,v_proj", .base = base_config(FL_OPT_ADALOMO)}},
    };
    size_t n_plain = sizeof cases / sizeof cases[0];
    for (size_t i = 0; i < n_plain + sizeof lora_cases / sizeof lora_cases[0]; i++) {
        const run_case *c = i < n_plain ? &cases[i] : &lora_cases[i - n_plain].run;
        const lora_case *l = i < n_plain ? NULL : &lora_cases[i - n_plain].lora;
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        if (pid == 0) _exit(measure(c, l));
        int status = 0;
        waitpid(pid, &status, 0);
        t_check(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "%s: predicted bytes per tag within 3%% of the measured peaks (status %d)", c->name,
                status);
    }
    snprintf(path, sizeof path, "%s/train_000000.bin", scratch);
    remove(path);
    snprintf(path, sizeof path, "%s/val_000000.bin", scratch);
    remove(path);
    t_remove_dir(hf_base);
    rmdir(scratch);
}

// ----------------------------------------------------------------------------
// data parallelism: `fitlm plan --ranks 2` against every rank's memory report

// Runs `cmd` through the shell, its stdout into out and its stderr into err
// (each NUL-terminated, truncated to size). Returns the exit status, -1 when
// it did not exit.
static int t_mpirun_plan(const char *cmd, char *out, char *err, size_t size) {
    char errpath[] = "/tmp/fitlm_test_plan_err_XXXXXX";
    int fd = mkstemp(errpath);
    if (fd < 0) return -1;
    close(fd);
    char *full = malloc(strlen(cmd) + sizeof errpath + 16);
    sprintf(full, "%s 2>%s", cmd, errpath);
    FILE *p = popen(full, "r");
    free(full);
    size_t got = p ? fread(out, 1, size - 1, p) : 0;
    out[got] = 0;
    char sink[4096]; // the rest is read, so the command never blocks on a full pipe
    while (p && fread(sink, 1, sizeof sink, p) > 0) {
    }
    int status = p ? pclose(p) : -1;
    size_t n;
    unsigned char *text = t_read_file(errpath, &n);
    snprintf(err, size, "%s", text ? (const char *)text : "");
    free(text);
    remove(errpath);
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A plan's bytes per tag, read from `fitlm plan`'s table, and what set-up
// frees again (ZeRO-3's whole weights). 0 when the table is incomplete.
typedef struct {
    size_t bytes[FL_MEM_NTAGS], freed_params, total;
    int runnable;
} printed_plan;

static int read_plan(const char *text, printed_plan *p) {
    memset(p, 0, sizeof *p);
    int found = 0;
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        char key[40];
        snprintf(key, sizeof key, "\n  %s ", fl_mem_tag_name(t));
        const char *at = strstr(text, key);
        found += at && sscanf(at + strlen(key), "%zu", &p->bytes[t]) == 1;
    }
    const char *at = strstr(text, "\n  total ");
    found += at && sscanf(at + 9, "%zu", &p->total) == 1;
    at = strstr(text, "params: the peak holds weights (");
    if (at) sscanf(at + strlen("params: the peak holds weights ("), "%zu", &p->freed_params);
    p->runnable = strstr(text, "runnable: yes") != NULL;
    return found == FL_MEM_NTAGS + 1;
}

// Rank r's memory report (fl_mem_report: MiB with two decimals, current and
// peak per tag, then the peak in bytes) in `text`, after its "memory of rank
// R:" line.
static int read_report(const char *text, int rank, char cur[][16], char peak[][16],
                       size_t *peak_bytes) {
    char head[32];
    snprintf(head, sizeof head, "memory of rank %d:\n", rank);
    const char *at = strstr(text, head);
    if (!at || !(at = strstr(at, "memory by tag (MiB):"))) return 0;
    int found = 0;
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        char key[40];
        snprintf(key, sizeof key, "\n  %s ", fl_mem_tag_name(t));
        const char *line = strstr(at, key);
        found += line &&
                 sscanf(line + strlen(key), "%15s %15s %zu", cur[t], peak[t], &peak_bytes[t]) == 3;
    }
    return found == FL_MEM_NTAGS;
}

typedef struct {
    int stage;
    const char *precision, *arch, *extra; // extra: zero_optimization (and tensor-parallel) flags
    int grad_accum;
    int weights_offloaded; // offload_param nvme: the shard lives until the file takes it
    int np;                // ranks (0: 2)
    int exact_other;       // other too must be exact (the plan is given the run's own options)
} dist_case;

// One case: `mpirun -np N fitlm train ... --mem-report` and `fitlm plan
// --ranks N --rank R` with the same options; every rank's peak per tag against
// its plan, in bytes. The tags the model, optimizer and strategy allocate
// must be exact; other (data loaders, config text, the strategy's
// bookkeeping) and offload within 3%, other exactly with exact_other.
static void check_dist_case(const char *bin, const dist_case *c) {
    static char out[65536], err[65536], plan_out[16384], plan_err[4096];
    char opts[768], cmd[2048], what[200];
    const int np = c->np ? c->np : 2;
    snprintf(opts, sizeof opts,
             "--model tiny --arch %s --data %s --tokenizer byte --seq-len 32 --batch 2 "
             "--threads 1 --sample-tokens 0 --val-data none --precision %s --grad-accum %d "
             "--zero-stage %d %s --steps 2 --mem-report --out ''",
             c->arch, t_source_path("data/brown_byte"), c->precision, c->grad_accum, c->stage,
             c->extra);
    snprintf(what, sizeof what, "np %d, ZeRO-%d %s %s, grad accum %d%s%s", np, c->stage, c->arch,
             c->precision, c->grad_accum, *c->extra ? ", " : "", c->extra);
    snprintf(cmd, sizeof cmd, "mpirun.openmpi -q --bind-to none -np %d %s train %s", np, bin, opts);
    int rc = t_mpirun_plan(cmd, out, err, sizeof out);
    if (!t_check(rc == 0, "%s: mpirun exits 0 (status %d): %.600s", what, rc, err)) return;
    printf("  %s\n    %-10s %4s %12s %12s\n", what, "tag", "rank", "planned", "peak");
    for (int rank = 0; rank < np; rank++) {
        snprintf(cmd, sizeof cmd, "%s plan %s --ranks %d --rank %d", bin, opts, np, rank);
        printed_plan p;
        int prc = t_mpirun_plan(cmd, plan_out, plan_err, sizeof plan_out);
        if (!t_check(prc == 0 && read_plan(plan_out, &p) && p.runnable,
                     "%s: fitlm plan --rank %d prints a runnable plan (status %d): %.600s%.300s",
                     what, rank, prc, plan_out, plan_err))
            return;
        char cur[FL_MEM_NTAGS][16], peak[FL_MEM_NTAGS][16];
        size_t measured[FL_MEM_NTAGS];
        if (!t_check(read_report(rank ? err : out, rank, cur, peak, measured),
                     "%s: rank %d's memory report is printed", what, rank))
            return;
        for (int t = 0; t < FL_MEM_NTAGS; t++) {
            double pred = (double)p.bytes[t], meas = (double)measured[t];
            int same = p.bytes[t] == measured[t];
            int exact_tag = t != FL_MEM_OFFLOAD && (t != FL_MEM_OTHER || c->exact_other);
            printf("    %-10s %4d %12zu %12zu  %s\n", fl_mem_tag_name(t), rank, p.bytes[t],
                   measured[t], same ? "same" : "differs");
            t_check(exact_tag ? same : same || fabs(pred - meas) <= 0.03 * fmax(pred, meas),
                    "%s, rank %d, %s: planned %zu bytes, measured peak %zu%s", what, rank,
                    fl_mem_tag_name(t), p.bytes[t], measured[t],
                    exact_tag ? " (exact)" : " (within 3%)");
        }
        // a random start allocates only what stays (ZeRO-3: the shard), so
        // the report's current value is the peak
        char after[32];
        snprintf(after, sizeof after, "%.2f",
                 (p.bytes[FL_MEM_PARAMS] - p.freed_params) / 1048576.0);
        t_check(!strcmp(after, cur[FL_MEM_PARAMS]) && (p.freed_params == 0) != c->weights_offloaded,
                "%s, rank %d: params after set-up planned %s MiB (freed %zu), measured %s MiB",
                what, rank, after, p.freed_params, cur[FL_MEM_PARAMS]);
        if (rank == 0) { // train's own plan, for its fits-check, is this plan
            char planned[32];
            snprintf(planned, sizeof planned, "planned memory %.1f MiB per rank",
                     p.total / 1048576.0);
            t_check(strstr(out, planned) != NULL, "%s: train says '%s'", what, planned);
        }
    }
}

// DeepSpeed's batch rule over the planned ranks: train_batch_size 32 with
// micro-batch 4 over 2 ranks is 4 accumulation steps (one rank: 8).
static void test_batch_rule_over_ranks(const char *bin) {
    static char out[16384], err[4096];
    char cmd[1024];
    for (int ranks = 1; ranks <= 2; ranks++) {
        snprintf(cmd, sizeof cmd,
                 "%s plan --model tiny --seq-len 32 --data %s --tokenizer byte --ranks %d "
                 "--zero-stage 1 --train-batch-size 32 --batch 4",
                 bin, t_source_path("data/brown_byte"), ranks);
        int rc = t_mpirun_plan(cmd, out, err, sizeof out);
        char want[64];
        snprintf(want, sizeof want, "grad accum %d | %d rank", 8 / ranks, ranks);
        t_check(rc == 0 && strstr(out, want), "plan --ranks %d: train_batch_size 32 = 4 x %d x %d",
                ranks, 8 / ranks, ranks);
    }
}

static void test_data_parallel_measured(void) {
    const char *bin = getenv("FITLM_BINARY");
    if (bin) test_batch_rule_over_ranks(bin);
    if (!bin || system("command -v mpirun.openmpi >/dev/null 2>&1") != 0) {
        printf("  (FITLM_BINARY not set or no mpirun.openmpi: data-parallel test skipped)\n");
        return;
    }
    // every stage in fp32 and bf16; accumulation (bf16's fp32 sum under
    // stages 0/1, the owners' sums under 2/3), small buckets, and stage 3
    // with blocks gathered through the ring (persistence threshold below a
    // block) as well as all kept gathered (the default threshold on tiny)
    const dist_case cases[] = {
        {0, "fp32", "gpt2", "", 1, 0, 2, 0},
        {0, "bf16", "llama", "", 2, 0, 2, 0},
        {1, "fp32", "llama", "", 2, 0, 2, 0},
        {1, "bf16", "gpt2", "--reduce-bucket-size 10000", 2, 0, 2, 0},
        {2, "fp32", "gpt2", "--reduce-bucket-size 10000", 1, 0, 2, 0},
        {2, "bf16", "llama", "", 2, 0, 2, 0},
        {3, "fp32", "llama", "--param-persistence-threshold 1000", 1, 0, 2, 0},
        {3, "bf16", "gpt2", "--param-persistence-threshold 1000 --prefetch-bucket-size 40000", 2, 0,
         2, 0},
        {3, "bf16", "gpt2", "", 1, 0, 2, 0},
        // LOMO and AdaLomo: one unit's reduction at a time, no gradient
        // buffer; AdaLomo's shards end at row boundaries
        {3, "fp32", "llama", "--optimizer lomo --param-persistence-threshold 1000", 1, 0, 2, 0},
        {1, "bf16", "gpt2", "--optimizer adalomo", 1, 0, 2, 0},
        // the LM head and loss 24 positions at a time: a chunk's logits
        {2, "bf16", "llama", "--logits-chunk 24 --sample-tokens 4", 2, 0, 2, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_dist_case(bin, &cases[i]);
    // tensor parallelism, every tag exact on every rank: t = 2 and 4, with
    // and without sequence parallelism, GPT-2 and LLaMA with grouped-query
    // attention (two query heads per KV head), TP x DP 2 x 2 under ZeRO-1 and
    // ZeRO-3, recompute, LOMO, AdaLomo (its per-row state of the rank's
    // slices), and generation's gathered logits at the end
    const dist_case tp[] = {
        {0, "fp32", "gpt2", "--tensor-parallel 2", 1, 0, 2, 1},
        {0, "bf16", "gpt2", "--tensor-parallel 2 --sequence-parallel --sample-tokens 4", 1, 0, 2,
         1},
        {0, "fp32", "llama", "--n-head 8 --n-kv-head 4 --tensor-parallel 4 --sample-tokens 4", 1, 0,
         4, 1},
        {0, "bf16", "llama",
         "--n-head 8 --n-kv-head 4 --tensor-parallel 4 --sequence-parallel "
         "--activation-checkpointing selective",
         2, 0, 4, 1},
        {1, "bf16", "gpt2", "--tensor-parallel 2", 2, 0, 4, 1},
        {3, "fp32", "llama",
         "--n-kv-head 2 --tensor-parallel 2 --sequence-parallel --param-persistence-threshold 1000",
         1, 0, 4, 1},
        {0, "bf16", "llama",
         "--n-kv-head 2 --tensor-parallel 2 --optimizer lomo --activation-checkpointing block", 1,
         0, 2, 1},
        {0, "bf16", "gpt2", "--tensor-parallel 2 --sequence-parallel --optimizer adalomo", 1, 0, 2,
         1},
    };
    // the sanitizer build's quick list (FITLM_TEST_QUICK): sequence
    // parallelism with sampling, t = 4 with recompute, TP x DP under ZeRO-3
    for (size_t i = 0; i < sizeof tp / sizeof tp[0]; i++)
        if (!t_quick() || i == 1 || i == 3 || i == 5) check_dist_case(bin, &tp[i]);
    // pipeline parallelism, every tag exact on every stage: p = 2 and 4,
    // 1F1B, GPipe and interleaved, a tied GPT-2 and LLaMA, activation
    // checkpointing, generation through the stages, TP x PP and PP x DP
    // under ZeRO-1
    const dist_case pp[] = {
        {0, "fp32", "gpt2", "--pipeline-parallel 2 --sample-tokens 4", 4, 0, 2, 1},
        {0, "bf16", "llama", "--n-layer 4 --pipeline-parallel 4 --pipeline-schedule gpipe", 4, 0, 4,
         1},
        {0, "fp32", "gpt2", "--n-layer 4 --pipeline-parallel 4 --activation-checkpointing block", 8,
         0, 4, 1},
        {0, "bf16", "gpt2",
         "--n-layer 4 --pipeline-parallel 2 --pipeline-schedule interleaved --virtual-stages 2", 4,
         0, 2, 1},
        {0, "fp32", "gpt2", "--tensor-parallel 2 --sequence-parallel --pipeline-parallel 2", 2, 0,
         4, 1},
        {1, "bf16", "llama", "--pipeline-parallel 2", 2, 0, 4, 1},
        // p 4 interleaved over m 16: more sends in a step than the
        // communicator has request slots, unless finished ones are freed
        {0, "fp32", "llama",
         "--n-layer 8 --pipeline-parallel 4 --pipeline-schedule interleaved --virtual-stages 2", 16,
         0, 4, 1},
    };
    for (size_t i = 0; i < sizeof pp / sizeof pp[0]; i++)
        if (!t_quick() || i == 3 || i == 5) check_dist_case(bin, &pp[i]);
    // NVMe offload: the buffers in RAM, the state on disk; under ZeRO-3 the
    // weights too, updated from the backward pass (no gradient buffer)
    char dir[] = "/tmp/fitlm-plan-nvme-XXXXXX";
    if (!t_check(mkdtemp(dir) != NULL, "a directory for the offload files")) return;
    static char opt_json[512], all_json[512], opt_cfg[64], all_cfg[64];
    snprintf(opt_json, sizeof opt_json,
             "{\"zero_optimization\": {\"sub_group_size\": 30000, \"offload_optimizer\": "
             "{\"device\": \"nvme\", \"nvme_path\": \"%s\", \"buffer_count\": 3, "
             "\"pipeline_read\": true, \"pipeline_write\": true}}}",
             dir);
    snprintf(all_json, sizeof all_json,
             "{\"optimizer_in_backward\": true, \"zero_optimization\": {\"offload_optimizer\": "
             "{\"device\": \"nvme\", \"nvme_path\": \"%s\"}, \"offload_param\": {\"device\": "
             "\"nvme\"}}}",
             dir);
    snprintf(opt_cfg, sizeof opt_cfg, "%s/opt.json", dir);
    snprintf(all_cfg, sizeof all_cfg, "%s/all.json", dir);
    t_write_text(opt_cfg, opt_json);
    t_write_text(all_cfg, all_json);
    static char opt_extra[96], all_extra[96];
    snprintf(opt_extra, sizeof opt_extra, "--config %s", opt_cfg);
    snprintf(all_extra, sizeof all_extra, "--config %s", all_cfg);
    const dist_case offload[] = {{2, "bf16", "gpt2", opt_extra, 2, 0, 2, 0},
                                 {3, "fp32", "llama", all_extra, 1, 1, 2, 0}};
    for (size_t i = 0; i < sizeof offload / sizeof offload[0]; i++)
        check_dist_case(bin, &offload[i]);
    char rm[96];
    snprintf(rm, sizeof rm, "rm -rf %s", dir);
    t_check(system(rm) == 0, "removing %s", dir);
}

// ----------------------------------------------------------------------------
// refusing to start

static fl_plan_request big_batch;
static size_t fits_at_8;

static void check_fits_dies(void *arg) {
    (void)arg;
    fl_plan p;
    fl_plan_compute(&big_batch, &p);
    fl_plan_check_fits(&big_batch, &p, fits_at_8);
}

// The pipeline's options reach the request (fl_plan_request_from_config),
// the stage split resolved over the model's blocks.
static void pp_request(fl_plan_request *r, const char *flags, int ranks) {
    char copy[512], *argv[32];
    snprintf(copy, sizeof copy, "%s", flags);
    int argc = 0;
    for (char *tok = strtok(copy, " "); tok && argc < 32; tok = strtok(NULL, " "))
        argv[argc++] = tok;
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    fl_config_parse_args(&cfg, argc, argv);
    cfg.ranks = ranks;
    fl_config_finish(&cfg, 257);
    fl_plan_request_from_config(r, &cfg, 0);
}

static void test_pipeline_request(void) {
    static fl_plan_request r; // 4 KiB of stage_blocks
    fl_plan_request_init(&r);
    t_check(r.pipeline_parallel == 1 && r.virtual_stages == 1 &&
                r.pipeline_schedule == FL_PP_1F1B && r.pipeline_split == FL_PP_SPLIT_PARAMETERS,
            "a request's pipeline defaults: p 1, v 1, 1F1B, by parameters");
    pp_request(&r, "--model gpt2 --seq-len 16 --pipeline-parallel 2", 4);
    t_check(r.pipeline_parallel == 2 && r.virtual_stages == 1 &&
                r.pipeline_schedule == FL_PP_1F1B && r.pipeline_split == FL_PP_SPLIT_PARAMETERS &&
                r.stage_blocks[0] == 6 && r.stage_blocks[1] == 6,
            "--pipeline-parallel 2: p %d, 1F1B, GPT-2's blocks %d,%d by parameters",
            r.pipeline_parallel, r.stage_blocks[0], r.stage_blocks[1]);
    pp_request(&r,
               "--model gpt2 --seq-len 16 --pipeline-parallel 2 --pipeline-schedule interleaved "
               "--virtual-stages 2 --grad-accum 4 --pipeline-split 2,4,4,2",
               4);
    t_check(r.pipeline_parallel == 2 && r.virtual_stages == 2 &&
                r.pipeline_schedule == FL_PP_INTERLEAVED &&
                r.pipeline_split == FL_PP_SPLIT_EXPLICIT && r.stage_blocks[0] == 2 &&
                r.stage_blocks[1] == 4 && r.stage_blocks[2] == 4 && r.stage_blocks[3] == 2 &&
                r.optim.grad_accum == 4,
            "interleaved, v 2, 2,4,4,2: p %d v %d schedule %d split %d blocks %d,%d,%d,%d",
            r.pipeline_parallel, r.virtual_stages, r.pipeline_schedule, r.pipeline_split,
            r.stage_blocks[0], r.stage_blocks[1], r.stage_blocks[2], r.stage_blocks[3]);
    pp_request(&r, "--model gpt2 --seq-len 16 --pipeline-parallel 3 --pipeline-split uniform", 3);
    t_check(r.pipeline_split == FL_PP_SPLIT_UNIFORM && r.stage_blocks[0] == 4 &&
                r.stage_blocks[1] == 4 && r.stage_blocks[2] == 4,
            "uniform over 3 stages: %d,%d,%d", r.stage_blocks[0], r.stage_blocks[1],
            r.stage_blocks[2]);
}

// A stage's plan: every stage against each alone, the largest deciding;
// the activation sets a stage holds: under 1F1B stage s keeps min(p - s, m)
// micro-batches (stage 0 min(p, m), the last one), under GPipe every stage m.
static void pp_plan(fl_plan_request *r, const char *flags, int ranks, fl_plan *out) {
    pp_request(r, flags, ranks);
    r->ranks = ranks;
    fl_plan_compute(r, out);
}

static fl_plan_request pp_refused_request;

static void test_pipeline_plan(void) {
    static fl_plan_request r;
    static fl_plan all, one, m1, mk;
    const char *base = "--model tiny --seq-len 32 --batch 2 --n-layer 4 --pipeline-split uniform "
                       "--pipeline-parallel 4";
    char flags[256];
    snprintf(flags, sizeof flags, "%s --grad-accum 8", base);
    pp_plan(&r, flags, 4, &all);
    size_t most = 0;
    int peak = -1;
    for (int s = 0; s < all.stages; s++)
        if (all.stage[s].total > most) most = all.stage[s].total, peak = s;
    t_check(all.stages == 4 && all.total == most && all.peak_stage == peak &&
                all.stage[peak].stage == peak,
            "every stage planned: %d stages, the figures the largest's (stage %d, %zu bytes)",
            all.stages, all.peak_stage, all.total);
    for (int s = 0; s < 4; s++) {
        r.rank = s;
        r.one_stage = 1;
        fl_plan_compute(&r, &one);
        t_check(one.stages == 1 && one.stage[0].stage == s && one.total == all.stage[s].total &&
                    one.bytes[FL_MEM_ACTS] == all.stage[s].acts && all.stage[s].blocks == 1,
                "stage %d alone: %zu bytes, as in the whole plan (%zu)", s, one.total,
                all.stage[s].total);
        if (s == peak)
            t_check(!memcmp(one.bytes, all.bytes, sizeof one.bytes),
                    "the plan's tags are the peak stage's");
    }
    // activation sets: stage 0 and the last, m = 1 .. 8, against m = 1 (one
    // set): each set the same bytes (set, m = 2 under GPipe / stage 0)
    size_t set0 = 0;
    for (int kind = 0; kind < 2; kind++) {
        const char *sched = kind ? "gpipe" : "1f1b";
        for (int stage = 0; stage < 4; stage += 3) {
            size_t set = 0;
            for (int m = 1; m <= 8; m++) {
                snprintf(flags, sizeof flags, "%s --pipeline-schedule %s --grad-accum %d", base,
                         sched, m);
                pp_request(&r, flags, 4);
                r.ranks = 4;
                r.rank = stage;
                r.one_stage = 1;
                fl_plan_compute(&r, m == 1 ? &m1 : &mk);
                if (m == 1) continue;
                size_t extra = mk.bytes[FL_MEM_ACTS] - m1.bytes[FL_MEM_ACTS];
                int sets = kind ? m : stage == 0 ? (m < 4 ? m : 4) : 1;
                if (m == 2) set = extra;
                if (m == 2 && stage == 0 && !kind) set0 = extra;
                t_check(extra == (size_t)(sets - 1) * set && (sets == 1 || set > 0),
                        "%s stage %d, m %d: %d activation set%s (acts %zu = %zu + %zu)", sched,
                        stage, m, sets, sets == 1 ? "" : "s", mk.bytes[FL_MEM_ACTS],
                        m1.bytes[FL_MEM_ACTS], extra);
            }
        }
    }
    // stage 0 under 1F1B at m >= p holds p sets, the last stage one
    snprintf(flags, sizeof flags, "%s --grad-accum 8", base);
    pp_plan(&r, flags, 4, &all);
    printf("  1F1B p 4 m 8, acts per stage:");
    for (int s = 0; s < 4; s++) printf(" %zu", all.stage[s].acts);
    printf(" (one set of stage 0: %zu)\n", set0);
    // what would fit keeps interleaved 1F1B's micro-batches a multiple of p
    // (ZeRO-1 over 4 ranks, micro-batch 1: the 6 sequences a step are 3 a
    // replica, rounded up to 4)
    pp_plan(&r,
            "--model tiny --seq-len 32 --batch 3 --grad-accum 2 --n-layer 4 --pipeline-parallel 2 "
            "--pipeline-schedule interleaved --virtual-stages 2",
            2, &all);
    char alt[2048];
    fl_plan_alternatives(&r, all.total - 1, alt, sizeof alt);
    printf("  interleaved p 2, alternatives under %zu bytes:\n%s", all.total - 1, alt);
    t_check(strstr(alt, "--ranks 4 --zero-stage 1 --batch 1 --grad-accum 4") != NULL,
            "interleaved: ZeRO-1 over 4 ranks with m rounded up to p");
    // refusals: the layout, a raw count
    snprintf(flags, sizeof flags, "%s --grad-accum 8", base);
    pp_request(&pp_refused_request, flags, 4);
    pp_refused_request.ranks = 6;
    t_dies("pipeline: 6 ranks over p 4", plan_dies, &pp_refused_request,
           "pipeline parallel 4 = 4 does not divide the 6 ranks");
    pp_refused_request.ranks = 4;
    pp_refused_request.num_params = 1000000;
    t_dies("pipeline: a raw count", plan_dies, &pp_refused_request, "needs a model shape");
}

static void test_check_fits(void) {
    big_batch = small_request(FL_F32, adamw_config(1), 64, 64);
    fl_plan_request at8 = big_batch;
    at8.B = 8;
    at8.optim.grad_accum = 8;
    fl_plan p8, p64;
    fl_plan_compute(&at8, &p8);
    fl_plan_compute(&big_batch, &p64);
    fits_at_8 = p8.total;
    fl_plan_check_fits(&big_batch, &p64, p64.total); // fits exactly: returns
    t_check(1, "a plan that fits passes");
    t_dies("too big: names the largest tag", check_fits_dies, NULL, "Largest: acts");
    t_dies("too big: a micro-batch that fits", check_fits_dies, NULL, "--batch 8 --grad-accum 8");
    t_dies("too big: LOMO, as the engine runs it", check_fits_dies, NULL, "--optimizer lomo");
    char alt[2048];
    fl_plan_alternatives(&big_batch, fits_at_8, alt, sizeof alt);
    printf("  alternatives under %zu bytes:\n%s", fits_at_8, alt);
    t_check(strstr(alt, "--precision bf16") != NULL, "bf16 is offered");
    // LOMO offered as it runs (one process, AdamW's request), not as its
    // formula, at the plan of that run
    fl_plan_request lomo = big_batch;
    lomo.optim.kind = FL_OPT_LOMO;
    lomo.optim.grad_accum = 1;
    fl_plan pl;
    char h[FL_SIZE_TEXT], want[96];
    for (; lomo.B > 1; lomo.B /= 2) {
        fl_plan_compute(&lomo, &pl);
        if (pl.total <= fits_at_8) break;
    }
    fl_plan_compute(&lomo, &pl);
    snprintf(want, sizeof want, "  --optimizer lomo%s%.0d%s: %s\n",
             lomo.B != big_batch.B ? " --batch " : "", lomo.B != big_batch.B ? lomo.B : 0,
             big_batch.optim.grad_accum != 1 ? " --grad-accum 1" : "", fl_size_text(pl.total, h));
    t_check(strstr(alt, want) && !strstr(alt, "--lomo:") && pl.runnable,
            "LOMO at its runnable plan (%s), not its formula: %s", want, alt);
}

// A device's ZeRO-Offload run whose host memory does not fit: what would
// fit names the optimizer's state on NVMe, at sub_group_size 1e8 where
// DeepSpeed's 1e9 makes its chunk buffers too large, and no ranks or LOMO
// (one process on a device).
static void test_device_offload_alternatives(void) {
    fl_plan_request r = small_request(FL_BF16, adamw_config(1), 4, 256);
    fl_model_preset(&r.model, "tinyllama-1.1b");
    r.recompute = FL_RECOMPUTE_BLOCK;
    r.dev = fl_device_get("test");
    r.dev_offload = 1;
    r.offload = (fl_offload_config){.buffer_count = 4,
                                    .chunk = 1e9,
                                    .block_size = 1048576,
                                    .queue_depth = 8,
                                    .thread_count = 1};
    fl_plan_request nvme = r;
    nvme.optim.paged = 1;
    nvme.offload.chunk = 1e8;
    fl_plan all, paged;
    fl_plan_compute(&r, &all);
    fl_plan_compute(&nvme, &paged);
    size_t host = all.total - all.device_total, limit = paged.total - paged.device_total;
    t_check(limit < host, "the state on NVMe needs less host memory (%zu) than in it (%zu)", limit,
            host);
    char alt[2048];
    fl_plan_alternatives(&r, limit, alt, sizeof alt);
    printf("  a device's offload over %zu host bytes:\n%s", limit, alt);
    t_check(strstr(alt, "offload_optimizer.device nvme, sub_group_size 1e8") &&
                !strstr(alt, "--ranks") && !strstr(alt, "--lomo"),
            "what would fit: the state on NVMe, no ranks nor LOMO");
}

// The command: a formula-only plan through the real binary.
// `fitlm plan ARGS` (stdout and stderr into out): its exit status, -1 when it
// did not exit.
static int plan_command(const char *bin, const char *args, char *out, size_t size) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s plan %s 2>&1", bin, args);
    FILE *f = popen(cmd, "r");
    size_t n = f ? fread(out, 1, size - 1, f) : 0;
    out[n] = 0;
    int status = f ? pclose(f) : -1;
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_cli(void) {
    const char *bin = getenv("FITLM_BINARY");
    if (!bin) {
        printf("  (FITLM_BINARY not set: command test skipped)\n");
        return;
    }
    char out[16384];
    int status = plan_command(
        bin, "--params 7B --precision bf16 --ranks 8 --zero-stage 3 --data '' --val-data ''", out,
        sizeof out);
    t_check(status == 0 && strstr(out, "14000000000 bytes (14.00 GB) = 2.00 bytes/param") &&
                strstr(out, "not runnable yet"),
            "fitlm plan --params 7B ... --zero-stage 3: %s", out);
    // the tensor-parallel flags reach the request: t x d, the rank's slices
    status = plan_command(bin,
                          "--model tiny --seq-len 32 --tensor-parallel 2 --sequence-parallel "
                          "--ranks 4 --data '' --val-data ''",
                          out, sizeof out);
    t_check(status == 0 &&
                strstr(out, "4 ranks (tensor parallel 2 with sequence parallelism x 2 "
                            "data-parallel)") &&
                strstr(out, "runnable: yes") &&
                strstr(out, "tensor parallel 2 with sequence parallelism: this rank's slices") &&
                strstr(out, "data parallel, data-parallel rank 0 of 2"),
            "fitlm plan --tensor-parallel 2 --sequence-parallel --ranks 4: %s", out);
    // the pipeline's refusals apply to a plan's ranks
    status = plan_command(bin,
                          "--model tiny --seq-len 32 --pipeline-parallel 2 --tensor-parallel 2 "
                          "--ranks 6 --data '' --val-data ''",
                          out, sizeof out);
    t_check(status == 1 &&
                strstr(out, "tensor_parallel.size 2 x pipeline_parallel.size 2 does not divide "
                            "the world of 6 ranks (6 % 4 = 2)"),
            "fitlm plan --pipeline-parallel 2 --tensor-parallel 2 --ranks 6: %s", out);
    status = plan_command(bin,
                          "--model tiny --seq-len 32 --pipeline-parallel 2 --ranks 2 "
                          "--zero-stage 3 --data '' --val-data ''",
                          out, sizeof out);
    t_check(status == 1 && strstr(out, "zero_optimization.stage 3 (--zero-stage) with "
                                       "pipeline_parallel.size 2 is refused"),
            "fitlm plan --pipeline-parallel 2 --zero-stage 3: %s", out);
}

int main(void) {
    // First, while the allocator is untouched: the children measure from zero.
    test_prediction_matches_measurement();
    test_zero_published_figures();
    test_lomo_published_figures();
    test_bytes_per_param();
    test_strategies_on_a_shape();
    test_parse_count();
    test_tp_scratch();
    test_tensor_parallel_plan();
    test_activations_against_korthikanti();
    test_tensor_parallel_raw_count();
    test_tensor_parallel_refusals();
    test_check_fits();
    test_device_offload_alternatives();
    test_pipeline_request();
    test_pipeline_plan();
    test_cli();
    test_data_parallel_measured();
    return t_report();
}
