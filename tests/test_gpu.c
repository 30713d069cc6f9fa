// test_gpu: every kernel entry of the cuda device's table against the cpu
// table (the oracle) on the same fixed-seed random inputs, at awkward sizes
// (V = 50257 padded to 50304, T = 77 and 200, 9 query heads over 3 kv
// heads, heads of 64 and 128 values, odd element counts), in fp32, bf16
// and fp16.
// Before each launch every output is poisoned (all bytes 0xFF: NaN in each
// dtype) and accumulated or in-place buffers reset to their start; NaN
// never passes. fp32 outputs must be within 1e-5 relative L2 error of the
// cpu's, 16-bit ones within 1e-2 (one rounding of the 16-bit result apart
// where the fp32 sums differ in order); LoRA's pieces, dropout, NF4 (of
// rows the cpu quantised, absmax plain and double quantised), convert and
// accumulate bitwise, LOMO's update too; the step's sums (sumsq, sum,
// sumsq_rows) within 1e-10
// (device.h: a fixed order of the device's own). On cuda the bf16
// attention cases run again with FITLM_CUDA_ATTENTION=wmma (both versions of
// the tensor-core kernels). Each entry runs twice on the device: the
// two results must be bitwise equal (no atomics, fixed orders).
//
// The backend's own scratch, as large as it asks for, serves its kernels;
// timed events time what the host waited; cuda measures its context.
//
// Exits 77 (CTest: skipped) when fl_device_cuda_table finds no backend or
// no GPU. `test_gpu test` runs the same checks on the test device (the
// cpu's kernels on memory the host cannot touch), which checks this
// program itself on any machine.
#include "fitlm/device.h"
#include "fitlm/kernels.h"
#include "fitlm/lora.h" // FL_DQ_BLOCK
#include "testlib.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_BUFS = 16 };

// One kernel call's buffers, each with its start (init), its host copy the
// cpu runs on, its device copy and the device's two results.
typedef struct {
    size_t bytes, n;
    fl_dtype dt; // of the values, for the comparison
    int compared, is_int;
    unsigned char *init, *host, *got[2];
    void *dev;
} tbuf;

typedef struct {
    const char *name;
    fl_dtype dt;
    const fl_device *d, *cpu;
    int side;  // 0: the cpu on host copies; 1, 2: the device, twice
    int exact; // every output, 16-bit ones too, must equal the cpu's values
    int nbuf;
    tbuf b[MAX_BUFS];
} tcase;

static const fl_device *dev; // the device under test

// the device under test is the CUDA emulator (tests/cuda_emu)
static int emulated(void) {
    char line[256];
    dev->describe(dev, line, sizeof line);
    return strstr(line, "CUDA emulator") != NULL;
}

// a GELU epilogue case's name: what runs
static const char *epilogue_case(const char *entry, int aligned) {
    static char name[160];
    snprintf(name, sizeof name, "%s (%s)", entry,
             getenv("FITLM_CUDA_EMU_NO_EPILOGUES") ? "no cuBLASLt algorithm: the two kernels"
             : aligned                             ? "the epilogue"
                       : "the aux's width not a multiple of 8: the two kernels");
    return name;
}

static tcase tc_new(const char *name, fl_dtype dt) {
    tcase t = {.name = name, .dt = dt, .d = dev, .cpu = fl_device_cpu_table()};
    return t;
}

static int tc_add(tcase *t, fl_dtype dt, size_t n, size_t elem, const void *init, int compared) {
    FL_ASSERT(t->nbuf < MAX_BUFS);
    tbuf *b = &t->b[t->nbuf];
    b->dt = dt, b->n = n, b->bytes = n * elem > 0 ? n * elem : 1, b->compared = compared;
    b->init = malloc(b->bytes), b->host = malloc(b->bytes);
    b->got[0] = malloc(b->bytes), b->got[1] = malloc(b->bytes);
    FL_ASSERT(b->init && b->host && b->got[0] && b->got[1]);
    if (init)
        memcpy(b->init, init, n * elem);
    else
        memset(b->init, 0xFF, b->bytes); // poison: NaN in fp32, bf16 and fp16
    b->dev = t->d->alloc(t->d, FL_MEM_WORKSPACE, b->bytes);
    return t->nbuf++;
}

// n random values in [-scale, scale) rounded to dt
static void *random_values(fl_dtype dt, size_t n, unsigned seed, float scale) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    void *v = malloc((n ? n : 1) * fl_dtype_size(dt));
    FL_ASSERT(x && v);
    t_fill(x, n, seed, scale);
    fl_convert(dt, v, FL_F32, x, n);
    free(x);
    return v;
}

static unsigned seed_counter = 1000; // a fresh draw for every buffer

// An input of n random values of dt (not compared)
static int tc_in(tcase *t, fl_dtype dt, size_t n, float scale) {
    void *v = random_values(dt, n, seed_counter++, scale);
    int i = tc_add(t, dt, n, fl_dtype_size(dt), v, 0);
    free(v);
    return i;
}

// An input of raw bytes (ids, targets, codes): not compared
static int tc_raw(tcase *t, const void *data, size_t bytes) {
    int i = tc_add(t, FL_F32, bytes, 1, data, 0);
    t->b[i].is_int = 1;
    return i;
}

// An output the kernel overwrites: poisoned, compared
static int tc_out(tcase *t, fl_dtype dt, size_t n) {
    return tc_add(t, dt, n, fl_dtype_size(dt), NULL, 1);
}

// A buffer the kernel accumulates into or changes in place: random start,
// compared
static int tc_acc(tcase *t, fl_dtype dt, size_t n, float scale) {
    int i = tc_in(t, dt, n, scale);
    t->b[i].compared = 1;
    return i;
}

// Starts side 0 (cpu), 1 or 2 (device): every buffer back to its start.
static const fl_device *tc_begin(tcase *t, int side) {
    t->side = side;
    for (int i = 0; i < t->nbuf; i++) {
        tbuf *b = &t->b[i];
        if (side == 0)
            memcpy(b->host, b->init, b->bytes);
        else
            fl_dev_upload(t->d, b->dev, b->init, b->bytes);
    }
    return side ? t->d : t->cpu;
}

static void *P(tcase *t, int i) {
    return t->side ? t->b[i].dev : (void *)t->b[i].host;
}

static void tc_end(tcase *t) {
    if (!t->side) return;
    t->d->sync(t->d);
    for (int i = 0; i < t->nbuf; i++)
        if (t->b[i].compared)
            fl_dev_download(t->d, t->b[i].got[t->side - 1], t->b[i].dev, t->b[i].bytes);
}

// Relative L2 error of got against want (fp32 copies of buffer b's values);
// any NaN or inf in got is +inf.
static double rel_l2(const tbuf *b, const void *got_raw, const void *want_raw) {
    float *got = malloc(b->n * sizeof(float)), *want = malloc(b->n * sizeof(float));
    FL_ASSERT(got && want);
    fl_convert(FL_F32, got, b->dt, got_raw, b->n);
    fl_convert(FL_F32, want, b->dt, want_raw, b->n);
    double num = 0.0, den = 0.0;
    int bad = 0;
    for (size_t i = 0; i < b->n; i++) {
        if (!isfinite(got[i]) || !isfinite(want[i])) bad = 1;
        double d = (double)got[i] - want[i];
        num += d * d, den += (double)want[i] * want[i];
    }
    free(got), free(want);
    if (bad) return INFINITY;
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double tol_of(fl_dtype dt) {
    return dt == FL_F32 ? 1e-5 : 1e-2;
}

// Compares every compared buffer (cpu vs device, device vs device) and frees.
static void tc_finish(tcase *t, double tol32) {
    for (int i = 0; i < t->nbuf; i++) {
        tbuf *b = &t->b[i];
        if (b->compared) {
            double tol = t->exact ? 0.0 : b->dt == FL_F32 ? tol32 : tol_of(b->dt);
            double e = rel_l2(b, b->got[0], b->host);
            t_check(e <= tol, "%s %s: output %d of %zu values: relative L2 error %.3g (bound %.0e)",
                    t->name, fl_dtype_name(t->dt), i, b->n, e, tol);
            t_check(memcmp(b->got[0], b->got[1], b->n * fl_dtype_size(b->dt)) == 0,
                    "%s %s: output %d: two device runs bitwise equal", t->name,
                    fl_dtype_name(t->dt), i);
        }
        t->d->free(t->d, b->dev);
        free(b->init), free(b->host), free(b->got[0]), free(b->got[1]);
    }
    t->nbuf = 0;
}

// The three runs of one case: `call` issues the kernel on the side's table.
typedef void (*tc_call)(tcase *t, const fl_device *x, void *arg);

static void tc_run(tcase *t, tc_call call, void *arg, double tol32) {
    for (int side = 0; side < 3; side++) {
        const fl_device *x = tc_begin(t, side);
        call(t, x, arg);
        tc_end(t);
    }
    tc_finish(t, tol32);
}

static int *random_ids(size_t n, int lo, int hi, unsigned seed) {
    int *ids = malloc((n ? n : 1) * sizeof(int));
    FL_ASSERT(ids);
    srand(seed);
    for (size_t i = 0; i < n; i++) ids[i] = lo + rand() % (hi - lo);
    return ids;
}

// ----------------------------------------------------------------------------
// the cases: each fills an args struct of buffer indices and shapes

typedef struct {
    int a[10];
    int B, T, C, N, V, Vp, NH, NKV, HS, OC, IC, extra;
    size_t n;
    float f;
} targs;

static void call_encoder(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->encoder_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]), a->B,
                       a->T, a->C);
}

static void call_encoder_bwd(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->encoder_backward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]), a->B,
                        a->T, a->C);
}

static void call_shard_emb(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->embedding_shard_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), a->extra, a->V,
                               a->N, a->C);
    x->position_forward(t->dt, P(t, a->a[0]), P(t, a->a[3]), a->B, a->T, a->C);
}

