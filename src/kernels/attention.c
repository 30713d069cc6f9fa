// attention.c: causal multi-head self-attention with grouped-query
// attention (NH query heads share NKV key/value heads), flash style.
// Nothing of size (T,T) survives the forward: only lse (B,NH,T), the log of
// each row's softmax denominator, from which the backward recomputes P.
// The fast version walks each (b, query head) in blocks of ATT_BR query rows;
// the block of rows i0..n-1 only sees keys 0..n-1 (causality), so its
// products skip the masked upper triangle (on AVX2 and AVX-512 tile by tile
// within the block too) and the per-thread workspace is ATT_BR rows of T
// scores rather than a (T,T) matrix. The backward runs one (b, kv head)
// per work item and its group's query heads inside it, in order: they all
// add into the same dk and dv, so this keeps it race-free and deterministic
// (with NKV == NH each item is one head, as in plain multi-head attention).
// fp32 q, k, v and their gradients are read and written in place in
// qkv/dqkv with a leading dimension of (NH+2*NKV)*HS (out and dout: NH*HS).
// For bf16/fp16 each head is first gathered into contiguous fp32 copies
// (leading dimension HS) in the workspace, the same algorithm runs on those,
// and the gradients, accumulated there in fp32 (dk and dv over the whole
// group), are rounded back into dqkv once.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "gemm.h"
#include "simd.h"
#include <cblas.h>
#include <math.h>
#include <omp.h>

#define ATT_BR 64 // query rows per block

// ----------------------------------------------------------------------------
// The block products. Row r of a block of query rows i0..i0+nb-1 sees keys
// 0..i0+r, so the block's keys are 0..n-1 (n = i0 + nb) and its scores,
// probabilities and their gradients are (nb, n) matrices, lds apart:
//   scores: S[r][j] = alpha * x_r . y_j for j <= i0 + r at least, j < n
//           (x: q or dO rows, ldx apart; y: k or v rows, ldy apart)
//   rows:   c_r = beta * c_r + alpha * sum_j p[r][j] y_j   (o, dq)
//   cols:   c_j += alpha * sum_r p[r][j] x_r               (dv, dk)
// where p is zero past each row's keys. The portable path makes each one
// sgemm of the whole block. The AVX2 and AVX-512 paths run register tiles
// that stop at the causal edge tile by tile (a block's whole (nb, n) square
// is ~1.25x the triangle's work at T = 256), read y for the scores from
// panels packed once per head instead of once per sgemm, and sum each
// element in one order on both ISAs (ascending, FMA by FMA, alpha applied
// last), so the two give the same bits.

static int min_int(int a, int b) {
    return a < b ? a : b;
}

// rows of the scores blocks: room for whole vectors of 16 keys
static int score_stride(int T) {
    return (T + 15) / 16 * 16;
}

// y's T rows (HS values, ldy apart) packed as gemm.c packs an op(b) of
// (HS, T): panels of gemm_panel_width() keys, value d of key j of a panel at
// [d * width + j], keys past T zero. HS <= GEMM_DEPTH_BLOCK: one depth block.
static void pack_keys(float *pk, const float *y, int ldy, int T, int HS) {
    gemm_mat yt = {.dt = FL_F32, .p = y, .ld = ldy, .trans = 1};
    gemm_pack(pk, yt, 1, T, HS, 0, T, 0);
}

// A path's register tiles:
//   scores: s (rows x 16 nv, row stride lds) = alpha * x (rows x HS, rows
//           ldx apart) @ the first 16 nv keys of a panel of pk (pw keys
//           wide); rows <= score_rows, 16 nv <= pw = gemm_panel_width()
//   sums:   c (rows x width, row stride ldc) = (beta ? c : 0) + alpha * a @ y
//           (kc x width, rows ldy apart), a (i, k) = a[i * a_ri + k * a_rk];
//           rows <= sum_rows, width <= sum_width
typedef struct {
    int score_rows;
    void (*scores)(int nv, int rows, int HS, const float *x, size_t ldx, const float *pk, int pw,
                   float *s, size_t lds, float alpha);
    int sum_rows, sum_width;
    void (*sums)(int rows, int width, int kc, const float *a, size_t a_ri, size_t a_rk,
                 const float *y, size_t ldy, float *c, size_t ldc, float alpha, int beta);
} att_tiles;

