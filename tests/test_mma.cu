// test_mma.cu: src/cuda/mma.cuh's warp-level primitives against the
// layouts its comment states, on a GPU (CTest mma, label gpu: exits 77
// without one) and on the CUDA emulator (CTest gpu_emu_mma), from the same
// source: which elements each lane's registers hold after the A and B
// operand loads (ldmatrix, as stored and transposed), 16 x 16 x 32
// products with B stored either way against a host sum (bf16 and fp16),
// and a product's accumulators rounded to pairs as the A operand of the
// next (the attention kernels' P V); cp.async's copies and zero fill in
// two groups waited for one at a time; on the emulator, its contract's
// violations. On a GPU this checks the PTX ISA's
// layouts that the emulator assumes.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifndef __CUDACC__
#include "in_child.h" // the emulator's (tests/cuda_emu)
#endif

#include <cuda_runtime.h>

#include "common.cuh"
#include "mma.cuh"

static int checks, failures;

static void check(bool ok, const char *what, int i) {
    checks++;
    if (ok) return;
    if (failures++ < 20) fprintf(stderr, "FAIL: %s (at %d)\n", what, i);
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "test_mma: %s: %s\n", #call, cudaGetErrorString(e_));                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum { LD = 24 }; // a 16-wide matrix's rows in shared memory, padded by 8 values

// The registers of every lane after each load from the 16 x 16 matrix m
// (raw 16-bit values): out[lane * 12 + 0..3] A, 4..7 B a row per column,
// 8..11 B a row per k.
__global__ void k_layout(uint32_t *out, const uint16_t *m) {
    __shared__ __align__(16) uint16_t s[16 * LD];
    for (int i = threadIdx.x; i < 16 * 16; i += blockDim.x) s[i / 16 * LD + i % 16] = m[i];
    __syncthreads();
    uint32_t a[4], b[4], c[4];
    fl_d_mma_load_a(a, s, LD);
    fl_d_mma_load_b_rows(b, s, LD);
    fl_d_mma_load_b_cols(c, s, LD);
    for (int i = 0; i < 4; i++) {
        out[threadIdx.x * 12 + i] = a[i];
        out[threadIdx.x * 12 + 4 + i] = b[i];
        out[threadIdx.x * 12 + 8 + i] = c[i];
    }
}

// d (16 x 16, row-major) = A (16 x 32) B (32 x 16): B from bt (16 x 32, a
// row per column) when rows, else from b (32 x 16, a row per k); then, for
// chain, e (16 x 8) = round(d) C (16 x 8, a row per k) into d's first 8
// columns, d's accumulators rounded to pairs as the A operand.
template <class E>
__global__ void k_product(float *d_out, const uint16_t *a, const uint16_t *b, const uint16_t *bt,
                          const uint16_t *c, fl_dtype dt, int rows, int chain) {
    __shared__ __align__(16) uint16_t sa[16 * 40], sb[32 * LD], sbt[16 * 40], sc[16 * LD];
    for (int i = threadIdx.x; i < 16 * 32; i += blockDim.x) {
        sa[i / 32 * 40 + i % 32] = a[i];
        sb[i / 16 * LD + i % 16] = b[i];
        sbt[i / 32 * 40 + i % 32] = bt[i];
    }
    for (int i = threadIdx.x; i < 16 * 8; i += blockDim.x) sc[i / 8 * LD + i % 8] = c[i];
    __syncthreads();
    float d[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    for (int k = 0; k < 32; k += 16) {
        uint32_t af[4], bf[4];
        fl_d_mma_load_a(af, sa + k, 40);
        if (rows)
            fl_d_mma_load_b_rows(bf, sbt + k, 40);
        else
            fl_d_mma_load_b_cols(bf, sb + k * LD, LD);
        fl_d_mma<E>(d[0], af, bf[0], bf[1]);
        fl_d_mma<E>(d[1], af, bf[2], bf[3]);
    }
    int l = threadIdx.x % 32, g = l / 4, t = l % 4;
    if (chain) {
        uint32_t pa[4], cf[4];
        for (int r = 0; r < 4; r++) {
            const float *x = d[r / 2] + 2 * (r % 2);
            uint16_t lo = dt == FL_BF16 ? fl_d_f32_to_bf16(x[0]) : fl_d_f32_to_f16(x[0]);
            uint16_t hi = dt == FL_BF16 ? fl_d_f32_to_bf16(x[1]) : fl_d_f32_to_f16(x[1]);
            pa[r] = fl_d_pair(lo, hi);
        }
        fl_d_mma_load_b_cols(cf, sc, LD); // columns 0-7 in cf[0..1]
        float e[4] = {0, 0, 0, 0};
        fl_d_mma<E>(e, pa, cf[0], cf[1]);
        for (int i = 0; i < 4; i++) d_out[(g + 8 * (i / 2)) * 16 + 2 * t + i % 2] = e[i];
        return;
    }
    for (int n = 0; n < 2; n++)
        for (int i = 0; i < 4; i++) d_out[(g + 8 * (i / 2)) * 16 + n * 8 + 2 * t + i % 2] = d[n][i];
}

// cp.async: 16-byte pieces of src (n of them) into shared memory in two
// groups, every third piece zero-filled instead; the first group waited
// for alone, then the second; out = what shared memory then holds.
struct alignas(16) piece {
    uint32_t w[4];
};

__global__ void k_copy(piece *out, const piece *src, int n) {
    __shared__ __align__(16) piece s[64];
    for (int i = threadIdx.x; i < n / 2; i += blockDim.x) fl_d_cp_async16(s + i, src + i, i % 3);
    fl_d_cp_async_commit();
    for (int i = n / 2 + threadIdx.x; i < n; i += blockDim.x)
        fl_d_cp_async16(s + i, src + i, i % 3);
    fl_d_cp_async_commit();
    fl_d_cp_async_wait<1>();
    __syncthreads();
    for (int i = threadIdx.x; i < n / 2; i += blockDim.x) out[i] = s[i];
    fl_d_cp_async_wait<0>();
    __syncthreads();
    for (int i = n / 2 + threadIdx.x; i < n; i += blockDim.x) out[i] = s[i];
}

#ifndef __CUDACC__
// The emulator's contract (tests/cuda_emu/fl_emu_ptx.h), each broken in a
// child that must stop with the message: a thread returning with a copy
// it never waited for, an ldmatrix row not 16-byte aligned.
__global__ void k_unwaited(const piece *src) {
    __shared__ __align__(16) piece s[32];
    fl_d_cp_async16(s + threadIdx.x, src + threadIdx.x, 1);
    fl_d_cp_async_commit();
}

__global__ void k_misaligned() {
    __shared__ __align__(16) uint16_t s[16 * LD];
    uint32_t a[4];
    fl_d_mma_load_a(a, s + 1, LD);
}

static void dies(const char *what, void (*bad)(const piece *), const piece *src,
                 const char *expect) {
    bool stopped;
    std::string err = in_child<const piece *>(bad, src, &stopped);
    check(stopped && err.find(expect) != std::string::npos, what, 0);
}

static void test_violations(void) {
    piece *src;
    CK(cudaMalloc((void **)&src, 32 * sizeof(piece)));
    CK(cudaMemsetAsync(src, 0, 32 * sizeof(piece), 0));
    dies(
        "a copy never waited for stops the run", [](const piece *p) { k_unwaited<<<1, 32>>>(p); },
        src, "never waited for");
    dies(
        "a misaligned ldmatrix row stops the run", [](const piece *) { k_misaligned<<<1, 32>>>(); },
        src, "16-byte aligned");
    CK(cudaFree(src));
}
#endif

static unsigned rng = 2024;
static float uniform() { // in [-2, 2)
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
}

static uint16_t to16(fl_dtype dt, float x) {
    return dt == FL_BF16 ? fl_f32_to_bf16(x) : fl_f32_to_f16(x);
}
static float from16(fl_dtype dt, uint16_t h) {
    return dt == FL_BF16 ? fl_bf16_to_f32(h) : fl_f16_to_f32(h);
}

static void *upload(const void *p, size_t bytes) {
    void *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
    return d;
}

static void test_layout(void) {
    uint16_t m[256];
    for (int i = 0; i < 256; i++) m[i] = (uint16_t)i; // element (r, c) holds 16 r + c
    uint16_t *dm = (uint16_t *)upload(m, sizeof m);
    uint32_t *dout, out[32 * 12];
    CK(cudaMalloc((void **)&dout, sizeof out));
    k_layout<<<1, 32>>>(dout, dm);
    CK(cudaGetLastError());
    CK(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
    for (int l = 0; l < 32; l++) {
        int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; i++) {
            // A: rows g, g + 8; columns 2t, 2t + 8 (as pairs along a row)
            int ar = g + 8 * (i & 1), ac = 2 * t + 8 * (i >> 1);
            check(out[l * 12 + i] ==
                      (uint32_t)(ar * 16 + ac) + ((uint32_t)(ar * 16 + ac + 1) << 16),
                  "A operand layout", l * 4 + i);
            // B, a row per column: column n = g (+8 for b[2], b[3]), k = 2t (+8 for b[1], b[3])
            int bn = g + 8 * (i >> 1), bk = 2 * t + 8 * (i & 1);
            check(out[l * 12 + 4 + i] ==
                      (uint32_t)(bn * 16 + bk) + ((uint32_t)(bn * 16 + bk + 1) << 16),
                  "B operand layout (a row per column)", l * 4 + i);
            // B, a row per k: the pair runs down a column
            int ck = 2 * t + 8 * (i & 1), cn = g + 8 * (i >> 1);
            check(out[l * 12 + 8 + i] ==
                      (uint32_t)(ck * 16 + cn) + ((uint32_t)((ck + 1) * 16 + cn) << 16),
                  "B operand layout (a row per k)", l * 4 + i);
        }
    }
    CK(cudaFree(dm));
    CK(cudaFree(dout));
}

static void test_copy(void) {
    enum { N = 64 };
    uint32_t src[N * 4], out[N * 4];
    for (int i = 0; i < N * 4; i++) src[i] = 0x9e3779b9u * (uint32_t)(i + 1);
    piece *ds = (piece *)upload(src, sizeof src), *dout;
    CK(cudaMalloc((void **)&dout, sizeof out));
    k_copy<<<1, 32>>>(dout, ds, N);
    CK(cudaGetLastError());
    CK(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N * 4; i++)
        check(out[i] == (i / 4 % 3 ? src[i] : 0u), "cp.async: copied, or zero-filled", i);
    CK(cudaFree(ds));
    CK(cudaFree(dout));
}

template <class E> static void test_product(fl_dtype dt) {
    uint16_t a[16 * 32], b[32 * 16], bt[16 * 32], c[16 * 8];
    float af[16 * 32], bf[32 * 16], cf[16 * 8];
    for (int i = 0; i < 16 * 32; i++) a[i] = to16(dt, uniform()), af[i] = from16(dt, a[i]);
    for (int k = 0; k < 32; k++)
        for (int n = 0; n < 16; n++) {
            b[k * 16 + n] = bt[n * 32 + k] = to16(dt, uniform());
            bf[k * 16 + n] = from16(dt, b[k * 16 + n]);
        }
    for (int i = 0; i < 16 * 8; i++) c[i] = to16(dt, uniform()), cf[i] = from16(dt, c[i]);
    uint16_t *da = (uint16_t *)upload(a, sizeof a), *db = (uint16_t *)upload(b, sizeof b);
    uint16_t *dbt = (uint16_t *)upload(bt, sizeof bt), *dc = (uint16_t *)upload(c, sizeof c);
    float *dd, d[256];
    CK(cudaMalloc((void **)&dd, sizeof d));
    double ref[256], mag[256];
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            double s = 0, m = 0;
            for (int k = 0; k < 32; k++) {
                s += (double)af[r * 32 + k] * bf[k * 16 + n];
                m += fabs((double)af[r * 32 + k] * bf[k * 16 + n]);
            }
            ref[r * 16 + n] = s, mag[r * 16 + n] = m;
        }
    const char *what[2] = {"product, B a row per k", "product, B a row per column"};
    for (int rows = 0; rows < 2; rows++) {
        k_product<E><<<1, 32>>>(dd, da, db, dbt, dc, dt, rows, 0);
        CK(cudaGetLastError());
        CK(cudaMemcpy(d, dd, sizeof d, cudaMemcpyDeviceToHost));
        for (int i = 0; i < 256; i++)
            check(fabs(d[i] - ref[i]) <= 1e-5 * mag[i] + 1e-30, what[rows], i);
    }
    // the chain: round(A B) C, rounding as the device does (fp32 sums of
    // exact products: the host's sum in double rounds to the same 16 bits
    // but where the fp32 sum sits on a rounding boundary)
    k_product<E><<<1, 32>>>(dd, da, db, dbt, dc, dt, 0, 1);
    CK(cudaGetLastError());
    CK(cudaMemcpy(d, dd, sizeof d, cudaMemcpyDeviceToHost));
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 8; n++) {
            double s = 0, m = 0;
            for (int k = 0; k < 16; k++) {
                float p = from16(dt, to16(dt, (float)ref[r * 16 + k]));
                s += (double)p * cf[k * 8 + n];
                m += fabs((double)p * cf[k * 8 + n]);
            }
            // one 16-bit rounding of a P element apart at most
            check(fabs(d[r * 16 + n] - s) <= 8e-3 * m + 1e-30, "accumulators as the A operand",
                  r * 8 + n);
        }
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dbt));
    CK(cudaFree(dc));
    CK(cudaFree(dd));
}

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("test_mma: no GPU: skipped\n");
        return 77;
    }
    test_layout();
    test_copy();
    test_product<__nv_bfloat16>(FL_BF16);
    test_product<__half>(FL_F16);
#ifndef __CUDACC__
    test_violations();
#endif
    printf("test_mma: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
