// cuda.c: the cuda device, one NVIDIA GPU (device 0 of those the process
// sees). Memory is cudaMalloc's, never managed memory (which can page and
// hang a GPU that runs short), zero-filled and counted per tag on the device;
// copies to and from the host return when done; kernels, GEMMs and copies
// between device buffers go on the one compute stream, in call order.
#include "cuda.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "fitlm/core.h"

void fl_cuda_check(cudaError_t err, const char *call, const char *file, int line) {
    if (err == cudaSuccess) return;
    fl_die("cuda: %s failed at %s:%d: %s (%s)", call, file, line, cudaGetErrorString(err),
           cudaGetErrorName(err));
}

struct fl_stream {
    cudaStream_t s;
};

struct fl_event {
    cudaEvent_t e;
    long issued; // the work issued when it was recorded
};

// a live allocation, for free's count under its tag
typedef struct {
    void *p;
    size_t bytes;
    fl_mem_tag tag;
} block;

static struct {
    int ready;
    cudaStream_t compute;
    struct cudaDeviceProp prop;
    pthread_mutex_t lock; // the blocks
    block *blocks;
    size_t n_blocks, cap;
    size_t context_bytes; // in use on the card once the context and cuBLASLt's handle exist
    // fl_cuda_scratch's: the models' lent scratch (newest last), or the
    // backend's own, grown when a call needs more than any lent one holds
    struct {
        void *p;
        size_t bytes;
    } lent[16];
    int n_lent;
    void *scratch;
    size_t scratch_bytes;
} g = {.lock = PTHREAD_MUTEX_INITIALIZER};

cudaStream_t fl_cuda_stream(void) {
    return g.compute;
}

// The host's waits behind queued work: issued counts the work issued,
// waited the point the host last waited for. A wait for point p (the stream
// now, or an event's record) stalls when it is the newest work (nothing
// issued after it keeps the device busy) and the host has not waited for it
// yet. (Host threads of an offload issue and wait too: a count, not a lock.)
static _Atomic long issued, waited, stalls;

void fl_cuda_issued(void) {
    issued++;
}

static void waited_for(long p) {
    if (p == issued && p > waited) stalls++;
    if (p > waited) waited = p;
}

void fl_cuda_waited(void) {
    waited_for(issued);
}

long fl_cuda_issue_point(void) {
    return issued;
}

void fl_cuda_waited_for(long point) {
    waited_for(point);
}

static long cuda_host_stalls(const fl_device *d) {
    (void)d;
    return stalls;
}

int fl_cuda_sm_count(void) {
    return g.prop.multiProcessorCount;
}

static void *cuda_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes);
static void cuda_free(const fl_device *d, void *p);
static fl_device cuda;

// The scratch's users: step.cu's reductions (a double per block, for all
// of sumsq_rows' ranges at once up to FL_CUDA_REDUCE_PARTIALS), the
// column sums' partials (columns.cuh: up to two arrays of chunks x cols
// floats, the LayerNorm's weight and bias), the embedding backward's
// buckets (encoder.cu: used + 2 buckets + 1 ints, used and buckets at most N)
// and the attention backward's D (attention_tc.cu: a float per row and head).
size_t fl_cuda_scratch_bytes(int N, int cols, int heads) {
    size_t reduce = FL_CUDA_REDUCE_PARTIALS * sizeof(double),
           columns = 2 * (size_t)fl_cuda_column_chunks(N) * (size_t)cols * sizeof(float),
           buckets = (3 * (size_t)N + 1) * sizeof(int),
           rows = (size_t)N * (size_t)heads * sizeof(float);
    size_t most = reduce > columns ? reduce : columns;
    most = most > buckets ? most : buckets;
    return most > rows ? most : rows;
}

static void cuda_scratch_lend(const fl_device *d, void *p, size_t bytes) {
    (void)d;
    if (g.n_lent == (int)(sizeof g.lent / sizeof g.lent[0]))
        fl_die("cuda: more than %d models' scratch lent at once", g.n_lent);
    g.lent[g.n_lent].p = p;
    g.lent[g.n_lent++].bytes = bytes;
    if (g.scratch) { // the lent one serves from now on: the own one leaves the counts
        cuda_free(&cuda, g.scratch);
        g.scratch = NULL;
        g.scratch_bytes = 0;
    }
}

