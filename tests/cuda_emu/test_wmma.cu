// test_wmma.cu: the CUDA emulator's warp matrix functions (mma.h) against a
// plain host matmul, bitwise (fp32 sums in k order on both sides): bf16 and
// fp16 operands, matrix_a and matrix_b row- and column-major, the
// accumulator loaded and stored either way, padded rows, d = c, several
// warps and blocks each on their own tile, the three shapes; the scrambled
// layout (a kernel that assumes one fails, elementwise scaling stays right);
// a store seen by other lanes only after a barrier; __syncwarp; the bf16
// and fp16 conversions; and the contract's
// violations, each in a child process that must stop with its message.
// Built for the emulator only (CTest gpu_emu_wmma), translated as src/cuda/.
#include <mma.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <type_traits>
#include <vector>

#include "in_child.h"

using namespace nvcuda;

static int checks, failures;

static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(bool ok, const char *fmt, ...) {
    checks++;
    if (ok) return;
    failures++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

static unsigned rng = 12345;
static float uniform() { // in [-2, 2)
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
}

static float to_f(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
static float to_f(__half v) {
    return __half2float(v);
}
static unsigned bits(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

template <class L> __host__ __device__ static bool is_row() {
    return std::is_same<L, wmma::row_major>::value;
}

// One warp per (M x K) x (K x N) product, K = 2k: two mma_sync calls
// (d = a0 b0 + c, then d = a1 b1 + d), each warp on its own tile; alias:
// the accumulator is c itself.
template <class T, class LA, class LB, int M, int N, int K>
__global__ void mm_kernel(const T *A, const T *B, const float *C, float *D, unsigned lda,
                          unsigned ldb, unsigned ldc, wmma::layout_t cl, wmma::layout_t dl,
                          size_t tile_a, size_t tile_b, size_t tile_c, int alias) {
    int w = (int)(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);
    A += tile_a * (size_t)w;
    B += tile_b * (size_t)w;
    C += tile_c * (size_t)w;
    D += tile_c * (size_t)w;
    wmma::fragment<wmma::matrix_a, M, N, K, T, LA> a;
    wmma::fragment<wmma::matrix_b, M, N, K, T, LB> b;
    wmma::fragment<wmma::accumulator, M, N, K, float> c, d;
    wmma::load_matrix_sync(c, C, ldc, cl);
    wmma::fragment<wmma::accumulator, M, N, K, float> &acc = alias ? c : d;
    for (int half = 0; half < 2; half++) {
        // the k-th column block of A, the k-th row block of B
        bool ra = is_row<LA>(), rb = is_row<LB>();
        wmma::load_matrix_sync(a, A + (ra ? (size_t)half * K : (size_t)half * K * lda), lda);
        wmma::load_matrix_sync(b, B + (rb ? (size_t)half * K * ldb : (size_t)half * K), ldb);
        wmma::mma_sync(acc, a, b, half ? acc : c);
    }
    wmma::store_matrix_sync(D, acc, ldc, dl);
}

static const unsigned poison = 0xffffffffu;

// A matrix of rows x cols at ld (row-major: rows of ld elements), the
// padding left 0xFF, as device memory starts.
template <class T> struct host_mat {
    std::vector<T> v;
    host_mat(size_t tiles, size_t n) : v(tiles * n) {
        memset((void *)v.data(), 0xff, v.size() * sizeof(T));
    }
};

template <class T, class LA, class LB, int M, int N, int K>
static void run_mm(const char *tname, wmma::layout_t cl, wmma::layout_t dl, int alias) {
    const int KK = 2 * K, tiles_per_block = 4, blocks = 2, tiles = tiles_per_block * blocks;
    bool ra = is_row<LA>(), rb = is_row<LB>(), rc = cl == wmma::mem_row_major,
         rd = dl == wmma::mem_row_major;
    // padded leading dimensions, multiples of 16 bytes
    unsigned lda = (unsigned)(ra ? KK : M) + 8, ldb = (unsigned)(rb ? N : KK) + 16,
             ldc = (unsigned)(M > N ? M : N) + 4;
    size_t tile_a = (size_t)lda * (ra ? M : KK), tile_b = (size_t)ldb * (rb ? KK : N),
           tile_c = (size_t)ldc * (M > N ? M : N);
    host_mat<T> A(tiles, tile_a), B(tiles, tile_b);
    host_mat<float> C(tiles, tile_c), D(tiles, tile_c);
    for (int t = 0; t < tiles; t++) {
        for (int i = 0; i < M; i++)
            for (int k = 0; k < KK; k++)
                A.v[t * tile_a + (ra ? i * lda + k : k * lda + i)] = T(uniform());
        for (int k = 0; k < KK; k++)
            for (int j = 0; j < N; j++)
                B.v[t * tile_b + (rb ? k * ldb + j : j * ldb + k)] = T(uniform());
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++)
                C.v[t * tile_c + (rc ? i * ldc + j : j * ldc + i)] = uniform();
    }
    T *dA, *dB;
    float *dC, *dD;
    cudaMalloc(&dA, A.v.size() * sizeof(T));
    cudaMalloc(&dB, B.v.size() * sizeof(T));
    cudaMalloc(&dC, C.v.size() * 4);
    cudaMalloc(&dD, D.v.size() * 4);
    cudaMemcpy(dA, A.v.data(), A.v.size() * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B.v.data(), B.v.size() * sizeof(T), cudaMemcpyHostToDevice);
    cudaMemcpy(dC, C.v.data(), C.v.size() * 4, cudaMemcpyHostToDevice);
    int bad = 0, padding = 0;
    for (int launch = 0; launch < 2; launch++) { // forward, then reverse order
        cudaMemsetAsync(dD, 0xff, D.v.size() * 4, 0);
        mm_kernel<T, LA, LB, M, N, K><<<blocks, 32 * tiles_per_block>>>(
            dA, dB, dC, dD, lda, ldb, ldc, cl, dl, tile_a, tile_b, tile_c, alias);
        check(cudaGetLastError() == cudaSuccess, "launch");
        cudaMemcpy(D.v.data(), dD, D.v.size() * 4, cudaMemcpyDeviceToHost);
        for (int t = 0; t < tiles; t++) {
            std::vector<char> written(tile_c);
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) {
                    float want = C.v[t * tile_c + (rc ? i * ldc + j : j * ldc + i)];
                    for (int k = 0; k < KK; k++)
                        want += to_f(A.v[t * tile_a + (ra ? i * lda + k : k * lda + i)]) *
                                to_f(B.v[t * tile_b + (rb ? k * ldb + j : j * ldb + k)]);
                    size_t at = rd ? (size_t)i * ldc + j : (size_t)j * ldc + i;
                    written[at] = 1;
                    bad += bits(D.v[t * tile_c + at]) != bits(want);
                }
            for (size_t at = 0; at < tile_c; at++)
                padding += !written[at] && bits(D.v[t * tile_c + at]) != poison;
        }
    }
    check(!bad && !padding,
          "m%dn%dk%d %s a %s b %s c %s d %s%s: %d of %d elements differ from the host's sums, %d "
          "padding elements written",
          M, N, K, tname, ra ? "row" : "col", rb ? "row" : "col", rc ? "row" : "col",
          rd ? "row" : "col", alias ? " (d = c)" : "", bad, 2 * tiles * M * N, padding);
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dC);
    cudaFree(dD);
}