// The three products on a path's tiles, or (t NULL) on OpenBLAS's sgemm; y
// for the scores packed in pk by pack_keys when there are tiles.
static void block_scores(const att_tiles *t, float *S, int lds, const float *x, int ldx,
                         const float *y, int ldy, const float *pk, int nb, int i0, int HS,
                         float alpha) {
    if (!t) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, i0 + nb, HS, alpha, x, ldx, y, ldy,
                    0.0f, S, lds);
        return;
    }
    int pw = gemm_panel_width();
    for (int r0 = 0; r0 < nb; r0 += t->score_rows) {
        int rows = min_int(t->score_rows, nb - r0);
        int keys = i0 + r0 + rows; // through the tile's last row's key
        // the next tile's rows of x, far apart and seldom in cache, fetched
        // while this tile runs
        for (int r = r0 + rows; r < min_int(nb, r0 + 2 * rows); r++)
            for (int d = 0; d < HS; d += 16) __builtin_prefetch(x + (size_t)r * ldx + d);
        for (int j0 = 0; j0 < keys; j0 += pw)
            t->scores((min_int(pw, keys - j0) + 15) / 16, rows, HS, x + (size_t)r0 * ldx, ldx,
                      pk + (size_t)j0 * HS, pw, S + (size_t)r0 * lds + j0, lds, alpha);
    }
}

static void block_rows(const att_tiles *t, float *c, int ldc, const float *p, int lds,
                       const float *y, int ldy, int nb, int i0, int HS, float alpha, int beta) {
    if (!t) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, HS, i0 + nb, alpha, p, lds, y,
                    ldy, (float)beta, c, ldc);
        return;
    }
    for (int r0 = 0; r0 < nb; r0 += t->sum_rows) {
        int rows = min_int(t->sum_rows, nb - r0), keys = i0 + r0 + rows;
        for (int e = 0; e < HS; e += t->sum_width)
            t->sums(rows, min_int(t->sum_width, HS - e), keys, p + (size_t)r0 * lds, lds, 1, y + e,
                    ldy, c + (size_t)r0 * ldc + e, ldc, alpha, beta);
    }
}

// key j is seen by the block's rows r >= j - i0
static void block_cols(const att_tiles *t, float *c, int ldc, const float *p, int lds,
                       const float *x, int ldx, int nb, int i0, int HS, float alpha) {
    if (!t) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, i0 + nb, HS, nb, alpha, p, lds, x, ldx,
                    1.0f, c, ldc);
        return;
    }
    for (int j0 = 0; j0 < i0 + nb; j0 += t->sum_rows) {
        int rows = min_int(t->sum_rows, i0 + nb - j0), r_first = j0 > i0 ? j0 - i0 : 0;
        for (int e = 0; e < HS; e += t->sum_width)
            t->sums(rows, min_int(t->sum_width, HS - e), nb - r_first,
                    p + (size_t)r_first * lds + j0, 1, lds, x + (size_t)r_first * ldx + e, ldx,
                    c + (size_t)j0 * ldc + e, ldc, alpha, 1);
    }
}

#if FL_HAVE_X86_SIMD
// 8 rows x nv vectors of 16 keys (24 accumulators at nv = 3); a tile's
// spare rows repeat its last row and are not stored
__attribute__((target("avx512f"), always_inline)) static inline void
scores_avx512_nv(int nv, int rows, int HS, const float *x, size_t ldx, const float *pk, int pw,
                 float *s, size_t lds, float alpha) {
    __m512 acc[8][3];
    const float *xr[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        xr[r] = x + (size_t)(r < rows ? r : rows - 1) * ldx;
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    }
    for (int d = 0; d < HS; d++, pk += pw) {
        __m512 y[3];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++) y[v] = _mm512_loadu_ps(pk + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            __m512 xv = _mm512_set1_ps(xr[r][d]);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(xv, y[v], acc[r][v]);
        }
    }
    __m512 av = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
        if (r < rows)
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++)
                _mm512_storeu_ps(s + r * lds + 16 * v, _mm512_mul_ps(acc[r][v], av));
}

__attribute__((target("avx512f"))) static void scores_avx512(int nv, int rows, int HS,
                                                             const float *x, size_t ldx,
                                                             const float *pk, int pw, float *s,
                                                             size_t lds, float alpha) {
    if (nv == 3)
        scores_avx512_nv(3, rows, HS, x, ldx, pk, pw, s, lds, alpha);
    else if (nv == 2)
        scores_avx512_nv(2, rows, HS, x, ldx, pk, pw, s, lds, alpha);
    else
        scores_avx512_nv(1, rows, HS, x, ldx, pk, pw, s, lds, alpha);
}

