// test.c: the test device. The cpu's kernels, on memory the host may not
// touch: every buffer lives in one reserved region that stays PROT_NONE
// except while one of the table's functions runs. A model, optimizer,
// checkpoint or export that reads or writes a device buffer without the
// table's copies faults at once, on every machine CI runs on: what makes
// the seam's placement testable without a GPU.
//
// The region is reserved once (address space only) and carved first fit;
// allocation happens at set-up, never inside a step. Calls may nest (a
// table function calling another); the region opens at the outermost.
#include "fitlm/device.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#define RESERVE    ((size_t)64 << 30) // the "device" holds 64 GiB at most
#define ALIGN      ((size_t)64)
#define MAX_BLOCKS 65536
#define MAX_LENT   16

typedef struct {
    size_t at, bytes; // offset into the region, size (ALIGN multiple)
    size_t asked;     // the bytes allocated (counted under tag)
    int tag;          // -1: free
} block;

static const fl_device *cpu; // whose kernels run
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *base;               // the region
static size_t top;               // bytes carved so far (blocks cover [0, top))
static size_t mapped;            // bytes made readable when open: top rounded up to huge pages
static int depth;                // table calls in progress
static block blocks[MAX_BLOCKS]; // by offset
static int n_blocks;
static size_t used;
static void *lent[MAX_LENT]; // scratch lent by models (test_scratch_lend)
static int n_lent;

// Huge pages where the kernel offers them: each table call opens and closes
// the region (two mprotects, whose cost is one entry per page: a 2 MiB page
// is one entry instead of 512), so the region starts on a 2 MiB boundary.
#define HUGE ((size_t)2 << 20)