template <class T, int M, int N, int K> static void run_layouts(const char *tname) {
    const wmma::layout_t row = wmma::mem_row_major, col = wmma::mem_col_major;
    run_mm<T, wmma::row_major, wmma::row_major, M, N, K>(tname, row, row, 0);
    run_mm<T, wmma::row_major, wmma::col_major, M, N, K>(tname, col, row, 1);
    run_mm<T, wmma::col_major, wmma::row_major, M, N, K>(tname, row, col, 0);
    run_mm<T, wmma::col_major, wmma::col_major, M, N, K>(tname, col, col, 1);
}

// Each lane writes lane * 8 + e into its x[e]: where each lands is the layout.
__global__ void layout_kernel(float *out) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    int lane = (int)threadIdx.x % 32;
    for (int e = 0; e < acc.num_elements; e++) acc.x[e] = (float)(lane * 8 + e);
    wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}

// A kernel that assumes sm_80's accumulator layout (lane / 4 is the row,
// e / 2 % 2 adds 8) and writes each element's row index into x[e].
__global__ void assumed_rows_kernel(float *out) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    int lane = (int)threadIdx.x % 32;
    for (int e = 0; e < acc.num_elements; e++) acc.x[e] = (float)(lane / 4 + 8 * (e / 2 % 2));
    wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}