// 6 rows x nv vectors of 16 columns (24 accumulators at nv = 4); with
// `ragged`, the last vector's columns masked at width (masks in the loop
// would be reloaded from the stack: the accumulators take every register)
__attribute__((target("avx512f"), always_inline)) static inline void
sums_avx512_nv(int nv, int ragged, int rows, int width, int kc, const float *a, size_t a_ri,
               size_t a_rk, const float *y, size_t ldy, float *c, size_t ldc, float alpha,
               int beta) {
    __m512 acc[6][4];
    __mmask16 m[4];
    const float *ar[6];
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) m[v] = ragged && v == nv - 1 ? tail_mask(width - 16 * v) : 0xFFFF;
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        ar[r] = a + (r < rows ? r : rows - 1) * a_ri;
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        __m512 yv[4];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            yv[v] = ragged && v == nv - 1 ? _mm512_maskz_loadu_ps(m[v], y + k * ldy + 16 * v)
                                          : _mm512_loadu_ps(y + k * ldy + 16 * v);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            __m512 av = _mm512_set1_ps(ar[r][k * a_rk]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(av, yv[v], acc[r][v]);
        }
    }
    __m512 alv = _mm512_set1_ps(alpha);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
        if (r < rows)
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) {
                float *cv = c + r * ldc + 16 * v;
                __m512 out = beta ? _mm512_fmadd_ps(alv, acc[r][v], _mm512_maskz_loadu_ps(m[v], cv))
                                  : _mm512_mul_ps(alv, acc[r][v]);
                _mm512_mask_storeu_ps(cv, m[v], out);
            }
}

__attribute__((target("avx512f"))) static void sums_avx512(int rows, int width, int kc,
                                                           const float *a, size_t a_ri, size_t a_rk,
                                                           const float *y, size_t ldy, float *c,
                                                           size_t ldc, float alpha, int beta) {
    if (width == 64)
        sums_avx512_nv(4, 0, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
    else if (width > 48)
        sums_avx512_nv(4, 1, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
    else if (width > 32)
        sums_avx512_nv(3, 1, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
    else if (width > 16)
        sums_avx512_nv(2, 1, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
    else
        sums_avx512_nv(1, 1, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
}

static const att_tiles avx512_tiles = {8, scores_avx512, 6, 64, sums_avx512};

// 6 rows x one panel of 16 keys as two 8-lane halves: 12 accumulators of
// the 16 registers
__attribute__((target("avx2,fma"))) static void scores_avx2(int nv, int rows, int HS,
                                                            const float *x, size_t ldx,
                                                            const float *pk, int pw, float *s,
                                                            size_t lds, float alpha) {
    FL_ASSERT(nv == 1 && pw == 16);
    __m256 lo[6], hi[6];
    const float *xr[6];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        xr[r] = x + (size_t)(r < rows ? r : rows - 1) * ldx;
        lo[r] = hi[r] = _mm256_setzero_ps();
    }
    for (int d = 0; d < HS; d++) {
        __m256 y0 = _mm256_loadu_ps(pk + d * 16), y1 = _mm256_loadu_ps(pk + d * 16 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            __m256 xv = _mm256_broadcast_ss(xr[r] + d);
            lo[r] = _mm256_fmadd_ps(xv, y0, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, y1, hi[r]);
        }
    }
    __m256 av = _mm256_set1_ps(alpha);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
        if (r < rows) {
            _mm256_storeu_ps(s + r * lds, _mm256_mul_ps(lo[r], av));
            _mm256_storeu_ps(s + r * lds + 8, _mm256_mul_ps(hi[r], av));
        }
}

// The first n lanes of 8 at p, with plain loads and stores where a vector is
// whole: masked ones are slow on AMD, and AVX2 is AMD Zen 3's path.
// load_lanes8: lanes [0, n) of p, the rest zero (none for n <= 0)
__attribute__((target("avx2"))) static inline __m256 load_lanes8(const float *p, int n) {
    if (n <= 0) return _mm256_setzero_ps();
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask8((size_t)n));
}

// v with lanes [n, 8) zeroed
__attribute__((target("avx2"))) static inline __m256 keep_lanes8(__m256 v, int n) {
    return n >= 8 ? v : _mm256_and_ps(v, _mm256_castsi256_ps(tail_mask8((size_t)n)));
}

// lanes [0, n) of v stored at p, 0 < n
__attribute__((target("avx2"))) static inline void store_lanes8(float *p, __m256 v, int n) {
    if (n >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, tail_mask8((size_t)n), v);
}

// 6 rows x nv vectors of 8 columns (12 accumulators at nv = 2); with
// `ragged`, the last vector's columns end at width
__attribute__((target("avx2,fma"), always_inline)) static inline void
sums_avx2_nv(int nv, int ragged, int rows, int width, int kc, const float *a, size_t a_ri,
             size_t a_rk, const float *y, size_t ldy, float *c, size_t ldc, float alpha, int beta) {
    __m256 acc[6][2];
    const float *ar[6];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
        ar[r] = a + (r < rows ? r : rows - 1) * a_ri;
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) acc[r][v] = _mm256_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        __m256 yv[2];
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++)
            yv[v] = ragged && v == nv - 1 ? load_lanes8(y + k * ldy + 8 * v, width - 8 * v)
                                          : _mm256_loadu_ps(y + k * ldy + 8 * v);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            __m256 av = _mm256_broadcast_ss(ar[r] + k * a_rk);
#pragma GCC unroll 2
            for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(av, yv[v], acc[r][v]);
        }
    }
    __m256 alv = _mm256_set1_ps(alpha);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
        if (r < rows)
