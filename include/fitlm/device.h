// device.h: the device seam. A device is a table of functions, in the
// manner of ggml's backend interface: memory with placement, copies each
// way, streams and events, one entry per kernel family of kernels.h, and
// the reductions and updates of the optimizer step. Model, architecture,
// LoRA, quantisation and optimizer code call a model's table (m->dev), so
// none of it knows where its buffers are.
//
// Devices:
// - "cpu": today's kernels on host memory; the reference every other
//   device is checked against (the default).
// - "test": the cpu's kernels on memory the host cannot touch. Its buffers
//   live in one reserved region that is mapped PROT_NONE except while one
//   of the table's functions runs, so any host access to a model buffer that
//   does not go through the table (a copy) faults at once. CI runs the
//   seam's copies and placement (checkpoints, export, eval, sample, plan)
//   on it, on every machine.
// - "cuda": one NVIDIA GPU (src/cuda/), built when CMake finds a CUDA
//   compiler (FITLM_CUDA).
//
// Pointers the table takes are device pointers unless named host_*. The
// kernel entries have kernels.h's signatures and contract (destination
// first, backward accumulates, the same exceptions), with every pointer,
// int * ids and float * statistics included, on the device, but for the
// input gradients a backward pass writes first: gelu_backward's and
// swiglu_backward's dinp, attention_backward's dqkv, matmul_backward's dinp
// (unless dinp_add) and matmul_dgelu_backward's dpre are OVERWRITTEN. A GPU
// writes them without reading them, so the backward pass needs no clearing
// pass over its activation gradients before them (llm.c's kernels overwrite
// them too); the cpu clears them and runs kernels.h's +=, the same bits.
//
// Ordering: work is issued on the device's compute stream in call order. A
// copy to or from the host (copy_h2d, copy_d2h) returns when it is done;
// copy_async does not (ordered on its stream; event_record and stream_wait
// order streams against each other, event_sync waits on the host). A
// training step waits once, when it reads its verdict after the last
// update (fl_optimizer_settle): the host's other calls in it only issue work.
#ifndef FITLM_DEVICE_H
#define FITLM_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/core.h"
#include "fitlm/dtype.h"
#include "fitlm/optim.h"
#include "fitlm/params.h"
#include "fitlm/profile.h"

typedef struct fl_stream fl_stream; // an ordered queue of device work (NULL: compute)
typedef struct fl_event fl_event;   // a point on a stream

enum { FL_COPY_H2D, FL_COPY_D2H, FL_COPY_D2D };
// the most rows a call of update_rows takes
enum { FL_UPDATE_ROWS = 48 };

typedef struct fl_device fl_device;
struct fl_device {
    const char *name; // "cpu", "test", "cuda"
    int host;         // 1: device pointers are host pointers (the cpu device)
    // one line for the start-up log: the backend, the card, its free memory
    void (*describe)(const fl_device *d, char *out, size_t size);
    // memory this device may still allocate (0: unknown, no limit known)
    size_t (*available)(const fl_device *d);