// Elementwise, layout-free: every accumulator element doubled, and a's
// elements doubled before the product.
__global__ void scale_kernel(const __half *A, const __half *B, const float *C, float *D) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::load_matrix_sync(a, A, 16);
    wmma::load_matrix_sync(b, B, 16);
    wmma::load_matrix_sync(c, C, 16, wmma::mem_row_major);
    for (int e = 0; e < c.num_elements; e++) c.x[e] *= 2.0f;
    for (int e = 0; e < a.num_elements; e++) a.x[e] = __float2half(2.0f * __half2float(a.x[e]));
    wmma::mma_sync(c, a, b, c);
    wmma::store_matrix_sync(D, c, 16, wmma::mem_row_major);
}

// Through 128-byte aligned dynamic shared memory: the tile staged there by
// the whole block, a product of it stored back there, read by every lane
// after __syncwarp (and by every lane at once without it: what it sees).
__global__ void shared_kernel(const __nv_bfloat16 *A, float *D, float *early, int *aligned) {
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *tile = (__nv_bfloat16 *)smem;
    float *out = (float *)(smem + 16 * 24 * sizeof(__nv_bfloat16));
    int lane = (int)threadIdx.x;
    if (lane == 0) *aligned = (int)((uintptr_t)smem % 128 == 0);
    for (int i = lane; i < 256; i += 32) tile[i / 16 * 24 + i % 16] = A[i];
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 0.0f);
    wmma::load_matrix_sync(a, tile, 24);
    wmma::load_matrix_sync(b, tile, 24); // A^T as b: D = A A^T
    wmma::mma_sync(c, a, b, c);
    wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
    early[lane] = out[255 - lane]; // another lane's element, before any barrier
    __syncwarp();
    for (int i = lane; i < 256; i += 32) D[i] = out[i];
}

// __syncwarp of a half-warp inside a branch: each lane then reads another's
__global__ void syncwarp_kernel(float *out) {
    __shared__ float buf[16];
    int lane = (int)threadIdx.x;
    if (lane < 16) {
        buf[lane] = (float)lane;
        __syncwarp(0x0000ffffu);
        out[lane] = buf[15 - lane];
    }
}
__global__ void syncwarp_without_itself_kernel() {
    __syncwarp(0xfffffffeu);
}

// __align__ where CUDA code puts it: before a type, after a declarator
struct __align__(16) aligned16 {
    float v[3];
};

static void test_syncwarp() {
    float after[3] __align__(32);
    check(alignof(aligned16) == 16 && sizeof(aligned16) == 16 && (uintptr_t)after % 32 == 0,
          "__align__ on a struct and after a declarator");
    float *d;
    std::vector<float> h(16);
    cudaMalloc(&d, 64);
    int bad = 0;
    for (int launch = 0; launch < 2; launch++) {
        syncwarp_kernel<<<1, 32>>>(d);
        cudaMemcpy(h.data(), d, 64, cudaMemcpyDeviceToHost);
        for (int l = 0; l < 16; l++) bad += h[l] != (float)(15 - l);
    }
    check(!bad, "__syncwarp(0xffff) of a half-warp: %d reads wrong", bad);
    cudaFree(d);
}