#pragma GCC unroll 2
            for (int v = 0; v < nv; v++) {
                float *cv = c + r * ldc + 8 * v;
                __m256 out = beta ? _mm256_fmadd_ps(alv, acc[r][v], load_lanes8(cv, width - 8 * v))
                                  : _mm256_mul_ps(alv, acc[r][v]);
                store_lanes8(cv, out, width - 8 * v);
            }
}

__attribute__((target("avx2,fma"))) static void sums_avx2(int rows, int width, int kc,
                                                          const float *a, size_t a_ri, size_t a_rk,
                                                          const float *y, size_t ldy, float *c,
                                                          size_t ldc, float alpha, int beta) {
    if (width == 16)
        sums_avx2_nv(2, 0, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
    else if (width > 8)
        sums_avx2_nv(2, 1, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
    else
        sums_avx2_nv(1, 1, rows, width, kc, a, a_ri, a_rk, y, ldy, c, ldc, alpha, beta);
}

static const att_tiles avx2_tiles = {6, scores_avx2, 6, 16, sums_avx2};
#endif

// scores block P (ATT_BR rows of score_stride), dP block, D (ATT_BR), k
// and v packed for the tiles; for 16-bit data also fp32 copies (T,HS) of
// q, k, v, out, dout, dq, dk and dv. The backward keeps one kv head's k, v,
// dk, dv for the whole group and reuses the query head's slots, so the size
// does not depend on the group.
size_t attention_workspace_floats(fl_dtype dt, int T, int HS, int group) {
    FL_ASSERT(group >= 1);
    size_t copies = dt == FL_F32 ? 0 : (size_t)8 * T * HS;
    return (size_t)2 * ATT_BR * score_stride(T) + ATT_BR + 2 * gemm_packed_floats(T, HS) + copies;
}

// An fp32 view of one head: T rows of HS values at src, ld elements apart.
// fp32: src itself (leading dimension ld); else its values converted into
// the workspace's copy number `slot` (leading dimension HS).
static float *head_f32(fl_dtype dt, const void *src, int ld, int T, int HS, float *copies,
                       int slot) {
    if (dt == FL_F32) return (float *)src;
    float *copy = copies + (size_t)slot * T * HS;
    fl_convert_rows(FL_F32, copy, HS, dt, src, ld, T, HS);
    return copy;
}

// Stores a head's fp32 copy (leading dimension HS) into dst; for fp32 the
// view was dst itself, so there is nothing to do.
static void head_flush(fl_dtype dt, void *dst, int ld, int T, int HS, const float *copy) {
    if (dt != FL_F32) fl_convert_rows(dt, dst, ld, FL_F32, copy, HS, T, HS);
}

static void check_heads(int NH, int NKV, int HS) {
    FL_ASSERT(NH > 0 && NKV > 0 && NH % NKV == 0 && HS > 0);
}

// ----------------------------------------------------------------------------
// the per-row softmax loops, scalar, AVX2 + FMA or AVX-512, each path with
// its products (above). The vector paths sum in 16 lanes (AVX2 as two 8-lane
// halves) and reduce them in one fixed order, so AVX2 and AVX-512 give the
// same bits; against the scalar loops and OpenBLAS they differ by exp's ~1
// ulp and the order of the sums.

typedef struct {
    // row[0:cnt) = softmax(row[0:cnt)), row[cnt:n) = 0; returns the lse
    float (*softmax)(float *row, int cnt, int n);
    // row[0:cnt) = exp(row[0:cnt) - lse), row[cnt:n) = 0
    void (*probs)(float *row, int cnt, int n, float lse);
    float (*dot)(const float *a, const float *b, int n);
    // dS[0:cnt) = p * (dS - D): the softmax backward; dS[cnt:n) = 0 (p is
    // zero there, and the tiles leave dS unset)
    void (*dsoftmax)(float *dS, const float *p, float D, int cnt, int n);
    const att_tiles *tiles; // NULL: the products on OpenBLAS
} att_ops;

static float softmax_scalar(float *row, int cnt, int n) {
    float maxval = -INFINITY;
    for (int j = 0; j < cnt; j++) maxval = fmaxf(maxval, row[j]);
    float sum = 0.0f;
    for (int j = 0; j < cnt; j++) {
        row[j] = expf(row[j] - maxval);
        sum += row[j];
    }
    float inv = 1.0f / sum;
    for (int j = 0; j < cnt; j++) row[j] *= inv;
    for (int j = cnt; j < n; j++) row[j] = 0.0f; // causal mask
    return maxval + logf(sum);
}

static void probs_scalar(float *row, int cnt, int n, float lse) {
    for (int j = 0; j < cnt; j++) row[j] = expf(row[j] - lse);
    for (int j = cnt; j < n; j++) row[j] = 0.0f;
}

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void dsoftmax_scalar(float *dS, const float *p, float D, int cnt, int n) {
    for (int j = 0; j < n; j++) dS[j] = j < cnt ? p[j] * (dS[j] - D) : 0.0f;
}

static const att_ops scalar_ops = {softmax_scalar, probs_scalar, dot, dsoftmax_scalar, NULL};

#if FL_HAVE_X86_SIMD
// lanes 0..15 summed as ((0..7 + 8..15) halves folded 4, 2, 1): both vector
// paths end here with the same 16 partial sums
__attribute__((target("avx2"))) static float hsum16(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

__attribute__((target("avx512f"))) static float hsum512(__m512 v) {
    return hsum16(_mm512_castps512_ps256(v),
                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

__attribute__((target("avx512f"))) static float softmax_avx512(float *row, int cnt, int n) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < cnt; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(cnt - j), row + j));
    float maxval = _mm512_reduce_max_ps(vmax);
    __m512 vsum = _mm512_setzero_ps();
    for (int j = 0; j < cnt; j += 16) {
        __mmask16 m = tail_mask(cnt - j);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), _mm512_set1_ps(maxval)));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(row + j, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    float sum = hsum512(vsum);
    __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int j = 0; j < n; j += 16) {
        __mmask16 keep = j < cnt ? tail_mask(cnt - j) : 0; // the rest is masked out
        __m512 p = _mm512_maskz_mul_ps(keep, _mm512_maskz_loadu_ps(keep, row + j), inv);
        _mm512_mask_storeu_ps(row + j, tail_mask(n - j), p);
    }
    return maxval + logf(sum);
}

