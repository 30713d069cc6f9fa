// gemm.c: c (M,N) = beta * c (or a bias row) + op(a) @ op(b), single-
// threaded, operands of any storage dtype, the BLIS way: op(b) is packed in
// blocks of KC x NC into panels NR columns wide, op(a) in micro-panels of MR
// rows x KC; a register-blocked kernel multiplies one micro-panel of each.
// Packing converts bf16 and fp16 to fp32, so the 16-bit path pays no
// conversion pass of its own; with AVX-512 an op(b) that is row-major
// already is read in place (16-bit values converted in registers), with
// either kernel a row-major fp32 op(a) when b is narrow, and a 16-bit c of
// one depth block is loaded and rounded by the kernel itself.
// Kernels: AVX-512 8 x 48, AVX2+FMA 6 x 16. Without AVX2 the matmul keeps
// OpenBLAS's sgemm on converted operands (matmul.c): a plain C kernel ran at
// a sixth of its speed.
// Each element of c sums its products in k order, in blocks of KC added to c
// (the first block to the bias, if any).
#include "gemm.h"

#include <string.h>

#include "fitlm/core.h"
#include "simd.h"

// Blocks of op(a) (MC x KC, 192 KiB) and op(b) (KC x NC, 288 KiB) stay in
// L2; a micro-panel of op(a) (MR x KC, 8 KiB at MR = 8) in L1 while the
// kernel streams op(b)'s panels. MC is a multiple of every MR, NC of every NR.
#define KC GEMM_DEPTH_BLOCK
#define NC 288
#define MC GEMM_ROW_BLOCK
// rows a block of op(a) is rounded to: a multiple of every kernel's MR
#define MR_ALL 24
// rows of a transposed operand fetched ahead while packing
#define PREFETCH_ROWS 4
#define NR_MAX        48

static int min_int(int a, int b) {
    return a < b ? a : b;
}

static int round_up(int n, int q) {
    return (n + q - 1) / q * q;
}

// a's and b's blocks for a call of that shape (any kernel's MR and NR)
static size_t a_block_floats(int M, int K) {
    return (size_t)min_int(MC, round_up(M, MR_ALL)) * min_int(KC, K);
}
static size_t b_block_floats(int N, int K) {
    return (size_t)min_int(KC, K) * min_int(NC, round_up(N, NR_MAX));
}

size_t gemm_pack_floats(int M, int N, int K) {
    return a_block_floats(M, K) + b_block_floats(N, K) + MR_ALL * NR_MAX; // and an edge tile
}

#if FL_HAVE_X86_SIMD
// The dtypes a kernel reads b and c in, one of them fp32: a 16-bit b read
// in place (the input gradient's weight), or a 16-bit c that the call adds
// one depth block into (a weight gradient over at most KC tokens); their
// values are converted in registers, c's rounded once as it is stored.
typedef struct {
    fl_dtype b, c;
} tile_dts;

// c (MR x NR, row stride ldc) = (load_c ? c : bias ? bias in every row : 0)
// + a (kc x MR) @ b (kc x NR, row stride ldb), b and c of dtypes dts, bias
// NR fp32 values; a a packed micro-panel (lda 0) or, where the kernel can,
// MR fp32 rows lda apart read in place
typedef void kernel_fn(int kc, const float *a, size_t lda, const void *b, size_t ldb, void *c,
                       size_t ldc, int load_c, const float *bias, tile_dts dts);

// kernel: mr x nr; narrow[v]: mr x 16 (v + 1) on the same panels, for a
// last panel of 16 (v + 1) columns (NULL: none, the scratch tile instead);
// b_in_place, a_in_place: reads an op(b), or an fp32 op(a), stored
// row-major where it lies (see gemm_tile_isa)
typedef struct {
    int mr, nr;
    kernel_fn *kernel, *narrow[2];
    int b_in_place, a_in_place;
} gemm_kernel;