// Before the model frees it: the work queued on it is done first.
static void cuda_scratch_return(const fl_device *d, void *p) {
    (void)d;
    for (int i = 0; i < g.n_lent; i++)
        if (g.lent[i].p == p) {
            fl_cuda_waited();
            FL_CUDA_CHECK(cudaStreamSynchronize(g.compute));
            memmove(&g.lent[i], &g.lent[i + 1], (size_t)(g.n_lent - i - 1) * sizeof g.lent[0]);
            g.n_lent--;
            return;
        }
}

void *fl_cuda_scratch(size_t bytes) {
    for (int i = g.n_lent - 1; i >= 0; i--)
        if (bytes <= g.lent[i].bytes) return g.lent[i].p;
    if (bytes <= g.scratch_bytes) return g.scratch;
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaStreamSynchronize(g.compute)); // the old one may still be read
    cuda_free(&cuda, g.scratch);
    g.scratch = cuda_alloc(&cuda, FL_MEM_WORKSPACE, bytes); // counted, as the lent ones are
    g.scratch_bytes = bytes;
    return g.scratch;
}

static void cuda_describe(const fl_device *d, char *out, size_t size) {
    (void)d;
    size_t free_b = 0, total = 0;
    FL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    snprintf(out, size,
             "cuda: %s (compute capability %d.%d, %d SMs), %.1f GiB free of %.1f GiB; context "
             "and cuBLASLt %.0f MiB",
             g.prop.name, g.prop.major, g.prop.minor, g.prop.multiProcessorCount,
             (double)free_b / (1 << 30), (double)total / (1 << 30),
             (double)g.context_bytes / (1 << 20));
}

static size_t cuda_reserved(const fl_device *d) {
    (void)d;
    return g.context_bytes;
}

static size_t cuda_available(const fl_device *d) {
    (void)d;
    size_t free_b = 0, total = 0;
    FL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    return free_b;
}

static void *cuda_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes) {
    (void)d;
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1); // 256-byte aligned
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); // clear it: the error below is the report
        fl_die_device_oom("cuda", bytes, tag);
    }
    FL_CUDA_CHECK(err);
    // zero-filled, and done before any stream uses it
    FL_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.compute));
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaStreamSynchronize(g.compute));
    pthread_mutex_lock(&g.lock);
    g.blocks =
        fl_reserve(FL_MEM_OTHER, g.blocks, &g.cap, g.n_blocks, g.n_blocks + 1, sizeof(block));
    g.blocks[g.n_blocks++] = (block){p, bytes, tag};
    pthread_mutex_unlock(&g.lock);
    fl_mem_device_count(tag, (long long)bytes);
    return p;
}

static void cuda_free(const fl_device *d, void *p) {
    (void)d;
    if (!p) return;
    pthread_mutex_lock(&g.lock);
    size_t at = g.n_blocks;
    for (size_t i = 0; i < g.n_blocks; i++)
        if (g.blocks[i].p == p) at = i;
    if (at == g.n_blocks) {
        pthread_mutex_unlock(&g.lock);
        fl_die("cuda: free of a pointer the device did not allocate");
    }
    block b = g.blocks[at];
    g.blocks[at] = g.blocks[--g.n_blocks];
    pthread_mutex_unlock(&g.lock);
    // the work queued on it finishes first (cudaFree waits for the device)
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaFree(p));
    fl_mem_device_count(b.tag, -(long long)b.bytes);
}

static void cuda_zero(const fl_device *d, void *p, size_t bytes) {
    (void)d;
    if (!bytes) return;
    fl_cuda_issued();
    FL_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.compute));
}

// After the compute stream's work so far; returns when the data is there.
static void cuda_copy_h2d(const fl_device *d, void *dst, const void *host_src, size_t bytes) {
    (void)d;
    if (!bytes) return;
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, g.compute));
    FL_CUDA_CHECK(cudaStreamSynchronize(g.compute));
}

