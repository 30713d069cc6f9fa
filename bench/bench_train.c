// bench_train.c: training throughput of fitlm on a GPT-2 shape (default:
// GPT-2 124M, L=12 C=768 NH=12 V=50257 maxT=1024), random weights and random
// tokens. A step is the full training step: zero_grad, forward, backward,
// clip the gradient norm to 1.0, AdamW step.
//
//   bench_train --B 8 --T 256 --steps 7 --warmup 2 --threads 2 [--peak GFLOPS]
//
// Reports ms/step (median, min, max over --steps timed steps after --warmup
// untimed ones), tokens/s, achieved GFLOP/s with
//     FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C
// (6 x the non-embedding weights plus the tied LM head, forward + backward,
// plus the attention score/value products; the padded vocabulary, layernorm,
// GELU, softmax and the optimizer are not counted), MFU against --peak (if
// absent, bench_train measures the fp32 FMA peak itself with --threads
// threads, as peak_fma does) and the process's peak RSS.
//
// The last line is machine-readable: "RESULT engine=fitlm key=value ...".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fma_peak.h"

typedef struct {
    int B, T, steps, warmup, threads;
    int L, C, NH, V, maxT;
    double peak; // GFLOP/s; 0 = measure
    uint64_t seed;
    int mem_report;
} bench_args;

static void usage(FILE *out) {
    fprintf(out, "usage: bench_train [--B 4] [--T 64] [--steps 5] [--warmup 2] [--threads 2]\n"
                 "                   [--peak GFLOPS] [--L 12] [--C 768] [--NH 12] [--V 50257]\n"
                 "                   [--maxT 1024] [--seed 1337] [--mem-report 0|1]\n"
                 "  --peak: fp32 peak for MFU (from peak_fma); 0 or absent = measure it here\n");
}

static void parse(bench_args *a, int argc, char **argv) {
    *a = (bench_args){.B = 4,
                      .T = 64,
                      .steps = 5,
                      .warmup = 2,
                      .threads = 2,
                      .L = 12,
                      .C = 768,
                      .NH = 12,
                      .V = 50257,
                      .maxT = 1024,
                      .peak = 0.0,
                      .seed = 1337};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "-h") || !strcmp(k, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (i + 1 >= argc) {
            usage(stderr);
            fl_die("option %s needs a value", k);
        }
        const char *v = argv[++i];
        char *end;
        double x = strtod(v, &end);
        if (end == v || *end) fl_die("option %s: '%s' is not a number", k, v);
        if (!strcmp(k, "--B"))
            a->B = (int)x;
        else if (!strcmp(k, "--T"))
            a->T = (int)x;
        else if (!strcmp(k, "--steps"))
            a->steps = (int)x;
        else if (!strcmp(k, "--warmup"))
            a->warmup = (int)x;
        else if (!strcmp(k, "--threads"))
            a->threads = (int)x;
        else if (!strcmp(k, "--L"))
            a->L = (int)x;
        else if (!strcmp(k, "--C"))
            a->C = (int)x;
        else if (!strcmp(k, "--NH"))
            a->NH = (int)x;
        else if (!strcmp(k, "--V"))
            a->V = (int)x;
        else if (!strcmp(k, "--maxT"))
            a->maxT = (int)x;
        else if (!strcmp(k, "--peak"))
            a->peak = x;
        else if (!strcmp(k, "--seed"))
            a->seed = (uint64_t)x;
        else if (!strcmp(k, "--mem-report"))
            a->mem_report = (int)x;
        else {
            usage(stderr);
            fl_die("unknown option %s", k);
        }
    }
    if (a->B < 1 || a->T < 1 || a->steps < 1 || a->warmup < 0 || a->threads < 1)
        fl_die("--B, --T, --steps, --threads must be >= 1 and --warmup >= 0");
    if (a->T > a->maxT) fl_die("--T %d exceeds --maxT %d", a->T, a->maxT);
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median(const double *v, int n) {
    double *s = malloc(sizeof(double) * (size_t)n);
    if (!s) fl_die("out of memory");
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    double m = n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
    free(s);
    return m;
}

static double vmin(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
    return m;
}

