// gemm.h: fitlm's own single-threaded GEMM, private to the kernels. It
// exists for the 16-bit path on CPUs without bf16/fp16 arithmetic: the
// operands are converted to fp32 while they are packed, which the GEMM does
// anyway, instead of in a pass of their own before sgemm.
#ifndef FITLM_KERNELS_GEMM_H
#define FITLM_KERNELS_GEMM_H

#include <stddef.h>

#include "fitlm/dtype.h"

// A matrix operand of any storage dtype: element (i, k) of op(X) is
// p[i * ld + k], or p[k * ld + i] when trans. Or, with `packed`, an operand
// packed ahead by gemm_pack (shared by the tiles of one GEMM): rows of op(a)
// or columns of op(b) from `first` on, of `count` in all.
typedef struct {
    fl_dtype dt;
    const void *p;
    int ld, trans;
    const float *packed;
    int count, first;
} gemm_mat;

// Floats of gemm_pack's output for an operand of n rows (a) or columns (b)
// and depth K.
size_t gemm_packed_floats(int n, int K);
// Packs rows [first, first + n) of op(x) (as_b == 0; op(x) is (count, K))
// or columns of op(x) (as_b; op(x) is (K, count)) into dst, sized by
// gemm_packed_floats(count, K), at depths [k0, k0 + GEMM_DEPTH_BLOCK): one
// piece of the operand, so that threads pack pieces side by side. first is a
// multiple of GEMM_PACK_QUANTUM, and so is n unless the range ends at count;
// k0 is a multiple of GEMM_DEPTH_BLOCK. attention.c packs a head's keys and
// values this way for its score tiles.
#define GEMM_PACK_QUANTUM 96
#define GEMM_DEPTH_BLOCK  256
// Rows of op(a) per block: a gemm_tile call of at most this many rows packs
// each depth block of a once for all of op(b)'s columns (more rows: once per
// block of columns). A multiple of every kernel's rows.
#define GEMM_ROW_BLOCK 192
void gemm_pack(float *dst, gemm_mat x, int as_b, int count, int K, int first, int n, int k0);

// Columns of op(b) per panel of the kernel gemm_tile runs (fl_cpu_isa()):
// tiles of whole panels need no narrower edge.
int gemm_panel_width(void);

// Floats of packing buffer a gemm_tile call of shape (M, N, K), or any
// smaller one, needs (one buffer per thread).
size_t gemm_pack_floats(int M, int N, int K);

// c (M,N) of dtype c_dt, row stride ldc, = beta * c + op(a) (M,K) @ op(b)
// (K,N), with beta 0 or 1; single-threaded, on the widest path fl_cpu_isa()
// allows, which must be AVX2 or wider. With beta 0, a bias (N fp32 values,
// or NULL) starts every row's sums where c would with beta 1: for an fp32
// c, the bits of c set to the bias row and beta 1, without that pass.
// An element of c sums its K products in the same order whatever M, N and
// the position of the tile, so tiles give the bits of one whole call: in k
// order within blocks of GEMM_DEPTH_BLOCK, each block's sum added to c.
// A 16-bit c needs K <= GEMM_DEPTH_BLOCK: its sum is rounded once, the bits
// of an fp32 copy of c rounded after the call.
void gemm_tile(int M, int N, int K, gemm_mat a, gemm_mat b, float beta, const float *bias,
               fl_dtype c_dt, void *c, int ldc, float *pack);
// The same through one path (FL_ISA_AVX2 or FL_ISA_AVX512), for the tests.
void gemm_tile_isa(int isa, int M, int N, int K, gemm_mat a, gemm_mat b, float beta,
                   const float *bias, fl_dtype c_dt, void *c, int ldc, float *pack);

#endif