// 8 rows x NV vectors of 16: c (8 x 16 NV, row stride ldc) = (load_c ? c :
// bias ? bias : 0) + a (kc x 8) @ the first 16 NV columns of b (kc x 48, row
// stride ldb); b of dtype bdt, c of cdt; a_rows: a's rows read in place, lda
// apart, else a packed micro-panel (all constants where inlined)
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) static inline void
kernel_avx512_rows8(int nv, fl_dtype bdt, fl_dtype cdt, int kc, const float *a, int a_rows,
                    size_t lda, const void *b, size_t ldb, void *c, size_t ldc, int load_c,
                    const float *bias) {
    __m512 acc[8][3], init[3];
#pragma GCC unroll 3
    for (int v = 0; v < nv; v++)
        init[v] = !load_c && bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++)
            acc[r][v] = load_c ? load16_f32(cdt, c, r * ldc + 16 * v, 0xFFFF) : init[v];
    for (int k = 0; k < kc; k++, a += a_rows ? 1 : 8, b = fl_at_const(bdt, b, ldb)) {
        __m512 bv[3];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) bv[v] = load16_f32(bdt, b, 16 * v, 0xFFFF);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            __m512 ar = _mm512_set1_ps(a_rows ? a[r * lda] : a[r]);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) store16_f32(cdt, c, r * ldc + 16 * v, 0xFFFF, acc[r][v]);
}

