// profile.c: the per-op profiler's slots, their table and its printing.
#include "fitlm/profile.h"

#include <stdlib.h>
#include <string.h>

int fl_profile_on;

static fl_op_stats slots[FL_OP_COUNT];
static double step_seconds;
static int steps;

// A device clock's marks not read yet: a step's slots (read when it ends,
// or earlier when the list fills: that waits for the device mid-step)
enum { PENDING_MAX = 8192 };
static const fl_profile_clock *clock;
typedef struct {
    fl_op op;
    fl_pass pass;
    void *a, *b;
    double flops, bytes;
} pending_slot;
static pending_slot pending[PENDING_MAX];
static int npending;

// The pending marks' times into their slots (or only released: !keep).
static void read_pending(int keep) {
    for (int i = 0; i < npending; i++) {
        double s = clock->seconds(clock->ctx, pending[i].a, pending[i].b);
        if (keep)
            fl_profile_add(pending[i].op, pending[i].pass, s, pending[i].flops, pending[i].bytes);
    }
    npending = 0;
}

void fl_profile_use_clock(const fl_profile_clock *c) {
    if (clock) read_pending(1);
    clock = c;
}

void *fl_profile_mark(void) {
    return clock ? clock->mark(clock->ctx) : NULL;
}

void fl_profile_end(fl_op op, fl_pass pass, void *mark, double t0, double flops, double bytes) {
    if (!clock) {
        fl_profile_add(op, pass, fl_now() - t0, flops, bytes);
        return;
    }
    if (npending == PENDING_MAX) read_pending(1);
    pending[npending++] = (pending_slot){op, pass, mark, clock->mark(clock->ctx), flops, bytes};
}

static const char *const names[FL_OP_COUNT] = {
    [FL_OP_ENCODER] = "encoder",
    [FL_OP_LAYERNORM] = "layernorm",
    [FL_OP_RMSNORM] = "rmsnorm",
    [FL_OP_MM_QKV] = "matmul attn qkv",
    [FL_OP_MM_ATTPROJ] = "matmul attn proj",
    [FL_OP_MM_FC] = "matmul mlp fc",
    [FL_OP_MM_FCPROJ] = "matmul mlp proj",
    [FL_OP_MM_LMHEAD] = "matmul lm head",
    [FL_OP_LORA] = "lora adapters",
    [FL_OP_DEQUANT] = "nf4 dequantize",
    [FL_OP_ROPE] = "rope",
    [FL_OP_ATTENTION] = "attention",
    [FL_OP_GELU] = "gelu",
    [FL_OP_SWIGLU] = "swiglu",
    [FL_OP_RESIDUAL] = "residual",
    [FL_OP_XENT] = "softmax+xent",
    [FL_OP_ZERO_GRAD] = "zero grad",
    [FL_OP_ZERO_ACTS] = "zero act grads",
    [FL_OP_OPTIMIZER] = "optimizer",
    [FL_OP_LOADER] = "data loader",
    [FL_OP_COMM] = "communication",
};

void fl_profile_enable(int on) {
    fl_profile_on = on != 0;
}

void fl_profile_reset(void) {
    if (clock) read_pending(0);
    memset(slots, 0, sizeof slots);
    step_seconds = 0.0;
    steps = 0;
}

void fl_profile_add(fl_op op, fl_pass pass, double seconds, double flops, double bytes) {
    FL_ASSERT(op >= 0 && op < FL_OP_COUNT && pass >= 0 && pass < FL_NPASSES);
    slots[op].seconds[pass] += seconds;
    slots[op].flops[pass] += flops;
    slots[op].bytes[pass] += bytes;
    slots[op].calls[pass]++;
}

void fl_profile_step(double seconds) {
    if (clock) read_pending(1);
    step_seconds += seconds;
    steps++;
}

int fl_profile_steps(void) {
    return steps;
}

const fl_op_stats *fl_profile_stats(fl_op op) {
    FL_ASSERT(op >= 0 && op < FL_OP_COUNT);
    return &slots[op];
}

const char *fl_op_name(fl_op op) {
    FL_ASSERT(op >= 0 && op < FL_OP_COUNT);
    return names[op];
}

static double gflops(double flops, double seconds) {
    return flops > 0.0 && seconds > 0.0 ? flops / seconds / 1e9 : 0.0;
}