static void reserve(void) {
    if (base) return;
    void *p =
        mmap(NULL, RESERVE + HUGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fl_die("test device: cannot reserve %zu bytes of address space", RESERVE);
    base = (char *)(((uintptr_t)p + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    (void)madvise(base, RESERVE, MADV_HUGEPAGE); // a hint: without it, 4 KiB pages
}

static void set_protection(int prot) {
    if (mapped && mprotect(base, mapped, prot) != 0)
        fl_die("test device: mprotect failed on its region");
}

// Opens the region to the host for one table call, and closes it after.
static long queued, stalls; // see waited()

static void open_(void) {
    pthread_mutex_lock(&lock);
    if (depth++ == 0) set_protection(PROT_READ | PROT_WRITE);
    queued++; // work issued
    pthread_mutex_unlock(&lock);
}

static void close_(void) {
    pthread_mutex_lock(&lock);
    FL_ASSERT(depth > 0);
    if (--depth == 0) set_protection(PROT_NONE);
    pthread_mutex_unlock(&lock);
}

static void test_describe(const fl_device *d, char *out, size_t size) {
    (void)d;
    snprintf(out, size,
             "test (the cpu's kernels on memory only the device table touches, %d "
             "threads)",
             fl_threads());
}

static size_t test_available(const fl_device *d) {
    (void)d;
    pthread_mutex_lock(&lock);
    size_t v = RESERVE - used;
    pthread_mutex_unlock(&lock);
    return v;
}

static void *test_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes) {
    (void)d;
    size_t want = (bytes + ALIGN - 1) / ALIGN * ALIGN;
    if (!want) want = ALIGN;
    pthread_mutex_lock(&lock);
    reserve();
    int at = -1;
    for (int i = 0; i < n_blocks; i++)
        if (blocks[i].tag < 0 && blocks[i].bytes >= want) {
            at = i;
            break;
        }
    if (at < 0) { // carve at the top
        if (want > RESERVE - top || n_blocks == MAX_BLOCKS) {
            pthread_mutex_unlock(&lock);
            fl_die_device_oom("test", bytes, tag);
        }
        at = n_blocks++;
        blocks[at] = (block){top, want, 0, -1};
        top += want;
        size_t need = (top + HUGE - 1) / HUGE * HUGE; // whole huge pages
        if (need > mapped) {
            mapped = need; // the new pages stay PROT_NONE until the next open
            if (depth && mprotect(base, mapped, PROT_READ | PROT_WRITE) != 0)
                fl_die("test device: mprotect failed on its region");
        }
    } else if (blocks[at].bytes > want) { // split: the rest stays free
        FL_ASSERT(n_blocks < MAX_BLOCKS);
        memmove(&blocks[at + 2], &blocks[at + 1], (size_t)(n_blocks - at - 1) * sizeof(block));
        n_blocks++;
        blocks[at + 1] = (block){blocks[at].at + want, blocks[at].bytes - want, 0, -1};
        blocks[at].bytes = want;
    }
    blocks[at].tag = (int)tag;
    blocks[at].asked = bytes;
    used += blocks[at].bytes;
    char *p = base + blocks[at].at;
    pthread_mutex_unlock(&lock);
    open_();
    memset(p, 0, want);
    close_();
    fl_mem_device_count(tag, (long long)bytes); // the bytes asked for: the plan's figure
    return p;
}

static void test_free(const fl_device *d, void *p) {
    (void)d;
    if (!p) return;
    pthread_mutex_lock(&lock);
    int at = -1;
    for (int i = 0; i < n_blocks; i++)
        if (base + blocks[i].at == (char *)p && blocks[i].tag >= 0) at = i;
    if (at < 0) fl_die("test device: free of a pointer it did not allocate");
    for (int i = 0; i < n_lent; i++)
        if (lent[i] == p) fl_die("test device: free of a scratch still lent to it");
    int tag = blocks[at].tag;
    size_t bytes = blocks[at].asked;
    blocks[at].tag = -1;
    used -= blocks[at].bytes;
    // merge with free neighbours
    if (at + 1 < n_blocks && blocks[at + 1].tag < 0) {
        blocks[at].bytes += blocks[at + 1].bytes;
        memmove(&blocks[at + 1], &blocks[at + 2], (size_t)(n_blocks - at - 2) * sizeof(block));
        n_blocks--;
    }
    if (at > 0 && blocks[at - 1].tag < 0) {
        blocks[at - 1].bytes += blocks[at].bytes;
        memmove(&blocks[at], &blocks[at + 1], (size_t)(n_blocks - at - 1) * sizeof(block));
        n_blocks--;
    }
    pthread_mutex_unlock(&lock);
    fl_mem_device_count((fl_mem_tag)tag, -(long long)bytes);
}

static void test_zero(const fl_device *d, void *p, size_t bytes) {
    (void)d;
    open_();
    memset(p, 0, bytes);
    close_();
}

// The host's waits a GPU would sit idle through: a wait (a copy to or
// from the host, a result returned, an event or device sync) that comes
// after work was issued (a table call that opened the region) and before
// the host issued more. done: the wait's own work is done too.
static void waited(int done) {
    pthread_mutex_lock(&lock);
    if (!done && queued) stalls++;
    queued = 0;
    pthread_mutex_unlock(&lock);
}

static long test_host_stalls(const fl_device *d) {
    (void)d;
    pthread_mutex_lock(&lock);
    long n = stalls;
    pthread_mutex_unlock(&lock);
    return n;
}

static void move(void *dst, const void *src, size_t bytes) {
    open_();
    memmove(dst, src, bytes);
    close_();
}

// copy_h2d and copy_d2h return when done
static void test_copy(const fl_device *d, void *dst, const void *src, size_t bytes) {
    (void)d;
    waited(0);
    move(dst, src, bytes);
    waited(1);
}

static void test_copy_d2d(const fl_device *d, void *dst, const void *src, size_t bytes) {
    (void)d;
    move(dst, src, bytes);
}

// Pinned host memory, recorded: an asynchronous copy's host side must lie
// in it, as a GPU's asynchronous copy needs (from pageable memory CUDA
// copies through a bounce buffer and may hold the host until the stream
// gets there: the overlap gone, silently), so CI catches one.
#define MAX_PINNED 256
static struct {
    const char *p;
    size_t bytes;
} pinned[MAX_PINNED];
static int n_pinned;

static void *test_host_alloc(const fl_device *d, fl_mem_tag tag, size_t bytes) {
    void *p = cpu->host_alloc(d, tag, bytes);
    pthread_mutex_lock(&lock);
    if (n_pinned == MAX_PINNED) fl_die("test device: more than %d pinned blocks", MAX_PINNED);
    pinned[n_pinned].p = p;
    pinned[n_pinned++].bytes = bytes;
    pthread_mutex_unlock(&lock);
    return p;
}

static void test_host_free(const fl_device *d, void *p) {
    if (!p) return;
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < n_pinned && pinned[i].p != p) i++;
    if (i == n_pinned) fl_die("test device: host_free of memory host_alloc did not give");
    pinned[i] = pinned[--n_pinned];
    pthread_mutex_unlock(&lock);
    cpu->host_free(d, p);
}

static int is_pinned(const void *p, size_t bytes) {
    const char *c = p;
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < n_pinned && !(c >= pinned[i].p && c + bytes <= pinned[i].p + pinned[i].bytes)) i++;
    pthread_mutex_unlock(&lock);
    return i < n_pinned;
}

