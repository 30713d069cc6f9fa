// test_profile.c: the per-op profiler on a few steps of a tiny model: every
// kernel lands in its slot once per call, the table adds up to the step, a
// disabled profiler records nothing, and profiling does not change training.
#define _GNU_SOURCE // open_memstream
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/config.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "fitlm/profile.h"
#include "testlib.h"

static const fl_model_config tiny = {
    .max_seq_len = 16, .vocab_size = 50, .n_layer = 2, .n_head = 4, .n_embd = 32};
enum { B = 2, T = 16, STEPS = 3, L = 2 };

// STEPS training steps the way `fitlm train` drives them (through
// fl_optimizer), profiled when `profile`; returns the weights (caller frees).
static float *train(int profile, float *losses) {
    fl_model m;
    fl_model_init(&m, &tiny, FL_F32, 7);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 0);
    fl_train_config defaults;
    fl_config_defaults(&defaults);
    fl_optimizer_config ocfg = fl_config_optimizer(&defaults);
    fl_optimizer opt;
    fl_optimizer_init(&opt, &ocfg, &m.table, FL_F32, m.params, m.grads);
    int tokens[B * T], targets[B * T];
    fl_rng rng;
    fl_rng_seed(&rng, 3);
    fl_profile_reset();
    for (int s = 0; s < STEPS; s++) {
        fl_profile_enable(profile);
        double t0 = fl_now();
        FL_PROFILE(
            FL_OP_LOADER, FL_STEP, 0.0, for (int i = 0; i < B * T; i++) {
                tokens[i] = (int)fl_rng_below(&rng, 50);
                targets[i] = (int)fl_rng_below(&rng, 50);
            });
        losses[s] = fl_train_step(&m, &opt, tokens, targets, 1, B, T, 1e-3f).loss;
        if (fl_profile_on) fl_profile_step(fl_now() - t0);
        fl_profile_enable(0);
    }
    float *w = malloc(m.table.numel * sizeof(float));
    memcpy(w, m.params, m.table.numel * sizeof(float));
    fl_optimizer_free(&opt);
    fl_model_free(&m);
    return w;
}

static long long calls(fl_op op, fl_pass pass) {
    return fl_profile_stats(op)->calls[pass];
}

static void test_disabled_records_nothing(void) {
    float losses[STEPS];
    free(train(0, losses));
    long long any = 0;
    for (int op = 0; op < FL_OP_COUNT; op++)
        for (int p = 0; p < FL_NPASSES; p++) any += calls((fl_op)op, (fl_pass)p);
    fl_profile_row rows[FL_PROFILE_ROWS];
    t_check(any == 0 && fl_profile_steps() == 0 && fl_profile_rows(rows) == 0,
            "profiling off: no calls (%lld), no steps, no rows", any);
}

