// bench_gpu_gemm.c: the best cuBLASLt rate on a training step's own GEMM
// shapes, on the GPU. For each distinct linear of the model (the LM head
// once a step, the others once a block; fl_model_gemm_shapes) and N = B*T rows,
// its three GEMMs (forward, input gradient, weight gradient) as fitlm
// issues them (src/cuda/matmul.cu), under each of cuBLASLt's first
// --algos heuristic algorithms: the fastest is the shape's best, the first
// is fitlm's own choice. The step's GEMM-bound time is the sum of the
// bests; bench/gpu.sh divides a run's model FLOP rate by this bound's rate
// (MFU against the best cuBLASLt rate, measured in the same run).
// Attention's products are inside its kernel, not counted.
//
// usage: bench_gpu_gemm --model NAME [--arch gpt2|llama] --vocab V [--B 16]
//                       [--T 1024] [--precision bf16|fp16|fp32] [--algos 8]
//                       [--rounds 10]
// Prints a markdown table, then one line:
//   RESULT gemm_flops_step=F gemm_bound_ms=MS gemm_best_tflops=R gemm_fitlm_ms=MS
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/device.h"
#include "fitlm/dtype.h"
#include "fitlm/model.h"
#include "cuda.h"

static const char *gemm_names[3] = {"forward", "input grad", "weight grad"};

static void usage(void) {
    fprintf(stderr, "usage: bench_gpu_gemm --model NAME [--arch gpt2|llama] --vocab V [--B 16] "
                    "[--T 1024] [--precision bf16|fp16|fp32] [--algos 8] [--rounds 10]\n");
    exit(2);
}

// n values of dt into device buffer p: one chunk of random values in
// [-1, 1), uploaded over and over (a GEMM's speed wants values that are not
// all zero, not a fresh draw for each of a billion)
static void fill(const fl_device *d, fl_dtype dt, void *p, size_t n, fl_rng *rng) {
    enum { CHUNK = 1 << 22 };
    float *x = malloc(CHUNK * sizeof(float));
    void *h = malloc(CHUNK * sizeof(float));
    FL_ASSERT(x && h);
    for (size_t i = 0; i < CHUNK; i++) x[i] = 2.0f * fl_rng_uniform(rng) - 1.0f;
    fl_convert(dt, h, FL_F32, x, CHUNK);
    size_t es = fl_dtype_size(dt);
    for (size_t at = 0; at < n; at += CHUNK)
        fl_dev_upload(d, (char *)p + at * es, h, (n - at < CHUNK ? n - at : CHUNK) * es);
    free(x), free(h);
}