static void call_shard_emb_bwd(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->embedding_shard_backward(t->dt, P(t, a->a[0]), P(t, a->a[2]), P(t, a->a[1]), a->extra, a->V,
                                a->N, a->C);
    x->position_backward(t->dt, P(t, a->a[3]), P(t, a->a[2]), a->B, a->T, a->C);
}

static void test_encoder(fl_dtype dt) {
    int B = 2, T = 77, C = 192, Vp = 512, N = B * T;
    int *ids = random_ids((size_t)N, 0, 500, 7);
    targs a = {.B = B, .T = T, .C = C, .N = N};
    tcase t = tc_new("encoder_forward", dt);
    a.a[0] = tc_out(&t, dt, (size_t)N * C);
    a.a[1] = tc_raw(&t, ids, (size_t)N * sizeof(int));
    a.a[2] = tc_in(&t, dt, (size_t)Vp * C, 1.0f);
    a.a[3] = tc_in(&t, dt, (size_t)T * C, 1.0f);
    tc_run(&t, call_encoder, &a, 1e-5);
    t = tc_new("encoder_backward", dt);
    a.a[0] = tc_acc(&t, dt, (size_t)Vp * C, 1.0f);
    a.a[1] = tc_acc(&t, dt, (size_t)T * C, 1.0f);
    a.a[2] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    a.a[3] = tc_raw(&t, ids, (size_t)N * sizeof(int));
    tc_run(&t, call_encoder_bwd, &a, 1e-5);
    // a shard of rows [100, 356): the other ids give zero rows
    a.extra = 100, a.V = 256;
    t = tc_new("embedding_shard_forward + position_forward", dt);
    a.a[0] = tc_out(&t, dt, (size_t)N * C);
    a.a[1] = tc_raw(&t, ids, (size_t)N * sizeof(int));
    a.a[2] = tc_in(&t, dt, (size_t)a.V * C, 1.0f);
    a.a[3] = tc_in(&t, dt, (size_t)T * C, 1.0f);
    tc_run(&t, call_shard_emb, &a, 1e-5);
    t = tc_new("embedding_shard_backward + position_backward", dt);
    a.a[0] = tc_acc(&t, dt, (size_t)a.V * C, 1.0f);
    a.a[1] = tc_raw(&t, ids, (size_t)N * sizeof(int));
    a.a[2] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    a.a[3] = tc_acc(&t, dt, (size_t)T * C, 1.0f);
    tc_run(&t, call_shard_emb_bwd, &a, 1e-5);
    free(ids);
}

static void call_layernorm(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->layernorm_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                         P(t, a->a[4]), P(t, a->a[5]), a->N, a->C);
}

static void call_layernorm_bwd(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->layernorm_backward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                          P(t, a->a[4]), P(t, a->a[5]), P(t, a->a[6]), P(t, a->a[7]), a->N, a->C);
}

static void call_rmsnorm(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->rmsnorm_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]), a->N,
                       a->C, 1e-5f);
}

// the residual add fused with the norm: res (accumulated) and the norm's outputs
static void call_residual_layernorm(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->residual_layernorm_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                                  P(t, a->a[4]), P(t, a->a[5]), P(t, a->a[6]), a->N, a->C);
}

static void call_residual_rmsnorm(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->residual_rmsnorm_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                                P(t, a->a[4]), a->N, a->C, 1e-5f);
}

static void call_rmsnorm_bwd(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->rmsnorm_backward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                        P(t, a->a[4]), P(t, a->a[5]), a->N, a->C);
}

// a norm case's name: the entry and C
static const char *norm_case(const char *entry, int C) {
    static char name[96];
    snprintf(name, sizeof name, "%s C %d", entry, C);
    return name;
}

// the saved statistics of a row of inputs, from the cpu (exact inputs for
// the backward cases); C a multiple of 8 (cuda: 16-byte accesses,
// common.cuh) and not (element by element where a row's 8 are not aligned)
static void norms(fl_dtype dt, int C) {
    int N = 154;
    targs a = {.N = N, .C = C};
    tcase t = tc_new(norm_case("layernorm_forward", C), dt);
    a.a[0] = tc_out(&t, dt, (size_t)N * C);
    a.a[1] = tc_out(&t, FL_F32, (size_t)N);
    a.a[2] = tc_out(&t, FL_F32, (size_t)N);
    a.a[3] = tc_in(&t, dt, (size_t)N * C, 2.0f);
    a.a[4] = tc_in(&t, dt, (size_t)C, 1.0f);
    a.a[5] = tc_in(&t, dt, (size_t)C, 1.0f);
    tc_run(&t, call_layernorm, &a, 1e-5);

    // the backward's mean and rstd: the cpu's for the same rows
    void *inp = random_values(dt, (size_t)N * C, 77, 2.0f),
         *w = random_values(dt, (size_t)C, 78, 1.0f);
    void *bias = random_values(dt, (size_t)C, 79, 1.0f), *o = malloc((size_t)N * C * 4);
    float *mean = malloc((size_t)N * 4), *rstd = malloc((size_t)N * 4);
    FL_ASSERT(o && mean && rstd);
    layernorm_forward(dt, o, mean, rstd, inp, w, bias, N, C);
    t = tc_new(norm_case("layernorm_backward", C), dt);
    a.a[0] = tc_acc(&t, dt, (size_t)N * C, 1.0f);
    a.a[1] = tc_acc(&t, dt, (size_t)C, 1.0f);
    a.a[2] = tc_acc(&t, dt, (size_t)C, 1.0f);
    a.a[3] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    a.a[4] = tc_add(&t, dt, (size_t)N * C, fl_dtype_size(dt), inp, 0);
    a.a[5] = tc_add(&t, dt, (size_t)C, fl_dtype_size(dt), w, 0);
    a.a[6] = tc_add(&t, FL_F32, (size_t)N, 4, mean, 0);
    a.a[7] = tc_add(&t, FL_F32, (size_t)N, 4, rstd, 0);
    tc_run(&t, call_layernorm_bwd, &a, 1e-5);

    t = tc_new(norm_case("rmsnorm_forward", C), dt);
    a.a[0] = tc_out(&t, dt, (size_t)N * C);
    a.a[1] = tc_out(&t, FL_F32, (size_t)N);
    a.a[2] = tc_in(&t, dt, (size_t)N * C, 2.0f);
    a.a[3] = tc_in(&t, dt, (size_t)C, 1.0f);
    tc_run(&t, call_rmsnorm, &a, 1e-5);

    t = tc_new(norm_case("residual_layernorm_forward", C), dt);
    a.a[0] = tc_acc(&t, dt, (size_t)N * C, 2.0f);
    a.a[1] = tc_out(&t, dt, (size_t)N * C);
    a.a[2] = tc_out(&t, FL_F32, (size_t)N);
    a.a[3] = tc_out(&t, FL_F32, (size_t)N);
    a.a[4] = tc_in(&t, dt, (size_t)N * C, 2.0f);
    a.a[5] = tc_in(&t, dt, (size_t)C, 1.0f);
    a.a[6] = tc_in(&t, dt, (size_t)C, 1.0f);
    tc_run(&t, call_residual_layernorm, &a, 1e-5);

    t = tc_new(norm_case("residual_rmsnorm_forward", C), dt);
    a.a[0] = tc_acc(&t, dt, (size_t)N * C, 2.0f);
    a.a[1] = tc_out(&t, dt, (size_t)N * C);
    a.a[2] = tc_out(&t, FL_F32, (size_t)N);
    a.a[3] = tc_in(&t, dt, (size_t)N * C, 2.0f);
    a.a[4] = tc_in(&t, dt, (size_t)C, 1.0f);
    tc_run(&t, call_residual_rmsnorm, &a, 1e-5);

    rmsnorm_forward(dt, o, rstd, inp, w, N, C, 1e-5f);
    t = tc_new(norm_case("rmsnorm_backward", C), dt);
    a.a[0] = tc_acc(&t, dt, (size_t)N * C, 1.0f);
    a.a[1] = tc_acc(&t, dt, (size_t)C, 1.0f);
    a.a[2] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    a.a[3] = tc_add(&t, dt, (size_t)N * C, fl_dtype_size(dt), inp, 0);
    a.a[4] = tc_add(&t, dt, (size_t)C, fl_dtype_size(dt), w, 0);
    a.a[5] = tc_add(&t, FL_F32, (size_t)N, 4, rstd, 0);
    tc_run(&t, call_rmsnorm_bwd, &a, 1e-5);
    free(inp), free(w), free(bias), free(o), free(mean), free(rstd);
}

// matmul: each side with its own workspace; the backward's dinp written or
// added to
typedef struct {
    targs a;
    void *ws[2];
    int dinp_add;
} mm_args;

// a GEMM case's shape and the cpu's and the device's workspaces
static mm_args mm_new(fl_dtype dt, int N, int C, int OC) {
    mm_args m = {.a = {.N = N, .C = C, .OC = OC}};
    size_t wc = fl_device_cpu_table()->matmul_workspace_bytes(dt, N, C, OC);
    size_t wd = dev->matmul_workspace_bytes(dt, N, C, OC);
    m.ws[0] = wc ? fl_alloc(FL_MEM_WORKSPACE, wc) : NULL;
    m.ws[1] = wd ? dev->alloc(dev, FL_MEM_WORKSPACE, wd) : NULL;
    return m;
}

static void mm_free(mm_args *m) {
    fl_free(m->ws[0]);
    dev->free(dev, m->ws[1]);
}

static void call_matmul(tcase *t, const fl_device *x, void *p) {
    mm_args *m = p;
    targs *a = &m->a;
    x->matmul_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                      m->ws[t->side ? 1 : 0], a->N, a->C, a->OC);
}

static void call_matmul_bwd(tcase *t, const fl_device *x, void *p) {
    mm_args *m = p;
    targs *a = &m->a;
    x->matmul_backward(t->dt, P(t, a->a[0]), P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                       P(t, a->a[4]), P(t, a->a[5]), m->ws[t->side ? 1 : 0], a->N, a->C, a->OC,
                       m->dinp_add);
}