static void test_slots_and_shares(void) {
    float losses[STEPS];
    free(train(1, losses));
    t_check(fl_profile_steps() == STEPS, "every step counted (%d)", fl_profile_steps());
    // calls per step of each model op: {op, forward, backward}; a training
    // step's loss pass writes the logits' gradient too (forward only); the
    // attention's residual add is ln_2's (fused), the MLP's its own; the
    // backward clears one activation gradient, the residual stream's in the
    // head (the device writes the others: device.h)
    const int want[][3] = {{FL_OP_ENCODER, 1, 1},   {FL_OP_LAYERNORM, 2 * L + 1, 2 * L + 1},
                           {FL_OP_MM_QKV, L, L},    {FL_OP_MM_ATTPROJ, L, L},
                           {FL_OP_MM_FC, L, L},     {FL_OP_MM_FCPROJ, L, L},
                           {FL_OP_MM_LMHEAD, 1, 1}, {FL_OP_ATTENTION, L, L},
                           {FL_OP_GELU, L, L},      {FL_OP_RESIDUAL, L, 0},
                           {FL_OP_XENT, 1, 0},      {FL_OP_ZERO_ACTS, 0, 1}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        fl_op op = (fl_op)want[i][0];
        const fl_op_stats *s = fl_profile_stats(op);
        t_check(calls(op, FL_FWD) == STEPS * want[i][1] && calls(op, FL_BWD) == STEPS * want[i][2],
                "%s: %lld forward and %lld backward calls, want %d and %d per step", fl_op_name(op),
                calls(op, FL_FWD), calls(op, FL_BWD), want[i][1], want[i][2]);
        t_check((want[i][1] == 0 || s->seconds[FL_FWD] > 0.0) &&
                    (want[i][2] == 0 || s->seconds[FL_BWD] > 0.0),
                "%s: time recorded", fl_op_name(op));
        int gemm = op >= FL_OP_MM_QKV && op <= FL_OP_MM_LMHEAD, att = op == FL_OP_ATTENTION;
        double bwd = gemm ? 2.0 : 2.5; // 2 GEMMs; attention's 5 products against 2
        t_check((gemm || att) == (s->flops[FL_FWD] > 0.0) &&
                    (!(gemm || att) || s->flops[FL_BWD] == bwd * s->flops[FL_FWD]),
                "%s: FLOPs for GEMMs and attention only, backward %.1f times the forward",
                fl_op_name(op), bwd);
    }
    t_check(calls(FL_OP_LOADER, FL_STEP) == STEPS && calls(FL_OP_ZERO_GRAD, FL_STEP) == STEPS &&
                calls(FL_OP_OPTIMIZER, FL_STEP) == 2 * STEPS,
            "data, zero grad and optimizer slots filled");
    // QKV forward: 2 * (B*T) * C * 3C per layer
    double qkv = 2.0 * B * T * 32 * 96 * L * STEPS;
    t_check(fl_profile_stats(FL_OP_MM_QKV)->flops[FL_FWD] == qkv, "QKV FLOPs are 2*N*C*OC");
    // attention forward: S and P V over T (T + 1) / 2 causal pairs, 2 HS each, per head
    double att = 2.0 * 2.0 * 8 * B * 4 * T * (T + 1) / 2.0 * L * STEPS;
    t_check(fl_profile_stats(FL_OP_ATTENTION)->flops[FL_FWD] == att,
            "attention FLOPs are 4 HS per causal pair and head (%g, want %g)",
            fl_profile_stats(FL_OP_ATTENTION)->flops[FL_FWD], att);

    // the memory-bound kernels' least bytes (fp32): GELU reads and writes
    // 4C values a position, its backward reads two and writes one; the
    // backward clears C values a position in the head; an
    // fp32 AdamW step reads the gradient twice and reads and writes the
    // weights, m and v: 8 times the bytes zero grad clears
    const fl_op_stats *gelu = fl_profile_stats(FL_OP_GELU);
    double gelu_fwd = 2.0 * B * T * 4 * 32 * 4 * L * STEPS, acts = 1.0 * B * T * 32 * 4;
    t_check(gelu->bytes[FL_FWD] == gelu_fwd && gelu->bytes[FL_BWD] == 1.5 * gelu_fwd,
            "GELU moves 2 and 3 passes over its 4C values (%g, %g; want %g, %g)",
            gelu->bytes[FL_FWD], gelu->bytes[FL_BWD], gelu_fwd, 1.5 * gelu_fwd);
    t_check(fl_profile_stats(FL_OP_ZERO_ACTS)->bytes[FL_BWD] == acts * STEPS,
            "the backward clears C values a position in the head (%g, want %g)",
            fl_profile_stats(FL_OP_ZERO_ACTS)->bytes[FL_BWD], acts * STEPS);
    double zero = fl_profile_stats(FL_OP_ZERO_GRAD)->bytes[FL_STEP];
    t_check(zero > 0.0 && fl_profile_stats(FL_OP_OPTIMIZER)->bytes[FL_STEP] == 8.0 * zero,
            "an fp32 AdamW step moves 8 times the gradient's bytes (%g, %g)",
            fl_profile_stats(FL_OP_OPTIMIZER)->bytes[FL_STEP], zero);
    t_check(fl_profile_stats(FL_OP_MM_QKV)->bytes[FL_FWD] == 0.0,
            "a GEMM's floor is its FLOPs: no bytes counted");

    fl_profile_row rows[FL_PROFILE_ROWS];
    int n = fl_profile_rows(rows);
    double share = 0.0;
    int sorted = 1, other = 0, called = 0;
    for (int op = 0; op < FL_OP_COUNT; op++) {
        const fl_op_stats *st = fl_profile_stats((fl_op)op);
        called += st->calls[FL_FWD] + st->calls[FL_BWD] + st->calls[FL_STEP] > 0;
    }
    for (int i = 0; i < n; i++) {
        share += rows[i].share;
        if (i) sorted &= rows[i].total_ms <= rows[i - 1].total_ms;
        if (!strcmp(rows[i].name, "other")) other = rows[i].total_ms >= 0.0;
    }
    t_check(n == called + 1 && called >= FL_OP_COUNT - 6 && sorted && other,
            "every called slot (GPT-2 on one process: all but LLaMA's three, LoRA's two and "
            "communication) and a non-negative "
            "'other' row, "
            "largest first (%d rows)",
            n);
    t_check(share > 99.999 && share < 100.001, "shares sum to 100%% (%.6f)", share);

    // the printed table: its shares, rounded to 0.1%, add up too
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    fl_profile_print(out);
    fclose(out);
    double printed = 0.0;
    int lines = 0;
    for (char *line = strstr(text, "\n| "); line; line = strstr(line + 1, "\n| ")) {
        char *eol = strchr(line + 1, '\n'), *pct = strchr(line + 1, '%'), *bar = pct;
        // the header row has no '%'
        if (!pct || (eol && pct > eol) || !strncmp(line, "\n| total ", 9)) continue;
        while (*bar != '|') bar--;
        printed += atof(bar + 1);
        lines++;
    }
    printf("%s", text);
    t_check(lines == n && printed > 100.0 - 0.05 * n && printed < 100.0 + 0.05 * n,
            "printed shares of %d rows sum to %.1f%%", lines, printed);
    t_check(strstr(text, "| matmul lm head ") && strstr(text, "| total ") &&
                strstr(text, "| other "),
            "the table names its rows");
    free(text);
}

