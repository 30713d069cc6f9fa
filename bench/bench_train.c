// bench_train.c: training throughput of fitlm on a GPT-2 or LLaMA shape
// (default: GPT-2 124M, L=12 C=768 NH=12 V=50257 maxT=1024), random weights
// and one batch of GPT-2 tokens of the Brown corpus (the first B windows of
// data/brown_gpt2/train_000000.bin, as torch_gpt2.py reads them; a LLaMA
// shape reads the same GPT-2 tokens, with --V 50257, so that both engines
// train on the same batch), in fp32, bf16 or fp16 (mixed precision: 16-bit
// weights, activations and gradients, fp32 master weights and AdamW state).
// The model and optimizer are a run opened as `fitlm train` opens it
// (fl_run_open). A step is the full training step as it drives it, through
// fl_optimizer, timed phase by phase: zero_grad, forward, backward, then the optimizer step (fp16
// overflow check, gradient norm, clip to 1.0 folded into AdamW, master
// update, rounding into the 16-bit weights, loss-scale update).
//
//   bench_train --B 8 --T 256 --steps 7 --warmup 2 --threads 2 --precision bf16
//               [--arch gpt2|llama] [--kv-heads N] [--I N] [--tie 0|1]
//               [--peak GFLOPS] [--peak-bf16 GFLOPS] [--peak-amx GFLOPS] [--gemm-bound 0|1]
//
// Reports ms/step (median, min, max over --steps timed steps after --warmup
// untimed ones), tokens/s, achieved GFLOP/s with the architecture's
//     GPT-2: FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C
//     LLaMA: FLOPs/token = 6*(L*(2*C^2 + 2*C*KV + 3*C*I) + V*C) + 12*L*T*C
// (6 x the weights of the block matmuls plus the LM head, forward +
// backward, plus the attention score/value products; KV = kv_heads * C/NH
// (k and v), I = the SwiGLU hidden size (gate, up, down); the padded
// vocabulary, norms, activations, softmax and the optimizer are not
// counted), MFU, the process's peak RSS, the CPUs it kept busy over the
// timed steps (CPU seconds of all its threads / wall seconds: "cpus"), and
// the per-op profile of the timed steps (fitlm/profile.h, as `fitlm train
// --profile` prints it). MFU is quoted against the fp32 FMA peak (--peak)
// for fp32 and against the bf16 dot-product (vdpbf16ps) peak (--peak-bf16)
// for bf16 and fp16 (the fp32 peak on a CPU without AVX512_BF16); the other
// peaks' MFUs (and the AMX-BF16 peak's, --peak-amx) are printed too. A peak
// that is not given (or 0) is measured here with --threads threads, as
// peak_fma does; --peak-amx -1 skips the AMX one.
//
// --gemm-bound 1 (the default for fp32): after the timed steps, every GEMM
// of the step's linear units (the model driver's list: forward, input
// gradient, weight gradient, N = B*T rows) is timed alone, per distinct
// shape, through OpenBLAS cblas_sgemm called whole, oneDNN dnnl_sgemm and
// fitlm's matmul_forward/matmul_backward (after a warm-up, the best of 7
// rounds in which the three take turns). The
// GEMM-bound time of the step is the sum over its GEMMs of the faster
// library's time. Attention's score/value products run inside the
// flash-style attention kernel, not as linear GEMMs: they are left out.
//
// The last line is machine-readable: "RESULT engine=fitlm precision=... key=value ...".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include "fitlm/core.h"
#include "fitlm/model.h"
#include "fitlm/config.h"
#include "fitlm/data.h"
#include "fitlm/profile.h"
#include "fitlm/run.h"
#include "fma_peak.h"
#include "fitlm/kernels.h"
#include "../src/kernels/matmul_dnnl.h"