// the MLP's GEMM and GELU: fused where the device fuses them
// (matmul_gelu_forward: cuda with FITLM_CUDA_GELU_FUSION=1 or 2, which main
// sets to 2), else the two calls
static void call_matmul_gelu(tcase *t, const fl_device *x, void *p) {
    mm_args *m = p;
    targs *a = &m->a;
    void *out = P(t, a->a[0]), *pre = P(t, a->a[4]), *ws = m->ws[t->side ? 1 : 0];
    if (x->matmul_gelu_forward) {
        x->matmul_gelu_forward(t->dt, out, pre, P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]), ws,
                               a->N, a->C, a->OC);
        return;
    }
    x->matmul_forward(t->dt, pre, P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]), ws, a->N, a->C,
                      a->OC);
    x->gelu_forward(t->dt, out, pre, (size_t)a->N * a->OC);
}

static void matmul_gelu(fl_dtype dt, int N, int C, int OC) {
    mm_args m = mm_new(dt, N, C, OC);
    tcase t = tc_new(epilogue_case("matmul_gelu_forward", OC % 8 == 0), dt);
    m.a.a[0] = tc_out(&t, dt, (size_t)N * OC);
    m.a.a[1] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    m.a.a[2] = tc_in(&t, dt, (size_t)OC * C, 0.2f);
    m.a.a[3] = tc_in(&t, dt, (size_t)OC, 1.0f);
    m.a.a[4] = tc_out(&t, dt, (size_t)N * OC);
    tc_run(&t, call_matmul_gelu, &m, 1e-5);
    mm_free(&m);
}

// the MLP projection's backward and GELU's: fused where the device fuses
// them (matmul_dgelu_backward: cuda with FITLM_CUDA_GELU_FUSION=2), else
// matmul_backward into a scratch (a[7]), then gelu_backward
static void call_matmul_dgelu(tcase *t, const fl_device *x, void *p) {
    mm_args *m = p;
    targs *a = &m->a;
    void *dpre = P(t, a->a[0]), *pre = P(t, a->a[6]), *ws = m->ws[t->side ? 1 : 0];
    if (x->matmul_dgelu_backward) {
        x->matmul_dgelu_backward(t->dt, dpre, P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]),
                                 P(t, a->a[4]), P(t, a->a[5]), pre, ws, a->N, a->C, a->OC);
        return;
    }
    void *dh = P(t, a->a[7]);
    x->matmul_backward(t->dt, dh, P(t, a->a[1]), P(t, a->a[2]), P(t, a->a[3]), P(t, a->a[4]),
                       P(t, a->a[5]), ws, a->N, a->C, a->OC, 0);
    x->gelu_backward(t->dt, dpre, pre, dh, (size_t)a->N * a->C);
}

static void matmul_dgelu(fl_dtype dt, int N, int C, int OC) {
    mm_args m = mm_new(dt, N, C, OC);
    tcase t = tc_new(epilogue_case("matmul_dgelu_backward", C % 8 == 0), dt);
    m.a.a[0] = tc_out(&t, dt, (size_t)N * C);
    m.a.a[1] = tc_acc(&t, dt, (size_t)OC * C, 1.0f);
    m.a.a[2] = tc_acc(&t, dt, (size_t)OC, 1.0f);
    m.a.a[3] = tc_in(&t, dt, (size_t)N * OC, 1.0f);
    m.a.a[4] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    m.a.a[5] = tc_in(&t, dt, (size_t)OC * C, 0.2f);
    m.a.a[6] = tc_in(&t, dt, (size_t)N * C, 3.0f); // GELU's bend and both tails
    m.a.a[7] = tc_add(&t, dt, (size_t)N * C, fl_dtype_size(dt), NULL, 0); // not compared
    tc_run(&t, call_matmul_dgelu, &m, 1e-5);
    mm_free(&m);
}

static void matmul_fwd(fl_dtype dt, int N, int C, int OC) {
    mm_args m = mm_new(dt, N, C, OC);
    tcase t = tc_new(getenv("FITLM_CUDA_EMU_NO_EPILOGUES")
                         ? "matmul_forward (no cuBLASLt algorithm for the bias epilogue)"
                         : "matmul_forward",
                     dt);
    m.a.a[0] = tc_out(&t, dt, (size_t)N * OC);
    m.a.a[1] = tc_in(&t, dt, (size_t)N * C, 1.0f);
    m.a.a[2] = tc_in(&t, dt, (size_t)OC * C, 0.2f);
    m.a.a[3] = tc_in(&t, dt, (size_t)OC, 1.0f);
    tc_run(&t, call_matmul, &m, 1e-5);
    mm_free(&m);
}

static void matmuls(fl_dtype dt) {
    int N = 154, C = 192, OC = 264;
    matmul_fwd(dt, N, C, OC);
    mm_args m = mm_new(dt, N, C, OC);
    tcase t;
    for (m.dinp_add = 0; m.dinp_add < 2; m.dinp_add++) { // dinp poisoned: never read
        t = tc_new(m.dinp_add ? "matmul_backward (dinp added to)" : "matmul_backward", dt);
        m.a.a[0] = m.dinp_add ? tc_acc(&t, dt, (size_t)N * C, 1.0f) : tc_out(&t, dt, (size_t)N * C);
        m.a.a[1] = tc_acc(&t, dt, (size_t)OC * C, 1.0f);
        m.a.a[2] = tc_acc(&t, dt, (size_t)OC, 1.0f);
        m.a.a[3] = tc_in(&t, dt, (size_t)N * OC, 1.0f);
        m.a.a[4] = tc_in(&t, dt, (size_t)N * C, 1.0f);
        m.a.a[5] = tc_in(&t, dt, (size_t)OC * C, 0.2f);
        tc_run(&t, call_matmul_bwd, &m, 1e-5);
    }
    mm_free(&m);
    matmul_gelu(dt, N, C, OC);
    matmul_gelu(dt, 37, 40, 50);
    matmul_dgelu(dt, N, OC, C); // the projection from the MLP's width
    matmul_dgelu(dt, 37, 50, 40);
    if (emulated()) { // cuBLASLt without the epilogues' kernels: the kernels apart
        setenv("FITLM_CUDA_EMU_NO_EPILOGUES", "1", 1);
        matmul_fwd(dt, 61, 48, 72); // shapes of their own: plans are cached by shape
        matmul_gelu(dt, 61, 48, 72);
        matmul_dgelu(dt, 61, 72, 48);
        unsetenv("FITLM_CUDA_EMU_NO_EPILOGUES");
    }
}

// attention: each side with its own workspace; qkv and dqkv `off` values
// into their buffers (1: rows not 16-byte aligned)
typedef struct {
    targs a;
    float *ws[2];
    int off;
} att_args;

static void *at_off(tcase *t, int i, int off) {
    return (char *)P(t, i) + (size_t)off * fl_dtype_size(t->dt);
}

static void call_attention(tcase *t, const fl_device *x, void *p) {
    att_args *m = p;
    targs *a = &m->a;
    x->attention_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), at_off(t, a->a[2], m->off),
                         m->ws[t->side ? 1 : 0], a->B, a->T, a->NH, a->NKV, a->HS);
}

static void call_attention_bwd(tcase *t, const fl_device *x, void *p) {
    att_args *m = p;
    targs *a = &m->a;
    x->attention_backward(t->dt, at_off(t, a->a[0], m->off), P(t, a->a[1]),
                          at_off(t, a->a[2], m->off), P(t, a->a[3]), P(t, a->a[4]),
                          m->ws[t->side ? 1 : 0], a->B, a->T, a->NH, a->NKV, a->HS);
}

// The backward of m's shape against the cpu's on qkv and the cpu forward's
// out and lse.
static void attention_bwd_case(att_args *m, const char *name, fl_dtype dt, const char *qkv,
                               const void *out, const float *lse) {
    const targs *g = &m->a;
    int W = (g->NH + 2 * g->NKV) * g->HS, C = g->NH * g->HS;
    size_t N = (size_t)g->B * g->T, D = fl_dtype_size(dt), off = (size_t)m->off;
    tcase t = tc_new(name, dt);
    // dqkv is overwritten (device.h): a random start the device must not
    // add to (the cpu clears it), and before an odd offset left alone
    m->a.a[0] = tc_acc(&t, dt, N * W + off, 1.0f);
    m->a.a[1] = tc_in(&t, dt, N * C, 1.0f);
    m->a.a[2] = tc_add(&t, dt, N * W + off, D, qkv, 0);
    m->a.a[3] = tc_add(&t, dt, N * C, D, out, 0);
    m->a.a[4] = tc_add(&t, FL_F32, (size_t)g->B * g->NH * g->T, 4, lse, 0);
    tc_run(&t, call_attention_bwd, m, 1e-5);
}

