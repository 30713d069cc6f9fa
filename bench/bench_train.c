// bench_train.c: training throughput of fitlm on a GPT-2 shape (default:
// GPT-2 124M, L=12 C=768 NH=12 V=50257 maxT=1024), random weights and one
// batch of GPT-2 tokens of the Brown corpus (the first B windows of
// data/brown_gpt2/train_000000.bin, as torch_gpt2.py reads them), in fp32, bf16 or fp16 (mixed
// precision: 16-bit weights, activations and gradients, fp32 master weights and AdamW state). A
// step is the full training step as `fitlm train` drives it, through fl_optimizer: zero_grad,
// forward, backward, then the optimizer step (fp16 overflow check, gradient norm, clip to 1.0
// folded into AdamW, master update, rounding into the 16-bit weights, loss-scale update).
//
//   bench_train --B 8 --T 256 --steps 7 --warmup 2 --threads 2 --precision bf16
//               [--peak GFLOPS] [--peak-bf16 GFLOPS] [--peak-amx GFLOPS]
//
// Reports ms/step (median, min, max over --steps timed steps after --warmup
// untimed ones), tokens/s, achieved GFLOP/s with
//     FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C
// (6 x the non-embedding weights plus the tied LM head, forward + backward,
// plus the attention score/value products; the padded vocabulary, layernorm,
// GELU, softmax and the optimizer are not counted), MFU and the process's
// peak RSS, and the per-op profile of the timed steps (fitlm/profile.h, as
// `fitlm train --profile` prints it). MFU is quoted against the fp32 FMA
// peak (--peak) for fp32 and against the bf16 dot-product (vdpbf16ps) peak
// (--peak-bf16) for bf16 and fp16 (the fp32 peak on a CPU without
// AVX512_BF16); the other peaks' MFUs (and the AMX-BF16 peak's, --peak-amx)
// are printed too. A peak that is not given (or 0) is measured here with
// --threads threads, as peak_fma does; --peak-amx -1 skips the AMX one.
//
// The last line is machine-readable: "RESULT engine=fitlm precision=... key=value ...".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/model.h"
#include "fitlm/config.h"
#include "fitlm/train.h"
#include "fitlm/data.h"
#include "fitlm/optim.h"
#include "fitlm/profile.h"
#include "fma_peak.h"

typedef struct {
    int B, T, steps, warmup, threads;
    int L, C, NH, V, maxT;
    double peak, peak_bf16, peak_amx; // GFLOP/s; 0 = measure (peak_amx < 0: skip)
    fl_dtype precision;
    uint64_t seed;
    int mem_report;
    const char *data; // token shards; the batch is their first B windows
} bench_args;

static void usage(FILE *out) {
    fprintf(out, "usage: bench_train [--B 4] [--T 64] [--steps 5] [--warmup 2] [--threads 2]\n"
                 "                   [--precision fp32|bf16|fp16] [--peak GFLOPS]\n"
                 "                   [--peak-bf16 GFLOPS] [--peak-amx GFLOPS] [--L 12] [--C 768]\n"
                 "                   [--NH 12] [--V 50257] [--maxT 1024] [--seed 1337]\n"
                 "                   [--mem-report 0|1] [--data data/brown_gpt2]\n"
                 "  --peak, --peak-bf16, --peak-amx: fp32 FMA, bf16 dot-product and AMX-BF16\n"
                 "  peaks for MFU (from peak_fma); 0 or absent = measure here (--peak-amx -1:\n"
                 "  skip). MFU is against --peak for fp32, --peak-bf16 for bf16 and fp16.\n");
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
                      .precision = FL_F32,
                      .seed = 1337,
                      .data = "data/brown_gpt2"};
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
        if (!strcmp(k, "--precision")) {
            if (!strcmp(v, "fp32"))
                a->precision = FL_F32;
            else if (!strcmp(v, "bf16"))
                a->precision = FL_BF16;
            else if (!strcmp(v, "fp16"))
                a->precision = FL_F16;
            else
                fl_die("--precision: '%s' is not fp32, bf16 or fp16", v);
            continue;
        }
        if (!strcmp(k, "--data")) {
            a->data = v;
            continue;
        }
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
        else if (!strcmp(k, "--peak-bf16"))
            a->peak_bf16 = x;
        else if (!strcmp(k, "--peak-amx"))
            a->peak_amx = x;
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

// A peak given on the command line, or measured here (0 when the CPU lacks
// the loop); *how receives "given", the loop's name or "n/a".
static double peak_of(double given, fma_peak_isa isa, int threads, const char **how) {
    if (given > 0.0) {
        *how = "given";
        return given;
    }
    if (given < 0.0 || !fma_peak_has(isa)) {
        *how = "n/a";
        return 0.0;
    }
    *how = fma_peak_isa_name(isa);
    return fma_peak_gflops(isa, threads, 0.3, 5, NULL, NULL);
}

