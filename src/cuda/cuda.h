// cuda.h: what the CUDA backend's files share (src/cuda/; host code C11,
// kernels in .cu files with extern "C" launchers): the checks on every CUDA
// and cuBLASLt return code, the device's compute stream, and the launchers
// the table (cuda.c) points at. For kernels.h's function X the launcher is
// fl_cuda_X with X's signature and contract, every pointer on the device;
// it queues its work on the compute stream and returns (device.h: work is
// issued in call order).
#ifndef FITLM_CUDA_H
#define FITLM_CUDA_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

// fitlm's headers are C: their functions keep C linkage in the .cu files
#ifdef __cplusplus
extern "C" {
#endif

#include "fitlm/core.h"
#include "fitlm/device.h"

// Dies naming the call, its place and CUDA's message when err is an error.
void fl_cuda_check(cudaError_t err, const char *call, const char *file, int line);
#define FL_CUDA_CHECK(call) fl_cuda_check((call), #call, __FILE__, __LINE__)
// After each kernel launch: a bad configuration shows here, not at the
// next synchronisation; and the launch is work issued (fl_cuda_issued).
#define FL_CUDA_LAUNCHED(kernel)                                                                   \
    (fl_cuda_issued(), fl_cuda_check(cudaGetLastError(), kernel, __FILE__, __LINE__))
// The host's waits behind queued work (device.h's host_stalls): work was
// issued (a launch, a GEMM, an asynchronous copy or memset), and a wait for
// the stream or an event, or a copy to or from the host, comes before more
// is: the GPU may idle until the host issues again.
void fl_cuda_issued(void);
void fl_cuda_waited(void);
// The work issued so far (a point an event recorded), and the host's wait
// for such a point: a stall only when nothing was issued after it.
long fl_cuda_issue_point(void);
void fl_cuda_waited_for(long point);
// Pinned host memory under tag (device.h's host_alloc), and its release
// (after the copies that use it).
void *fl_cuda_host_alloc(fl_mem_tag tag, size_t bytes);
void fl_cuda_host_free(void *p);
// device.h's host_scratch_bytes: the embedding backward's buckets (encoder.cu)
size_t fl_cuda_host_scratch_bytes(int N);

// The device's one compute stream: every kernel, GEMM and table copy of
// the backend is queued on it, in call order.
cudaStream_t fl_cuda_stream(void);
// The multiprocessors of the device (grid sizes of the reductions that do
// not depend on it are fixed; this only sizes grid-stride loops).
int fl_cuda_sm_count(void);

// The backend's own scratch on the device, at least `bytes`: the
// reductions' partial sums (norms' weight gradients, bias gradients, sums
// of squares) and the embedding backward's buckets. A model's lent scratch
// (device.h's scratch_lend: sized by fl_cuda_scratch_bytes, counted under
// FL_MEM_WORKSPACE and planned); without one big enough (kernels called
// outside a model) the backend's own, counted the same, grown when a call
// needs more (after the stream's work so far) and freed when a model lends
// one.
void *fl_cuda_scratch(size_t bytes);
// What the kernels on at most N rows, with column sums at most cols wide, ask of it.
size_t fl_cuda_scratch_bytes(int N, int cols, int heads);
#define FL_CUDA_REDUCE_BLOCKS 1024 // step.cu's reductions: at most this many blocks' partial sums
// step.cu's sumsq_rows: at most this many blocks' partial sums (its ranges'
// together) in the scratch per copy back: 64 rows of 1024 blocks, a GPT-2
// 124M's ~150 rows (~40K blocks) in one
#define FL_CUDA_REDUCE_PARTIALS (64 * FL_CUDA_REDUCE_BLOCKS)
// Row chunks of a column sum over N rows (columns.cuh): >= 128 rows a
// chunk, at most 128 chunks (a norm's C = 768 columns over 16K rows: 384
// blocks of partial sums, where 64 chunks of 256 rows gave an H200's 132
// multiprocessors 192; with the second pass's warps, GPT-2 124M's
// LayerNorm backward went from 2.41 to 2.07 ms a step at B 16).
static inline int fl_cuda_column_chunks(int N) {
    int chunks = (N + 127) / 128;
    return chunks > 128 ? 128 : chunks < 1 ? 1 : chunks;
}
// cuBLASLt's handle (matmul.cu), made at start-up so that the context's
// bytes measured then include it.
void fl_cuda_matmul_init(void);

// ---- launchers (src/cuda/<family>.cu)
void fl_cuda_encoder_forward(fl_dtype dt, void *out, const int *inp, const void *wte,
                             const void *wpe, int B, int T, int C);
void fl_cuda_encoder_backward(fl_dtype dt, void *dwte, void *dwpe, const void *dout, const int *inp,
                              int B, int T, int C);
void fl_cuda_embedding_shard_forward(fl_dtype dt, void *out, const int *inp, const void *wte,
                                     int first, int rows, int N, int C);
void fl_cuda_ids_known(const fl_device *d, const int *ids, const int *host_ids, size_t n);
void fl_cuda_embedding_shard_backward(fl_dtype dt, void *dwte, const void *dout, const int *inp,
                                      int first, int rows, int N, int C);
void fl_cuda_position_forward(fl_dtype dt, void *out, const void *wpe, int B, int T, int C);
void fl_cuda_position_backward(fl_dtype dt, void *dwpe, const void *dout, int B, int T, int C);
void fl_cuda_layernorm_forward(fl_dtype dt, void *out, float *mean, float *rstd, const void *inp,
                               const void *weight, const void *bias, int N, int C);
void fl_cuda_residual_layernorm_forward(fl_dtype dt, void *res, void *out, float *mean, float *rstd,
                                        const void *skip, const void *weight, const void *bias,
                                        int N, int C);
void fl_cuda_layernorm_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias,
                                const void *dout, const void *inp, const void *weight,
                                const float *mean, const float *rstd, int N, int C);