static void test_profiling_changes_nothing(void) {
    float on[STEPS], off[STEPS];
    float *w_on = train(1, on), *w_off = train(0, off);
    t_check(memcmp(on, off, sizeof on) == 0 &&
                memcmp(w_on, w_off, fl_model_num_params(&tiny) * sizeof(float)) == 0,
            "losses and weights are bitwise identical with and without profiling");
    free(w_on);
    free(w_off);
}

// A device's clock (a GPU's timed events) as a counter: each mark the next
// integer, a slot's time 1 ms a mark between its two; it counts releases.
static long marks, released;

static void *count_mark(void *ctx) {
    (void)ctx;
    return (void *)(intptr_t)++marks;
}

static double count_seconds(void *ctx, void *a, void *b) {
    (void)ctx;
    released += 2;
    return 1e-3 * (double)((intptr_t)b - (intptr_t)a);
}

static void test_device_clock(void) {
    const fl_profile_clock clock = {count_mark, count_seconds, NULL};
    fl_profile_use_clock(&clock);
    float losses[STEPS];
    free(train(1, losses));
    fl_profile_use_clock(NULL);
    long long calls_all = 0;
    for (int op = 0; op < FL_OP_COUNT; op++)
        for (int p = 0; p < FL_NPASSES; p++) calls_all += calls((fl_op)op, (fl_pass)p);
    t_check(marks == 2 * calls_all && released == marks,
            "a device clock: two marks a timed call (%ld for %lld calls), every one read and "
            "released at the step's end (%ld)",
            marks, calls_all, released);
    const fl_op_stats *a = fl_profile_stats(FL_OP_ATTENTION);
    t_check(a->seconds[FL_FWD] == 1e-3 * (double)a->calls[FL_FWD] &&
                a->seconds[FL_BWD] == 1e-3 * (double)a->calls[FL_BWD],
            "a slot's time is the clock's between its marks (attention: %g s for %lld calls)",
            a->seconds[FL_FWD], a->calls[FL_FWD]);
    long before = marks;
    free(train(1, losses));
    t_check(marks == before, "the host's clock again after fl_profile_use_clock(NULL)");
}

int main(void) {
    test_disabled_records_nothing();
    test_device_clock();
    test_slots_and_shares();
    test_profiling_changes_nothing();
    return t_report();
}
