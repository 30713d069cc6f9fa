// bench_gpu_attention.c: the CUDA backend's causal attention alone, on the
// GPU: the forward and the backward (D's pass and both kernels) of one
// layer at a model's shape, timed between device events (the mean of
// --rounds calls after one), under each version of the tensor-core kernels
// (FITLM_CUDA_ATTENTION=mma, the default, and wmma; under grouped-query
// attention the mma backward also without its workspace, a kv head's
// blocks running its group's query heads in turn, as kernels=mma-kvhead).
// Rates count the
// causal FLOPs FlashAttention's benchmarks count: 2 B NH T^2 HS forward
// (two products over half the score matrix), 2.5 times that backward.
// bench/gpu.sh runs it beside PyTorch's scaled_dot_product_attention on
// the same shapes (bench/torch_attention.py).
//
// usage: bench_gpu_attention --B 16 --T 1024 --NH 12 [--NKV 12] --HS 64
//                            [--precision bf16|fp16] [--rounds 20]
// Prints one line per version:
//   RESULT kernels=K fwd_ms=MS bwd_ms=MS fwd_tflops=R bwd_tflops=R
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/device.h"
#include "fitlm/dtype.h"

static void usage(void) {
    fprintf(stderr, "usage: bench_gpu_attention --B 16 --T 1024 --NH 12 [--NKV 12] --HS 64 "
                    "[--precision bf16|fp16] [--rounds 20]\n");
    exit(2);
}

// n random values in [-1, 1) of dt into device buffer p
static void fill(const fl_device *d, fl_dtype dt, void *p, size_t n, fl_rng *rng) {
    float *x = malloc(n * sizeof(float));
    void *h = malloc(n * fl_dtype_size(dt));
    FL_ASSERT(x && h);
    for (size_t i = 0; i < n; i++) x[i] = 2.0f * fl_rng_uniform(rng) - 1.0f;
    fl_convert(dt, h, FL_F32, x, n);
    fl_dev_upload(d, p, h, n * fl_dtype_size(dt));
    free(x), free(h);
}

typedef struct {
    const fl_device *d;
    fl_dtype dt;
    int B, T, NH, NKV, HS;
    void *qkv, *out, *dout, *dqkv;
    float *lse, *ws; // ws: the backend's attention workspace, or NULL
} att_bufs;

static void forward(const att_bufs *a) {
    a->d->attention_forward(a->dt, a->out, a->lse, a->qkv, a->ws, a->B, a->T, a->NH, a->NKV, a->HS);
}

static void backward(const att_bufs *a) {
    a->d->attention_backward(a->dt, a->dqkv, a->dout, a->qkv, a->out, a->lse, a->ws, a->B, a->T,
                             a->NH, a->NKV, a->HS);
}

// the mean ms of `rounds` calls after one
static double time_ms(const att_bufs *a, void (*call)(const att_bufs *), int rounds) {
    call(a);
    fl_event *e0 = a->d->event_record_timed(a->d, NULL);
    for (int i = 0; i < rounds; i++) call(a);
    fl_event *e1 = a->d->event_record_timed(a->d, NULL);
    a->d->sync(a->d);
    double ms = a->d->event_elapsed_ms(a->d, e0, e1) / rounds;
    a->d->event_destroy(a->d, e0);
    a->d->event_destroy(a->d, e1);
    return ms;
}

