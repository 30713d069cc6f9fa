// columns.cuh: column sums of an (N,C) matrix into a gradient of C values
// without atomics: the norms' weight gradients (norm.cuh) and the linear's
// bias gradient (matmul.cu).
#ifndef FITLM_CUDA_COLUMNS_CUH
#define FITLM_CUDA_COLUMNS_CUH

#include "common.cuh"

// Columns of an (N,C) matrix are summed in two passes: row chunk r of
// `chunks` (fixed by N alone) sums its rows into partial[r][c] in a
// fixed order (threads by row stride, then the block's 8 warps in order);
// the second adds the chunks in a fixed order (each warp of a block every
// 8th chunk, then the warps in order) to the gradient and rounds once.
// Deterministic and independent of the GPU.
#define COL_THREADS 32
#define COL_WARPS   8

static inline int column_chunks(int N) {
    return fl_cuda_column_chunks(N); // cuda.h's: the scratch is sized by it
}

// dst[c] (dtype dt) = round(dst[c] + sum over r of partial[r][c]) on the
// compute stream (matmul.cu)
void fl_cuda_column_finish(fl_dtype dt, void *dst, const float *partial, int chunks, int C);

#endif