static void test_layout() {
    float *d;
    std::vector<float> h(256);
    cudaMalloc(&d, 256 * 4);
    layout_kernel<<<1, 32>>>(d);
    cudaMemcpy(h.data(), d, 256 * 4, cudaMemcpyDeviceToHost);
    std::vector<int> seen(256);
    int identity = 1, ok = 1;
    for (int p = 0; p < 256; p++) {
        int v = (int)h[p];
        ok &= v >= 0 && v < 256 && (float)v == h[p] && !seen[v]++;
        identity &= v == p;
    }
    check(ok, "the accumulator's layout is a bijection of the 256 elements");
    check(!identity, "the accumulator's layout is not the identity");
    assumed_rows_kernel<<<1, 32>>>(d);
    cudaMemcpy(h.data(), d, 256 * 4, cudaMemcpyDeviceToHost);
    int right = 0;
    for (int p = 0; p < 256; p++) right += h[p] == (float)(p / 16);
    check(right < 256, "a kernel assuming a layout stores wrong rows (%d of 256 right)", right);
    cudaFree(d);

    std::vector<__half> A(256), B(256);
    std::vector<float> C(256), D(256);
    for (int i = 0; i < 256; i++)
        A[i] = __float2half(uniform()), B[i] = __float2half(uniform()), C[i] = uniform();
    __half *dA, *dB;
    float *dC, *dD;
    cudaMalloc(&dA, 512);
    cudaMalloc(&dB, 512);
    cudaMalloc(&dC, 1024);
    cudaMalloc(&dD, 1024);
    cudaMemcpy(dA, A.data(), 512, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B.data(), 512, cudaMemcpyHostToDevice);
    cudaMemcpy(dC, C.data(), 1024, cudaMemcpyHostToDevice);
    scale_kernel<<<1, 32>>>(dA, dB, dC, dD);
    cudaMemcpy(D.data(), dD, 1024, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float want = 2.0f * C[i * 16 + j];
            for (int k = 0; k < 16; k++)
                want += 2.0f * __half2float(A[i * 16 + k]) * __half2float(B[k * 16 + j]);
            bad += bits(D[i * 16 + j]) != bits(want);
        }
    check(!bad, "elementwise scaling of the fragments: %d of 256 elements wrong", bad);
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dC);
    cudaFree(dD);
}

static void test_shared() {
    std::vector<__nv_bfloat16> A(256);
    for (int i = 0; i < 256; i++) A[i] = __float2bfloat16(uniform());
    __nv_bfloat16 *dA;
    float *dD, *dEarly;
    int *dAligned, aligned = 0;
    cudaMalloc(&dA, 512);
    cudaMalloc(&dD, 1024);
    cudaMalloc(&dEarly, 128);
    cudaMalloc(&dAligned, 4);
    cudaMemcpy(dA, A.data(), 512, cudaMemcpyHostToDevice);
    std::vector<float> D(256), early(32);
    int bad = 0, poisoned = 0;
    for (int launch = 0; launch < 2; launch++) { // forward, then reverse order
        shared_kernel<<<1, 32, 16 * 24 * 2 + 1024>>>(dA, dD, dEarly, dAligned);
        cudaMemcpy(D.data(), dD, 1024, cudaMemcpyDeviceToHost);
        cudaMemcpy(early.data(), dEarly, 128, cudaMemcpyDeviceToHost);
        cudaMemcpy(&aligned, dAligned, 4, cudaMemcpyDeviceToHost);
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) {
                float want = 0;
                for (int k = 0; k < 16; k++)
                    want += __bfloat162float(A[i * 16 + k]) * __bfloat162float(A[j * 16 + k]);
                bad += bits(D[i * 16 + j]) != bits(want);
            }
        for (int l = 0; l < 32; l++) poisoned += bits(early[l]) == poison;
        check(aligned == 1, "dynamic shared memory 128-byte aligned");
    }
    check(!bad, "through shared memory: %d elements wrong", bad);
    check(poisoned > 0,
          "a store is not seen by other lanes before a barrier (%d reads of 64 saw "
          "the old bytes)",
          poisoned);
    cudaFree(dA);
    cudaFree(dD);
    cudaFree(dEarly);
    cudaFree(dAligned);
}