static void attention_at(fl_dtype dt, int B, int T, int NH, int NKV, int HS, int off) {
    att_args m = {.a = {.B = B, .T = T, .NH = NH, .NKV = NKV, .HS = HS}, .off = off};
    int group = NH / NKV, W = (NH + 2 * NKV) * HS, C = NH * HS;
    size_t N = (size_t)B * T;
    size_t wc =
        fl_device_cpu_table()->attention_workspace_floats(dt, B, T, NH, HS, group, fl_threads());
    size_t wd = dev->attention_workspace_floats(dt, B, T, NH, HS, group, fl_threads());
    m.ws[0] = wc ? fl_alloc(FL_MEM_WORKSPACE, wc * sizeof(float)) : NULL;
    m.ws[1] = wd ? dev->alloc(dev, FL_MEM_WORKSPACE, wd * sizeof(float)) : NULL;
    char name[128];
    const char *kernels = getenv("FITLM_CUDA_ATTENTION") ? " (wmma)" : "";
    snprintf(name, sizeof name, "attention_forward B %d T %d NH %d NKV %d HS %d%s%s", B, T, NH, NKV,
             HS, off ? " (qkv at an odd offset)" : "", kernels);
    tcase t = tc_new(name, dt);
    m.a.a[0] = tc_out(&t, dt, N * C);
    m.a.a[1] = tc_out(&t, FL_F32, (size_t)B * NH * T);
    m.a.a[2] = tc_in(&t, dt, N * W + off, 1.0f);
    tc_run(&t, call_attention, &m, 1e-5);

    // the backward's out and lse: the cpu forward's on the same qkv
    size_t D = fl_dtype_size(dt);
    char *qkv = random_values(dt, N * W + off, 4242, 1.0f);
    void *out = malloc(N * C * 4);
    float *lse = malloc((size_t)B * NH * T * 4);
    FL_ASSERT(out && lse);
    attention_forward(dt, out, lse, qkv + off * D, m.ws[0], B, T, NH, NKV, HS);
    snprintf(name, sizeof name, "attention_backward B %d T %d NH %d NKV %d HS %d%s%s", B, T, NH,
             NKV, HS, off ? " (qkv and dqkv at an odd offset)" : "", kernels);
    attention_bwd_case(&m, name, dt, qkv, out, lse);
    // grouped-query heads without the workspace the device asks only for
    // them (cuda's per-query-head partials): a block per kv head
    if (m.ws[1] && !dev->attention_workspace_floats(dt, B, T, NH, HS, 1, fl_threads())) {
        void *ws = m.ws[1];
        m.ws[1] = NULL;
        snprintf(name, sizeof name,
                 "attention_backward B %d T %d NH %d NKV %d HS %d%s%s, no workspace", B, T, NH, NKV,
                 HS, off ? " (qkv and dqkv at an odd offset)" : "", kernels);
        attention_bwd_case(&m, name, dt, qkv, out, lse);
        m.ws[1] = ws;
    }
    free(qkv), free(out), free(lse);
    fl_free(m.ws[0]);
    dev->free(dev, m.ws[1]);
}

static void attention(fl_dtype dt, int B, int T, int NH, int NKV, int HS) {
    attention_at(dt, B, T, NH, NKV, HS, 0);
}

static void attentions(fl_dtype dt) {
    attention(dt, 2, 77, 9, 3, 64);
    attention(dt, 1, 200, 3, 1, 64); // four 64-row tiles, the last mostly past T
    attention(dt, 1, 77, 4, 4, 128);
    attention(dt, 1, 130, 2, 1, 64);
    attention(dt, 1, 7, 2, 1, 16);        // one row tile, mostly past T
    attention(dt, 1, 50, 4, 2, 40);       // 16-bit heads the tensor cores do not take
    attention_at(dt, 1, 70, 4, 2, 32, 1); // rows copied value by value
}

static void call_rope(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    x->rope_forward(t->dt, P(t, a->a[0]), P(t, a->a[1]), a->B, a->T, a->NH, a->NKV, a->HS);
    x->rope_backward(t->dt, P(t, a->a[2]), P(t, a->a[1]), a->B, a->T, a->NH, a->NKV, a->HS);
}

// HS 64 (cuda: a head's pairs 8 at a time, common.cuh) and 20 (10 pairs:
// a chunk of 8 and one of 2, not 16-byte aligned)
static void rope(fl_dtype dt, int HS) {
    int B = 2, T = 77, NH = 9, NKV = 3, W = (NH + 2 * NKV) * HS;
    float *cs = malloc((size_t)T * HS * sizeof(float));
    FL_ASSERT(cs);
    rope_table(cs, T, HS, 10000.0f);
    targs a = {.B = B, .T = T, .NH = NH, .NKV = NKV, .HS = HS};
    char name[64];
    snprintf(name, sizeof name, "rope_forward + rope_backward HS %d", HS);
    tcase t = tc_new(name, dt);
    a.a[0] = tc_acc(&t, dt, (size_t)B * T * W, 1.0f);
    a.a[1] = tc_add(&t, FL_F32, (size_t)T * HS, 4, cs, 0);
    a.a[2] = tc_acc(&t, dt, (size_t)B * T * W, 1.0f);
    tc_run(&t, call_rope, &a, 1e-5);
    free(cs);
}

static void call_elementwise(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->gelu_forward(t->dt, P(t, b[0]), P(t, b[1]), a->n);
    x->gelu_backward(t->dt, P(t, b[2]), P(t, b[1]), P(t, b[3]), a->n);
    x->residual_forward(t->dt, P(t, b[4]), P(t, b[1]), P(t, b[3]), a->n);
    x->residual_backward(t->dt, P(t, b[5]), P(t, b[6]), P(t, b[3]), a->n);
    x->residual_backward(t->dt, P(t, b[6]), P(t, b[6]), P(t, b[3]), a->n); // da = db: twice
    x->swiglu_forward(t->dt, P(t, b[7]), P(t, b[8]), a->N, a->IC);
    x->swiglu_backward(t->dt, P(t, b[9]), P(t, b[8]), P(t, b[7]), a->N, a->IC);
    // bias_forward on swiglu's output, viewed as (N, IC)
    x->bias_forward(t->dt, P(t, b[7]), P(t, b[1]), a->N, a->IC);
}

// IC a multiple of 8 (cuda: SwiGLU's gates and ups in 16-byte accesses,
// common.cuh) and not (rows that split 8 elements: one by one)
static void elementwise(fl_dtype dt, int IC) {
    // n over 8 x 64 x 256: several passes of the streaming kernels'
    // grid-stride loops on the emulator's 2 SMs (common.cuh); odd: a tail
    targs a = {.n = 150001, .N = 154, .IC = IC};
    size_t n = a.n, nsw = (size_t)a.N * a.IC;
    char name[64];
    snprintf(name, sizeof name, "gelu, residual, swiglu (IC %d), bias", IC);
    tcase t = tc_new(name, dt);
    a.a[0] = tc_out(&t, dt, n);
    a.a[1] = tc_in(&t, dt, n, 3.0f);
    a.a[2] = tc_out(&t, dt, n); // overwritten (device.h): poisoned, never read
    a.a[3] = tc_in(&t, dt, n, 1.0f);
    a.a[4] = tc_out(&t, dt, n);
    a.a[5] = tc_acc(&t, dt, n, 1.0f);
    a.a[6] = tc_acc(&t, dt, n, 1.0f);
    a.a[7] = tc_out(&t, dt, nsw);
    a.a[8] = tc_in(&t, dt, 2 * nsw, 3.0f);
    a.a[9] = tc_out(&t, dt, 2 * nsw);
    tc_run(&t, call_elementwise, &a, 1e-5);
}

static void call_xent(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->softmax_xent_forward(t->dt, P(t, b[0]), P(t, b[1]), P(t, b[2]), P(t, b[3]), a->N, a->V,
                            a->Vp);
    // the backward on the forward's lse, into a separate buffer
    x->softmax_xent_backward(t->dt, P(t, b[4]), P(t, b[2]), P(t, b[1]), P(t, b[3]), P(t, b[5]),
                             a->N, a->V, a->Vp);
}

static void call_xent_fused(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->softmax_xent_forward_backward(t->dt, P(t, b[0]), P(t, b[1]), P(t, b[2]), P(t, b[3]),
                                     P(t, b[5]), a->N, a->V, a->Vp);
}

static void call_xent_shard(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->xent_shard_max(t->dt, P(t, b[0]), P(t, b[2]), a->N, a->V, a->Vp);
    // the sums against a global max 0.5 above this shard's (another rank's)
    x->xent_shard_sums(t->dt, P(t, b[1]), P(t, b[2]), P(t, b[6]), P(t, b[3]), a->N, a->V, a->Vp);
    x->xent_shard_backward(t->dt, P(t, b[4]), P(t, b[2]), P(t, b[7]), P(t, b[3]), P(t, b[5]), a->N,
                           a->V, a->Vp);
}

// targets: every 7th position without loss (-1)
static int *xent_targets(int N, int V) {
    int *tg = random_ids((size_t)N, 0, V, 99);
    for (int i = 0; i < N; i += 7) tg[i] = -1;
    return tg;
}

static void xent(fl_dtype dt) {
    int N = 154, V = 50257, Vp = 50304;
    size_t NV = (size_t)N * Vp;
    int *tg = xent_targets(N, V);
    float *dl = malloc((size_t)N * sizeof(float));
    FL_ASSERT(dl);
    for (int i = 0; i < N; i++) dl[i] = tg[i] < 0 ? 0.0f : 1.0f / (float)N;
    targs a = {.N = N, .V = V, .Vp = Vp};
    tcase t = tc_new("softmax_xent_forward + backward V 50257 Vp 50304", dt);
    a.a[0] = tc_out(&t, FL_F32, (size_t)N);
    a.a[1] = tc_out(&t, FL_F32, (size_t)N);
    a.a[2] = tc_in(&t, dt, NV, 8.0f);
    a.a[3] = tc_raw(&t, tg, (size_t)N * sizeof(int));
    a.a[4] = tc_out(&t, dt, NV);
    a.a[5] = tc_add(&t, FL_F32, (size_t)N, 4, dl, 0);
    tc_run(&t, call_xent, &a, 1e-5);

    t = tc_new("softmax_xent_forward_backward (fused, in place)", dt);
    a.a[0] = tc_out(&t, FL_F32, (size_t)N);
    a.a[1] = tc_out(&t, FL_F32, (size_t)N);
    a.a[2] = tc_acc(&t, dt, NV, 8.0f);
    a.a[3] = tc_raw(&t, tg, (size_t)N * sizeof(int));
    a.a[4] = a.a[2];
    a.a[5] = tc_add(&t, FL_F32, (size_t)N, 4, dl, 0);
    tc_run(&t, call_xent_fused, &a, 1e-5);

    // a shard of 25129 columns in 25152; its local targets, -1 elsewhere
    int Vs = 25129, Vps = 25152;
    int *tl = xent_targets(N, Vs);
    for (int i = 3; i < N; i += 5) tl[i] = -1;
    float *mx = malloc((size_t)N * 4), *lse = malloc((size_t)N * 4);
    void *logits = random_values(dt, (size_t)N * Vps, 555, 8.0f);
    FL_ASSERT(mx && lse);
    xent_shard_max(dt, mx, logits, N, Vs, Vps);
    for (int i = 0; i < N; i++) mx[i] += 0.5f, lse[i] = mx[i] + 10.0f;
    a = (targs){.N = N, .V = Vs, .Vp = Vps};
    t = tc_new("xent_shard_max, _sums, _backward", dt);
    a.a[0] = tc_out(&t, FL_F32, (size_t)N);
    a.a[1] = tc_out(&t, FL_F32, (size_t)2 * N);
    a.a[2] = tc_add(&t, dt, (size_t)N * Vps, fl_dtype_size(dt), logits, 0);
    a.a[3] = tc_raw(&t, tl, (size_t)N * sizeof(int));
    a.a[4] = tc_out(&t, dt, (size_t)N * Vps);
    a.a[5] = tc_add(&t, FL_F32, (size_t)N, 4, dl, 0);
    a.a[6] = tc_add(&t, FL_F32, (size_t)N, 4, mx, 0);
    a.a[7] = tc_add(&t, FL_F32, (size_t)N, 4, lse, 0);
    tc_run(&t, call_xent_shard, &a, 1e-5);
    free(tg), free(tl), free(dl), free(mx), free(lse), free(logits);
}