int main(int argc, char **argv) {
    bench_args a;
    parse(&a, argc, argv);
    fl_set_threads(a.threads);
    const char *prec = fl_dtype_name(a.precision);

    fl_model_config cfg = {
        .max_seq_len = a.maxT, .vocab_size = a.V, .n_layer = a.L, .n_head = a.NH, .n_embd = a.C};
    fl_model_config_finish(&cfg);

    double L = a.L, C = a.C, V = a.V, T = a.T;
    double flops_per_token = 6.0 * (12.0 * L * C * C + V * C) + 12.0 * L * T * C;
    double tokens_per_step = (double)a.B * a.T;

    // the peaks: fp32 FMA, bf16 dot product (vdpbf16ps), AMX-BF16 tiles
    const char *how_fp32, *how_bf16, *how_amx;
    double peak_fp32 = peak_of(a.peak, fma_peak_pick_isa(), a.threads, &how_fp32);
    double peak_bf16 = peak_of(a.peak_bf16, FMA_PEAK_BF16_DP, a.threads, &how_bf16);
    double peak_amx = peak_of(a.peak_amx, FMA_PEAK_AMX_BF16, a.threads, &how_amx);
    // MFU's denominator: the peak of the precision's arithmetic (the fp32
    // one on a CPU without AVX512_BF16)
    int use_bf16_peak = a.precision != FL_F32 && peak_bf16 > 0.0;
    double peak = use_bf16_peak ? peak_bf16 : peak_fp32;
    const char *peak_kind = use_bf16_peak ? "bf16" : "fp32";

    printf("fitlm train bench: GPT-2 L=%d C=%d NH=%d V=%d (padded %d) maxT=%d | B=%d T=%d | "
           "%s | %d threads | %d warm-up + %d timed steps\n",
           a.L, a.C, a.NH, a.V, cfg.padded_vocab_size, a.maxT, a.B, a.T, prec, a.threads, a.warmup,
           a.steps);
    printf("step = zero_grad + forward + backward + fl_optimizer step: clip_grad_norm(1.0) + "
           "AdamW(lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1)%s\n",
           a.precision == FL_F32   ? ""
           : a.precision == FL_F16 ? " on fp32 master weights, dynamic loss scale"
                                   : " on fp32 master weights");
    printf("FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C = %.4g\n", flops_per_token);
    printf("peaks (GFLOP/s, %d threads): fp32 FMA %.1f (%s), bf16 dot product %.1f (%s), AMX-BF16 "
           "%.1f (%s); MFU against the %s peak\n",
           a.threads, peak_fp32, how_fp32, peak_bf16, how_bf16, peak_amx, how_amx, peak_kind);
    if (!(peak > 0.0)) fl_die("no peak to quote MFU against: pass one with --peak");
    fflush(stdout);

    double t_init = fl_now();
    fl_model model;
    fl_model_init(&model, &cfg, a.precision, a.seed);
    fl_model_alloc_acts(&model, a.B, a.T, FL_RECOMPUTE_NONE, 0);
    // `fitlm train`'s defaults: AdamW betas 0.9/0.95, eps 1e-8, wd 0.1, clip
    // 1.0, no accumulation, DeepSpeed's fp16 loss-scaler settings
    fl_train_config defaults;
    fl_config_defaults(&defaults);
    fl_optimizer_config ocfg = fl_config_optimizer(&defaults);
    fl_optimizer opt;
    fl_optimizer_init(&opt, &ocfg, &model.table, a.precision, model.params, model.grads);
    printf("%zu parameters (%.2f M, padded vocabulary included); init %.2f s\n", model.table.numel,
           model.table.numel / 1e6, fl_now() - t_init);

    // the first B windows of the data, in order: the batch torch_gpt2.py reads
    size_t n = (size_t)a.B * a.T;
    int *inputs = fl_alloc(FL_MEM_OTHER, n * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, n * sizeof(int));
    fl_loader data;
    fl_loader_open(&data, a.data, "train", a.T, 0, 0, 0, 1);
    if ((int)data.vocab_size > a.V)
        fl_die("%s has a vocabulary of %u, more than --V %d", a.data, data.vocab_size, a.V);
    fl_loader_next(&data, inputs, targets, a.B);
    fl_loader_close(&data);

    int total = a.warmup + a.steps;
    double *ms = calloc((size_t)a.steps, sizeof(double));
    double *ms_fwd = calloc((size_t)a.steps, sizeof(double));
    double *ms_bwd = calloc((size_t)a.steps, sizeof(double));
    double *ms_opt = calloc((size_t)a.steps, sizeof(double));
    if (!ms || !ms_fwd || !ms_bwd || !ms_opt) fl_die("out of memory");
    float first_loss = 0.0f, last_loss = 0.0f, loss_scale = 1.0f;
    int skipped = 0, skipped_timed = 0;
    for (int s = 0; s < total; s++) {
        fl_profile_enable(s >= a.warmup);
        double t0 = fl_now();
        FL_PROFILE(FL_OP_ZERO_GRAD, FL_STEP, 0.0, fl_optimizer_zero_grad(&opt));
        float loss = fl_model_forward(&model, inputs, targets, a.B, a.T);
        double t1 = fl_now();
        fl_model_backward(&model, fl_optimizer_scale(&opt) / model.n_targets);
        double t2 = fl_now();
        fl_step_result r;
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_micro_done(&opt));
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, r = fl_optimizer_step(&opt, 1e-4f));
        double t3 = fl_now();
        if (fl_profile_on) fl_profile_step(t3 - t0);
        fl_profile_enable(0);
        if (s == 0) first_loss = loss;
        last_loss = loss;
        loss_scale = r.loss_scale;
        skipped += r.skipped;
        int timed = s - a.warmup;
        printf("step %2d/%d %-7s | loss %.4f | norm %.3f | %.1f ms (fwd %.1f, bwd %.1f, "
               "clip+adamw %.1f)",
               s + 1, total, timed < 0 ? "warm-up" : "", loss, r.grad_norm, (t3 - t0) * 1e3,
               (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3);
        if (a.precision == FL_F16)
            printf(" | scale %g%s", r.loss_scale, r.skipped ? " OVERFLOW, skipped" : "");
        printf("\n");
        fflush(stdout);
        if (timed >= 0) {
            ms[timed] = (t3 - t0) * 1e3;
            ms_fwd[timed] = (t1 - t0) * 1e3;
            ms_bwd[timed] = (t2 - t1) * 1e3;
            ms_opt[timed] = (t3 - t2) * 1e3;
            skipped_timed += r.skipped;
        }
    }

    double med = median(ms, a.steps), lo = vmin(ms, a.steps), hi = vmax(ms, a.steps);
    double tok_s = tokens_per_step / (med / 1e3);
    double gflops = flops_per_token * tok_s / 1e9;
    double mfu = gflops / peak;
    double mfu_fp32 = peak_fp32 > 0.0 ? gflops / peak_fp32 : 0.0;
    double mfu_bf16 = peak_bf16 > 0.0 ? gflops / peak_bf16 : 0.0;
    double mfu_amx = peak_amx > 0.0 ? gflops / peak_amx : 0.0;
    double rss_mib = fl_mem_peak_rss() / 1048576.0;
    double tagged_mib = fl_mem_total_peak() / 1048576.0;
    if (a.mem_report) fl_mem_report(stdout);
    fl_profile_print(stdout);
    printf("median %.1f ms/step (min %.1f, max %.1f; fwd %.1f, bwd %.1f, clip+adamw %.1f) | "
           "%.1f tok/s | %.1f GFLOP/s | MFU %.1f%% of the %s peak %.1f (fp32 %.1f%%, bf16 %.1f%%, "
           "AMX %.1f%%) | peak RSS %.0f MiB (tagged %.0f)",
           med, lo, hi, median(ms_fwd, a.steps), median(ms_bwd, a.steps), median(ms_opt, a.steps),
           tok_s, gflops, 100.0 * mfu, peak_kind, peak, 100.0 * mfu_fp32, 100.0 * mfu_bf16,
           100.0 * mfu_amx, rss_mib, tagged_mib);
    if (a.precision == FL_F16)
        printf(" | %d of %d steps skipped (%d timed)", skipped, total, skipped_timed);
    printf("\n");
    printf("RESULT engine=fitlm precision=%s B=%d T=%d threads=%d steps=%d warmup=%d "
           "ms_median=%.2f ms_min=%.2f ms_max=%.2f ms_fwd=%.2f ms_bwd=%.2f ms_opt=%.2f "
           "tok_s=%.2f flops_per_token=%.0f gflops=%.2f peak=%s peak_gflops=%.1f mfu=%.4f "
           "peak_fp32_gflops=%.1f peak_bf16_gflops=%.1f peak_amx_gflops=%.1f mfu_fp32=%.4f "
           "mfu_bf16=%.4f mfu_amx=%.4f peak_rss_mib=%.0f tagged_mib=%.0f loss_first=%.4f "
           "loss_last=%.4f skipped=%d loss_scale=%g\n",
           prec, a.B, a.T, a.threads, a.steps, a.warmup, med, lo, hi, median(ms_fwd, a.steps),
           median(ms_bwd, a.steps), median(ms_opt, a.steps), tok_s, flops_per_token, gflops,
           peak_kind, peak, mfu, peak_fp32, peak_bf16, peak_amx, mfu_fp32, mfu_bf16, mfu_amx,
           rss_mib, tagged_mib, first_loss, last_loss, skipped, loss_scale);

    free(ms);
    free(ms_fwd);
    free(ms_bwd);
    free(ms_opt);
    fl_free(inputs);
    fl_free(targets);
    fl_optimizer_free(&opt);
    fl_model_free(&model);
    return 0;
}
