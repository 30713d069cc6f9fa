// matmul_dnnl.h: the bf16 GEMM backend of matmul (see kernels.h), built on
// oneDNN's matmul primitive: bf16 operands, fp32 accumulation, bf16 results
// rounded once to nearest even. Same contract as matmul_forward and
// matmul_backward: out (N,OC) = inp (N,C) @ weight^T + bias with weight
// (OC,C) row-major (nn.Linear); backward accumulates into dinp (N,C),
// dweight (OC,C) and dbias (OC), any of which may be NULL; bias may be NULL.
//
// Weights stay in their plain row-major layout (no reorders); transposes are
// expressed through oneDNN memory strides. oneDNN's primitives are created
// once per (dtype, N, C, OC, GEMM) and cached; they run on the OpenMP pool
// with the thread count in force when they were created.
//
// oneDNN allocates no scratchpad of its own (user scratchpad mode): every
// call takes `workspace`, dnnl_matmul_workspace_bytes(dt, N, C, OC) bytes
// (may be NULL when that is 0), so the tagged allocator counts every byte.
// One workspace must not be used by two calls running at the same time.
#ifndef FITLM_MATMUL_DNNL_H
#define FITLM_MATMUL_DNNL_H

#include <stddef.h>

#include "fitlm/dtype.h"

// 1 when dt is FL_BF16 and oneDNN runs native bf16 kernels on this CPU
// (AVX512_BF16 or AMX; never its emulated bf16 path); 0 otherwise, always 0
// for FL_F32 and FL_F16. The other functions die unless this is 1.
int dnnl_matmul_supported(fl_dtype dt);

// Scratchpad bytes the forward and both backward GEMMs of this shape need
// (their maximum). Creates and caches the shape's primitives.
size_t dnnl_matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC);

// out (N,OC) = inp (N,C) @ weight^T + bias; bias (OC) may be NULL. Overwrites out.
void dnnl_matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                         const void *bias, void *workspace, int N, int C, int OC);

// dinp (N,C) += dout @ weight, dweight (OC,C) += dout^T @ inp,
// dbias (OC) += column sums of dout; each may be NULL. dst = round(dst + sum)
// with the sum formed in fp32; dbias sums rows in a fixed order per block of
// output channels (bitwise independent of the thread count).
void dnnl_matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                          const void *inp, const void *weight, void *workspace, int N, int C,
                          int OC);

// Destroys every cached primitive, the oneDNN engine and stream, and flushes
// oneDNN's own primitive cache. Later calls recreate what they need. Call it
// after fl_set_threads changes the thread count (cached primitives keep the
// old one; re-query the workspace size after), and at exit to stay
// leak-clean. Not to be called while another thread runs a matmul.
void dnnl_matmul_release(void);

#endif