static void call_lora(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->lora_add_columns(t->dt, P(t, b[0]), a->extra, P(t, b[1]), 0.75f, a->N, a->C);
    x->lora_gather_columns(t->dt, P(t, b[2]), P(t, b[0]), a->extra, 1.5f, a->N, a->C);
    x->dropout_apply(t->dt, P(t, b[3]), P(t, b[4]), a->n, 0.1f, 0x1234abcdull);
    x->dropout_apply(t->dt, P(t, b[4]), P(t, b[4]), a->n, 0.3f, 77ull); // in place
    x->nf4_dequantize(t->dt, P(t, b[5]), P(t, b[6]), P(t, b[7]), (size_t)a->B, 64);
}

static void lora_nf4(fl_dtype dt) {
    int N = 154, cols = 100, ld = 576, n4 = 4098; // n4 even (nf4_quantised: odd)
    size_t n = 100003;
    unsigned char *codes = malloc((size_t)(n4 + 1) / 2);
    float *absmax = malloc((size_t)(n4 + 63) / 64 * sizeof(float));
    FL_ASSERT(codes && absmax);
    for (int i = 0; i < (n4 + 1) / 2; i++) codes[i] = (unsigned char)(i * 37 + 11);
    for (int i = 0; i < (n4 + 63) / 64; i++) absmax[i] = 0.01f * (float)(i + 1);
    targs a = {.N = N, .C = cols, .extra = ld, .n = n, .B = n4};
    tcase t = tc_new("lora_add_columns, lora_gather_columns, dropout_apply, nf4_dequantize", dt);
    a.a[0] = tc_acc(&t, dt, (size_t)N * ld, 1.0f);
    a.a[1] = tc_in(&t, dt, (size_t)N * cols, 1.0f);
    a.a[2] = tc_out(&t, dt, (size_t)N * cols);
    a.a[3] = tc_out(&t, dt, n);
    a.a[4] = tc_acc(&t, dt, n, 1.0f);
    a.a[5] = tc_out(&t, dt, (size_t)n4);
    a.a[6] = tc_raw(&t, codes, (size_t)(n4 + 1) / 2);
    a.a[7] = tc_add(&t, FL_F32, (size_t)(n4 + 63) / 64, 4, absmax, 0);
    // the cpu rounds these exactly as the device must: bitwise (bound 0)
    t.exact = 1;
    tc_run(&t, call_lora, &a, 0.0);
    free(codes), free(absmax);
}

static void call_nf4(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->nf4_dequantize(t->dt, P(t, b[0]), P(t, b[2]), P(t, b[3]), a->n, a->B);
    x->dq8_dequantize(P(t, b[4]), P(t, b[5]), P(t, b[6]), a->f, a->C, FL_DQ_BLOCK);
    x->nf4_dequantize(t->dt, P(t, b[1]), P(t, b[2]), P(t, b[4]), a->n, a->B);
}

// QLoRA's weights as a model stores them: random rows quantised by the
// cpu (nf4_quantize), their absmax as is and double quantised (dq8 with
// 256 absmax a block, undone by the table's dq8_dequantize), dequantised
// at the smallest and largest block sizes and an odd length: bitwise.
static void nf4_quantised(fl_dtype dt) {
    const int blocks[] = {32, 4096};
    size_t n = 70001;
    float *w = malloc(n * sizeof(float));
    FL_ASSERT(w);
    t_fill(w, n, 4242, 0.05f);
    for (int k = 0; k < 2; k++) {
        int bs = blocks[k];
        size_t nb = (n + (size_t)bs - 1) / (size_t)bs, nn = (nb + FL_DQ_BLOCK - 1) / FL_DQ_BLOCK;
        unsigned char *codes = malloc((n + 1) / 2), *q = malloc(nb);
        float *absmax = malloc(nb * sizeof(float)), *nested = malloc(nn * sizeof(float)), offset;
        FL_ASSERT(codes && q && absmax && nested);
        nf4_quantize(codes, absmax, w, n, bs);
        dq8_quantize(q, nested, &offset, absmax, nb, FL_DQ_BLOCK);
        targs a = {.n = n, .B = bs, .C = (int)nb, .f = offset};
        tcase t = tc_new(bs == 32 ? "nf4_dequantize, dq8_dequantize of quantised rows, block 32"
                                  : "nf4_dequantize, dq8_dequantize of quantised rows, block 4096",
                         dt);
        t.exact = 1;
        a.a[0] = tc_out(&t, dt, n);
        a.a[1] = tc_out(&t, dt, n);
        a.a[2] = tc_raw(&t, codes, (n + 1) / 2);
        a.a[3] = tc_add(&t, FL_F32, nb, 4, absmax, 0);
        a.a[4] = tc_out(&t, FL_F32, nb);
        a.a[5] = tc_raw(&t, q, nb);
        a.a[6] = tc_add(&t, FL_F32, nn, 4, nested, 0);
        tc_run(&t, call_nf4, &a, 0.0);
        free(codes), free(q), free(absmax), free(nested);
    }
    free(w);
}

// the step's pieces: convert, accumulate, sumsq and sum
static void call_step(tcase *t, const fl_device *x, void *p) {
    targs *a = p;
    int *b = a->a;
    x->convert(FL_F32, P(t, b[0]), t->dt, P(t, b[1]), a->n);
    x->convert(t->dt, P(t, b[2]), FL_F32, P(t, b[3]), a->n);
    x->accumulate(P(t, b[4]), t->dt, P(t, b[1]), a->n);
    double s[2] = {x->sumsq(t->dt, P(t, b[1]), a->n), x->sum(P(t, b[3]), a->n)};
    // the two doubles, as bytes, into an 16-byte output (host memory on both
    // sides: the reductions return to the host)
    memcpy(t->side ? t->b[b[5]].got[t->side - 1] : t->b[b[5]].host, s, sizeof s);
}

static void step_pieces(fl_dtype dt) {
    targs a = {.n = 1000003};
    tcase t = tc_new("convert, accumulate, sumsq, sum", dt);
    a.a[0] = tc_out(&t, FL_F32, a.n);
    a.a[1] = tc_in(&t, dt, a.n, 1.0f);
    a.a[2] = tc_out(&t, dt, a.n);
    a.a[3] = tc_in(&t, FL_F32, a.n, 1.0f);
    a.a[4] = tc_acc(&t, FL_F32, a.n, 1.0f);
    // a host result: not uploaded or downloaded (not compared by tc_end)
    a.a[5] = tc_out(&t, FL_F32, 4);
    t.b[a.a[5]].compared = 0;
    for (int side = 0; side < 3; side++) {
        const fl_device *x = tc_begin(&t, side);
        call_step(&t, x, &a);
        tc_end(&t);
    }
    // the device sums in a fixed order of its own (device.h): within a
    // double's rounding over the 10^6 terms of the cpu's, the same bits twice
    tbuf *r = &t.b[a.a[5]];
    double got[2], want[2];
    memcpy(got, r->got[0], sizeof got), memcpy(want, r->host, sizeof want);
    for (int k = 0; k < 2; k++)
        t_check(fabs(got[k] - want[k]) <= 1e-10 * fabs(want[k]),
                "%s %s: %.17g against the cpu's %.17g", k ? "sum" : "sumsq", fl_dtype_name(dt),
                got[k], want[k]);
    t_check(memcmp(r->got[0], r->got[1], 16) == 0, "sumsq and sum %s: the same bits twice",
            fl_dtype_name(dt));
    tc_finish(&t, 0.0);
}

// sumsq_rows (the gradient norm's rows at once): each range's sum is
// bitwise the device's own sumsq of it (cuda: the same blocks added in the
// same order, however many ranges share the copy back) and within 1e-10 of
// the cpu's; an empty range is 0.0; the same bits twice. The ranges are
// awkward: empty ones first, between and last, one value, 2047, 2048 and
// 2049 values (cuda: one and two reduction blocks), unaligned and
// overlapping ones, the whole buffer (the most blocks); then 70 whole-buffer
// ranges at once, more partial sums than one copy back of the lent scratch
// holds (cuda: 64 x 1024 blocks), which must still serve them all (in fp32).
enum { ROWS_N = 2100001, ROWS_MANY = 70 };