static void test_copy_async(const fl_device *d, void *dst, const void *src, size_t bytes, int kind,
                            fl_stream *s) {
    (void)d, (void)s;
    const void *host = kind == FL_COPY_H2D ? src : kind == FL_COPY_D2H ? dst : NULL;
    if (host && bytes && !is_pinned(host, bytes))
        fl_die("test device: an asynchronous copy %s pageable host memory (%zu bytes): a GPU "
               "would copy it synchronously; it must be pinned (host_alloc)",
               kind == FL_COPY_H2D ? "from" : "to", bytes);
    move(dst, src, bytes);
}

static void test_event_sync(const fl_device *d, fl_event *e) {
    waited(0);
    cpu->event_sync(d, e);
}

static void test_sync(const fl_device *d) {
    waited(0);
    cpu->sync(d);
}

static double test_event_elapsed_ms(const fl_device *d, fl_event *a, fl_event *b) {
    waited(0);
    return cpu->event_elapsed_ms(d, a, b);
}

// The backend scratch of a GPU's kernels, emulated: the cpu's kernels need
// none, but a model on this device allocates and lends what a GPU backend
// would ask for (column sums' partials of 64 row chunks, three ints a row
// for the embedding's buckets), so that CI checks the generic path: the
// plan counts it, the model allocates it, lends it, takes it back and
// frees it. Lent blocks are checked to be the region's.

static size_t test_scratch_bytes(int N, int cols, int heads) {
    (void)heads;
    return 64 * (size_t)cols * sizeof(float) + 3 * (size_t)N * sizeof(int);
}

static void test_scratch_lend(const fl_device *d, void *p, size_t bytes) {
    (void)d;
    pthread_mutex_lock(&lock);
    int ok = 0;
    for (int i = 0; i < n_blocks; i++)
        ok |= base + blocks[i].at == (char *)p && blocks[i].tag >= 0 && blocks[i].asked >= bytes;
    if (!ok || n_lent == MAX_LENT) fl_die("test device: scratch lent that is not its own block");
    lent[n_lent++] = p;
    pthread_mutex_unlock(&lock);
}

static void test_scratch_return(const fl_device *d, void *p) {
    (void)d;
    if (!p) return;
    pthread_mutex_lock(&lock);
    int at = -1;
    for (int i = 0; i < n_lent; i++)
        if (lent[i] == p) at = i;
    if (at < 0) fl_die("test device: scratch returned that was not lent");
    lent[at] = lent[--n_lent];
    pthread_mutex_unlock(&lock);
}

// The kernels: the cpu's, with the region open while they run.

static void t_encoder_forward(fl_dtype dt, void *out, const int *inp, const void *wte,
                              const void *wpe, int B, int T, int C) {
    open_();
    cpu->encoder_forward(dt, out, inp, wte, wpe, B, T, C);
    close_();
}

static void t_encoder_backward(fl_dtype dt, void *dwte, void *dwpe, const void *dout,
                               const int *inp, int B, int T, int C) {
    open_();
    cpu->encoder_backward(dt, dwte, dwpe, dout, inp, B, T, C);
    close_();
}

static void t_embedding_shard_forward(fl_dtype dt, void *out, const int *inp, const void *wte,
                                      int first, int rows, int N, int C) {
    open_();
    cpu->embedding_shard_forward(dt, out, inp, wte, first, rows, N, C);
    close_();
}

static void t_embedding_shard_backward(fl_dtype dt, void *dwte, const void *dout, const int *inp,
                                       int first, int rows, int N, int C) {
    open_();
    cpu->embedding_shard_backward(dt, dwte, dout, inp, first, rows, N, C);
    close_();
}