int main(int argc, char **argv) {
    const char *prec = "bf16";
    int B = 0, T = 0, NH = 0, NKV = 0, HS = 0, rounds = 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--B"))
            B = atoi(v);
        else if (!strcmp(k, "--T"))
            T = atoi(v);
        else if (!strcmp(k, "--NH"))
            NH = atoi(v);
        else if (!strcmp(k, "--NKV"))
            NKV = atoi(v);
        else if (!strcmp(k, "--HS"))
            HS = atoi(v);
        else if (!strcmp(k, "--precision"))
            prec = v;
        else if (!strcmp(k, "--rounds"))
            rounds = atoi(v);
        else
            usage();
    }
    if (!NKV) NKV = NH;
    fl_dtype dt = !strcmp(prec, "bf16") ? FL_BF16 : !strcmp(prec, "fp16") ? FL_F16 : FL_F32;
    if (argc % 2 == 0 || B <= 0 || T <= 0 || NH <= 0 || NKV <= 0 || NH % NKV || HS <= 0 ||
        rounds < 1 || dt == FL_F32)
        usage();
    char why[256] = "";
    const fl_device *d = fl_device_cuda_table(why, sizeof why);
    if (!d) {
        fprintf(stderr, "bench_gpu_attention: no GPU: %s\n", why);
        return 1;
    }
    char line[256];
    d->describe(d, line, sizeof line);
    size_t es = fl_dtype_size(dt), N = (size_t)B * T, W = (size_t)(NH + 2 * NKV) * HS,
           C = (size_t)NH * HS;
    att_bufs a = {d, dt, B, T, NH, NKV, HS, NULL, NULL, NULL, NULL, NULL, NULL};
    a.qkv = d->alloc(d, FL_MEM_WORKSPACE, N * W * es);
    a.dqkv = d->alloc(d, FL_MEM_WORKSPACE, N * W * es);
    a.out = d->alloc(d, FL_MEM_WORKSPACE, N * C * es);
    a.dout = d->alloc(d, FL_MEM_WORKSPACE, N * C * es);
    a.lse = d->alloc(d, FL_MEM_WORKSPACE, (size_t)B * NH * T * sizeof(float));
    size_t sb = d->scratch_bytes((int)N, (int)C, NH);
    void *scratch = sb ? d->alloc(d, FL_MEM_WORKSPACE, sb) : NULL;
    if (scratch) d->scratch_lend(d, scratch, sb);
    fl_rng rng;
    fl_rng_seed(&rng, 1234);
    fill(d, dt, a.qkv, N * W, &rng);
    fill(d, dt, a.dout, N * C, &rng);

    double fwd_flops = 2.0 * B * NH * (double)T * T * HS, bwd_flops = 2.5 * fwd_flops;
    printf("causal attention, B %d T %d NH %d NKV %d HS %d, %s, on %s: the mean of %d calls "
           "after one\n",
           B, T, NH, NKV, HS, fl_dtype_name(dt), line, rounds);
    // the versions: the mma kernels with the workspace the backend asks
    // for, and (grouped-query attention) without it; the wmma kernels
    const struct {
        const char *name, *env;
        int ws;
    } versions[] = {{"mma", "mma", 1}, {"mma-kvhead", "mma", 0}, {"wmma", "wmma", 1}};
    for (int k = 0; k < 3; k++) {
        if (!versions[k].ws && NKV == NH) continue; // the same kernels as mma's
        setenv("FITLM_CUDA_ATTENTION", versions[k].env, 1);
        size_t wf =
            versions[k].ws ? d->attention_workspace_floats(dt, B, T, NH, HS, NH / NKV, 1) : 0;
        a.ws = wf ? d->alloc(d, FL_MEM_WORKSPACE, wf * sizeof(float)) : NULL;
        double f = time_ms(&a, forward, rounds), b = time_ms(&a, backward, rounds);
        printf("RESULT kernels=%s fwd_ms=%.4f bwd_ms=%.4f fwd_tflops=%.1f bwd_tflops=%.1f\n",
               versions[k].name, f, b, fwd_flops / f / 1e9, bwd_flops / b / 1e9);
        d->free(d, a.ws);
        a.ws = NULL;
    }
    unsetenv("FITLM_CUDA_ATTENTION");
    if (scratch) {
        if (d->scratch_return) d->scratch_return(d, scratch);
        d->free(d, scratch);
    }
    void *bufs[] = {a.qkv, a.dqkv, a.out, a.dout, a.lse};
    for (int i = 0; i < 5; i++) d->free(d, bufs[i]);
    return 0;
}