typedef struct {
    int B, T, steps, warmup, threads;
    int L, C, NH, V, maxT;
    fl_arch_kind arch;
    int kv_heads, hidden, tie;        // LLaMA only; 0 = fitlm's default (NH, 4C), LM head untied
    int gemm_bound;                   // -1 = on for fp32 runs
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
                 "                   [--arch gpt2|llama] [--kv-heads NH] [--I 4C] [--tie 0]\n"
                 "                   [--gemm-bound 0|1]\n"
                 "  --kv-heads, --I (SwiGLU hidden size), --tie (LM head = embedding): LLaMA\n"
                 "  only, 0 = fitlm's defaults. --gemm-bound: time the step's GEMMs alone through\n"
                 "  OpenBLAS, oneDNN and fitlm (default: on for fp32).\n"
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
                      .gemm_bound = -1,
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
        if (!strcmp(k, "--arch")) {
            if (fl_arch_parse(v, &a->arch)) fl_die("--arch: '%s' is not gpt2 or llama", v);
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
        else if (!strcmp(k, "--kv-heads"))
            a->kv_heads = (int)x;
        else if (!strcmp(k, "--I"))
            a->hidden = (int)x;
        else if (!strcmp(k, "--tie"))
            a->tie = (int)x;
        else if (!strcmp(k, "--gemm-bound"))
            a->gemm_bound = (int)x;
        else {
            usage(stderr);
            fl_die("unknown option %s", k);
        }
    }
    if (a->B < 1 || a->T < 1 || a->steps < 1 || a->warmup < 0 || a->threads < 1)
        fl_die("--B, --T, --steps, --threads must be >= 1 and --warmup >= 0");
    if (a->T > a->maxT) fl_die("--T %d exceeds --maxT %d", a->T, a->maxT);
    if (a->arch != FL_ARCH_LLAMA && (a->kv_heads || a->hidden || a->tie))
        fl_die("--kv-heads, --I and --tie are LLaMA's (--arch llama)");
    if (a->gemm_bound < 0) a->gemm_bound = a->precision == FL_F32;
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

// ----------------------------------------------------------------------------
// the GEMM-bound time of the step

enum { G_FWD, G_DINP, G_DW, NGEMM };       // forward, input gradient, weight gradient
enum { E_BLAS, E_DNNL, E_FITLM, NENGINE }; // OpenBLAS, oneDNN, fitlm's matmul
static const char *gemm_name[NGEMM] = {"fwd", "dinp", "dweight"};
enum { GEMM_ROUNDS = 7 }; // timed rounds per GEMM, each engine once per round

// One distinct (C, OC) shape of the step's linear units, with N = B*T
// rows, and its GEMMs' times: one call, best of GEMM_ROUNDS.
typedef struct {
    fl_gemm_shape s;
    double ms[NGEMM][NENGINE];
} gemm_shape;

// CPU seconds this process has run, all threads summed
static double process_cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float *rand_floats(size_t n, uint64_t seed) {
    float *x = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    if (!x) fl_die("out of memory");
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) x[i] = 0.02f * fl_rng_normal(&rng);
    return x;
}

// One GEMM of the shape through one engine, with the transposes and betas
// src/kernels/matmul.c uses (row-major; dinp and dweight accumulate).
static void gemm_run(int g, int e, int N, int C, int OC, float *inp, float *w, float *out,
                     float *dout, float *dinp, float *dw, void *ws) {
    if (e == E_FITLM) {
        if (g == G_FWD) matmul_forward(FL_F32, out, inp, w, NULL, ws, N, C, OC);
        if (g == G_DINP) matmul_backward(FL_F32, dinp, NULL, NULL, dout, inp, w, ws, N, C, OC);
        if (g == G_DW) matmul_backward(FL_F32, NULL, dw, NULL, dout, inp, w, ws, N, C, OC);
        return;
    }
    dnnl_status_t st = dnnl_success;
    if (g == G_FWD) { // out (N,OC) = inp (N,C) @ w (OC,C)^T
        if (e == E_BLAS)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, w, C, 0.0f,
                        out, OC);
        else
            st = dnnl_sgemm('N', 'T', N, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
    } else if (g == G_DINP) { // dinp (N,C) += dout (N,OC) @ w (OC,C)
        if (e == E_BLAS)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, w, C,
                        1.0f, dinp, C);
        else
            st = dnnl_sgemm('N', 'N', N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
    } else { // dw (OC,C) += dout (N,OC)^T @ inp (N,C)
        if (e == E_BLAS)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C,
                        1.0f, dw, C);
        else
            st = dnnl_sgemm('T', 'N', OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C);
    }
    if (st != dnnl_success) fl_die("dnnl_sgemm failed (status %d)", (int)st);
}