static void cuda_copy_d2h(const fl_device *d, void *host_dst, const void *src, size_t bytes) {
    (void)d;
    if (!bytes) return;
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, g.compute));
    FL_CUDA_CHECK(cudaStreamSynchronize(g.compute));
}

// queued on the compute stream like a kernel: later work sees it
static void cuda_copy_d2d(const fl_device *d, void *dst, const void *src, size_t bytes) {
    (void)d;
    if (!bytes) return;
    fl_cuda_issued();
    FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.compute));
}

static void cuda_copy_async(const fl_device *d, void *dst, const void *src, size_t bytes, int kind,
                            fl_stream *s) {
    (void)d;
    enum cudaMemcpyKind k = kind == FL_COPY_H2D   ? cudaMemcpyHostToDevice
                            : kind == FL_COPY_D2H ? cudaMemcpyDeviceToHost
                                                  : cudaMemcpyDeviceToDevice;
    if (kind != FL_COPY_H2D && kind != FL_COPY_D2H && kind != FL_COPY_D2D)
        fl_die("cuda: copy_async of unknown kind %d", kind);
    if (!bytes) return;
    fl_cuda_issued();
    FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, s ? s->s : g.compute));
}

static fl_stream *cuda_stream_create(const fl_device *d) {
    (void)d;
    fl_stream *s = fl_alloc(FL_MEM_OTHER, sizeof *s);
    FL_CUDA_CHECK(cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking));
    return s;
}

static void cuda_stream_destroy(const fl_device *d, fl_stream *s) {
    (void)d;
    if (!s) return;
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaStreamSynchronize(s->s));
    FL_CUDA_CHECK(cudaStreamDestroy(s->s));
    fl_free(s);
}

static fl_event *cuda_event_record(const fl_device *d, fl_stream *s) {
    (void)d;
    fl_event *e = fl_alloc(FL_MEM_OTHER, sizeof *e);
    FL_CUDA_CHECK(cudaEventCreateWithFlags(&e->e, cudaEventDisableTiming));
    FL_CUDA_CHECK(cudaEventRecord(e->e, s ? s->s : g.compute));
    e->issued = issued;
    return e;
}

static void cuda_stream_wait(const fl_device *d, fl_stream *s, fl_event *e) {
    (void)d;
    FL_CUDA_CHECK(cudaStreamWaitEvent(s ? s->s : g.compute, e->e, 0));
}

static fl_event *cuda_event_record_timed(const fl_device *d, fl_stream *s) {
    (void)d;
    fl_event *e = fl_alloc(FL_MEM_OTHER, sizeof *e);
    FL_CUDA_CHECK(cudaEventCreate(&e->e)); // with timing, unlike event_record's
    FL_CUDA_CHECK(cudaEventRecord(e->e, s ? s->s : g.compute));
    e->issued = issued;
    return e;
}

static double cuda_event_elapsed_ms(const fl_device *d, fl_event *a, fl_event *b) {
    (void)d;
    float ms = 0.0f;
    waited_for(b->issued);
    FL_CUDA_CHECK(cudaEventSynchronize(b->e));
    FL_CUDA_CHECK(cudaEventElapsedTime(&ms, a->e, b->e));
    return ms;
}

static void cuda_event_sync(const fl_device *d, fl_event *e) {
    (void)d;
    waited_for(e->issued);
    FL_CUDA_CHECK(cudaEventSynchronize(e->e));
}

static void cuda_event_destroy(const fl_device *d, fl_event *e) {
    (void)d;
    if (!e) return;
    FL_CUDA_CHECK(cudaEventDestroy(e->e));
    fl_free(e);
}

static void cuda_sync(const fl_device *d) {
    (void)d;
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaDeviceSynchronize());
}

// Pinned host memory (cudaHostAlloc: copy_async moves it without a bounce
// through a staging buffer); a header in front holds the tag and size.
typedef struct {
    size_t bytes;
    fl_mem_tag tag;
} host_header;