static void check_rows(const char *what, fl_dtype dt, const void *host, const void *x, int n,
                       const size_t *offsets, const size_t *counts) {
    const fl_device *cpu = fl_device_cpu_table();
    double *got = malloc(2 * (size_t)n * sizeof(double)),
           *want = malloc((size_t)n * sizeof(double));
    FL_ASSERT(got && want);
    cpu->sumsq_rows(dt, host, n, offsets, counts, want);
    // the results are the device's (left there for the step's gate)
    double *out = dev->alloc(dev, FL_MEM_OTHER, (n ? (size_t)n : 1) * sizeof(double));
    for (int twice = 0; twice < 2; twice++) {
        memset(got + twice * n, 0xFF, (size_t)n * sizeof(double)); // NaN: a range not written
        fl_dev_upload(dev, out, got + twice * n, (size_t)n * sizeof(double));
        dev->sumsq_rows(dt, x, n, offsets, counts, out);
        fl_dev_download(dev, got + twice * n, out, (size_t)n * sizeof(double));
    }
    dev->free(dev, out);
    int bad = 0;
    double *own1 = malloc(2 * (size_t)n * sizeof(double)), *cpu1s = own1 + n;
    FL_ASSERT(own1);
    for (int i = 0; i < n && bad < 3; i++) {
        int seen = 0; // a range met before: its sums alone then
        while (seen < i && (offsets[seen] != offsets[i] || counts[seen] != counts[i])) seen++;
        own1[i] = seen < i ? own1[seen] : dev->sumsq(dt, fl_at_const(dt, x, offsets[i]), counts[i]);
        cpu1s[i] =
            seen < i ? cpu1s[seen] : cpu->sumsq(dt, fl_at_const(dt, host, offsets[i]), counts[i]);
        double own = own1[i], cpu1 = cpu1s[i];
        int ok = memcmp(&got[i], &own, sizeof own) == 0 &&
                 memcmp(&want[i], &cpu1, sizeof cpu1) == 0 &&
                 memcmp(&got[i], &got[n + i], sizeof got[i]) == 0 &&
                 fabs(got[i] - want[i]) <= 1e-10 * fabs(want[i]) && (counts[i] || got[i] == 0.0);
        bad += !ok;
        t_check(ok,
                "sumsq_rows %s %s, range %d of %d (%zu values from %zu): %.17g, twice %.17g, "
                "sumsq alone %.17g, the cpu's %.17g (its sumsq %.17g)",
                what, fl_dtype_name(dt), i, n, counts[i], offsets[i], got[i], got[n + i], own,
                want[i], cpu1);
    }
    free(got), free(want), free(own1);
}

static void sumsq_rows(fl_dtype dt) {
    void *host = random_values(dt, ROWS_N, seed_counter++, 1.0f);
    size_t bytes = ROWS_N * fl_dtype_size(dt);
    void *x = dev->alloc(dev, FL_MEM_GRADS, bytes);
    fl_dev_upload(dev, x, host, bytes);
    const size_t offsets[] = {0, 0,  7,      1, 0,    2048,       2049, 5,
                              3, 99, ROWS_N, 0, 1000, ROWS_N - 1, 17,   0};
    const size_t counts[] = {0,      1,    1, 2047,   2048,          2049, 2047, 0,
                             100000, 2048, 0, ROWS_N, ROWS_N - 1000, 1,    4096, 0};
    int n = (int)(sizeof counts / sizeof counts[0]);
    check_rows("awkward ranges", dt, host, x, n, offsets, counts);
    check_rows("no ranges", dt, host, x, 0, offsets, counts);
    if (dt != FL_F32) { // the copies back do not depend on the dtype
        dev->free(dev, x);
        free(host);
        return;
    }
    // many whole ranges, on the scratch a model of one row lends
    size_t many_off[ROWS_MANY], many_n[ROWS_MANY], lend = dev->scratch_bytes(1, 1, 1);
    for (int i = 0; i < ROWS_MANY; i++) many_off[i] = i % 3, many_n[i] = ROWS_N - i % 3;
    many_n[ROWS_MANY / 2] = 0;
    void *s = dev->alloc(dev, FL_MEM_WORKSPACE, lend ? lend : 1);
    dev->scratch_lend(dev, s, lend);
    size_t ws = fl_mem_device_current(FL_MEM_WORKSPACE);
    check_rows("many whole ranges", dt, host, x, ROWS_MANY, many_off, many_n);
    t_check(fl_mem_device_current(FL_MEM_WORKSPACE) == ws,
            "sumsq_rows %s: %d ranges within a lent scratch of %zu bytes (the device's "
            "workspace count %zu, was %zu)",
            fl_dtype_name(dt), ROWS_MANY, lend, fl_mem_device_current(FL_MEM_WORKSPACE), ws);
    dev->scratch_return(dev, s);
    dev->free(dev, s);
    dev->free(dev, x);
    free(host);
}

// ----------------------------------------------------------------------------
// the step's scalars on the device: sum_to (sum's bits, left in device
// memory), fill, and the gate, whose verdicts must be the cpu's: one device
// thread runs the host's arithmetic (src/optim/gate.h), so every field is
// the same bits (NaN as NaN) for each kind of verdict

static int same_or_nan(double a, double b) {
    return (isnan(a) && isnan(b)) || !memcmp(&a, &b, sizeof a);
}

static int gates_equal(const fl_step_gate *a, const fl_step_gate *b) {
    return same_or_nan(a->loss_raw, b->loss_raw) && same_or_nan(a->loss_sum, b->loss_sum) &&
           same_or_nan(a->sumsq, b->sumsq) && same_or_nan(a->loss, b->loss) &&
           same_or_nan(a->grad_norm, b->grad_norm) && same_or_nan(a->grad_scale, b->grad_scale) &&
           same_or_nan(a->unscale, b->unscale) && same_or_nan(a->clip_coef, b->clip_coef) &&
           same_or_nan(a->loss_z, b->loss_z) && same_or_nan(a->grad_z, b->grad_z) &&
           a->skip == b->skip && a->judged == b->judged;
}

static void step_scalars(void) {
    const fl_device *cpu = fl_device_cpu_table();
    size_t n = 100003;
    float *h = malloc(n * sizeof(float));
    FL_ASSERT(h);
    t_fill(h, n, 77, 1.0f);
    float *x = dev->alloc(dev, FL_MEM_OTHER, n * sizeof(float));
    double *d = dev->alloc(dev, FL_MEM_OTHER, sizeof(double)), got;
    fl_dev_upload(dev, x, h, n * sizeof(float));
    double want = dev->sum(x, n);
    dev->sum_to(d, x, n);
    fl_dev_download(dev, &got, d, sizeof got);
    t_check(!memcmp(&got, &want, sizeof got), "sum_to: sum's bits, left on the device (%.17g)",
            got);
    dev->fill(x, 0.375f, n);
    fl_dev_download(dev, h, x, n * sizeof(float));
    int filled = 1;
    for (size_t i = 0; i < n; i++) filled &= h[i] == 0.375f;
    t_check(filled, "fill: every value");
    free(h);
    dev->free(dev, x), dev->free(dev, d);

    // the rows' sums and a parent gate beside the gate, on each side
    enum { ROWS = 5 };
    size_t bytes = 2 * sizeof(fl_step_gate) + ROWS * sizeof(double);
    fl_step_gate host[2] = {{0}}, dg[2];
    double rows[ROWS];
    char *mem = dev->alloc(dev, FL_MEM_OTHER, bytes);
    fl_step_gate *g = (fl_step_gate *)mem, *parent = g + 1;
    double *drows = (double *)(void *)(mem + 2 * sizeof(fl_step_gate));
    fl_spike_stat flat = {4.0, 0.04, 1}, wide = {1.0, 0.5, 1}, few = {0.0, 0.0, 0};
    const struct {
        const char *what;
        double raw, row3; // the model's loss sum, and row 3's sum of squares
        fl_gate_op op;
    } cases[] = {
        {"a micro-batch's loss", 123.456, 1.0, {.op = FL_GATE_LOSS, .n = 31, .first = 1}},
        {"the next micro-batch's", 98.7, 1.0, {.op = FL_GATE_LOSS, .n = 29}},
        {"an empty micro-batch's", 0.0, 1.0, {.op = FL_GATE_LOSS, .n = 0}},
        {"a clipped verdict",
         0.0,
         2.5,
         {.op = FL_GATE_VERDICT,
          .nrows = ROWS,
          .total = 60,
          .scale = 1.0f,
          .max_grad_norm = 1.0f,
          .nonfinite_skips = 1}},
        {"a loss-scaled verdict, no clipping, the guard judging",
         0.0,
         7e9,
         {.op = FL_GATE_VERDICT,
          .nrows = ROWS,
          .total = 60,
          .scale = 65536.0f,
          .overflow_skips = 1,
          .nonfinite_skips = 1,
          .judge = 1,
          .loss_z = 3.0f,
          .grad_z = 3.0f,
          .loss_stat = flat,
          .norm_stat = wide}},
        {"a spike (the loss)",
         0.0,
         1.0,
         {.op = FL_GATE_VERDICT,
          .nrows = ROWS,
          .total = 60,
          .scale = 1.0f,
          .max_grad_norm = 1.0f,
          .nonfinite_skips = 1,
          .judge = 1,
          .loss_z = 0.5f,
          .loss_stat = {1.0, 0.01, 1},
          .norm_stat = wide}},
        {"an fp16 overflow",
         0.0,
         INFINITY,
         {.op = FL_GATE_VERDICT,
          .nrows = ROWS,
          .total = 60,
          .scale = 1024.0f,
          .overflow_skips = 1,
          .nonfinite_skips = 1,
          .judge = 1,
          .loss_z = 3.0f,
          .loss_stat = flat}},
        {"a NaN gradient in bf16",
         0.0,
         NAN,
         {.op = FL_GATE_VERDICT, .nrows = ROWS, .total = 60, .scale = 1.0f, .nonfinite_skips = 1}},
        {"a NaN gradient, a fused step's (updated with)",
         0.0,
         NAN,
         {.op = FL_GATE_VERDICT,
          .nrows = ROWS,
          .total = 60,
          .scale = 1.0f,
          .max_grad_norm = 1.0f,
          .judge = 1,
          .grad_z = 1.0f,
          .norm_stat = wide}},
        {"the loss alone, too few values to judge",
         0.0,
         1.0,
         {.op = FL_GATE_JUDGE_LOSS,
          .total = 60,
          .scale = 1.0f,
          .judge = 1,
          .loss_z = 1.0f,
          .loss_stat = few}},
        {"the norm after a one-pass update", 0.0, 3.0, {.op = FL_GATE_NORM, .nrows = ROWS}},
        {"the host's total, the loss given",
         0.0,
         1.0,
         {.op = FL_GATE_VERDICT,
          .nrows = -1,
          .total = 60,
          .loss_given = 1,
          .loss = 2.5f,
          .scale = 1.0f,
          .max_grad_norm = 0.25f,
          .nonfinite_skips = 1}},
        {"no rows: a zero norm, not the last one",
         0.0,
         1.0,
         {.op = FL_GATE_VERDICT, .total = 60, .scale = 1.0f, .nonfinite_skips = 1}},
        {"a parent's skip",
         0.0,
         1.0,
         {.op = FL_GATE_VERDICT, .nrows = ROWS, .total = 60, .scale = 1.0f, .nonfinite_skips = 1}},
    };
    int n_cases = (int)(sizeof cases / sizeof cases[0]);
    memset(dg, 0, sizeof dg);
    fl_dev_upload(dev, g, dg, sizeof dg);
    host[1].skip = FL_SKIP_SPIKE; // the parent of the last case
    fl_dev_upload(dev, parent, &host[1], sizeof host[1]);
    for (int c = 0; c < n_cases; c++) {
        for (int r = 0; r < ROWS; r++) rows[r] = r == 3 ? cases[c].row3 : 0.125 * (r + 1);
        fl_dev_upload(dev, drows, rows, sizeof rows);
        fl_gate_op hop = cases[c].op, dop = cases[c].op;
        if (hop.nrows > 0) hop.rows = rows, dop.rows = drows;
        if (c == n_cases - 1) hop.parent = &host[1], dop.parent = parent;
        if (hop.op == FL_GATE_LOSS) { // the model's sum, as its loss sink leaves it
            host[0].loss_raw = cases[c].raw;
            fl_dev_upload(dev, &g->loss_raw, &cases[c].raw, sizeof(double));
        }
        if (hop.op == FL_GATE_VERDICT && hop.nrows < 0) { // a host's sum over ranks
            host[0].sumsq = 0.75;
            fl_dev_upload(dev, &g->sumsq, &host[0].sumsq, sizeof(double));
        }
        cpu->gate(&host[0], &hop);
        dev->gate(g, &dop);
        fl_dev_download(dev, &dg[0], g, sizeof dg[0]);
        t_check(gates_equal(&host[0], &dg[0]),
                "gate, %s: the cpu's verdict (skip %d/%d, loss %.9g/%.9g, norm %.9g/%.9g, "
                "scale %.9g/%.9g, z %g %g)",
                cases[c].what, dg[0].skip, host[0].skip, dg[0].loss, host[0].loss, dg[0].grad_norm,
                host[0].grad_norm, dg[0].grad_scale, host[0].grad_scale, dg[0].loss_z,
                dg[0].grad_z);
    }
    t_check(host[0].skip == FL_SKIP_PARENT, "gate: the last case is skipped by its parent");
    t_check(host[0].sumsq == 0.0 && dg[0].sumsq == 0.0, "gate: no rows sum to zero (%g, %g)",
            host[0].sumsq, dg[0].sumsq);
    dev->free(dev, mem);
}