    // ---- memory: zero-filled, 64-byte aligned, counted under tag on the
    // device (fl_mem_device_*); dies with the tag and size when it runs out
    void *(*alloc)(const fl_device *d, fl_mem_tag tag, size_t bytes);
    void (*free)(const fl_device *d, void *p); // NULL is fine
    void (*zero)(const fl_device *d, void *p, size_t bytes);
    void (*copy_h2d)(const fl_device *d, void *dst, const void *host_src, size_t bytes);
    void (*copy_d2h)(const fl_device *d, void *host_dst, const void *src, size_t bytes);
    void (*copy_d2d)(const fl_device *d, void *dst, const void *src, size_t bytes);
    // kind: FL_COPY_*; the host side must stay valid until the copy is done
    void (*copy_async)(const fl_device *d, void *dst, const void *src, size_t bytes, int kind,
                       fl_stream *s);
    fl_stream *(*stream_create)(const fl_device *d);
    void (*stream_destroy)(const fl_device *d, fl_stream *s);
    fl_event *(*event_record)(const fl_device *d, fl_stream *s);        // a new event
    void (*stream_wait)(const fl_device *d, fl_stream *s, fl_event *e); // s waits for e
    void (*event_sync)(const fl_device *d, fl_event *e);                // the host waits
    void (*event_destroy)(const fl_device *d, fl_event *e);
    void (*sync)(const fl_device *d); // the host waits for every stream
    // timing (ZeRO-Offload's share of the step the device waits on the
    // host): a new event that notes when stream s reaches it (the cpu and
    // test devices: the host's clock, their work being done when a call
    // returns), and the milliseconds from a to b, timed events of one
    // stream with a before b; it waits for b
    fl_event *(*event_record_timed)(const fl_device *d, fl_stream *s);
    double (*event_elapsed_ms)(const fl_device *d, fl_event *a, fl_event *b);
    // device bytes held outside the tagged blocks, measured at start-up
    // (cuda: its context, cuBLASLt's handle; 0 for the others): counted
    // against --mem-limit, which then stands for a card's total memory
    size_t (*reserved)(const fl_device *d);
    // pinned (page-locked) host memory, which copy_async moves without a
    // bounce (ZeRO-Offload's master, state and staging): zero-filled,
    // 64-byte aligned, counted under tag as host memory and as pinned
    // (fl_mem_pinned_count); the cpu and test devices give ordinary memory
    void *(*host_alloc)(const fl_device *d, fl_mem_tag tag, size_t bytes);
    void (*host_free)(const fl_device *d, void *p); // NULL is fine
    // the host's waits so far that came after it issued work and before it
    // issued more: where the device may sit idle until the host issues
    // again (a training step's budget is one, its verdict's read); NULL
    // where every call is done when it returns (the cpu)
    long (*host_stalls)(const fl_device *d);
    // the host's copy (host_ids, n values) of ids just copied to device
    // memory `ids`, valid until the step that copied them returns (NULL:
    // none, and any kept for `ids` is forgotten): a backend may read it
    // instead of the device's (cuda: the embedding backward's buckets, made
    // on the host as llm.c makes them, without waiting for a copy back);
    // NULL where nothing reads ids on the host (the cpu)
    void (*ids_known)(const fl_device *d, const int *ids, const int *host_ids, size_t n);