__attribute__((target("avx512f"))) static void probs_avx512(float *row, int cnt, int n, float lse) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 keep = j < cnt ? tail_mask(cnt - j) : 0;
        __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(keep, row + j), _mm512_set1_ps(lse));
        _mm512_mask_storeu_ps(row + j, tail_mask(n - j), _mm512_maskz_mov_ps(keep, exp512(d)));
    }
}

__attribute__((target("avx512f"))) static float dot_avx512(const float *a, const float *b, int n) {
    __m512 s = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask(n - j);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + j), _mm512_maskz_loadu_ps(m, b + j), s);
    }
    return hsum512(s);
}

__attribute__((target("avx512f"))) static void dsoftmax_avx512(float *dS, const float *p, float D,
                                                               int cnt, int n) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 keep = j < cnt ? tail_mask(cnt - j) : 0;
        __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(keep, dS + j), _mm512_set1_ps(D));
        __m512 ds = _mm512_maskz_mul_ps(keep, _mm512_maskz_loadu_ps(keep, p + j), d);
        _mm512_mask_storeu_ps(dS + j, tail_mask(n - j), ds);
    }
}

static const att_ops avx512_ops = {softmax_avx512, probs_avx512, dot_avx512, dsoftmax_avx512,
                                   &avx512_tiles};

// AVX2 walks the same 16-value blocks as two 8-lane halves (the lane
// helpers are with the tiles).