// ---- the 16-bit types' conversions

// bf16 by the definition: the nearer of the two neighbours in double, a tie
// to the even one (the exponent unbounded, as IEEE rounds to infinity)
static unsigned short bf16_reference(float f) {
    unsigned lo = bits(f) >> 16, hi = lo + 1;
    double dlo = (double)__bfloat162float(__ushort_as_bfloat16((unsigned short)lo)),
           dhi = (double)__bfloat162float(__ushort_as_bfloat16((unsigned short)hi));
    if ((hi & 0x7f80) == 0x7f80) dhi = ldexp(f < 0 ? -1.0 : 1.0, 128); // past the largest: 2^128
    double elo = fabs((double)f - dlo), ehi = fabs(dhi - (double)f);
    return (unsigned short)(elo < ehi || (elo == ehi && !(lo & 1)) ? lo : hi);
}

static void test_conversions() {
    // every fp16 and bf16 value: exact to float (against the compiler's
    // _Float16) and back unchanged; fp16's NaNs to CUDA's canonical float NaN
    int bad_h = 0, bad_b = 0;
    for (unsigned u = 0; u < 65536; u++) {
        unsigned short h = (unsigned short)u;
        _Float16 ref;
        memcpy(&ref, &h, 2);
        float f = __half2float(__ushort_as_half(h));
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        bad_h += nan ? bits(f) != 0x7fffffffu || __half_as_ushort(__float2half(f)) != 0x7fff
                     : bits(f) != bits((float)ref) || __half_as_ushort(__float2half(f)) != h;
        float g = __bfloat162float(__ushort_as_bfloat16(h));
        bool bnan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        bad_b += bits(g) != (unsigned)h << 16 ||
                 __bfloat16_as_ushort(__float2bfloat16(g)) != (bnan ? 0x7fff : h);
    }
    check(!bad_h, "fp16 -> float -> fp16 on all 65536 values: %d wrong", bad_h);
    check(!bad_b, "bf16 -> float -> bf16 on all 65536 values: %d wrong", bad_b);
    // rounding: random floats over every exponent, and the halfway points
    // (ties to even), against _Float16's conversion and the definition
    bad_h = bad_b = 0;
    for (int i = 0; i < 2000000; i++) {
        rng = rng * 1664525u + 1013904223u;
        unsigned u = rng;
        if (i % 4 == 1) u = (u & 0xffffe000u) | 0x1000u;     // halfway between two normal fp16s
        if (i % 4 == 2) u = (u & 0xffff0000u) | 0x8000u;     // halfway between two bf16s
        if (i % 4 == 3) u = (u & 0x8fffffffu) | 0x30000000u; // fp16's subnormal range and near
        float f;
        memcpy(&f, &u, 4);
        if (f != f) continue;
        bad_h += __half_as_ushort(__float2half(f)) != [f] {
            _Float16 r = (_Float16)f;
            unsigned short s;
            memcpy(&s, &r, 2);
            return s;
        }();
        bad_b += __bfloat16_as_ushort(__float2bfloat16(f)) != bf16_reference(f) ||
                 __bfloat16_as_ushort(__float2bfloat16_rn(f)) != bf16_reference(f);
        bad_h += __half_as_ushort(__float2half_rn(f)) != __half_as_ushort(__float2half(f));
    }
    check(!bad_h, "float -> fp16 rounding against _Float16: %d of 2M wrong", bad_h);
    check(!bad_b, "float -> bf16 rounding against the definition: %d of 2M wrong", bad_b);
    check(__half_as_ushort(__float2half(65520.0f)) == 0x7c00 &&
              __half_as_ushort(__float2half(65519.0f)) == 0x7bff &&
              __half_as_ushort(__float2half(5.9604645e-8f)) == 1 &&
              __half_as_ushort(__float2half(2.9802322e-8f)) == 0 &&
              __half_as_ushort(__float2half(-2.9802326e-8f)) == 0x8001,
          "fp16's overflow and subnormal edges");
    check(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat16) == 2 && sizeof(half) == 2 &&
              alignof(__half) == 2 && std::is_trivially_copyable<__nv_bfloat16>::value &&
              std::is_trivially_copyable<__half>::value,
          "the 16-bit types are 2 bytes, aligned to 2, trivially copyable");
}