// ----------------------------------------------------------------------------
// the optimizer update through the table: the same rule twice, its state
// on the host for the cpu and on the device for the device (the struct
// copied, its state pointers swapped for zeroed device buffers), two steps

typedef struct {
    int sgd;
    fl_adamw adamw[2]; // [0] host state, [1] device state
    fl_sgd sgdr[2];
    fl_param_view row;
    size_t n;
    // rows: the buffer as a table of rows (ragged sizes, decay on every
    // other one, one frozen, one empty), through update_rows where the
    // device has it, FL_UPDATE_ROWS at a time, and row by row elsewhere
    fl_param_table *rows;
} optim_args;

static fl_optim_rule *rule_of(optim_args *o, int side) {
    return o->sgd ? &o->sgdr[side ? 1 : 0].rule : &o->adamw[side ? 1 : 0].rule;
}

static void call_update(tcase *t, const fl_device *x, void *p) {
    optim_args *o = p;
    const int b[5] = {0, 1, 2, 3, 4}; // the buffers, in the order optim adds them
    fl_optim_rule *r = rule_of(o, t->side);
    // the state from zero on each side's first run (tc_begin resets buffers)
    if (o->sgd) {
        o->sgdr[t->side ? 1 : 0].t = 0;
        if (t->side) o->sgdr[1].buf = P(t, b[3]);
    } else {
        o->adamw[t->side ? 1 : 0].t = 0;
        if (t->side) o->adamw[1].m = P(t, b[3]), o->adamw[1].v = P(t, b[4]);
    }
    fl_update_args a = {.params = P(t, b[0]),
                        .params_lowp = t->dt == FL_F32 ? NULL : P(t, b[1]),
                        .lowp_dtype = t->dt,
                        .grads = P(t, b[2]),
                        .grads_dtype = t->dt,
                        .grad_scale = 0.5f};
    for (int step = 0; step < 2; step++) {
        fl_optim_begin_step(r, 1e-2f);
        if (!o->rows) x->update(r, &o->row, 0, o->n, &a);
        for (int k0 = 0; o->rows && k0 < o->rows->count; k0 += FL_UPDATE_ROWS) {
            const fl_param_view *rows[FL_UPDATE_ROWS];
            size_t lo[FL_UPDATE_ROWS], n[FL_UPDATE_ROWS];
            fl_update_args ra[FL_UPDATE_ROWS];
            int k = 0;
            for (; k < FL_UPDATE_ROWS && k0 + k < o->rows->count; k++) {
                const fl_param_view *v = &o->rows->views[k0 + k];
                rows[k] = v, lo[k] = v->offset, n[k] = v->numel, ra[k] = a;
                ra[k].params = (float *)a.params + v->offset;
                ra[k].params_lowp = a.params_lowp ? fl_at(t->dt, a.params_lowp, v->offset) : NULL;
                ra[k].grads = fl_at_const(t->dt, a.grads, v->offset);
                if (!x->update_rows) x->update(r, v, v->offset, v->numel, &ra[k]);
            }
            if (x->update_rows) x->update_rows(r, k, rows, lo, n, ra);
        }
        fl_optim_end_step(r);
    }
}

static void optim(fl_dtype dt, int sgd, int by_rows) {
    optim_args o = {.sgd = sgd, .n = 100003};
    o.row = (fl_param_view){
        .name = "w", .ndim = 1, .shape = {o.n}, .numel = o.n, .flags = FL_PARAM_DECAY};
    fl_param_table rows = {0};
    if (by_rows) { // 70 rows: more than a call of update_rows takes
        char name[16];
        for (int k = 0; k < 70; k++) {
            size_t left = o.n - rows.numel, n = k == 69 ? left : k == 5 ? 0 : 1 + (size_t)k * 37;
            int flags = (k % 2 ? FL_PARAM_DECAY : 0) | (k == 9 ? FL_PARAM_FROZEN : 0);
            snprintf(name, sizeof name, "r%d", k);
            fl_params_add(&rows, name, flags, 1, &n);
        }
        o.rows = &rows;
    }
    if (sgd)
        fl_sgd_init(&o.sgdr[0], o.n, 0.9f, 0.01f), o.sgdr[1] = o.sgdr[0];
    else
        fl_adamw_init(&o.adamw[0], o.n, 0.9f, 0.95f, 1e-8f, 0.1f), o.adamw[1] = o.adamw[0];
    tcase t =
        tc_new(sgd ? by_rows ? "update: SGD momentum 0.9, 70 rows" : "update: SGD momentum 0.9"
               : by_rows ? "update: AdamW, 70 rows"
                         : "update: AdamW",
               dt);
    tc_acc(&t, FL_F32, o.n, 1.0f); // 0: the fp32 (master) weights
    // 1: the 16-bit weights the step refreshes (by rows: from a start, which
    // the frozen row keeps)
    if (by_rows)
        tc_acc(&t, dt, o.n, 1.0f);
    else
        tc_out(&t, dt, o.n);
    tc_in(&t, dt, o.n, 1.0f); // 2: the gradients
    tc_out(&t, FL_F32, o.n);  // 3: m (SGD: the momentum buffer)
    tc_out(&t, FL_F32, o.n);  // 4: v (unused by SGD)
    // the state starts at zero, not poisoned; the host's is the rule's own
    float *zero = calloc(o.n, sizeof(float));
    FL_ASSERT(zero);
    for (int k = 3; k <= 4; k++) memcpy(t.b[k].init, zero, o.n * sizeof(float));
    if (sgd) t.b[4].compared = 0;
    if (dt == FL_F32) t.b[1].compared = 0;
    for (int side = 0; side < 3; side++) {
        const fl_device *x = tc_begin(&t, side);
        if (!side) { // the host rule's state into the host buffers compared
            if (sgd) {
                memset(o.sgdr[0].buf, 0, o.n * sizeof(float));
            } else {
                memset(o.adamw[0].m, 0, o.n * sizeof(float));
                memset(o.adamw[0].v, 0, o.n * sizeof(float));
            }
        }
        call_update(&t, x, &o);
        if (!side) {
            memcpy(t.b[3].host, sgd ? o.sgdr[0].buf : o.adamw[0].m, o.n * sizeof(float));
            if (!sgd) memcpy(t.b[4].host, o.adamw[0].v, o.n * sizeof(float));
        }
        tc_end(&t);
    }
    tc_finish(&t, 1e-5);
    if (sgd)
        fl_sgd_free(&o.sgdr[0]);
    else
        fl_adamw_free(&o.adamw[0]);
    free(zero);
    if (by_rows) fl_params_free(&rows);
}

// ----------------------------------------------------------------------------
// the fused rules (LOMO, AdaLomo) through the table: no master, the weights
// of the dtype updated in place (16-bit ones stored back by stochastic
// rounding keyed on the step and the flat element), the rows from the last
// as the backward pass completes them, two steps. The cpu's rule holds its
// AdaLomo state on the host, the device's copy of it a device buffer.

