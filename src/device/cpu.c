// cpu.c: the cpu device. Its memory is the host's (counted as host memory
// by the tagged allocator), its copies are memcpy and its kernels are
// kernels.h's: the reference every other device is checked against.
#include "fitlm/device.h"
#include "fitlm/kernels.h"

#include "../optim/gate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void cpu_describe(const fl_device *d, char *out, size_t size) {
    (void)d;
    snprintf(out, size, "cpu (%d threads)", fl_threads());
}

static size_t cpu_available(const fl_device *d) {
    (void)d;
    return fl_mem_available();
}

static void *cpu_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes) {
    (void)d;
    return fl_alloc(tag, bytes);
}

static void cpu_free(const fl_device *d, void *p) {
    (void)d;
    fl_free(p);
}

// Host memory counted as pinned (the cpu has nothing to pin): a header in
// front holds the tag and size for the free.
typedef struct {
    size_t bytes;
    fl_mem_tag tag;
} host_header;

static void *cpu_host_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes) {
    (void)d;
    void *raw = NULL;
    if (posix_memalign(&raw, 64, 64 + bytes) != 0) fl_die_oom(bytes, tag);
    memset(raw, 0, 64 + bytes);
    *(host_header *)raw = (host_header){bytes, tag};
    fl_mem_pinned_count(tag, (long long)bytes);
    return (char *)raw + 64;
}

static void cpu_host_free(const fl_device *d, void *p) {
    (void)d;
    if (!p) return;
    host_header h = *(host_header *)((char *)p - 64);
    fl_mem_pinned_count(h.tag, -(long long)h.bytes);
    free((char *)p - 64);
}

static void cpu_zero(const fl_device *d, void *p, size_t bytes) {
    (void)d;
    memset(p, 0, bytes);
}

// The input gradients the table overwrites (device.h): cleared, then
// kernels.h's +=, the bits of a clear before the call.
static void cpu_matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias,
                                const void *dout, const void *inp, const void *weight,
                                void *workspace, int N, int C, int OC, int dinp_add) {
    if (dinp && !dinp_add) memset(dinp, 0, (size_t)N * C * fl_dtype_size(dt));
    matmul_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC);
}

static void cpu_attention_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                   const void *out, const float *lse, float *workspace, int B,
                                   int T, int NH, int NKV, int HS) {
    memset(dqkv, 0, (size_t)B * T * (NH + 2 * NKV) * HS * fl_dtype_size(dt));
    attention_backward(dt, dqkv, dout, qkv, out, lse, workspace, B, T, NH, NKV, HS);
}

static void cpu_swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N,
                                int IC) {
    memset(dinp, 0, (size_t)N * 2 * IC * fl_dtype_size(dt));
    swiglu_backward(dt, dinp, inp, dout, N, IC);
}

static void cpu_gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                              size_t N) {
    memset(dinp, 0, N * fl_dtype_size(dt));
    gelu_backward(dt, dinp, inp, dout, N);
}

static void cpu_copy(const fl_device *d, void *dst, const void *src, size_t bytes) {
    (void)d;
    memmove(dst, src, bytes);
}

static void cpu_copy_async(const fl_device *d, void *dst, const void *src, size_t bytes, int kind,
                           fl_stream *s) {
    (void)kind, (void)s;
    cpu_copy(d, dst, src, bytes);
}

// Work on the cpu is done when its call returns: a stream is a name, an
// event a point already reached.
static fl_stream *cpu_stream_create(const fl_device *d) {
    (void)d;
    return (fl_stream *)fl_alloc(FL_MEM_OTHER, 1);
}

static void cpu_stream_destroy(const fl_device *d, fl_stream *s) {
    (void)d;
    fl_free(s);
}

static fl_event *cpu_event_record(const fl_device *d, fl_stream *s) {
    (void)d, (void)s;
    return (fl_event *)fl_alloc(FL_MEM_OTHER, 1);
}

static void cpu_stream_wait(const fl_device *d, fl_stream *s, fl_event *e) {
    (void)d, (void)s, (void)e;
}

static void cpu_event_sync(const fl_device *d, fl_event *e) {
    (void)d, (void)e;
}

static void cpu_event_destroy(const fl_device *d, fl_event *e) {
    (void)d;
    fl_free(e);
}

static void cpu_sync(const fl_device *d) {
    (void)d;
}

// a timed event: the host's clock when it is recorded (the work before it is done)
static fl_event *cpu_event_record_timed(const fl_device *d, fl_stream *s) {
    (void)d, (void)s;
    double *at = fl_alloc(FL_MEM_OTHER, sizeof *at);
    *at = fl_now();
    return (fl_event *)at;
}

static double cpu_event_elapsed_ms(const fl_device *d, fl_event *a, fl_event *b) {
    (void)d;
    return (*(const double *)b - *(const double *)a) * 1e3;
}

static size_t cpu_reserved(const fl_device *d) {
    (void)d;
    return 0;
}