static int by_total_desc(const void *a, const void *b) {
    double x = ((const fl_profile_row *)a)->total_ms, y = ((const fl_profile_row *)b)->total_ms;
    return (x < y) - (x > y);
}

int fl_profile_rows(fl_profile_row *rows) {
    if (!steps) return 0;
    double per_step = 1e3 / steps, step_ms = step_seconds * per_step, covered = 0.0;
    int n = 0;
    for (int op = 0; op < FL_OP_COUNT; op++) {
        const fl_op_stats *s = &slots[op];
        long long calls = s->calls[FL_FWD] + s->calls[FL_BWD] + s->calls[FL_STEP];
        if (!calls) continue;
        double total = s->seconds[FL_FWD] + s->seconds[FL_BWD] + s->seconds[FL_STEP];
        covered += total * per_step;
        rows[n++] = (fl_profile_row){names[op],
                                     (double)calls / steps,
                                     s->seconds[FL_FWD] * per_step,
                                     s->seconds[FL_BWD] * per_step,
                                     total * per_step,
                                     0.0,
                                     gflops(s->flops[FL_FWD], s->seconds[FL_FWD]),
                                     gflops(s->flops[FL_BWD], s->seconds[FL_BWD]),
                                     (s->bytes[FL_FWD] + s->bytes[FL_BWD] + s->bytes[FL_STEP]) /
                                         steps / 1e9};
    }
    // the step outside every slot: bookkeeping between kernels, buffer
    // clears, gradient hooks, logging inside the step
    rows[n++] = (fl_profile_row){.name = "other", .total_ms = step_ms - covered};
    for (int i = 0; i < n; i++)
        rows[i].share = step_ms > 0.0 ? 100.0 * rows[i].total_ms / step_ms : 0.0;
    qsort(rows, (size_t)n, sizeof *rows, by_total_desc);
    return n;
}

// A number cell, blank for 0 (a pass an op does not have, a non-GEMM rate).
static void cell(FILE *out, double v, int width, int decimals) {
    if (v == 0.0)
        fprintf(out, " %*s |", width, "");
    else
        fprintf(out, " %*.*f |", width, decimals, v);
}

void fl_profile_print(FILE *out) {
    fl_profile_row rows[FL_PROFILE_ROWS];
    int n = fl_profile_rows(rows);
    if (!n) {
        fprintf(out, "per-op profile: no steps profiled\n");
        return;
    }
    double step_ms = step_seconds * 1e3 / steps;
    fprintf(out, "per-op profile: %d step%s, %.2f ms/step\n", steps, steps == 1 ? "" : "s",
            step_ms);
    fprintf(out, "| %-16s | %10s | %10s | %10s | %10s | %6s | %11s | %11s | %9s | %8s |\n", "op",
            "calls/step", "fwd ms", "bwd ms", "total ms", "share", "fwd GFLOP/s", "bwd GFLOP/s",
            "GB/step", "GB/s");
    fprintf(out, "|:-----------------|-----------:|-----------:|-----------:|-----------:|-------:|"
                 "------------:|------------:|----------:|---------:|\n");
    for (int i = 0; i < n; i++) {
        const fl_profile_row *r = &rows[i];
        fprintf(out, "| %-16s |", r->name);
        cell(out, r->calls, 10, r->calls == (long long)r->calls ? 0 : 1);
        cell(out, r->fwd_ms, 10, 2);
        cell(out, r->bwd_ms, 10, 2);
        fprintf(out, " %10.2f | %5.1f%% |", r->total_ms, r->share);
        cell(out, r->fwd_gflops, 11, 1);
        cell(out, r->bwd_gflops, 11, 1);
        cell(out, r->gbytes, 9, 4);
        cell(out, r->gbytes > 0.0 && r->total_ms > 0.0 ? r->gbytes / (r->total_ms / 1e3) : 0.0, 8,
             1);
        fprintf(out, "\n");
    }
    double fwd = 0.0, bwd = 0.0;
    for (int i = 0; i < n; i++) fwd += rows[i].fwd_ms, bwd += rows[i].bwd_ms;
    fprintf(out,
            "| %-16s | %10s | %10.2f | %10.2f | %10.2f | %5.1f%% | %11s | %11s | %9s | %8s |\n",
            "total", "", fwd, bwd, step_ms, 100.0, "", "", "", "");
}