static void t_position_forward(fl_dtype dt, void *out, const void *wpe, int B, int T, int C) {
    open_();
    cpu->position_forward(dt, out, wpe, B, T, C);
    close_();
}

static void t_position_backward(fl_dtype dt, void *dwpe, const void *dout, int B, int T, int C) {
    open_();
    cpu->position_backward(dt, dwpe, dout, B, T, C);
    close_();
}

static void t_layernorm_forward(fl_dtype dt, void *out, float *mean, float *rstd, const void *inp,
                                const void *weight, const void *bias, int N, int C) {
    open_();
    cpu->layernorm_forward(dt, out, mean, rstd, inp, weight, bias, N, C);
    close_();
}

static void t_residual_layernorm_forward(fl_dtype dt, void *res, void *out, float *mean,
                                         float *rstd, const void *skip, const void *weight,
                                         const void *bias, int N, int C) {
    open_();
    cpu->residual_layernorm_forward(dt, res, out, mean, rstd, skip, weight, bias, N, C);
    close_();
}

static void t_layernorm_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias,
                                 const void *dout, const void *inp, const void *weight,
                                 const float *mean, const float *rstd, int N, int C) {
    open_();
    cpu->layernorm_backward(dt, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    close_();
}

static void t_matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                             const void *bias, void *workspace, int N, int C, int OC) {
    open_();
    cpu->matmul_forward(dt, out, inp, weight, bias, workspace, N, C, OC);
    close_();
}

static void t_matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                              const void *inp, const void *weight, void *workspace, int N, int C,
                              int OC, int dinp_add) {
    open_();
    cpu->matmul_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC,
                         dinp_add);
    close_();
}

static void t_attention_forward(fl_dtype dt, void *out, float *lse, const void *qkv,
                                float *workspace, int B, int T, int NH, int NKV, int HS) {
    open_();
    cpu->attention_forward(dt, out, lse, qkv, workspace, B, T, NH, NKV, HS);
    close_();
}

static void t_attention_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                 const void *out, const float *lse, float *workspace, int B, int T,
                                 int NH, int NKV, int HS) {
    open_();
    cpu->attention_backward(dt, dqkv, dout, qkv, out, lse, workspace, B, T, NH, NKV, HS);
    close_();
}

static void t_rmsnorm_forward(fl_dtype dt, void *out, float *rstd, const void *inp,
                              const void *weight, int N, int C, float eps) {
    open_();
    cpu->rmsnorm_forward(dt, out, rstd, inp, weight, N, C, eps);
    close_();
}

static void t_residual_rmsnorm_forward(fl_dtype dt, void *res, void *out, float *rstd,
                                       const void *skip, const void *weight, int N, int C,
                                       float eps) {
    open_();
    cpu->residual_rmsnorm_forward(dt, res, out, rstd, skip, weight, N, C, eps);
    close_();
}

static void t_rmsnorm_backward(fl_dtype dt, void *dinp, void *dweight, const void *dout,
                               const void *inp, const void *weight, const float *rstd, int N,
                               int C) {
    open_();
    cpu->rmsnorm_backward(dt, dinp, dweight, dout, inp, weight, rstd, N, C);
    close_();
}

static void t_rope_forward(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH,
                           int NKV, int HS) {
    open_();
    cpu->rope_forward(dt, qkv, cos_sin, B, T, NH, NKV, HS);
    close_();
}

static void t_rope_backward(fl_dtype dt, void *dqkv, const float *cos_sin, int B, int T, int NH,
                            int NKV, int HS) {
    open_();
    cpu->rope_backward(dt, dqkv, cos_sin, B, T, NH, NKV, HS);
    close_();
}

static void t_swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    open_();
    cpu->swiglu_forward(dt, out, inp, N, IC);
    close_();
}

static void t_swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N,
                              int IC) {
    open_();
    cpu->swiglu_backward(dt, dinp, inp, dout, N, IC);
    close_();
}

static void t_gelu_forward(fl_dtype dt, void *out, const void *inp, size_t N) {
    open_();
    cpu->gelu_forward(dt, out, inp, N);
    close_();
}