static void *cuda_host_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes) {
    (void)d;
    void *raw = NULL;
    cudaError_t err = cudaHostAlloc(&raw, 64 + bytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        fl_die_oom(bytes, tag);
    }
    FL_CUDA_CHECK(err);
    memset(raw, 0, 64 + bytes);
    *(host_header *)raw = (host_header){bytes, tag};
    fl_mem_pinned_count(tag, (long long)bytes);
    return (char *)raw + 64;
}

static void cuda_host_free(const fl_device *d, void *p);

void *fl_cuda_host_alloc(fl_mem_tag tag, size_t bytes) {
    return cuda_host_alloc(&cuda, tag, bytes);
}

void fl_cuda_host_free(void *p) {
    cuda_host_free(&cuda, p);
}

static void cuda_host_free(const fl_device *d, void *p) {
    (void)d;
    if (!p) return;
    host_header h = *(host_header *)((char *)p - 64);
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaFreeHost((char *)p - 64)); // waits for the copies that use it
    fl_mem_pinned_count(h.tag, -(long long)h.bytes);
}

static fl_device cuda = {
    .name = "cuda",
    .host = 0,
    .describe = cuda_describe,
    .available = cuda_available,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .zero = cuda_zero,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .copy_d2d = cuda_copy_d2d,
    .copy_async = cuda_copy_async,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .event_record = cuda_event_record,
    .stream_wait = cuda_stream_wait,
    .event_sync = cuda_event_sync,
    .event_destroy = cuda_event_destroy,
    .sync = cuda_sync,
    .event_record_timed = cuda_event_record_timed,
    .event_elapsed_ms = cuda_event_elapsed_ms,
    .reserved = cuda_reserved,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_stalls = cuda_host_stalls,
    .ids_known = fl_cuda_ids_known,
    .matmul_workspace_bytes = fl_cuda_matmul_workspace_bytes,
    .scratch_bytes = fl_cuda_scratch_bytes,
    .host_scratch_bytes = fl_cuda_host_scratch_bytes,
    .scratch_lend = cuda_scratch_lend,
    .scratch_return = cuda_scratch_return,
    .encoder_forward = fl_cuda_encoder_forward,
    .encoder_backward = fl_cuda_encoder_backward,
    .embedding_shard_forward = fl_cuda_embedding_shard_forward,
    .embedding_shard_backward = fl_cuda_embedding_shard_backward,
    .position_forward = fl_cuda_position_forward,
    .position_backward = fl_cuda_position_backward,
    .layernorm_forward = fl_cuda_layernorm_forward,
    .residual_layernorm_forward = fl_cuda_residual_layernorm_forward,
    .layernorm_backward = fl_cuda_layernorm_backward,
    .matmul_forward = fl_cuda_matmul_forward,
    .matmul_backward = fl_cuda_matmul_backward,
    .rmsnorm_forward = fl_cuda_rmsnorm_forward,
    .residual_rmsnorm_forward = fl_cuda_residual_rmsnorm_forward,
    .rmsnorm_backward = fl_cuda_rmsnorm_backward,
    .rope_forward = fl_cuda_rope_forward,
    .rope_backward = fl_cuda_rope_backward,
    .swiglu_forward = fl_cuda_swiglu_forward,
    .swiglu_backward = fl_cuda_swiglu_backward,
    .gelu_forward = fl_cuda_gelu_forward,
    .gelu_backward = fl_cuda_gelu_backward,
    .residual_forward = fl_cuda_residual_forward,
    .residual_backward = fl_cuda_residual_backward,
    .bias_forward = fl_cuda_bias_forward,
    .attention_workspace_floats = fl_cuda_attention_workspace_floats,
    .attention_forward = fl_cuda_attention_forward,
    .attention_backward = fl_cuda_attention_backward,
    .softmax_xent_forward = fl_cuda_softmax_xent_forward,
    .softmax_xent_backward = fl_cuda_softmax_xent_backward,
    .softmax_xent_forward_backward = fl_cuda_softmax_xent_forward_backward,
    .xent_shard_max = fl_cuda_xent_shard_max,
    .xent_shard_sums = fl_cuda_xent_shard_sums,
    .xent_shard_backward = fl_cuda_xent_shard_backward,
    .lora_add_columns = fl_cuda_lora_add_columns,
    .lora_gather_columns = fl_cuda_lora_gather_columns,
    .dropout_apply = fl_cuda_dropout_apply,
    .nf4_dequantize = fl_cuda_nf4_dequantize,
    .dq8_dequantize = fl_cuda_dq8_dequantize,
    .convert = fl_cuda_convert,
    .accumulate = fl_cuda_accumulate,
    .sumsq = fl_cuda_sumsq,
    .sumsq_rows = fl_cuda_sumsq_rows,
    .sum = fl_cuda_sum,
    .sum_to = fl_cuda_sum_to,
    .fill = fl_cuda_fill,
    .gate = fl_cuda_gate,
    .update = fl_cuda_update,
    .update_rows = fl_cuda_update_rows,
};