size_t fl_cuda_matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC);
// The linear's GEMM `kind` (0 forward, 1 input gradient, 2 weight
// gradient) as fl_cuda_matmul_forward/backward issue it, under each of
// cuBLASLt's first `algos` (at most 16) algorithms for its descriptors:
// ms[i] per call of algorithm i (0: the one fitlm runs), the mean of
// `rounds` (>= 1) calls after one untimed; returns how many it timed
// (bench/bench_gpu_gemm.c: the best rate on a step's GEMM shapes).
int fl_cuda_matmul_algos_ms(fl_dtype dt, int kind, void *out, const void *inp, const void *weight,
                            void *dinp, void *dweight, const void *dout, void *workspace, int N,
                            int C, int OC, int algos, int rounds, double *ms);
void fl_cuda_matmul_gelu_forward(fl_dtype dt, void *out, void *pre, const void *inp,
                                 const void *weight, const void *bias, void *workspace, int N,
                                 int C, int OC);
void fl_cuda_matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                            const void *bias, void *workspace, int N, int C, int OC);
void fl_cuda_matmul_dgelu_backward(fl_dtype dt, void *dpre, void *dweight, void *dbias,
                                   const void *dout, const void *inp, const void *weight,
                                   const void *pre, void *workspace, int N, int C, int OC);
void fl_cuda_matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                             const void *inp, const void *weight, void *workspace, int N, int C,
                             int OC, int dinp_add);
void fl_cuda_rmsnorm_forward(fl_dtype dt, void *out, float *rstd, const void *inp,
                             const void *weight, int N, int C, float eps);
void fl_cuda_residual_rmsnorm_forward(fl_dtype dt, void *res, void *out, float *rstd,
                                      const void *skip, const void *weight, int N, int C,
                                      float eps);