static void t_gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t N) {
    open_();
    cpu->gelu_backward(dt, dinp, inp, dout, N);
    close_();
}

static void t_residual_forward(fl_dtype dt, void *out, const void *a, const void *b, size_t N) {
    open_();
    cpu->residual_forward(dt, out, a, b, N);
    close_();
}

static void t_residual_backward(fl_dtype dt, void *da, void *db, const void *dout, size_t N) {
    open_();
    cpu->residual_backward(dt, da, db, dout, N);
    close_();
}

static void t_bias_forward(fl_dtype dt, void *out, const void *bias, int N, int OC) {
    open_();
    cpu->bias_forward(dt, out, bias, N, OC);
    close_();
}

static void t_softmax_xent_forward(fl_dtype dt, float *losses, float *lse, const void *logits,
                                   const int *targets, int N, int V, int Vp) {
    open_();
    cpu->softmax_xent_forward(dt, losses, lse, logits, targets, N, V, Vp);
    close_();
}

static void t_softmax_xent_backward(fl_dtype dt, void *dlogits, const void *logits,
                                    const float *lse, const int *targets, const float *dlosses,
                                    int N, int V, int Vp) {
    open_();
    cpu->softmax_xent_backward(dt, dlogits, logits, lse, targets, dlosses, N, V, Vp);
    close_();
}

static void t_softmax_xent_forward_backward(fl_dtype dt, float *losses, float *lse, void *logits,
                                            const int *targets, const float *dlosses, int N, int V,
                                            int Vp) {
    open_();
    cpu->softmax_xent_forward_backward(dt, losses, lse, logits, targets, dlosses, N, V, Vp);
    close_();
}

static void t_xent_shard_max(fl_dtype dt, float *mx, const void *logits, int N, int V, int Vp) {
    open_();
    cpu->xent_shard_max(dt, mx, logits, N, V, Vp);
    close_();
}

static void t_xent_shard_sums(fl_dtype dt, float *sums, const void *logits, const float *mx,
                              const int *targets, int N, int V, int Vp) {
    open_();
    cpu->xent_shard_sums(dt, sums, logits, mx, targets, N, V, Vp);
    close_();
}

static void t_xent_shard_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                                  const int *targets, const float *dlosses, int N, int V, int Vp) {
    open_();
    cpu->xent_shard_backward(dt, dlogits, logits, lse, targets, dlosses, N, V, Vp);
    close_();
}

static void t_lora_add_columns(fl_dtype dt, void *out, int ld, const void *x, float scale, int N,
                               int cols) {
    open_();
    cpu->lora_add_columns(dt, out, ld, x, scale, N, cols);
    close_();
}

static void t_lora_gather_columns(fl_dtype dt, void *x, const void *src, int ld, float scale, int N,
                                  int cols) {
    open_();
    cpu->lora_gather_columns(dt, x, src, ld, scale, N, cols);
    close_();
}

static void t_dropout_apply(fl_dtype dt, void *out, const void *inp, size_t n, float p,
                            uint64_t key) {
    open_();
    cpu->dropout_apply(dt, out, inp, n, p, key);
    close_();
}

static void t_nf4_dequantize(fl_dtype dt, void *out, const uint8_t *codes, const float *absmax,
                             size_t n, int block) {
    open_();
    cpu->nf4_dequantize(dt, out, codes, absmax, n, block);
    close_();
}

static void t_dq8_dequantize(float *absmax, const uint8_t *q, const float *nested, float offset,
                             size_t n, int block) {
    open_();
    cpu->dq8_dequantize(absmax, q, nested, offset, n, block);
    close_();
}

static void t_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src, size_t n) {
    open_();
    cpu->convert(dst_dt, dst, src_dt, src, n);
    close_();
}

static void t_accumulate(float *dst, fl_dtype dt, const void *src, size_t n) {
    open_();
    cpu->accumulate(dst, dt, src, n);
    close_();
}

static double t_sumsq(fl_dtype dt, const void *x, size_t n) {
    waited(0); // the result comes back
    open_();
    double r = cpu->sumsq(dt, x, n);
    close_();
    waited(1);
    return r;
}

static void t_sumsq_rows(fl_dtype dt, const void *x, int n, const size_t *offsets,
                         const size_t *counts, double *out) {
    open_();
    cpu->sumsq_rows(dt, x, n, offsets, counts, out);
    close_();
}