// the cpu's kernels keep their scratch on the stack or in the model's workspace
static size_t cpu_scratch_bytes(int N, int cols, int heads) {
    (void)N, (void)cols, (void)heads;
    return 0;
}

static void cpu_scratch_lend(const fl_device *d, void *p, size_t bytes) {
    (void)d, (void)p, (void)bytes;
}

static void cpu_scratch_return(const fl_device *d, void *p) {
    (void)d, (void)p;
}

// each range as sumsq alone (an empty one 0.0): the per-row sums every cpu
// result was made with
static void cpu_sumsq_rows(fl_dtype dt, const void *x, int n, const size_t *offsets,
                           const size_t *counts, double *out) {
    for (int i = 0; i < n; i++)
        out[i] = fl_grad_sumsq(dt, fl_at_const(dt, x, offsets[i]), counts[i]);
}

static size_t cpu_attention_workspace(fl_dtype dt, int B, int T, int NH, int HS, int group,
                                      int threads) {
    (void)B, (void)NH;
    return attention_workspace_floats(dt, T, HS, group) * (size_t)threads;
}

static void cpu_accumulate(float *dst, fl_dtype dt, const void *src, size_t n) {
    size_t block = 4096, nblocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t i = b * block, len = n - i < block ? n - i : block;
        float scratch[4096];
        const float *g = fl_load_f32(dt, fl_at_const(dt, src, i), len, scratch);
        for (size_t k = 0; k < len; k++) dst[i + k] += g[k];
    }
}

// fl_convert in blocks over the threads (a whole model's master weights)
static void cpu_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src, size_t n) {
    size_t block = 65536, nblocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t i = b * block, len = n - i < block ? n - i : block;
        fl_convert(dst_dt, fl_at(dst_dt, dst, i), src_dt, fl_at_const(src_dt, src, i), len);
    }
}

static double cpu_sum(const float *x, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += x[i];
    return s;
}

static void cpu_sum_to(double *out, const float *x, size_t n) {
    *out = cpu_sum(x, n);
}

static void cpu_fill(float *x, float v, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = v;
}

static void cpu_gate(fl_step_gate *g, const fl_gate_op *op) {
    fl_gate_apply(g, op);
}

static const fl_device cpu = {
    .name = "cpu",
    .host = 1,
    .describe = cpu_describe,
    .available = cpu_available,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .zero = cpu_zero,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy,
    .copy_async = cpu_copy_async,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .event_sync = cpu_event_sync,
    .event_destroy = cpu_event_destroy,
    .sync = cpu_sync,
    .event_record_timed = cpu_event_record_timed,
    .event_elapsed_ms = cpu_event_elapsed_ms,
    .reserved = cpu_reserved,
    .matmul_workspace_bytes = matmul_workspace_bytes,
    .attention_workspace_floats = cpu_attention_workspace,
    .scratch_bytes = cpu_scratch_bytes,
    .scratch_lend = cpu_scratch_lend,
    .scratch_return = cpu_scratch_return,
    .encoder_forward = encoder_forward,
    .encoder_backward = encoder_backward,
    .embedding_shard_forward = embedding_shard_forward,
    .embedding_shard_backward = embedding_shard_backward,
    .position_forward = position_forward,
    .position_backward = position_backward,
    .layernorm_forward = layernorm_forward,
    .residual_layernorm_forward = residual_layernorm_forward,
    .layernorm_backward = layernorm_backward,
    .matmul_forward = matmul_forward,
    .matmul_backward = cpu_matmul_backward,
    .attention_forward = attention_forward,
    .attention_backward = cpu_attention_backward,
    .rmsnorm_forward = rmsnorm_forward,
    .residual_rmsnorm_forward = residual_rmsnorm_forward,
    .rmsnorm_backward = rmsnorm_backward,
    .rope_forward = rope_forward,
    .rope_backward = rope_backward,
    .swiglu_forward = swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .gelu_forward = gelu_forward,
    .gelu_backward = cpu_gelu_backward,
    .residual_forward = residual_forward,
    .residual_backward = residual_backward,
    .bias_forward = bias_forward,
    .softmax_xent_forward = softmax_xent_forward,
    .softmax_xent_backward = softmax_xent_backward,
    .softmax_xent_forward_backward = softmax_xent_forward_backward,
    .xent_shard_max = xent_shard_max,
    .xent_shard_sums = xent_shard_sums,
    .xent_shard_backward = xent_shard_backward,
    .lora_add_columns = lora_add_columns,
    .lora_gather_columns = lora_gather_columns,
    .dropout_apply = dropout_apply,
    .nf4_dequantize = nf4_dequantize,
    .dq8_dequantize = dq8_dequantize,
    .convert = cpu_convert,
    .accumulate = cpu_accumulate,
    .sumsq = fl_grad_sumsq,
    .sumsq_rows = cpu_sumsq_rows,
    .sum = cpu_sum,
    .sum_to = cpu_sum_to,
    .fill = cpu_fill,
    .gate = cpu_gate,
    .update = fl_optim_update,
};

const fl_device *fl_device_cpu_table(void) {
    return &cpu;
}