int main(int argc, char **argv) {
    const char *model = NULL, *arch = NULL, *prec = "bf16";
    int B = 16, T = 1024, V = 0, algos = 8, rounds = 10;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--model"))
            model = v;
        else if (!strcmp(k, "--arch"))
            arch = v;
        else if (!strcmp(k, "--precision"))
            prec = v;
        else if (!strcmp(k, "--vocab"))
            V = atoi(v);
        else if (!strcmp(k, "--B"))
            B = atoi(v);
        else if (!strcmp(k, "--T"))
            T = atoi(v);
        else if (!strcmp(k, "--algos"))
            algos = atoi(v);
        else if (!strcmp(k, "--rounds"))
            rounds = atoi(v);
        else
            usage();
    }
    fl_dtype dt = !strcmp(prec, "bf16") ? FL_BF16 : !strcmp(prec, "fp16") ? FL_F16 : FL_F32;
    if (argc % 2 == 0 || !model || V <= 0 || B <= 0 || T <= 0 || algos < 1 || algos > 16 ||
        rounds < 1 || (dt == FL_F32 && strcmp(prec, "fp32")))
        usage();
    fl_model_config c;
    fl_model_preset(&c, model);
    if (arch) c.arch = !strcmp(arch, "llama") ? FL_ARCH_LLAMA : FL_ARCH_GPT2;
    c.vocab_size = V;
    fl_model_config_finish(&c);

    fl_gemm_shape shapes[FL_MAX_SLOTS];
    int ns = fl_model_gemm_shapes(&c, shapes), N = B * T, maxC = 0, maxOC = 0;
    for (int k = 0; k < ns; k++) {
        if (shapes[k].C > maxC) maxC = shapes[k].C;
        if (shapes[k].OC > maxOC) maxOC = shapes[k].OC;
    }

    const fl_device *d = fl_device_get("cuda");
    char line[256];
    d->describe(d, line, sizeof line);
    size_t es = fl_dtype_size(dt);
    void *out = d->alloc(d, FL_MEM_WORKSPACE, (size_t)N * maxOC * es);
    void *dout = d->alloc(d, FL_MEM_WORKSPACE, (size_t)N * maxOC * es);
    void *inp = d->alloc(d, FL_MEM_WORKSPACE, (size_t)N * maxC * es);
    void *dinp = d->alloc(d, FL_MEM_WORKSPACE, (size_t)N * maxC * es);
    void *w = d->alloc(d, FL_MEM_WORKSPACE, (size_t)maxOC * maxC * es);
    void *dw = d->alloc(d, FL_MEM_WORKSPACE, (size_t)maxOC * maxC * es);
    void *ws = d->alloc(d, FL_MEM_WORKSPACE, fl_cuda_matmul_workspace_bytes(dt, N, maxC, maxOC));
    fl_rng rng;
    fl_rng_seed(&rng, 1234);
    fill(d, dt, inp, (size_t)N * maxC, &rng);
    fill(d, dt, dout, (size_t)N * maxOC, &rng);
    fill(d, dt, w, (size_t)maxOC * maxC, &rng);
    d->zero(d, dinp, (size_t)N * maxC * es);
    d->zero(d, dw, (size_t)maxOC * maxC * es);

    printf("GEMMs of a %s step (%s, N = B*T = %d) on %s: each of cuBLASLt's first %d algorithms, "
           "the mean of %d calls after one\n\n",
           model, fl_dtype_name(dt), N, line, algos, rounds);
    printf("| linear | N | C | OC | calls/step | GEMM | algorithms | best TFLOP/s | fitlm's "
           "TFLOP/s | best ms/step | fitlm's ms/step |\n|---|---|---|---|---|---|---|---|---|---|"
           "---|\n");
    double flops = 0.0, bound_ms = 0.0, fitlm_ms = 0.0;
    for (int k = 0; k < ns; k++) {
        const fl_gemm_shape *s = &shapes[k];
        double f = 2.0 * N * s->C * s->OC; // one GEMM's
        for (int g = 0; g < 3; g++) {
            double ms[16];
            int n = fl_cuda_matmul_algos_ms(dt, g, out, inp, w, dinp, dw, dout, ws, N, s->C, s->OC,
                                            algos, rounds, ms);
            double best = ms[0];
            for (int i = 1; i < n; i++)
                if (ms[i] < best) best = ms[i];
            flops += f * s->calls, bound_ms += best * s->calls, fitlm_ms += ms[0] * s->calls;
            printf("| %s | %d | %d | %d | %d | %s | %d | %.1f | %.1f | %.3f | %.3f |\n", s->ops, N,
                   s->C, s->OC, s->calls, gemm_names[g], n, f / best / 1e9, f / ms[0] / 1e9,
                   best * s->calls, ms[0] * s->calls);
        }
    }
    printf("\nGEMM FLOPs a step %.4g: GEMM-bound %.2f ms at the best algorithms (%.1f TFLOP/s), "
           "%.2f ms at fitlm's\n",
           flops, bound_ms, flops / bound_ms / 1e9, fitlm_ms);
    printf("RESULT gemm_flops_step=%.6g gemm_bound_ms=%.6g gemm_best_tflops=%.6g "
           "gemm_fitlm_ms=%.6g\n",
           flops, bound_ms, flops / bound_ms / 1e9, fitlm_ms);
    void *bufs[] = {out, dout, inp, dinp, w, dw, ws};
    for (int i = 0; i < 7; i++) d->free(d, bufs[i]);
    return 0;
}