static void gemm_time(gemm_shape *shape, int N, uint64_t seed) {
    const fl_gemm_shape *s = &shape->s;
    size_t nc = (size_t)N * s->C, no = (size_t)N * s->OC, wc = (size_t)s->OC * s->C;
    float *inp = rand_floats(nc, seed), *w = rand_floats(wc, seed + 1);
    float *dout = rand_floats(no, seed + 2), *out = rand_floats(no, seed + 3);
    float *dinp = rand_floats(nc, seed + 4), *dw = rand_floats(wc, seed + 5);
    size_t ws_bytes = matmul_workspace_bytes(FL_F32, N, s->C, s->OC);
    void *ws = ws_bytes ? fl_alloc(FL_MEM_WORKSPACE, ws_bytes) : NULL;
    // the engines take turns, round by round, so that a burst of other load
    // on the machine slows all three rather than the one it happens to hit
    for (int g = 0; g < NGEMM; g++) {
        for (int e = 0; e < NENGINE; e++) {
            gemm_run(g, e, N, s->C, s->OC, inp, w, out, dout, dinp, dw, ws); // warm-up
            shape->ms[g][e] = 1e30;
        }
        for (int r = 0; r < GEMM_ROUNDS; r++)
            for (int e = 0; e < NENGINE; e++) {
                double t0 = fl_now();
                gemm_run(g, e, N, s->C, s->OC, inp, w, out, dout, dinp, dw, ws);
                double ms = (fl_now() - t0) * 1e3;
                shape->ms[g][e] = ms < shape->ms[g][e] ? ms : shape->ms[g][e];
            }
    }
    free(inp), free(w), free(dout), free(out), free(dinp), free(dw);
    if (ws) fl_free(ws);
}

typedef struct {
    double flops, bound_ms, fitlm_ms, profiled_flops;
} gemm_bound;

// Times the step's GEMMs and prints the table; the FLOPs per step the
// profile recorded (its GEMM slots) check the enumeration.
static gemm_bound gemm_bound_of(const fl_model *m, int B, int T, int steps) {
    const fl_model_config *c = &m->config;
    fl_gemm_shape found[FL_MAX_SLOTS];
    gemm_shape shapes[FL_MAX_SLOTS];
    int ns = fl_model_gemm_shapes(c, found), N = B * T; // the GEMMs the step runs
    for (int k = 0; k < ns; k++) shapes[k].s = found[k];
    gemm_bound r = {0};
    for (int op = FL_OP_MM_QKV; op <= FL_OP_MM_LMHEAD; op++) {
        const fl_op_stats *st = fl_profile_stats((fl_op)op);
        r.profiled_flops += (st->flops[FL_FWD] + st->flops[FL_BWD]) / steps;
    }
    printf("\nGEMM-bound time of the step (fp32, N = B*T = %d, %d threads; each GEMM alone, best "
           "of %d rounds after a warm-up, the three engines taking turns; attention's "
           "score/value products are inside the attention kernel, not counted):\n\n",
           N, fl_threads(), GEMM_ROUNDS);
    printf("| linear | N | C | OC | calls/step | GEMM | OpenBLAS GFLOP/s | oneDNN GFLOP/s | fitlm "
           "GFLOP/s | best ms/step | fitlm ms/step |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < ns; k++) {
        gemm_time(&shapes[k], N, 1000 + (uint64_t)k * 16);
        const fl_gemm_shape *s = &shapes[k].s;
        double f = 2.0 * N * s->C * s->OC; // one GEMM's FLOPs
        for (int g = 0; g < NGEMM; g++) {
            double *t = shapes[k].ms[g];
            double best = t[E_BLAS] < t[E_DNNL] ? t[E_BLAS] : t[E_DNNL];
            r.flops += f * s->calls;
            r.bound_ms += best * s->calls;
            r.fitlm_ms += t[E_FITLM] * s->calls;
            printf("| %s | %d | %d | %d | %d | %s | %.1f | %.1f | %.1f | %.2f | %.2f |\n", s->ops,
                   N, s->C, s->OC, s->calls, gemm_name[g], f / t[E_BLAS] / 1e6, f / t[E_DNNL] / 1e6,
                   f / t[E_FITLM] / 1e6, best * s->calls, t[E_FITLM] * s->calls);
        }
    }
    printf("\nGEMM FLOPs/step %.4g (the profile counted %.4g), GEMM-bound %.2f ms (%.1f GFLOP/s), "
           "fitlm's matmul alone %.2f ms\n",
           r.flops, r.profiled_flops, r.bound_ms, r.flops / r.bound_ms / 1e6, r.fitlm_ms);
    return r;
}