__attribute__((target("avx2,fma"))) static float softmax_avx2(float *row, int cnt, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= cnt; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
    if (j < cnt) { // lanes past cnt keep vmax
        __m256 m = _mm256_castsi256_ps(tail_mask8((size_t)(cnt - j)));
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, load_lanes8(row + j, cnt - j), m));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float maxval = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, vm = _mm256_set1_ps(maxval);
    for (j = 0; j < cnt; j += 16)
        for (int h = 0; h < 16 && j + h < cnt; h += 8) { // an empty half would add zeros
            int left = cnt - j - h;
            __m256 e = keep_lanes8(exp256(_mm256_sub_ps(load_lanes8(row + j + h, left), vm)), left);
            store_lanes8(row + j + h, e, left);
            sum[h / 8] = _mm256_add_ps(sum[h / 8], e);
        }
    float s = hsum16(sum[0], sum[1]);
    __m256 inv = _mm256_set1_ps(1.0f / s);
    for (j = 0; j < n; j += 8)
        store_lanes8(row + j, _mm256_mul_ps(load_lanes8(row + j, cnt - j), inv), n - j);
    return maxval + logf(s);
}

__attribute__((target("avx2,fma"))) static void probs_avx2(float *row, int cnt, int n, float lse) {
    __m256 vlse = _mm256_set1_ps(lse);
    for (int j = 0; j < n; j += 8) {
        int left = cnt - j;
        __m256 p = _mm256_setzero_ps();
        if (left > 0)
            p = keep_lanes8(exp256(_mm256_sub_ps(load_lanes8(row + j, left), vlse)), left);
        store_lanes8(row + j, p, n - j);
    }
}

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int n) {
    __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < n; j += 16)
        for (int h = 0; h < 16 && j + h < n; h += 8)
            s[h / 8] = _mm256_fmadd_ps(load_lanes8(a + j + h, n - j - h),
                                       load_lanes8(b + j + h, n - j - h), s[h / 8]);
    return hsum16(s[0], s[1]);
}

__attribute__((target("avx2,fma"))) static void dsoftmax_avx2(float *dS, const float *p, float D,
                                                              int cnt, int n) {
    __m256 vD = _mm256_set1_ps(D);
    for (int j = 0; j < n; j += 8) {
        int left = cnt - j;
        __m256 ds = _mm256_setzero_ps();
        if (left > 0) {
            __m256 d = _mm256_sub_ps(load_lanes8(dS + j, left), vD);
            ds = keep_lanes8(_mm256_mul_ps(load_lanes8(p + j, left), d), left);
        }
        store_lanes8(dS + j, ds, n - j);
    }
}

static const att_ops avx2_ops = {softmax_avx2, probs_avx2, dot_avx2, dsoftmax_avx2, &avx2_tiles};
#endif

// The widest path allowed; a head of more than one depth block of the
// packing (256 values) keeps the products on OpenBLAS.
static att_ops fast_ops(int HS) {
    att_ops ops = scalar_ops;
#if FL_HAVE_X86_SIMD
    fl_isa isa = fl_cpu_isa();
    if (isa == FL_ISA_AVX512) ops = avx512_ops;
    if (isa == FL_ISA_AVX2) ops = avx2_ops;
#endif
    if (HS > GEMM_DEPTH_BLOCK) ops.tiles = NULL;
    return ops;
}

void attention_forward(fl_dtype dt, void *out, float *lse, const void *qkv, float *workspace, int B,
                       int T, int NH, int NKV, int HS) {
    check_heads(NH, NKV, HS);
    const att_ops ops_ = fast_ops(HS), *ops = &ops_;
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;   // out and qkv row widths
    int ldq = dt == FL_F32 ? W : HS, ldo = dt == FL_F32 ? C : HS; // of the fp32 views
    int lds = score_stride(T);
    float scale = 1.0f / sqrtf((float)HS);
    size_t ws_per_thread = attention_workspace_floats(dt, T, HS, group);
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++) {
        int b = bh / NH, h = bh % NH, g = h / group;
        float *S = workspace + (size_t)omp_get_thread_num() * ws_per_thread;
        float *kpk = S + (size_t)2 * ATT_BR * lds + ATT_BR;
        float *copies = kpk + 2 * gemm_packed_floats(T, HS);
        const void *row0 = fl_at_const(dt, qkv, (size_t)b * T * W);
        const float *q = head_f32(dt, fl_at_const(dt, row0, (size_t)h * HS), W, T, HS, copies, 0);
        const float *k =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + g * HS), W, T, HS, copies, 1);
        const float *v =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + (NKV + g) * HS), W, T, HS, copies, 2);
        void *oh = fl_at(dt, out, (size_t)b * T * C + h * HS);
        float *o = dt == FL_F32 ? (float *)oh : copies + 3 * (size_t)T * HS;
        float *lse_bh = lse + (size_t)bh * T;
        if (ops->tiles) pack_keys(kpk, k, ldq, T, HS);
        for (int i0 = 0; i0 < T; i0 += ATT_BR) {
            int nb = T - i0 < ATT_BR ? T - i0 : ATT_BR, n = i0 + nb; // rows i0..n-1, keys 0..n-1
            block_scores(ops->tiles, S, lds, q + (size_t)i0 * ldq, ldq, k, ldq, kpk, nb, i0, HS,
                         scale);
            // row i sees keys 0..i
            for (int r = 0; r < nb; r++)
                lse_bh[i0 + r] = ops->softmax(S + (size_t)r * lds, i0 + r + 1, n);
            block_rows(ops->tiles, o + (size_t)i0 * ldo, ldo, S, lds, v, ldq, nb, i0, HS, 1.0f, 0);
        }
        head_flush(dt, oh, C, T, HS, o);
    }
}