// ---- the contract's violations, each in a child

__global__ void misaligned_kernel(const __nv_bfloat16 *A) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    wmma::load_matrix_sync(a, A + 8, 32); // 16 bytes in
}
__global__ void bad_ldm_kernel(const __nv_bfloat16 *A) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    wmma::load_matrix_sync(a, A, 20);
}
__global__ void bad_ldm_float_kernel(float *D) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 1.0f);
    wmma::store_matrix_sync(D, c, 18, wmma::mem_col_major);
}
__global__ void half_warp_kernel(const __nv_bfloat16 *A) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    if (threadIdx.x < 16) wmma::load_matrix_sync(a, A, 16);
    __syncthreads();
}
__global__ void half_warp_returns_kernel(const __nv_bfloat16 *A) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    if (threadIdx.x < 16) wmma::load_matrix_sync(a, A, 16);
}
// the last tile's rows run past the allocation's end (4096 bytes: 128 rows
// of 16 bf16 from the start, the tile at row 120 needs 16)
__global__ void past_the_end_kernel(const __nv_bfloat16 *A) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    wmma::load_matrix_sync(a, A + 120 * 16, 16);
}
__global__ void local_memory_kernel(float *D) {
    __align__(32) float local[256];
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 1.0f);
    wmma::store_matrix_sync(local, c, 16, wmma::mem_row_major);
    D[0] = local[0];
}
__global__ void ptrs_differ_kernel(const __nv_bfloat16 *A) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    wmma::load_matrix_sync(a, A + (threadIdx.x == 5 ? 16 : 0), 32);
}
__global__ void layouts_differ_kernel(float *D) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 1.0f);
    wmma::store_matrix_sync(D, c, 16, threadIdx.x ? wmma::mem_row_major : wmma::mem_col_major);
}
__global__ void wmma_and_shuffle_kernel(const __nv_bfloat16 *A, float *D) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    if (threadIdx.x < 16)
        wmma::load_matrix_sync(a, A, 16);
    else
        D[0] = __shfl_sync(0xffffffffu, 1.0f, 0);
}
__global__ void copies_differ_kernel(const __half *A, float *D) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::load_matrix_sync(a, A, 16);
    wmma::load_matrix_sync(b, A, 16);
    wmma::fill_fragment(c, 0.0f);
    // the first half-warp's elements only: one copy of each matrix element
    if (threadIdx.x < 16)
        for (int e = 0; e < a.num_elements; e++) a.x[e] = __float2half(0.5f);
    wmma::mma_sync(c, a, b, c);
    wmma::store_matrix_sync(D, c, 16, wmma::mem_row_major);
}

struct device_bufs {
    __nv_bfloat16 *bf;
    __half *h;
    float *f;
};

// Runs `bad` in a child, which must stop (abort) with `expect` on stderr.
static void dies(const char *name, void (*bad)(const device_bufs &), const device_bufs &b,
                 const char *expect) {
    bool stopped;
    std::string err = in_child<const device_bufs &>(bad, b, &stopped);
    check(stopped && err.find(expect) != std::string::npos, "%s: stops with '%s' (%s: %s)", name,
          expect, stopped ? "stopped" : "did not stop", err.c_str());
}