typedef struct {
    int ada;
    fl_param_table table;
    fl_lomo lomo[2]; // [0] the cpu's, [1] the device's
    fl_adalomo adalomo[2];
} fused_args;

static void call_fused(tcase *t, const fl_device *x, void *p) {
    fused_args *o = p;
    int s = t->side ? 1 : 0;
    fl_optim_rule *r = o->ada ? &o->adalomo[s].rule : &o->lomo[s].rule;
    if (o->ada) {
        o->adalomo[s].t = 0;
        if (s) o->adalomo[1].state = P(t, 2);
    } else {
        o->lomo[s].t = 0;
    }
    fl_dtype dt = t->dt;
    for (int step = 0; step < 2; step++) {
        fl_optim_begin_step(r, 1e-2f);
        for (int k = o->table.count - 1; k >= 0; k--) {
            const fl_param_view *v = &o->table.views[k];
            fl_update_args a = {.params = dt == FL_F32 ? (float *)P(t, 0) + v->offset : NULL,
                                .params_lowp = dt == FL_F32 ? NULL : fl_at(dt, P(t, 0), v->offset),
                                .lowp_dtype = dt,
                                .grads = fl_at(dt, P(t, 1), v->offset),
                                .grads_dtype = dt,
                                .grad_scale = 0.5f,
                                .clip_coef = 0.7f,
                                .stochastic = 1,
                                .sr_seed = fl_sr_bits(7, (uint64_t)step + 1),
                                .first_index = v->offset};
            x->update(r, v, v->offset, v->numel, &a);
        }
        fl_optim_end_step(r);
    }
}

// LOMO bitwise the cpu's; AdaLomo too where the device sums in the cpu's
// order (src/cuda/update.cu does), checked within 1e-6 (fp32) so that a
// device with an order of its own passes within a double's rounding.
static void fused(fl_dtype dt, int ada) {
    fused_args o = {.ada = ada};
    size_t w[2] = {300, 257}, b[1] = {1001}; // several of AdaLomo's chunks, ragged ends
    fl_params_add(&o.table, "w", FL_PARAM_DECAY, 2, w);
    fl_params_add(&o.table, "b", 0, 1, b);
    size_t n = o.table.numel;
    if (ada) {
        fl_adalomo_init_range(&o.adalomo[0], &o.table, 0, n, 1e-30f, 1e-3f, 1.0f, -0.8f, 0.01f,
                              0.0f);
        o.adalomo[1] = o.adalomo[0];
    } else {
        fl_lomo_init_range(&o.lomo[0], 0, n, 0.01f, 0.3f);
        o.lomo[1] = o.lomo[0];
    }
    size_t state_n = ada ? o.adalomo[0].numel : 0;
    tcase t = tc_new(ada ? "update: AdaLomo" : "update: LOMO", dt);
    tc_acc(&t, dt, n, 1.0f);     // 0: the weights, updated in place
    tc_in(&t, dt, n, 1.0f);      // 1: the gradients
    tc_out(&t, FL_F32, state_n); // 2: AdaLomo's state (from zero)
    memset(t.b[2].init, 0, t.b[2].bytes);
    t.b[2].compared = ada;
    for (int side = 0; side < 3; side++) {
        const fl_device *x = tc_begin(&t, side);
        if (!side && ada) memset(o.adalomo[0].state, 0, state_n * sizeof(float));
        call_fused(&t, x, &o);
        if (!side && ada) memcpy(t.b[2].host, o.adalomo[0].state, state_n * sizeof(float));
        tc_end(&t);
    }
    t_check(ada || memcmp(t.b[0].got[0], t.b[0].host, t.b[0].n * fl_dtype_size(dt)) == 0,
            "update: LOMO %s: the device's weights are the cpu's bitwise", fl_dtype_name(dt));
    tc_finish(&t, ada ? 1e-6 : 0.0);
    if (ada) fl_adalomo_free(&o.adalomo[0]);
    fl_params_free(&o.table);
}

// The backend's own scratch (device.h's scratch_bytes, issue 46): a block
// of the size it asks for, lent, serves its kernels at their widest (64
// row chunks of column sums of the LayerNorm's and a bias's gradients, an
// embedding backward over N distinct tokens, a sum of squares) without the
// device allocating more (its workspace count stays put); timed events
// measure a span the host slept through; cuda reports its context's bytes.
static void scratch_and_timing(void) {
    const int N = 64 * 256 + 5, cols = 96, C = 8;
    const fl_dtype dt = FL_F32;
    size_t bytes = dev->scratch_bytes(N, cols, 1), f = sizeof(float);
    void *b[12];
    size_t sizes[12] = {(size_t)N * cols * f,
                        cols * f,
                        cols * f,
                        (size_t)N * cols * f,
                        (size_t)N * cols * f,
                        cols * f,
                        (size_t)N * f,
                        (size_t)N * f,
                        (size_t)N * C * f,
                        (size_t)N * sizeof(int),
                        dev->matmul_workspace_bytes(dt, N, C, cols),
                        (size_t)cols * C * f};
    for (int i = 0; i < 12; i++) b[i] = dev->alloc(dev, FL_MEM_ACTS, sizes[i] ? sizes[i] : 1);
    int *ids = malloc((size_t)N * sizeof(int));
    for (int i = 0; i < N; i++) ids[i] = i;
    fl_dev_upload(dev, b[9], ids, (size_t)N * sizeof(int));
    free(ids);
    void *s = dev->alloc(dev, FL_MEM_WORKSPACE, bytes ? bytes : 1);
    dev->scratch_lend(dev, s, bytes);
    size_t ws = fl_mem_device_current(FL_MEM_WORKSPACE);
    // LayerNorm (N, cols): dinp, dweight, dbias, dout, inp, weight, mean, rstd
    dev->layernorm_backward(dt, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], N, cols);
    // a bias of cols outputs over N rows of C inputs: dinp, dweight, dbias, dout, inp, weight
    dev->matmul_backward(dt, b[8], b[11], b[2], b[3], b[8], b[11], b[10], N, C, cols, 1);
    dev->embedding_shard_backward(dt, b[0], b[8], b[9], 0, N, N, C);
    double sq = dev->sumsq(dt, b[0], (size_t)N * cols);
    dev->sync(dev);
    t_check(isfinite(sq) && fl_mem_device_current(FL_MEM_WORKSPACE) == ws,
            "%s: the lent scratch of %zu bytes serves the kernels at N %d, cols %d (the device's "
            "workspace count %zu, was %zu)",
            dev->name, bytes, N, cols, fl_mem_device_current(FL_MEM_WORKSPACE), ws);
    dev->scratch_return(dev, s);
    dev->free(dev, s);
    for (int i = 0; i < 12; i++) dev->free(dev, b[i]);
    dev->sync(dev); // the stream idle: the first event is reached as it is recorded
    fl_event *e0 = dev->event_record_timed(dev, NULL);
    struct timespec nap = {0, 20 * 1000000L};
    while (nanosleep(&nap, &nap) != 0) continue;
    fl_event *e1 = dev->event_record_timed(dev, NULL);
    double ms = dev->event_elapsed_ms(dev, e0, e1);
    dev->event_destroy(dev, e0);
    dev->event_destroy(dev, e1);
    t_check(ms >= 19.0 && ms < 10000.0,
            "%s: timed events measure the 20 ms the host slept between them (%.3f ms)", dev->name,
            ms);
    char line[256];
    dev->describe(dev, line, sizeof line);
    int cuda = !strcmp(dev->name, "cuda");
    t_check(cuda ? dev->reserved(dev) > 0 && strstr(line, "context") : dev->reserved(dev) == 0,
            "%s: the bytes it holds itself (%zu) %s", dev->name, dev->reserved(dev),
            cuda ? "measured at start-up and described" : "none");
}

int main(int argc, char **argv) {
    char why[512] = "";
    // the GELU epilogues checked too (matmul_gelu, matmul_dgelu)
    setenv("FITLM_CUDA_GELU_FUSION", "2", 0);
    if (argc > 1 && strcmp(argv[1], "test") == 0)
        dev = fl_device_test_table();
    else
        dev = fl_device_cuda_table(why, sizeof why);
    if (!dev) {
        printf("test_gpu: skipped: %s\n", why);
        return 77;
    }
    char line[256];
    dev->describe(dev, line, sizeof line);
    printf("test_gpu: %s against the cpu\n", line);
    const char *fusion = getenv("FITLM_CUDA_GELU_FUSION");
    int level = strcmp(dev->name, "cuda") ? 0 : atoi(fusion);
    t_check((level >= 1) == (dev->matmul_gelu_forward != NULL) &&
                (level >= 2) == (dev->matmul_dgelu_backward != NULL),
            "%s: the GELU epilogues are %s and %s (FITLM_CUDA_GELU_FUSION=%s)", dev->name,
            dev->matmul_gelu_forward ? "on" : "off", dev->matmul_dgelu_backward ? "on" : "off",
            fusion);
    const fl_dtype dts[] = {FL_F32, FL_BF16, FL_F16};
    for (int k = 0; k < 3; k++) {
        fl_dtype dt = dts[k];
        test_encoder(dt);
        norms(dt, 200);
        norms(dt, 197);
        matmuls(dt);
        attentions(dt);
        if (dt == FL_BF16 && !strcmp(dev->name, "cuda")) {
            // the WMMA version of the tensor-core kernels too (attention.cu;
            // fp16's is the same code on the other type)
            setenv("FITLM_CUDA_ATTENTION", "wmma", 1);
            attentions(dt);
            unsetenv("FITLM_CUDA_ATTENTION");
        }
        rope(dt, 64);
        rope(dt, 20);
        elementwise(dt, 520);
        elementwise(dt, 517);
        xent(dt);
        lora_nf4(dt);
        nf4_quantised(dt);
        step_pieces(dt);
        sumsq_rows(dt);
        optim(dt, 0, 0);
        optim(dt, 1, 0);
        optim(dt, 0, 1);
        optim(dt, 1, 1);
        fused(dt, 0);
        fused(dt, 1);
    }
    step_scalars();
    scratch_and_timing();
    return t_report();
}
