// attention.cuh: what attention.cu (the launchers, the fp32 kernels) and
// attention_tc.cu (the tensor-core kernels for 16-bit heads) share.
#ifndef FITLM_CUDA_ATTENTION_CUH
#define FITLM_CUDA_ATTENTION_CUH

#include "common.cuh"

// One call's shape: W the qkv row (NH + 2 NKV heads), C the output row.
typedef struct {
    int T, NH, NKV, HS, group, W, C, tile;
    float scale;
} att_shape;

// Whether the tensor-core kernels take heads of HS values in dtype dt:
// bf16 and fp16 (fp32 stays in fp32 arithmetic: no TF32 unasked), HS a
// multiple of the 16-wide matrix tiles, at most 128.
static inline int fl_cuda_attention_tc(fl_dtype dt, int HS) {
    return dt != FL_F32 && HS % 16 == 0 && HS <= 128;
}

// The tensor-core forward and backward (attention_tc.cu), with
// kernels.h's contract, on the compute stream.
void fl_cuda_attention_tc_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                                  const att_shape &a);
void fl_cuda_attention_tc_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                   const void *out, const float *lse, int B, const att_shape &a);

// Raises a kernel's dynamic shared-memory limit to `bytes` (over the default 48 KB).
void fl_cuda_attention_allow_smem(const void *kernel, size_t bytes, const char *what);

#endif