static double vmax(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

int main(int argc, char **argv) {
    bench_args a;
    parse(&a, argc, argv);
    fl_set_threads(a.threads);

    fl_gpt2_config cfg = {
        .max_seq_len = a.maxT, .vocab_size = a.V, .n_layer = a.L, .n_head = a.NH, .n_embd = a.C};
    fl_gpt2_config_finish(&cfg);

    double L = a.L, C = a.C, V = a.V, T = a.T;
    double flops_per_token = 6.0 * (12.0 * L * C * C + V * C) + 12.0 * L * T * C;
    double tokens_per_step = (double)a.B * a.T;

    const char *isa = "given";
    if (!(a.peak > 0.0)) {
        fma_peak_isa pisa = fma_peak_pick_isa();
        isa = fma_peak_isa_name(pisa);
        a.peak = fma_peak_gflops(pisa, a.threads, 0.3, 5, NULL, NULL);
    }

    printf("fitlm train bench: GPT-2 L=%d C=%d NH=%d V=%d (padded %d) maxT=%d | B=%d T=%d | "
           "%d threads | %d warm-up + %d timed steps\n",
           a.L, a.C, a.NH, a.V, cfg.padded_vocab_size, a.maxT, a.B, a.T, a.threads, a.warmup,
           a.steps);
    printf("step = zero_grad + forward + backward + clip_grad_norm(1.0) + AdamW(lr 1e-4, betas "
           "0.9/0.95, eps 1e-8, wd 0.1)\n");
    printf("FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C = %.4g; peak %.1f GFLOP/s (%s)\n",
           flops_per_token, a.peak, isa);
    fflush(stdout);

    double t_init = fl_now();
    fl_gpt2 model;
    fl_gpt2_init(&model, &cfg, a.seed);
    fl_gpt2_alloc_acts(&model, a.B, a.T);
    fl_adamw opt;
    fl_adamw_init(&opt, model.table.numel, 0.9f, 0.95f, 1e-8f, 0.1f);
    printf("%zu parameters (%.2f M, padded vocabulary included); init %.2f s\n", model.table.numel,
           model.table.numel / 1e6, fl_now() - t_init);

    // random tokens: one sequence of B*T+1, inputs and targets shifted by one
    size_t n = (size_t)a.B * a.T;
    int *tokens = fl_alloc(FL_MEM_OTHER, (n + 1) * sizeof(int));
    fl_rng rng;
    fl_rng_seed(&rng, a.seed ^ 0xb3ac4ull);
    for (size_t i = 0; i <= n; i++) tokens[i] = (int)fl_rng_below(&rng, (uint64_t)a.V);
    const int *inputs = tokens, *targets = tokens + 1;

    int total = a.warmup + a.steps;
    double *ms = calloc((size_t)a.steps, sizeof(double));
    double *ms_fwd = calloc((size_t)a.steps, sizeof(double));
    double *ms_bwd = calloc((size_t)a.steps, sizeof(double));
    double *ms_opt = calloc((size_t)a.steps, sizeof(double));
    if (!ms || !ms_fwd || !ms_bwd || !ms_opt) fl_die("out of memory");
    float first_loss = 0.0f, last_loss = 0.0f;
    for (int s = 0; s < total; s++) {
        double t0 = fl_now();
        fl_gpt2_zero_grad(&model);
        float loss = fl_gpt2_forward(&model, inputs, targets, a.B, a.T);
        double t1 = fl_now();
        fl_gpt2_backward(&model, 1.0f);
        double t2 = fl_now();
        float norm = fl_clip_grad_norm(model.grads, model.table.numel, 1.0f);
        fl_adamw_step(&opt, &model.table, model.params, model.grads, 1e-4f);
        double t3 = fl_now();
        if (s == 0) first_loss = loss;
        last_loss = loss;
        int timed = s - a.warmup;
        printf("step %2d/%d %-7s | loss %.4f | norm %.3f | %.1f ms (fwd %.1f, bwd %.1f, "
               "clip+adamw %.1f)\n",
               s + 1, total, timed < 0 ? "warm-up" : "", loss, norm, (t3 - t0) * 1e3,
               (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3);
        fflush(stdout);
        if (timed >= 0) {
            ms[timed] = (t3 - t0) * 1e3;
            ms_fwd[timed] = (t1 - t0) * 1e3;
            ms_bwd[timed] = (t2 - t1) * 1e3;
            ms_opt[timed] = (t3 - t2) * 1e3;
        }
    }

    double med = median(ms, a.steps), lo = vmin(ms, a.steps), hi = vmax(ms, a.steps);
    double tok_s = tokens_per_step / (med / 1e3);
    double gflops = flops_per_token * tok_s / 1e9;
    double mfu = gflops / a.peak;
    double rss_mib = fl_mem_peak_rss() / 1048576.0;
    double tagged_mib = fl_mem_total_peak() / 1048576.0;
    if (a.mem_report) fl_mem_report(stdout);
    printf("median %.1f ms/step (min %.1f, max %.1f; fwd %.1f, bwd %.1f, clip+adamw %.1f) | "
           "%.1f tok/s | %.1f GFLOP/s | MFU %.1f%% of %.1f | peak RSS %.0f MiB (tagged %.0f)\n",
           med, lo, hi, median(ms_fwd, a.steps), median(ms_bwd, a.steps), median(ms_opt, a.steps),
           tok_s, gflops, 100.0 * mfu, a.peak, rss_mib, tagged_mib);
    printf("RESULT engine=fitlm B=%d T=%d threads=%d steps=%d warmup=%d ms_median=%.2f "
           "ms_min=%.2f ms_max=%.2f ms_fwd=%.2f ms_bwd=%.2f ms_opt=%.2f tok_s=%.2f "
           "flops_per_token=%.0f gflops=%.2f peak_gflops=%.1f mfu=%.4f peak_rss_mib=%.0f "
           "loss_first=%.4f loss_last=%.4f\n",
           a.B, a.T, a.threads, a.steps, a.warmup, med, lo, hi, median(ms_fwd, a.steps),
           median(ms_bwd, a.steps), median(ms_opt, a.steps), tok_s, flops_per_token, gflops, a.peak,
           mfu, rss_mib, first_loss, last_loss);

    free(ms);
    free(ms_fwd);
    free(ms_bwd);
    free(ms_opt);
    fl_free(tokens);
    fl_adamw_free(&opt);
    fl_gpt2_free(&model);
    return 0;
}