// kernel_avx512_rows8 with the dtypes as constants, one of them fp32 (both,
// with a read in place)
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) static inline void
kernel_avx512_dts(int nv, tile_dts dts, int kc, const float *a, size_t lda, const void *b,
                  size_t ldb, void *c, size_t ldc, int load_c, const float *bias) {
    if (lda) {
        FL_ASSERT(dts.b == FL_F32 && dts.c == FL_F32);
        kernel_avx512_rows8(nv, FL_F32, FL_F32, kc, a, 1, lda, b, ldb, c, ldc, load_c, bias);
    } else if (dts.c == FL_BF16)
        kernel_avx512_rows8(nv, FL_F32, FL_BF16, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
    else if (dts.c == FL_F16)
        kernel_avx512_rows8(nv, FL_F32, FL_F16, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
    else if (dts.b == FL_BF16)
        kernel_avx512_rows8(nv, FL_BF16, FL_F32, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
    else if (dts.b == FL_F16)
        kernel_avx512_rows8(nv, FL_F16, FL_F32, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
    else
        kernel_avx512_rows8(nv, FL_F32, FL_F32, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
}

// 8 rows x 3 vectors: 24 accumulators, 3 b vectors, a broadcast a value:
// 11 loads per 24 FMAs (12 x 32: 14); and token counts (multiples of 8) and
// GPT-2's widths (768, 2304, 3072, 50304: multiples of 48) leave no edge
// micro-tiles, where 12 rows left 4 of every 256 tokens to a scratch tile
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) static void
kernel_avx512(int kc, const float *a, size_t lda, const void *b, size_t ldb, void *c, size_t ldc,
              int load_c, const float *bias, tile_dts dts) {
    kernel_avx512_dts(3, dts, kc, a, lda, b, ldb, c, ldc, load_c, bias);
}
// A panel's first 32 or 16 columns, straight into c: the demo's 128
// channels are two panels and 32 columns
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) static void
kernel_avx512_32(int kc, const float *a, size_t lda, const void *b, size_t ldb, void *c, size_t ldc,
                 int load_c, const float *bias, tile_dts dts) {
    kernel_avx512_dts(2, dts, kc, a, lda, b, ldb, c, ldc, load_c, bias);
}
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) static void
kernel_avx512_16(int kc, const float *a, size_t lda, const void *b, size_t ldb, void *c, size_t ldc,
                 int load_c, const float *bias, tile_dts dts) {
    kernel_avx512_dts(1, dts, kc, a, lda, b, ldb, c, ldc, load_c, bias);
}

// 6 rows x 2 vectors: 12 accumulators of the 16 registers; b is always
// packed (fp32) for this kernel, c of dtype cdt; a_rows as for AVX-512
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
kernel_avx2_rows6(fl_dtype cdt, int kc, const float *a, int a_rows, size_t lda, const float *b,
                  size_t ldb, void *c, size_t ldc, int load_c, const float *bias) {
    __m256 c0[6], c1[6];
    __m256 init0 = !load_c && bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    __m256 init1 = !load_c && bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        c0[r] = load_c ? load8_f32(cdt, c, r * ldc) : init0;
        c1[r] = load_c ? load8_f32(cdt, c, r * ldc + 8) : init1;
    }
    for (int k = 0; k < kc; k++, a += a_rows ? 1 : 6, b += ldb) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            __m256 ar = _mm256_broadcast_ss(a_rows ? a + r * lda : a + r);
            c0[r] = _mm256_fmadd_ps(ar, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(ar, b1, c1[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        store8_f32(cdt, c, r * ldc, c0[r]);
        store8_f32(cdt, c, r * ldc + 8, c1[r]);
    }
}

__attribute__((target("avx2,fma,f16c"))) static void kernel_avx2(int kc, const float *a, size_t lda,
                                                                 const void *b, size_t ldb, void *c,
                                                                 size_t ldc, int load_c,
                                                                 const float *bias, tile_dts dts) {
    FL_ASSERT(dts.b == FL_F32 && (!lda || dts.c == FL_F32));
    if (lda)
        kernel_avx2_rows6(FL_F32, kc, a, 1, lda, b, ldb, c, ldc, load_c, bias);
    else if (dts.c == FL_BF16)
        kernel_avx2_rows6(FL_BF16, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
    else if (dts.c == FL_F16)
        kernel_avx2_rows6(FL_F16, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
    else
        kernel_avx2_rows6(FL_F32, kc, a, 0, 0, b, ldb, c, ldc, load_c, bias);
}

static gemm_kernel kernel_for(int isa) {
    if (isa == FL_ISA_AVX512)
        return (gemm_kernel){8, 48, kernel_avx512, {kernel_avx512_16, kernel_avx512_32}, 1, 1};
    return (gemm_kernel){6, 16, kernel_avx2, {NULL, NULL}, 0, 1};
}

// Packing. X (i, k) is x.p[i * ld + k] (x.trans == 0) or x.p[k * ld + i];
// columns [i0, i0+n) of X, rows [k0, k0+kc), become ceil(n / w) panels of
// kc x w fp32 values, panel q at dst + q * kc * w, columns past n zero.

// m values from element i of p to dst as fp32 (masked stores are slow on AMD)
__attribute__((target("avx2,f16c"))) static inline void copy_f32(float *dst, gemm_mat x, size_t i,
                                                                 int m) {
    int j = 0;
    for (; j + 8 <= m; j += 8) _mm256_storeu_ps(dst + j, load8_f32(x.dt, x.p, i + j));
    if (j + 4 <= m) {
        _mm_storeu_ps(dst + j, load4_f32(x.dt, x.p, i + j));
        j += 4;
    }
    for (; j < m; j++) dst[j] = fp32_at(x.dt, x.p, i + j);
}

// lanes [0, m) of v to dst, 0 < m <= 8
__attribute__((target("avx2"))) static inline void store_lanes(float *dst, __m256 v, int m) {
    if (m == 8) {
        _mm256_storeu_ps(dst, v);
        return;
    }
    __m128 lo = _mm256_castps256_ps128(v);
    if (m >= 4) {
        _mm_storeu_ps(dst, lo);
        lo = _mm256_extractf128_ps(v, 1);
        dst += 4;
        m -= 4;
    }
    if (m >= 2) {
        _mm_storel_pi((__m64 *)dst, lo);
        lo = _mm_movehl_ps(lo, lo);
        dst += 2;
        m -= 2;
    }
    if (m) _mm_store_ss(dst, lo);
}

// columns [i, i+g) of X (g <= 8, the rest zero), rows [k, k+8), transposed
// in registers into d (row stride w), lanes [0, m) of each row
__attribute__((target("avx2,f16c"))) static inline void transpose8(float *d, int w, int m,
                                                                   gemm_mat x, size_t src, int g) {
    __m256 r[8];
    for (int q = 0; q < 8; q++)
        r[q] = q < g ? load8_f32(x.dt, x.p, src + (size_t)q * x.ld) : _mm256_setzero_ps();
    __m256 u0 = _mm256_unpacklo_ps(r[0], r[1]), u1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 u2 = _mm256_unpacklo_ps(r[2], r[3]), u3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 u4 = _mm256_unpacklo_ps(r[4], r[5]), u5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 u6 = _mm256_unpacklo_ps(r[6], r[7]), u7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
    __m256 t[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                   _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                   _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                   _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
    for (int j = 0; j < 8; j++) store_lanes(d + (size_t)j * w, t[j], m);
}

// how many of the n columns of X a group of 8 starting at column first holds
static int group_columns(int n, int first) {
    int g = n - first;
    return g < 0 ? 0 : g > 8 ? 8 : g;
}

// rows of X read whole (x.trans), or 8 x 8 blocks transposed in registers.
// next_kc: the depth of the block packed after this one (0: none). Its part of
// each row is fetched while this block's is transposed: a row's block is
// only KC values (a few cache lines, far from the next row's), too short
// for the hardware prefetcher, and a kernel's worth of work later they are
// in cache.
__attribute__((target("avx2,f16c"))) static void pack(float *dst, int w, gemm_mat x, int i0, int n,
                                                      int k0, int kc, int next_kc) {
    int panels = (n + w - 1) / w;
    if (x.trans) { // a row of X converted whole, then dealt out to the panels
        float row[NC + NR_MAX + 8] = {0};
        FL_ASSERT(n <= NC);
        size_t esize = x.dt == FL_F32 ? 4 : 2;
        for (int k = 0; k < kc; k++) {
            // rows of X are far apart (a page or more): fetch a few ahead
            if (k + PREFETCH_ROWS < kc) {
                const char *next = (const char *)fl_at_const(
                    x.dt, x.p, (size_t)(k0 + k + PREFETCH_ROWS) * x.ld + i0);
                for (size_t b = 0; b < n * esize; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            }
            copy_f32(row, x, (size_t)(k0 + k) * x.ld + i0, n);
            for (int q = 0; q < panels; q++) {
                float *d = dst + (size_t)q * kc * w + (size_t)k * w;
                // whole vectors (row has zeros past n): GCC would turn a
                // loop of floats into calls to memcpy
                for (int j = 0; j < w; j += 8)
                    store_lanes(d + j, _mm256_loadu_ps(row + q * w + j), w - j < 8 ? w - j : 8);
            }
        }
        return;
    }
    for (int q = 0; q < panels; q++) {
        float *panel = dst + (size_t)q * kc * w;
        for (int i = 0; i < w; i += 8) {
            int g = group_columns(n, q * w + i); // columns of X in this group of 8
            int m = w - i < 8 ? w - i : 8;
            size_t src = (size_t)(i0 + q * w + i) * x.ld + k0;
            // with no next block (the last, or a pack of one block), the
            // next group's rows of this block instead: up to 8 rows
            // further on, as far apart as any
            int next_g = next_kc ? 0 : group_columns(n, q * w + i + 8);
            size_t next_src = src + (size_t)8 * x.ld;
            int k = 0;
            for (; k + 8 <= kc; k += 8) {
                if (k < next_kc && k % 16 == 0) // a line of each row at most every other k
                    for (int q = 0; q < g; q++)
                        _mm_prefetch(
                            (const char *)fl_at_const(x.dt, x.p, src + (size_t)q * x.ld + kc + k),
                            _MM_HINT_T0);
                if (k % 16 == 0)
                    for (int q = 0; q < next_g; q++)
                        _mm_prefetch(
                            (const char *)fl_at_const(x.dt, x.p, next_src + (size_t)q * x.ld + k),
                            _MM_HINT_T0);
                transpose8(panel + (size_t)k * w + i, w, m, x, src + k, g);
            }
            for (; k < kc; k++) // the last k, one by one
                for (int j = 0; j < m; j++)
                    panel[(size_t)k * w + i + j] =
                        j < g ? fp32_at(x.dt, x.p, src + (size_t)j * x.ld + k) : 0.0f;
        }
    }
}

// op(a) (i, k) is X (i, k) for pack(); op(b) (k, j) is X (j, k) of b transposed
static gemm_mat transposed(gemm_mat m) {
    m.trans = !m.trans;
    return m;
}

// A packed operand, block by block of KC rows of depth: the block at pc
// starts at pc * (count rounded up to the panel width w), its panels in
// order, so rows (or columns) [first, ...) of block pc start at first * kc.
static const float *packed_block(gemm_mat x, int w, int pc, int kc, int first) {
    FL_ASSERT(first % w == 0);
    return x.packed + (size_t)pc * round_up(x.count, w) + (size_t)first * kc;
}

size_t gemm_packed_floats(int n, int K) {
    return (size_t)round_up(n, GEMM_PACK_QUANTUM) * K;
}

int gemm_panel_width(void) {
    return kernel_for(fl_cpu_isa()).nr;
}

void gemm_pack(float *dst, gemm_mat x, int as_b, int count, int K, int first, int n, int k0) {
    gemm_kernel kn = kernel_for(fl_cpu_isa());
    int w = as_b ? kn.nr : kn.mr;
    FL_ASSERT(GEMM_PACK_QUANTUM % w == 0 && first % GEMM_PACK_QUANTUM == 0 && k0 % KC == 0);
    FL_ASSERT(first + n == count || n % GEMM_PACK_QUANTUM == 0);
    gemm_mat packed = {.packed = dst, .count = count};
    int kc = min_int(KC, K - k0);
    pack((float *)packed_block(packed, w, k0, kc, first), w, as_b ? transposed(x) : x, first, n, k0,
         kc, 0);
}

// c (mc x nc, row stride ldc) = (load_c ? c : bias ? bias in every row : 0)
// + a_block (mc x kc) @ b_block (kc x nc), micro-tile by micro-tile; b's
// panels panel_step values apart, their rows ldb apart (packed: kc * NR and
// NR); b and c of dtypes dts, bias nc fp32 values
static void multiply_block(gemm_kernel kn, int kc, int mc, int nc, const float *a_block, size_t lda,
                           const void *b_block, size_t ldb, size_t panel_step, tile_dts dts,
                           void *c, int ldc, int load_c, const float *bias, float *edge) {
    for (int ir = 0; ir < mc; ir += kn.mr) {
        int mr = min_int(kn.mr, mc - ir);
        const float *a_panel = a_block + (size_t)ir * (lda ? lda : (size_t)kc);
        for (int jr = 0; jr < nc; jr += kn.nr) {
            int nr = min_int(kn.nr, nc - jr);
            const void *b_panel = fl_at_const(dts.b, b_block, (size_t)(jr / kn.nr) * panel_step);
            void *cij = fl_at(dts.c, c, (size_t)ir * ldc + jr);
            // the kernel as wide as the panel, if there is one
            kernel_fn *fits = nr == kn.nr ? kn.kernel : nr % 16 ? NULL : kn.narrow[nr / 16 - 1];
            const float *bias_j = bias ? bias + jr : NULL;
            if (mr == kn.mr && fits) {
                fits(kc, a_panel, lda, b_panel, ldb, cij, ldc, load_c, bias_j, dts);
                continue;
            }
            // an edge: the whole micro-tile on fp32 scratch (the same
            // arithmetic as inside, a 16-bit c rounded once as it goes back),
            // its valid part back into c; the full kernel only on a packed
            // panel (zeros past nr). The bias goes into the scratch rows,
            // which the kernel then loads: it has only nr values.
            tile_dts on_edge = {dts.b, FL_F32};
            memset(edge, 0, (size_t)kn.mr * kn.nr * sizeof(float));
            if (load_c)
                fl_convert_rows(FL_F32, edge, kn.nr, dts.c, cij, ldc, mr, nr);
            else if (bias_j)
                for (int r = 0; r < mr; r++) memcpy(edge + r * kn.nr, bias_j, nr * sizeof(float));
            (fits ? fits : kn.kernel)(kc, a_panel, lda, b_panel, ldb, edge, kn.nr, load_c || bias_j,
                                      NULL, on_edge);
            fl_convert_rows(dts.c, cij, ldc, FL_F32, edge, kn.nr, mr, nr);
        }
    }
}

void gemm_tile_isa(int isa, int M, int N, int K, gemm_mat a, gemm_mat b, float beta,
                   const float *bias, fl_dtype c_dt, void *c, int ldc, float *pack_buf) {
    FL_ASSERT(isa >= FL_ISA_AVX2 && isa <= (int)fl_cpu_isa());
    FL_ASSERT(beta == 0.0f || beta == 1.0f);
    FL_ASSERT(!bias || beta == 0.0f);
    // a 16-bit c takes one depth block, its sum rounded once
    FL_ASSERT(c_dt == FL_F32 || K <= KC);
    if (K == 0) {
        if (beta == 0.0f)
            for (int i = 0; i < M; i++) {
                void *row = fl_at(c_dt, c, (size_t)i * ldc);
                if (bias)
                    fl_store_f32(c_dt, row, bias, N);
                else
                    memset(row, 0, N * fl_dtype_size(c_dt));
            }
        return;
    }
    gemm_kernel kn = kernel_for(isa);
    float *ap = pack_buf, *bp = ap + a_block_floats(M, K), *edge = bp + b_block_floats(N, K);
    gemm_mat bt = transposed(b);
    // One block of rows (M <= MC): depth blocks outermost, so that a's
    // block is packed once for all of b's column blocks rather than once per
    // column block. Several: column blocks outermost, b's block packed once
    // for all of a's row blocks.
    int a_once = M <= MC;
    // An op(b) stored row-major is read in place by the AVX-512 kernel, its
    // rows ldb apart (a 16-bit one converted in registers, unless c is
    // 16-bit too): packing it would copy a block that only this call's rows
    // read. Its columns must end in whole panels or narrow ones (nothing is
    // read past them, where a packed panel has zeros). The AVX2 kernel's
    // panel row is one cache line, used for 12 FMAs: read in place, its
    // strided rows cost more than packing them.
    int b_in_place =
        kn.b_in_place && !b.packed && !b.trans && N % 16 == 0 && (b.dt == FL_F32 || c_dt == FL_F32);
    tile_dts dts = {b_in_place ? b.dt : FL_F32, c_dt};
    // An fp32 op(a) stored row-major is read in place by either kernel too
    // (its micro-panel's 8 or 6 rows lda apart, whole micro-panels only),
    // when b has at most three column blocks: packing a's block is then
    // paid back over few panels of b. Against packing (N = 2048, 2 threads,
    // Zen 5, alternated), AVX-512: the LM head's input gradient at 128
    // channels 368 -> 470 GFLOP/s (both gradients 374 -> 426), the forward
    // of 3072 -> 768 channels 3.5-6% faster, 768-channel gradients level to
    // +2%; over 11 column blocks (3072 channels) the gradients were 1-3%
    // slower. AVX2: 202-206 -> 239-241 (both 204 -> 222), the 768-channel
    // forwards and input gradients 1-4% faster.
    int a_as_rows = kn.a_in_place && !a.packed && !a.trans && M % kn.mr == 0 && dts.b == FL_F32 &&
                    c_dt == FL_F32 && N <= 3 * NC;
    int a_in_place = a_as_rows && a.dt == FL_F32;
    // A 16-bit one, in one block of rows, is converted to fp32 rows (a
    // straight conversion, where packing transposes too) and read so.
    int a_converted = a_as_rows && a.dt != FL_F32 && a_once;
    int outer = a_once ? K : N, outer_step = a_once ? KC : NC;
    int inner = a_once ? N : K, inner_step = a_once ? NC : KC;
    for (int o = 0; o < outer; o += outer_step) {
        for (int i = 0; i < inner; i += inner_step) {
            int jc = a_once ? i : o, pc = a_once ? o : i;
            int nc = min_int(NC, N - jc), kc = min_int(KC, K - pc);
            int load_c = pc > 0 || beta != 0.0f;
            const float *bias_j = load_c || !bias ? NULL : bias + jc;
            const void *b_block = b.packed ? packed_block(b, kn.nr, pc, kc, b.first + jc) : bp;
            size_t ldb = kn.nr, panel_step = (size_t)kn.nr * kc;
            if (b_in_place)
                b_block = fl_at_const(b.dt, b.p, (size_t)pc * b.ld + jc), ldb = b.ld,
                panel_step = kn.nr;
            else if (!b.packed)
                pack(bp, kn.nr, bt, jc, nc, pc, kc, 0);
            for (int ic = 0; ic < M; ic += MC) {
                int mc = min_int(MC, M - ic);
                const float *a_block = a.packed ? packed_block(a, kn.mr, pc, kc, a.first + ic) : ap;
                size_t lda = 0; // packed micro-panels
                if (a_in_place)
                    a_block = (const float *)a.p + (size_t)ic * a.ld + pc, lda = a.ld;
                else if (a_converted) {
                    if (jc == 0)
                        fl_convert_rows(FL_F32, ap, kc, a.dt,
                                        fl_at_const(a.dt, a.p, (size_t)ic * a.ld + pc), a.ld, mc,
                                        kc);
                    lda = kc;
                } else if (!a.packed && (!a_once || jc == 0))
                    pack(ap, kn.mr, a, ic, mc, pc, kc, min_int(KC, K - pc - kc));
                multiply_block(kn, kc, mc, nc, a_block, lda, b_block, ldb, panel_step, dts,
                               fl_at(c_dt, c, (size_t)ic * ldc + jc), ldc, load_c, bias_j, edge);
            }
        }
    }
}

#else
void gemm_tile_isa(int isa, int M, int N, int K, gemm_mat a, gemm_mat b, float beta,
                   const float *bias, fl_dtype c_dt, void *c, int ldc, float *pack_buf) {
    fl_die("gemm: no AVX2 on this CPU (matmul's portable path is OpenBLAS's sgemm)");
}

size_t gemm_packed_floats(int n, int K) {
    return 0;
}

int gemm_panel_width(void) {
    fl_die("gemm: no AVX2 on this CPU (matmul's portable path is OpenBLAS's sgemm)");
}

void gemm_pack(float *dst, gemm_mat x, int as_b, int count, int K, int first, int n, int k0) {
    fl_die("gemm: no AVX2 on this CPU (matmul's portable path is OpenBLAS's sgemm)");
}
#endif

void gemm_tile(int M, int N, int K, gemm_mat a, gemm_mat b, float beta, const float *bias,
               fl_dtype c_dt, void *c, int ldc, float *pack_buf) {
    gemm_tile_isa(fl_cpu_isa(), M, N, K, a, b, beta, bias, c_dt, c, ldc, pack_buf);
}