// Every entry filled: a missing kernel is a build that lacks it, said at
// start-up rather than as a crash mid-step.
static int table_complete(const fl_device *d, char *why, size_t why_size) {
    const void *const *f = (const void *const *)&d->describe;
    const void *const *end = (const void *const *)&d->state;
    // the GELU epilogues, set by FITLM_CUDA_GELU_FUSION
    const void *const *optional[] = {(const void *const *)&d->matmul_gelu_forward,
                                     (const void *const *)&d->matmul_dgelu_backward};
    for (int k = 0; f + k < end; k++)
        if (!f[k] && f + k != optional[0] && f + k != optional[1]) {
            snprintf(why, why_size,
                     "this build's CUDA backend lacks entry %d of its device table (the "
                     "function pointers of fl_device in include/fitlm/device.h, counted from "
                     "describe; src/cuda/cuda.c): a partial build",
                     k);
            return 0;
        }
    return 1;
}

const fl_device *fl_device_cuda_table(char *why, size_t why_size) {
    if (g.ready) return &cuda;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        snprintf(why, why_size,
                 "'cuda' asked for, but no NVIDIA GPU is usable here (%s): use --device cpu",
                 err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
        (void)cudaGetLastError();
        return NULL;
    }
    if (!table_complete(&cuda, why, why_size)) return NULL;
    FL_CUDA_CHECK(cudaSetDevice(0));
    FL_CUDA_CHECK(cudaFree(0)); // the context, now
    FL_CUDA_CHECK(cudaGetDeviceProperties(&g.prop, 0));
    // GPT-2's MLP GELU in its GEMMs' epilogues, llm.c's gelu_fusion: 1 the
    // forward's, 2 the backward's too; by default 2 on Hopper and later
    // (llm.c's choice; an H200 measured GPT-2 124M's step 3% faster with
    // it, bench/results_gpu_h200.md), 0 before (llm.c finds it slower on
    // Ampere and Ada)
    const char *fusion = getenv("FITLM_CUDA_GELU_FUSION");
    int level = !fusion || !*fusion    ? (g.prop.major >= 9 ? 2 : 0)
                : !strcmp(fusion, "0") ? 0
                : !strcmp(fusion, "1") ? 1
                : !strcmp(fusion, "2") ? 2
                                       : -1;
    if (level < 0)
        fl_die("FITLM_CUDA_GELU_FUSION=%s: 0 (off), 1 (cuBLASLt's GELU epilogue on the forward "
               "GEMM) or 2 (and its DGELU epilogue on the backward's); by default 2 on compute "
               "capability 9.0 and later, else 0",
               fusion);
    cuda.matmul_gelu_forward = level >= 1 ? fl_cuda_matmul_gelu_forward : NULL;
    cuda.matmul_dgelu_backward = level >= 2 ? fl_cuda_matmul_dgelu_backward : NULL;
    FL_CUDA_CHECK(cudaStreamCreate(&g.compute)); // blocking: the legacy stream waits for it
    fl_cuda_matmul_init();
    // What the card holds before fitlm allocates: the context and cuBLASLt's
    // handle. The runtime's first call makes the context, so there is no
    // reading before it: other processes' memory on the card is included
    // (none on a card of one's own), which --mem-limit, a card's total
    // memory, must leave room for just the same.
    size_t free_b = 0, total = 0;
    FL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    g.context_bytes = total - free_b;
    g.ready = 1;
    return &cuda;
}