void attention_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                        const float *lse, float *workspace, int B, int T, int NH, int NKV, int HS) {
    check_heads(NH, NKV, HS);
    const att_ops ops_ = fast_ops(HS), *ops = &ops_;
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;   // out and qkv row widths
    int ldq = dt == FL_F32 ? W : HS, ldo = dt == FL_F32 ? C : HS; // of the fp32 views
    int lds = score_stride(T);
    float scale = 1.0f / sqrtf((float)HS);
    size_t ws_per_thread = attention_workspace_floats(dt, T, HS, group);
    // each (b, kv head) owns its own columns of dqkv: its dk, dv and its
    // query heads' dq, so work items never race
#pragma omp parallel for
    for (int bg = 0; bg < B * NKV; bg++) {
        int b = bg / NKV, g = bg % NKV;
        float *P = workspace + (size_t)omp_get_thread_num() * ws_per_thread;
        float *dP = P + (size_t)ATT_BR * lds, *D = dP + (size_t)ATT_BR * lds;
        float *kpk = D + ATT_BR, *vpk = kpk + gemm_packed_floats(T, HS);
        float *copies = vpk + gemm_packed_floats(T, HS);
        const void *row0 = fl_at_const(dt, qkv, (size_t)b * T * W);
        void *drow0 = fl_at(dt, dqkv, (size_t)b * T * W);
        void *dkh = fl_at(dt, drow0, (size_t)C + g * HS);
        void *dvh = fl_at(dt, drow0, (size_t)C + (NKV + g) * HS);
        const float *k =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + g * HS), W, T, HS, copies, 1);
        const float *v =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + (NKV + g) * HS), W, T, HS, copies, 2);
        float *dk = head_f32(dt, dkh, W, T, HS, copies, 6);
        float *dv = head_f32(dt, dvh, W, T, HS, copies, 7);
        if (ops->tiles) pack_keys(kpk, k, ldq, T, HS), pack_keys(vpk, v, ldq, T, HS);
        for (int h = g * group; h < (g + 1) * group; h++) { // the group's query heads, in order
            const void *oh = fl_at_const(dt, out, (size_t)b * T * C + h * HS);
            const void *dOh = fl_at_const(dt, dout, (size_t)b * T * C + h * HS);
            void *dqh = fl_at(dt, drow0, (size_t)h * HS);
            const float *q =
                head_f32(dt, fl_at_const(dt, row0, (size_t)h * HS), W, T, HS, copies, 0);
            const float *o = head_f32(dt, oh, C, T, HS, copies, 3);
            const float *dO = head_f32(dt, dOh, C, T, HS, copies, 4);
            float *dq = head_f32(dt, dqh, W, T, HS, copies, 5);
            const float *lse_bh = lse + ((size_t)b * NH + h) * T;
            for (int i0 = 0; i0 < T; i0 += ATT_BR) {
                int nb = T - i0 < ATT_BR ? T - i0 : ATT_BR, n = i0 + nb;
                const float *q_blk = q + (size_t)i0 * ldq, *dO_blk = dO + (size_t)i0 * ldo;
                // recompute P = exp(scale * Q K^T - lse), masked
                block_scores(ops->tiles, P, lds, q_blk, ldq, k, ldq, kpk, nb, i0, HS, scale);
                // D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, in a loop of
                // its own: the rows are far apart and not in cache, and
                // without the exps between them their loads overlap
                for (int r = 0; r < nb; r++)
                    D[r] = ops->dot(dO_blk + (size_t)r * ldo, o + (size_t)(i0 + r) * ldo, HS);
                for (int r = 0; r < nb; r++)
                    ops->probs(P + (size_t)r * lds, i0 + r + 1, n, lse_bh[i0 + r]);
                // dV[0:n] += P^T dO[i0:n]
                block_cols(ops->tiles, dv, ldq, P, lds, dO_blk, ldo, nb, i0, HS, 1.0f);
                // dP = dO V^T, then dS = P * (dP - D) in place
                block_scores(ops->tiles, dP, lds, dO_blk, ldo, v, ldq, vpk, nb, i0, HS, 1.0f);
                for (int r = 0; r < nb; r++)
                    ops->dsoftmax(dP + (size_t)r * lds, P + (size_t)r * lds, D[r], i0 + r + 1, n);
                // dQ[i0:n] += scale * dS K[0:n] ; dK[0:n] += scale * dS^T Q[i0:n]
                block_rows(ops->tiles, dq + (size_t)i0 * ldq, ldq, dP, lds, k, ldq, nb, i0, HS,
                           scale, 1);
                block_cols(ops->tiles, dk, ldq, dP, lds, q_blk, ldq, nb, i0, HS, scale);
            }
            head_flush(dt, dqh, W, T, HS, dq);
        }
        head_flush(dt, dkh, W, T, HS, dk);
        head_flush(dt, dvh, W, T, HS, dv);
    }
}