    // ---- kernels (kernels.h)
    size_t (*matmul_workspace_bytes)(fl_dtype dt, int N, int C, int OC);
    // attention's workspace in floats for B x T positions of NH query heads
    // of HS values, `group` to a kv head: the cpu's per-thread rows for
    // `threads` host threads; cuda's fp32 dK and dV per query head under
    // grouped-query attention (attention_mma.cu)
    size_t (*attention_workspace_floats)(fl_dtype dt, int B, int T, int NH, int HS, int group,
                                         int threads);
    // the backend's own device scratch (cuda: the reductions' partial sums,
    // the embedding backward's buckets, attention's per-row D) for kernels
    // on at most N rows whose column sums (norm and bias gradients) are at
    // most cols wide, with at most `heads` query heads: a model allocates it
    // under FL_MEM_WORKSPACE (so the plan counts it) and lends it to the
    // device for as long as it lives
    size_t (*scratch_bytes)(int N, int cols, int heads);
    // pinned host memory the backend stages for a step's kernels on at most
    // N rows, allocated by it at first use and kept, counted as pinned
    // FL_MEM_WORKSPACE (cuda: the embedding backward's buckets, which an
    // asynchronous copy takes up; the plan counts it where the embedding
    // trains); NULL: none
    size_t (*host_scratch_bytes)(int N);
    void (*scratch_lend)(const fl_device *d, void *p, size_t bytes);
    void (*scratch_return)(const fl_device *d, void *p); // NULL is fine
    void (*encoder_forward)(fl_dtype dt, void *out, const int *inp, const void *wte,
                            const void *wpe, int B, int T, int C);
    void (*encoder_backward)(fl_dtype dt, void *dwte, void *dwpe, const void *dout, const int *inp,
                             int B, int T, int C);
    void (*embedding_shard_forward)(fl_dtype dt, void *out, const int *inp, const void *wte,
                                    int first, int rows, int N, int C);
    void (*embedding_shard_backward)(fl_dtype dt, void *dwte, const void *dout, const int *inp,
                                     int first, int rows, int N, int C);
    void (*position_forward)(fl_dtype dt, void *out, const void *wpe, int B, int T, int C);
    void (*position_backward)(fl_dtype dt, void *dwpe, const void *dout, int B, int T, int C);
    void (*layernorm_forward)(fl_dtype dt, void *out, float *mean, float *rstd, const void *inp,
                              const void *weight, const void *bias, int N, int C);
    void (*layernorm_backward)(fl_dtype dt, void *dinp, void *dweight, void *dbias,
                               const void *dout, const void *inp, const void *weight,
                               const float *mean, const float *rstd, int N, int C);
    void (*residual_layernorm_forward)(fl_dtype dt, void *res, void *out, float *mean, float *rstd,
                                       const void *skip, const void *weight, const void *bias,
                                       int N, int C);
    void (*matmul_forward)(fl_dtype dt, void *out, const void *inp, const void *weight,
                           const void *bias, void *workspace, int N, int C, int OC);
    void (*matmul_backward)(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                            const void *inp, const void *weight, void *workspace, int N, int C,
                            int OC, int dinp_add);
    // out = gelu(inp x weight^T + bias) and pre = the product plus bias, in
    // one pass (cuBLASLt's GELU_AUX_BIAS epilogue: its tanh GELU rounds
    // apart from gelu_forward's); NULL where the device does not fuse them
    // (the model then runs matmul_forward and gelu_forward): the cpu and
    // test devices, and cuda unless FITLM_CUDA_GELU_FUSION is 1 or 2
    void (*matmul_gelu_forward)(fl_dtype dt, void *out, void *pre, const void *inp,
                                const void *weight, const void *bias, void *workspace, int N, int C,
                                int OC);
    // matmul_backward (dinp_add 0) whose input gradient leaves through
    // GELU's backward: dpre = (dout x weight) * gelu'(pre), where pre is
    // the GELU's input (N,C), in one pass (cuBLASLt's DGELU epilogue); NULL
    // where the device does not fuse them (the model then runs
    // matmul_backward and gelu_backward): the cpu and test devices, and
    // cuda unless FITLM_CUDA_GELU_FUSION=2
    void (*matmul_dgelu_backward)(fl_dtype dt, void *dpre, void *dweight, void *dbias,
                                  const void *dout, const void *inp, const void *weight,
                                  const void *pre, void *workspace, int N, int C, int OC);
    void (*attention_forward)(fl_dtype dt, void *out, float *lse, const void *qkv, float *workspace,
                              int B, int T, int NH, int NKV, int HS);
    void (*attention_backward)(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                               const void *out, const float *lse, float *workspace, int B, int T,
                               int NH, int NKV, int HS);
    void (*rmsnorm_forward)(fl_dtype dt, void *out, float *rstd, const void *inp,
                            const void *weight, int N, int C, float eps);
    void (*rmsnorm_backward)(fl_dtype dt, void *dinp, void *dweight, const void *dout,
                             const void *inp, const void *weight, const float *rstd, int N, int C);
    void (*residual_rmsnorm_forward)(fl_dtype dt, void *res, void *out, float *rstd,
                                     const void *skip, const void *weight, int N, int C, float eps);
    void (*rope_forward)(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH,
                         int NKV, int HS);
    void (*rope_backward)(fl_dtype dt, void *dqkv, const float *cos_sin, int B, int T, int NH,
                          int NKV, int HS);
    void (*swiglu_forward)(fl_dtype dt, void *out, const void *inp, int N, int IC);
    void (*swiglu_backward)(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N,
                            int IC);
    void (*gelu_forward)(fl_dtype dt, void *out, const void *inp, size_t N);
    void (*gelu_backward)(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t N);
    void (*residual_forward)(fl_dtype dt, void *out, const void *a, const void *b, size_t N);
    void (*residual_backward)(fl_dtype dt, void *da, void *db, const void *dout, size_t N);
    void (*bias_forward)(fl_dtype dt, void *out, const void *bias, int N, int OC);
    void (*softmax_xent_forward)(fl_dtype dt, float *losses, float *lse, const void *logits,
                                 const int *targets, int N, int V, int Vp);
    void (*softmax_xent_backward)(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                                  const int *targets, const float *dlosses, int N, int V, int Vp);
    void (*softmax_xent_forward_backward)(fl_dtype dt, float *losses, float *lse, void *logits,
                                          const int *targets, const float *dlosses, int N, int V,
                                          int Vp);
    void (*xent_shard_max)(fl_dtype dt, float *mx, const void *logits, int N, int V, int Vp);
    void (*xent_shard_sums)(fl_dtype dt, float *sums, const void *logits, const float *mx,
                            const int *targets, int N, int V, int Vp);
    void (*xent_shard_backward)(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                                const int *targets, const float *dlosses, int N, int V, int Vp);
    void (*lora_add_columns)(fl_dtype dt, void *out, int ld, const void *x, float scale, int N,
                             int cols);
    void (*lora_gather_columns)(fl_dtype dt, void *x, const void *src, int ld, float scale, int N,
                                int cols);
    void (*dropout_apply)(fl_dtype dt, void *out, const void *inp, size_t n, float p, uint64_t key);
    void (*nf4_dequantize)(fl_dtype dt, void *out, const uint8_t *codes, const float *absmax,
                           size_t n, int block);
    void (*dq8_dequantize)(float *absmax, const uint8_t *q, const float *nested, float offset,
                           size_t n, int block);