static double t_sum(const float *x, size_t n) {
    waited(0);
    open_();
    double r = cpu->sum(x, n);
    close_();
    waited(1);
    return r;
}

static void t_sum_to(double *out, const float *x, size_t n) {
    open_();
    cpu->sum_to(out, x, n);
    close_();
}

static void t_fill(float *x, float v, size_t n) {
    open_();
    cpu->fill(x, v, n);
    close_();
}

static void t_gate(fl_step_gate *g, const fl_gate_op *op) {
    open_();
    cpu->gate(g, op);
    close_();
}

static void t_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                     const fl_update_args *a) {
    open_();
    cpu->update(r, row, offset, count, a);
    close_();
}

// The cpu's table, with the memory, the copies and every function that
// touches device memory replaced by the region's own (streams and events
// stay the cpu's: work is done when its call returns).
const fl_device *fl_device_test_table(void) {
    static fl_device t;
    if (t.name) return &t;
    cpu = fl_device_cpu_table();
    t = *cpu;
    t.name = "test";
    t.host = 0;
    t.describe = test_describe;
    t.available = test_available;
    t.alloc = test_alloc;
    t.free = test_free;
    t.zero = test_zero;
    t.copy_h2d = test_copy;
    t.copy_d2h = test_copy;
    t.copy_d2d = test_copy_d2d;
    t.copy_async = test_copy_async;
    t.host_alloc = test_host_alloc;
    t.host_free = test_host_free;
    t.event_sync = test_event_sync;
    t.sync = test_sync;
    t.event_elapsed_ms = test_event_elapsed_ms;
    t.host_stalls = test_host_stalls;
    t.scratch_bytes = test_scratch_bytes;
    t.scratch_lend = test_scratch_lend;
    t.scratch_return = test_scratch_return;
    t.encoder_forward = t_encoder_forward;
    t.encoder_backward = t_encoder_backward;
    t.embedding_shard_forward = t_embedding_shard_forward;
    t.embedding_shard_backward = t_embedding_shard_backward;
    t.position_forward = t_position_forward;
    t.position_backward = t_position_backward;
    t.layernorm_forward = t_layernorm_forward;
    t.residual_layernorm_forward = t_residual_layernorm_forward;
    t.layernorm_backward = t_layernorm_backward;
    t.matmul_forward = t_matmul_forward;
    t.matmul_backward = t_matmul_backward;
    t.attention_forward = t_attention_forward;
    t.attention_backward = t_attention_backward;
    t.rmsnorm_forward = t_rmsnorm_forward;
    t.residual_rmsnorm_forward = t_residual_rmsnorm_forward;
    t.rmsnorm_backward = t_rmsnorm_backward;
    t.rope_forward = t_rope_forward;
    t.rope_backward = t_rope_backward;
    t.swiglu_forward = t_swiglu_forward;
    t.swiglu_backward = t_swiglu_backward;
    t.gelu_forward = t_gelu_forward;
    t.gelu_backward = t_gelu_backward;
    t.residual_forward = t_residual_forward;
    t.residual_backward = t_residual_backward;
    t.bias_forward = t_bias_forward;
    t.softmax_xent_forward = t_softmax_xent_forward;
    t.softmax_xent_backward = t_softmax_xent_backward;
    t.softmax_xent_forward_backward = t_softmax_xent_forward_backward;
    t.xent_shard_max = t_xent_shard_max;
    t.xent_shard_sums = t_xent_shard_sums;
    t.xent_shard_backward = t_xent_shard_backward;
    t.lora_add_columns = t_lora_add_columns;
    t.lora_gather_columns = t_lora_gather_columns;
    t.dropout_apply = t_dropout_apply;
    t.nf4_dequantize = t_nf4_dequantize;
    t.dq8_dequantize = t_dq8_dequantize;
    t.convert = t_convert;
    t.accumulate = t_accumulate;
    t.sumsq = t_sumsq;
    t.sumsq_rows = t_sumsq_rows;
    t.sum = t_sum;
    t.sum_to = t_sum_to;
    t.fill = t_fill;
    t.gate = t_gate;
    t.update = t_update;
    return &t;
}