void fl_cuda_rmsnorm_backward(fl_dtype dt, void *dinp, void *dweight, const void *dout,
                              const void *inp, const void *weight, const float *rstd, int N, int C);
void fl_cuda_rope_forward(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH,
                          int NKV, int HS);
void fl_cuda_rope_backward(fl_dtype dt, void *dqkv, const float *cos_sin, int B, int T, int NH,
                           int NKV, int HS);
void fl_cuda_swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC);
void fl_cuda_swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N,
                             int IC);
void fl_cuda_gelu_forward(fl_dtype dt, void *out, const void *inp, size_t N);
void fl_cuda_gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t N);
void fl_cuda_residual_forward(fl_dtype dt, void *out, const void *a, const void *b, size_t N);
void fl_cuda_residual_backward(fl_dtype dt, void *da, void *db, const void *dout, size_t N);
void fl_cuda_bias_forward(fl_dtype dt, void *out, const void *bias, int N, int OC);

size_t fl_cuda_attention_workspace_floats(fl_dtype dt, int B, int T, int NH, int HS, int group,
                                          int threads);
void fl_cuda_attention_forward(fl_dtype dt, void *out, float *lse, const void *qkv,
                               float *workspace, int B, int T, int NH, int NKV, int HS);
void fl_cuda_attention_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                const void *out, const float *lse, float *workspace, int B, int T,
                                int NH, int NKV, int HS);
void fl_cuda_softmax_xent_forward(fl_dtype dt, float *losses, float *lse, const void *logits,
                                  const int *targets, int N, int V, int Vp);
void fl_cuda_softmax_xent_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                                   const int *targets, const float *dlosses, int N, int V, int Vp);
void fl_cuda_softmax_xent_forward_backward(fl_dtype dt, float *losses, float *lse, void *logits,
                                           const int *targets, const float *dlosses, int N, int V,
                                           int Vp);
void fl_cuda_xent_shard_max(fl_dtype dt, float *mx, const void *logits, int N, int V, int Vp);
void fl_cuda_xent_shard_sums(fl_dtype dt, float *sums, const void *logits, const float *mx,
                             const int *targets, int N, int V, int Vp);
void fl_cuda_xent_shard_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                                 const int *targets, const float *dlosses, int N, int V, int Vp);
void fl_cuda_lora_add_columns(fl_dtype dt, void *out, int ld, const void *x, float scale, int N,
                              int cols);
void fl_cuda_lora_gather_columns(fl_dtype dt, void *x, const void *src, int ld, float scale, int N,
                                 int cols);
void fl_cuda_dropout_apply(fl_dtype dt, void *out, const void *inp, size_t n, float p,
                           uint64_t key);
void fl_cuda_nf4_dequantize(fl_dtype dt, void *out, const uint8_t *codes, const float *absmax,
                            size_t n, int block);
void fl_cuda_dq8_dequantize(float *absmax, const uint8_t *q, const float *nested, float offset,
                            size_t n, int block);

// ---- the step's reductions and updates (src/cuda/step.cu, update.cu)
void fl_cuda_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src, size_t n);
void fl_cuda_accumulate(float *dst, fl_dtype dt, const void *src, size_t n);
double fl_cuda_sumsq(fl_dtype dt, const void *x, size_t n);
void fl_cuda_sumsq_rows(fl_dtype dt, const void *x, int n, const size_t *offsets,
                        const size_t *counts, double *out);
double fl_cuda_sum(const float *x, size_t n);
void fl_cuda_sum_to(double *out, const float *x, size_t n);
void fl_cuda_fill(float *x, float v, size_t n);
void fl_cuda_gate(fl_step_gate *g, const fl_gate_op *op);
void fl_cuda_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                    const fl_update_args *a);
void fl_cuda_update_rows(fl_optim_rule *r, int n, const fl_param_view *const *rows,
                         const size_t *offset, const size_t *count, const fl_update_args *args);

#ifdef __cplusplus
}
#endif

#endif