static void test_violations() {
    device_bufs b;
    cudaMalloc(&b.bf, 4096);
    cudaMalloc(&b.h, 4096);
    cudaMalloc(&b.f, 4096);
    cudaMemsetAsync(b.bf, 0, 4096, 0);
    cudaMemsetAsync(b.h, 0, 4096, 0);
    dies(
        "misaligned", [](const device_bufs &d) { misaligned_kernel<<<1, 32>>>(d.bf); }, b,
        "kernel misaligned_kernel: wmma::load_matrix_sync at");
    dies(
        "misaligned message", [](const device_bufs &d) { misaligned_kernel<<<1, 32>>>(d.bf); }, b,
        "not 256-bit (32-byte) aligned");
    dies(
        "ldm", [](const device_bufs &d) { bad_ldm_kernel<<<1, 32>>>(d.bf); }, b,
        "kernel bad_ldm_kernel: wmma::load_matrix_sync with ldm 20, not a multiple of 8 elements");
    dies(
        "float ldm", [](const device_bufs &d) { bad_ldm_float_kernel<<<1, 32>>>(d.f); }, b,
        "wmma::store_matrix_sync with ldm 18, not a multiple of 4 elements");
    dies(
        "16 lanes", [](const device_bufs &d) { half_warp_kernel<<<1, 32>>>(d.bf); }, b,
        "kernel half_warp_kernel: its threads wait at barriers that cannot open");
    dies(
        "16 lanes, the rest returned",
        [](const device_bufs &d) { half_warp_returns_kernel<<<1, 32>>>(d.bf); }, b,
        "names lane 16, which has returned");
    dies(
        "a block of 16 threads",
        [](const device_bufs &d) { misaligned_kernel<<<1, 16>>>(d.bf + 8); }, b,
        "names lane 16 of a block without it");
    dies(
        "pointers differ", [](const device_bufs &d) { ptrs_differ_kernel<<<1, 32>>>(d.bf); }, b,
        "wmma::load_matrix_sync with arguments that differ across warp 0 (lane 5");
    dies(
        "layouts differ", [](const device_bufs &d) { layouts_differ_kernel<<<1, 32>>>(d.f); }, b,
        "wmma::store_matrix_sync with arguments that differ across warp 0");
    dies(
        "wmma beside a shuffle",
        [](const device_bufs &d) { wmma_and_shuffle_kernel<<<1, 32>>>(d.bf, d.f); }, b,
        "meet at a WMMA call and at a shuffle or __syncwarp");
    dies(
        "past the allocation's end",
        [](const device_bufs &d) { past_the_end_kernel<<<1, 32>>>(d.bf); }, b,
        "kernel past_the_end_kernel: wmma::load_matrix_sync of [");
    dies(
        "past the allocation's end message",
        [](const device_bufs &d) { past_the_end_kernel<<<1, 32>>>(d.bf); }, b,
        "+512 bytes) (ldm 16), outside every device allocation and shared array");
    dies(
        "a local array", [](const device_bufs &d) { local_memory_kernel<<<1, 32>>>(d.f); }, b,
        "kernel local_memory_kernel: wmma::store_matrix_sync of [");
    dies(
        "__syncwarp without itself",
        [](const device_bufs &) { syncwarp_without_itself_kernel<<<1, 32>>>(); }, b,
        "kernel syncwarp_without_itself_kernel: lane 0 calls __syncwarp with a mask without "
        "itself");
    dies(
        "fp16 copies differ",
        [](const device_bufs &d) { copies_differ_kernel<<<1, 32>>>(d.h, d.f); }, b,
        "differs from another copy of the same matrix element");
    cudaFree(b.bf);
    cudaFree(b.h);
    cudaFree(b.f);
}

int main() {
    run_layouts<__nv_bfloat16, 16, 16, 16>("bf16");
    run_layouts<__half, 16, 16, 16>("fp16");
    run_layouts<__nv_bfloat16, 32, 8, 16>("bf16");
    run_layouts<__half, 32, 8, 16>("fp16");
    run_layouts<__nv_bfloat16, 8, 32, 16>("bf16");
    run_layouts<__half, 8, 32, 16>("fp16");
    test_layout();
    test_shared();
    test_syncwarp();
    test_conversions();
    test_violations();
    printf("test_wmma: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