    // ---- the step's reductions and updates
    // n values of dtype src_dt converted into dst (dst_dt): fp32 master
    // weights from 16-bit ones, a row for the host
    void (*convert)(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src, size_t n);
    // dst (fp32) += src (of dt), elementwise: gradient accumulation in fp32
    void (*accumulate)(float *dst, fl_dtype dt, const void *src, size_t n);
    // the sum of squares of n values in double, in fl_grad_sumsq's order
    // (bitwise the cpu's; cuda: a fixed order of its own, src/cuda/step.cu,
    // within a double's rounding of it); inf or NaN when a value is
    double (*sumsq)(fl_dtype dt, const void *x, size_t n);
    // the gradient norm's rows at once: out[i] (device memory) = sumsq(dt,
    // x + offsets[i], counts[i]) bitwise for each of the n ranges, 0.0 for
    // an empty one; ranges may overlap and come in any order. Issued like a
    // kernel: the host does not wait (cuda: up to 64 ranges a launch into
    // one buffer of partial sums, each range's added in order on the device)
    void (*sumsq_rows)(fl_dtype dt, const void *x, int n, const size_t *offsets,
                       const size_t *counts, double *out);
    // the sum of n fp32 values in double, in index order (the losses; cuda:
    // its fixed order, as sumsq), returned to the host, or (sum_to) left in
    // *out, device memory, without a wait
    double (*sum)(const float *x, size_t n);
    void (*sum_to)(double *out, const float *x, size_t n);
    // x[0..n) = v (the losses' weights of the backward)
    void (*fill)(float *x, float v, size_t n);
    // fl_gate_apply (src/optim/gate.h) on g, device memory, and op (by
    // value; op->rows and op->parent device memory too): a one-thread
    // kernel on a GPU, the host's own arithmetic
    void (*gate)(fl_step_gate *g, const fl_gate_op *op);
    // fl_optim_update on device memory: every pointer of a (params,
    // params_lowp, grads) and the rule's state are the device's
    void (*update)(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                   const fl_update_args *a);
    // update for n rows at once (rows[i]: elements [offset[i], offset[i] +
    // count[i]), args[i]; the args alike but for their pointers and
    // first_index), the same bits as a call each; NULL: the caller calls
    // update row by row (cuda: AdamW and SGD rows in one launch per
    // FL_UPDATE_ROWS, where a launch each left the GPU waiting on the
    // host's launches after the step's norm)
    void (*update_rows)(fl_optim_rule *r, int n, const fl_param_view *const *rows,
                        const size_t *offset, const size_t *count, const fl_update_args *args);

    void *state; // the backend's own
};

// The device called `name` ("cpu", "test", "cuda"); dies with a clear
// message when it is unknown or this build or machine has none.
const fl_device *fl_device_get(const char *name);
// Whether a device of that name exists in this build and machine (no dying);
// why not in `why` when it does not.
int fl_device_available(const char *name, char *why, size_t why_size);
const fl_device *fl_device_cpu(void);
// The cpu's table whose alloc and free are d's host_alloc and host_free: an
// optimizer made on it keeps its master, state and gradient sum in d's
// pinned host memory and updates there with the cpu's kernels (offload).
const fl_device *fl_device_pinned(const fl_device *d);
// The device new models and optimizers are put on (fl_model_init_from,
// fl_optimizer_init): the cpu until fl_device_use names another.
const fl_device *fl_device_default(void);
void fl_device_use(const fl_device *d);

// The per-op profile's clock for d's work (profile.h): its timed events on
// the compute stream; NULL for the cpu, whose calls return when done (the
// host's clock).
const fl_profile_clock *fl_device_profile_clock(const fl_device *d);

// Shorthands for host code that moves whole buffers.
static inline void fl_dev_upload(const fl_device *d, void *dst, const void *host_src, size_t n) {
    if (n) d->copy_h2d(d, dst, host_src, n);
}
static inline void fl_dev_download(const fl_device *d, void *host_dst, const void *src, size_t n) {
    if (n) d->copy_d2h(d, host_dst, src, n);
}

// The backends (src/device/, src/cuda/).
const fl_device *fl_device_cpu_table(void);
const fl_device *fl_device_test_table(void);
// NULL when the build has no CUDA backend or the machine no GPU (why says which).
const fl_device *fl_device_cuda_table(char *why, size_t why_size);

#endif