void attention_forward_ref(float *out, float *lse, const float *qkv, int B, int T, int NH, int NKV,
                           int HS) {
    check_heads(NH, NKV, HS);
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;
    float scale = 1.0f / sqrtf((float)HS);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float *qh = qkv + (size_t)b * T * W + h * HS; // position 0's q
            const float *kh = qkv + (size_t)b * T * W + C + (h / group) * HS, *vh = kh + NKV * HS;
            for (int t = 0; t < T; t++) {
                const float *q = qh + (size_t)t * W;
                float maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++)
                    maxval = fmaxf(maxval, scale * dot(q, kh + (size_t)t2 * W, HS));
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++)
                    sum += expf(scale * dot(q, kh + (size_t)t2 * W, HS) - maxval);
                // cppcheck-suppress invalidFunctionArg ; the loop above ran at least once
                float l = maxval + logf(sum);
                lse[((size_t)b * NH + h) * T + t] = l;
                float *o = out + ((size_t)b * T + t) * C + h * HS;
                for (int e = 0; e < HS; e++) o[e] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = kh + (size_t)t2 * W, *v = vh + (size_t)t2 * W;
                    float p = expf(scale * dot(q, k, HS) - l);
                    for (int e = 0; e < HS; e++) o[e] += p * v[e];
                }
            }
        }
    }
}

void attention_backward_ref(float *dqkv, const float *dout, const float *qkv, const float *out,
                            const float *lse, int B, int T, int NH, int NKV, int HS) {
    (void)out; // D is summed as P.dP here, so the oracle does not trust out
    check_heads(NH, NKV, HS);
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;
    float scale = 1.0f / sqrtf((float)HS);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            size_t qoff = (size_t)b * T * W + h * HS; // position 0's q in (d)qkv
            size_t koff = (size_t)b * T * W + C + (h / group) * HS, voff = koff + NKV * HS;
            for (int t = 0; t < T; t++) {
                const float *q = qkv + qoff + (size_t)t * W;
                const float *dO = dout + ((size_t)b * T + t) * C + h * HS;
                float *dq = dqkv + qoff + (size_t)t * W;
                float l = lse[((size_t)b * NH + h) * T + t];
                // P_j = softmax weight of key j, dP_j = dO . v_j, D = sum_j P_j dP_j
                float D = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + koff + (size_t)t2 * W, *v = qkv + voff + (size_t)t2 * W;
                    D += expf(scale * dot(q, k, HS) - l) * dot(dO, v, HS);
                }
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + koff + (size_t)t2 * W, *v = qkv + voff + (size_t)t2 * W;
                    float *dk = dqkv + koff + (size_t)t2 * W, *dv = dqkv + voff + (size_t)t2 * W;
                    float p = expf(scale * dot(q, k, HS) - l);
                    float ds = p * (dot(dO, v, HS) - D); // through the softmax
                    for (int e = 0; e < HS; e++) {
                        dq[e] += scale * ds * k[e];
                        dk[e] += scale * ds * q[e];
                        dv[e] += p * dO[e];
                    }
                }
            }
        }
    }
}