int main(int argc, char **argv) {
    fl_runtime_env(argv);
    bench_args a;
    parse(&a, argc, argv);
    fl_set_threads(a.threads);
    const char *prec = fl_dtype_name(a.precision);

    // as `fitlm train` builds a model: the shape, then the architecture's
    // defaults (LLaMA: n_kv_head = n_head, intermediate_size = 4C, RMSNorm
    // eps 1e-5, RoPE theta 1e4) and the padded vocabulary
    fl_model_config cfg = {.arch = a.arch,
                           .max_seq_len = a.maxT,
                           .vocab_size = a.V,
                           .n_layer = a.L,
                           .n_head = a.NH,
                           .n_kv_head = a.kv_heads,
                           .n_embd = a.C,
                           .intermediate_size = a.hidden,
                           .tie_embeddings = a.tie};
    fl_model_config_finish(&cfg);
    int llama = cfg.arch == FL_ARCH_LLAMA;

    double L = a.L, C = a.C, V = a.V, T = a.T, H = cfg.intermediate_size;
    double KV = (double)cfg.n_kv_head * (a.C / a.NH); // k's (and v's) width
    double flops_per_token =
        llama ? 6.0 * (L * (2.0 * C * C + 2.0 * C * KV + 3.0 * C * H) + V * C) + 12.0 * L * T * C
              : 6.0 * (12.0 * L * C * C + V * C) + 12.0 * L * T * C;
    double tokens_per_step = (double)a.B * a.T;

    // the peaks: fp32 FMA, bf16 dot product (vdpbf16ps), AMX-BF16 tiles
    const char *how_fp32, *how_bf16, *how_amx;
    double peak_fp32 = peak_of(a.peak, fma_peak_pick_isa(), a.threads, &how_fp32);
    double peak_bf16 = peak_of(a.peak_bf16, FMA_PEAK_BF16_DP, a.threads, &how_bf16);
    double peak_amx = peak_of(a.peak_amx, FMA_PEAK_AMX_BF16, a.threads, &how_amx);
    // MFU's denominator: the peak of the arithmetic the GEMMs run on (bf16
    // dot products where matmul takes oneDNN's native bf16, else fp32 FMAs)
    int use_bf16_peak = matmul_native_bf16(a.precision) && peak_bf16 > 0.0;
    double peak = use_bf16_peak ? peak_bf16 : peak_fp32;
    const char *peak_kind = use_bf16_peak ? "bf16" : "fp32";

    if (llama)
        printf("fitlm train bench: LLaMA L=%d C=%d NH=%d KV heads=%d SwiGLU I=%d V=%d (padded %d, "
               "GPT-2's vocabulary) maxT=%d LM head %s, RMSNorm eps %g, RoPE theta %g | B=%d T=%d "
               "| %s | %d threads | %d warm-up + %d timed steps\n",
               a.L, a.C, a.NH, cfg.n_kv_head, cfg.intermediate_size, a.V, cfg.padded_vocab_size,
               a.maxT, cfg.tie_embeddings ? "tied" : "untied", cfg.norm_eps, cfg.rope_theta, a.B,
               a.T, prec, a.threads, a.warmup, a.steps);
    else
        printf("fitlm train bench: GPT-2 L=%d C=%d NH=%d V=%d (padded %d) maxT=%d | B=%d T=%d | "
               "%s | %d threads | %d warm-up + %d timed steps\n",
               a.L, a.C, a.NH, a.V, cfg.padded_vocab_size, a.maxT, a.B, a.T, prec, a.threads,
               a.warmup, a.steps);
    printf("step = zero_grad + forward + backward + fl_optimizer step: clip_grad_norm(1.0) + "
           "AdamW(lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1)%s\n",
           a.precision == FL_F32   ? ""
           : a.precision == FL_F16 ? " on fp32 master weights, dynamic loss scale"
                                   : " on fp32 master weights");
    if (llama)
        printf("FLOPs/token = 6*(L*(2*C^2 + 2*C*KV + 3*C*I) + V*C) + 12*L*T*C with KV = %g, "
               "I = %g: %.4g\n",
               KV, H, flops_per_token);
    else
        printf("FLOPs/token = 6*(12*L*C^2 + V*C) + 12*L*T*C = %.4g\n", flops_per_token);
    printf("peaks (GFLOP/s, %d threads): fp32 FMA %.1f (%s), bf16 dot product %.1f (%s), AMX-BF16 "
           "%.1f (%s); MFU against the %s peak\n",
           a.threads, peak_fp32, how_fp32, peak_bf16, how_bf16, peak_amx, how_amx, peak_kind);
    printf("kernels: fitlm %s, GEMMs %s, OpenBLAS %s (attention's products without AVX2)\n",
           fl_isa_name(fl_cpu_isa()), matmul_gemm_name(a.precision), openblas_get_corename());
    if (!(peak > 0.0)) fl_die("no peak to quote MFU against: pass one with --peak");
    fflush(stdout);

    double t_init = fl_now();
    // the run as `fitlm train` opens it, on this shape, with its defaults:
    // AdamW betas 0.9/0.95, eps 1e-8, wd 0.1, clip 1.0, no accumulation,
    // DeepSpeed's fp16 loss-scaler settings; the batch is the bench's own
    fl_train_config tc;
    fl_config_defaults(&tc);
    strcpy(tc.model_preset, "tiny"); // the shape is set whole below
    fl_config_set_shape(&tc, &cfg, "bench_train's shape");
    snprintf(tc.precision, sizeof tc.precision, "%s", prec);
    tc.micro_batch = a.B;
    tc.seq_len = a.T;
    tc.seed = a.seed;
    tc.threads = a.threads;
    tc.sample_tokens = 0;
    tc.out_dir[0] = 0;
    fl_run run;
    fl_run_open(&run, &tc, &(fl_run_options){.own_batches = 1});
    fl_model *model = &run.model;
    fl_optimizer *opt = &run.optim;
    printf("%zu parameters (%.2f M, padded vocabulary included); init %.2f s\n", model->table.numel,
           model->table.numel / 1e6, fl_now() - t_init);

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
    long n_targets = fl_batch_targets(opt, targets, (size_t)a.B * a.T);
    double cpu_timed = 0.0, wall_timed = 0.0; // CPU seconds of all threads, wall seconds
    for (int s = 0; s < total; s++) {
        fl_profile_enable(s >= a.warmup);
        double c0 = process_cpu_s(), t0 = fl_now();
        size_t cleared = 0; // bytes, for the profile
        FL_PROFILE_IO(FL_OP_ZERO_GRAD, FL_STEP, 0.0, cleared,
                      cleared = fl_optimizer_zero_grad(opt));
        // as fl_train_step: the loss pass writes the logits' gradient too
        float dloss = fl_optimizer_scale(opt) / (float)n_targets;
        float loss = fl_model_forward_train(model, inputs, targets, a.B, a.T, dloss);
        double t1 = fl_now();
        fl_model_backward(model, dloss);
        double t2 = fl_now();
        fl_step_result r;
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_micro_done(opt));
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, r = fl_optimizer_step(opt, 1e-4f));
        double t3 = fl_now(), c3 = process_cpu_s();
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
            cpu_timed += c3 - c0;
            wall_timed += t3 - t0;
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
    // after RSS was read: the section's buffers are not the step's
    gemm_bound gb = {0};
    if (a.gemm_bound) gb = gemm_bound_of(model, a.B, a.T, a.steps);
    printf("median %.1f ms/step (min %.1f, max %.1f; fwd %.1f, bwd %.1f, clip+adamw %.1f) | "
           "%.1f tok/s | %.1f GFLOP/s | MFU %.1f%% of the %s peak %.1f (fp32 %.1f%%, bf16 %.1f%%, "
           "AMX %.1f%%) | peak RSS %.0f MiB (tagged %.0f)",
           med, lo, hi, median(ms_fwd, a.steps), median(ms_bwd, a.steps), median(ms_opt, a.steps),
           tok_s, gflops, 100.0 * mfu, peak_kind, peak, 100.0 * mfu_fp32, 100.0 * mfu_bf16,
           100.0 * mfu_amx, rss_mib, tagged_mib);
    if (a.precision == FL_F16)
        printf(" | %d of %d steps skipped (%d timed)", skipped, total, skipped_timed);
    if (a.gemm_bound)
        printf(" | %.2fx the GEMM-bound time %.2f ms", med / gb.bound_ms, gb.bound_ms);
    printf("\n");
    printf("RESULT engine=fitlm arch=%s precision=%s B=%d T=%d threads=%d steps=%d warmup=%d "
           "ms_median=%.2f ms_min=%.2f ms_max=%.2f ms_fwd=%.2f ms_bwd=%.2f ms_opt=%.2f "
           "tok_s=%.2f flops_per_token=%.0f gflops=%.2f peak=%s peak_gflops=%.1f mfu=%.4f "
           "peak_fp32_gflops=%.1f peak_bf16_gflops=%.1f peak_amx_gflops=%.1f mfu_fp32=%.4f "
           "mfu_bf16=%.4f mfu_amx=%.4f peak_rss_mib=%.0f tagged_mib=%.0f loss_first=%.4f "
           "loss_last=%.4f skipped=%d loss_scale=%g gemm=%s isa=%s openblas=%s params=%zu "
           "cpus=%.2f",
           fl_arch_name(cfg.arch), prec, a.B, a.T, a.threads, a.steps, a.warmup, med, lo, hi,
           median(ms_fwd, a.steps), median(ms_bwd, a.steps), median(ms_opt, a.steps), tok_s,
           flops_per_token, gflops, peak_kind, peak, mfu, peak_fp32, peak_bf16, peak_amx, mfu_fp32,
           mfu_bf16, mfu_amx, rss_mib, tagged_mib, first_loss, last_loss, skipped, loss_scale,
           matmul_gemm_name(a.precision), fl_isa_name(fl_cpu_isa()), openblas_get_corename(),
           model->table.numel, cpu_timed / wall_timed);
    if (llama)
        printf(" L=%d C=%d NH=%d kv_heads=%d I=%d V=%d tie=%d", a.L, a.C, a.NH, cfg.n_kv_head,
               cfg.intermediate_size, a.V, cfg.tie_embeddings);
    if (a.gemm_bound)
        printf(" gemm_flops_step=%.0f gemm_bound_ms=%.3f gemm_fitlm_ms=%.3f sgemm_best_gflops=%.2f "
               "step_vs_gemm_bound=%.4f",
               gb.flops, gb.bound_ms, gb.fitlm_ms, gb.flops / gb.bound_ms / 1e6, med / gb.bound_ms);
    printf("\n");

    free(ms);
    free(ms_fwd);
    free(ms_bwd);
    free(ms_opt);
    fl_free(inputs);
    fl_free(targets);
    fl_run_close(&run);
    return 0;
}
