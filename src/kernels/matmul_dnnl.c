// matmul_dnnl.c: bf16 GEMMs through oneDNN's matmul primitive (C API). See
// matmul_dnnl.h for the contract.
//
// The three GEMMs, all on plain row-major buffers (transposes are strides):
//   forward  dst out (N,OC)  = src inp (N,C)   @ wei W^T (C,OC)  + bias (1,OC)
//   dinp     dst dinp (N,C) += src dout (N,OC) @ wei W (OC,C)
//   dweight  dst dW (OC,C)  += src dout^T (OC,N) @ wei inp (N,C)
// The accumulating ones use the sum post-op: dst = dst + result in fp32,
// rounded to bf16 once. dbias is plain C (column sums of dout).
#include "matmul_dnnl.h"

#include "fitlm/core.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>

// output-channel block for the bias gradient
#define MMD_OCBLOCK 64

typedef enum { MMD_FWD_BIAS, MMD_FWD, MMD_DINP, MMD_DWEIGHT, MMD_NKINDS } mmd_kind;

static const char *const kind_names[MMD_NKINDS] = {"forward+bias", "forward", "dinp", "dweight"};

typedef struct {
    fl_dtype dt;
    int N, C, OC;
    mmd_kind kind;
    dnnl_primitive_t prim;
    // argument descriptors, kept for the per-call memory objects
    dnnl_memory_desc_t src, wei, bias, dst, scratch;
    size_t scratch_bytes;
} mmd_entry;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t engine;
static dnnl_stream_t stream;
static mmd_entry **entries; // every cached primitive (a handful per model)
static int n_entries, cap_entries;

static void check(dnnl_status_t st, const char *what) {
    if (st != dnnl_success) fl_die("oneDNN: %s failed: %s", what, dnnl_status2str(st));
}

// ----------------------------------------------------------------------------
// support probe

static int supported;
static pthread_once_t support_once = PTHREAD_ONCE_INIT;

static void probe_support(void) {
    // fl_cpu() honours FITLM_NO_SIMD; oneDNN's effective ISA honours
    // ONEDNN_MAX_CPU_ISA. Below avx512_core_bf16 (0xe7, a subset of the AMX
    // mask 0x3e7) oneDNN emulates bf16 at a third of the speed, or has no
    // bf16 matmul at all: then the caller takes its portable path instead.
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    unsigned need = (unsigned)dnnl_cpu_isa_avx512_core_bf16;
    supported = fl_cpu()->avx512_bf16 && (isa & need) == need;
}

int dnnl_matmul_supported(fl_dtype dt) {
    if (dt != FL_BF16) return 0;
    pthread_once(&support_once, probe_support);
    return supported;
}

// ----------------------------------------------------------------------------
// primitive cache

static void md_init(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int64_t row_stride,
                    int64_t col_stride) {
    dnnl_dims_t dims = {rows, cols}, strides = {row_stride, col_stride};
    check(dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_bf16, strides),
          "memory_desc_init_by_strides");
}

// Builds the primitive of one GEMM; called with the lock held.
static void entry_create(mmd_entry *e) {
    int64_t N = e->N, C = e->C, OC = e->OC;
    int accumulate = 0;
    memset(&e->bias, 0, sizeof e->bias); // format_kind undef: no bias
    switch (e->kind) {
    case MMD_FWD_BIAS:
        md_init(&e->bias, 1, OC, OC, 1);
        // fall through
    case MMD_FWD:
        md_init(&e->src, N, C, C, 1);
        md_init(&e->wei, C, OC, 1, C); // W^T: element (c,o) at W[o*C + c]
        md_init(&e->dst, N, OC, OC, 1);
        break;
    case MMD_DINP:
        md_init(&e->src, N, OC, OC, 1);
        md_init(&e->wei, OC, C, C, 1);
        md_init(&e->dst, N, C, C, 1);
        accumulate = 1;
        break;
    case MMD_DWEIGHT:
        md_init(&e->src, OC, N, 1, OC); // dout^T: element (o,n) at dout[n*OC + o]
        md_init(&e->wei, N, C, C, 1);
        md_init(&e->dst, OC, C, C, 1);
        accumulate = 1;
        break;
    default:
        fl_die("internal: bad oneDNN matmul kind %d", (int)e->kind);
    }

    dnnl_matmul_desc_t desc;
    check(dnnl_matmul_desc_init(&desc, &e->src, &e->wei, e->kind == MMD_FWD_BIAS ? &e->bias : NULL,
                                &e->dst),
          "matmul_desc_init");
    dnnl_primitive_attr_t attr;
    check(dnnl_primitive_attr_create(&attr), "primitive_attr_create");
    check(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user),
          "primitive_attr_set_scratchpad_mode");
    if (accumulate) {
        dnnl_post_ops_t post_ops;
        check(dnnl_post_ops_create(&post_ops), "post_ops_create");
        check(dnnl_post_ops_append_sum(post_ops, 1.0f), "post_ops_append_sum");
        check(dnnl_primitive_attr_set_post_ops(attr, post_ops), "primitive_attr_set_post_ops");
        check(dnnl_post_ops_destroy(post_ops), "post_ops_destroy");
    }
    dnnl_primitive_desc_t pd;
    dnnl_status_t st = dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL);
    check(dnnl_primitive_attr_destroy(attr), "primitive_attr_destroy");
    if (st != dnnl_success)
        fl_die("oneDNN: no bf16 matmul for %s N=%d C=%d OC=%d: %s", kind_names[e->kind], e->N, e->C,
               e->OC, dnnl_status2str(st));
    const dnnl_memory_desc_t *scratch =
        dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (scratch) {
        e->scratch = *scratch;
        e->scratch_bytes = dnnl_memory_desc_get_size(scratch);
    } else {
        memset(&e->scratch, 0, sizeof e->scratch);
        e->scratch_bytes = 0;
    }
    check(dnnl_primitive_create(&e->prim, pd), "primitive_create");
    check(dnnl_primitive_desc_destroy(pd), "primitive_desc_destroy");
}

// The cached primitive of one GEMM, created on first use. Entries stay put
// (only the table of pointers grows) until dnnl_matmul_release.
static const mmd_entry *lookup(fl_dtype dt, int N, int C, int OC, mmd_kind kind) {
    if (!dnnl_matmul_supported(dt))
        fl_die("oneDNN matmul: %s is not supported (bf16 only, on a CPU with AVX512_BF16 or AMX)",
               fl_dtype_name(dt));
    if (N <= 0 || C <= 0 || OC <= 0) fl_die("oneDNN matmul: bad shape N=%d C=%d OC=%d", N, C, OC);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_entries; i++) {
        const mmd_entry *e = entries[i];
        if (e->dt == dt && e->N == N && e->C == C && e->OC == OC && e->kind == kind) {
            pthread_mutex_unlock(&lock);
            return e;
        }
    }
    if (!engine) {
        check(dnnl_engine_create(&engine, dnnl_cpu, 0), "engine_create");
        check(dnnl_stream_create(&stream, engine, dnnl_stream_default_flags), "stream_create");
    }
    if (n_entries == cap_entries) {
        int cap = cap_entries ? 2 * cap_entries : 16;
        mmd_entry **grown = realloc(entries, (size_t)cap * sizeof *grown);
        if (!grown) fl_die("out of memory (oneDNN matmul cache)");
        entries = grown;
        cap_entries = cap;
    }
    mmd_entry *e = calloc(1, sizeof *e);
    if (!e) fl_die("out of memory (oneDNN matmul cache)");
    e->dt = dt;
    e->N = N;
    e->C = C;
    e->OC = OC;
    e->kind = kind;
    entry_create(e);
    entries[n_entries++] = e;
    pthread_mutex_unlock(&lock);
    return e;
}

void dnnl_matmul_release(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_entries; i++) {
        check(dnnl_primitive_destroy(entries[i]->prim), "primitive_destroy");
        free(entries[i]);
    }
    free(entries);
    entries = NULL;
    n_entries = cap_entries = 0;
    if (stream) check(dnnl_stream_destroy(stream), "stream_destroy");
    if (engine) check(dnnl_engine_destroy(engine), "engine_destroy");
    stream = NULL;
    engine = NULL;
    // oneDNN keeps its own LRU cache of primitive implementations: capacity
    // 0 empties it, then the old capacity is restored
    int capacity = 0;
    check(dnnl_get_primitive_cache_capacity(&capacity), "get_primitive_cache_capacity");
    check(dnnl_set_primitive_cache_capacity(0), "set_primitive_cache_capacity");
    check(dnnl_set_primitive_cache_capacity(capacity), "set_primitive_cache_capacity");
    pthread_mutex_unlock(&lock);
}

size_t dnnl_matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC) {
    size_t bytes = 0;
    for (int k = 0; k < MMD_NKINDS; k++) {
        const mmd_entry *e = lookup(dt, N, C, OC, (mmd_kind)k);
        if (e->scratch_bytes > bytes) bytes = e->scratch_bytes;
    }
    return bytes;
}

// ----------------------------------------------------------------------------
// execution

// Runs one cached GEMM. Memory objects are made per call (cheap: they wrap
// the caller's pointers), so concurrent calls with separate workspaces share
// nothing mutable but the stream, which on the CPU runs primitives
// synchronously.
static void run(const mmd_entry *e, void *dst, const void *src, const void *wei, const void *bias,
                void *workspace) {
    if (e->scratch_bytes && !workspace)
        fl_die("oneDNN matmul: %s N=%d C=%d OC=%d needs a workspace of %zu bytes, got NULL",
               kind_names[e->kind], e->N, e->C, e->OC, e->scratch_bytes);
    dnnl_exec_arg_t args[5];
    int nargs = 0;
    const struct {
        int arg;
        const dnnl_memory_desc_t *md;
        const void *ptr;
    } bind[5] = {{DNNL_ARG_SRC, &e->src, src},
                 {DNNL_ARG_WEIGHTS, &e->wei, wei},
                 {DNNL_ARG_DST, &e->dst, dst},
                 {DNNL_ARG_BIAS, &e->bias, e->kind == MMD_FWD_BIAS ? bias : NULL},
                 {DNNL_ARG_SCRATCHPAD, &e->scratch, e->scratch_bytes ? workspace : NULL}};
    for (int i = 0; i < 5; i++) {
        if (!bind[i].ptr) continue;
        args[nargs].arg = bind[i].arg;
        // oneDNN takes non-const handles; it writes only dst and scratchpad
        check(dnnl_memory_create(&args[nargs].memory, bind[i].md, engine, (void *)bind[i].ptr),
              "memory_create");
        nargs++;
    }
    dnnl_status_t st = dnnl_primitive_execute(e->prim, stream, nargs, args);
    if (st == dnnl_success) st = dnnl_stream_wait(stream);
    for (int i = 0; i < nargs; i++) check(dnnl_memory_destroy(args[i].memory), "memory_destroy");
    if (st != dnnl_success)
        fl_die("oneDNN: %s N=%d C=%d OC=%d failed: %s", kind_names[e->kind], e->N, e->C, e->OC,
               dnnl_status2str(st));
}

void dnnl_matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                         const void *bias, void *workspace, int N, int C, int OC) {
    run(lookup(dt, N, C, OC, bias ? MMD_FWD_BIAS : MMD_FWD), out, inp, weight, bias, workspace);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// dbias (OC) += column sums of dout (N,OC), bf16. Each block of output
// channels is summed over the rows in order, in fp32, then added and rounded
// once: deterministic and independent of the thread count.
static void dbias_accumulate(uint16_t *dbias, const uint16_t *dout, int N, int OC) {
    int nblocks = (OC + MMD_OCBLOCK - 1) / MMD_OCBLOCK;
#pragma omp parallel for if ((size_t)N * OC >= 65536)
    for (int blk = 0; blk < nblocks; blk++) {
        int o0 = blk * MMD_OCBLOCK, len = OC - o0 < MMD_OCBLOCK ? OC - o0 : MMD_OCBLOCK;
        float sum[MMD_OCBLOCK] = {0};
        for (int n = 0; n < N; n++) {
            const uint16_t *row = dout + (size_t)n * OC + o0;
            for (int j = 0; j < len; j++) sum[j] += bf16_to_f32(row[j]);
        }
        for (int j = 0; j < len; j++)
            dbias[o0 + j] = fl_f32_to_bf16(bf16_to_f32(dbias[o0 + j]) + sum[j]);
    }
}

void dnnl_matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                          const void *inp, const void *weight, void *workspace, int N, int C,
                          int OC) {
    if (dinp) run(lookup(dt, N, C, OC, MMD_DINP), dinp, dout, weight, NULL, workspace);
    if (dweight) run(lookup(dt, N, C, OC, MMD_DWEIGHT), dweight, dout, inp, NULL, workspace);
    if (dbias) {
        if (!dnnl_matmul_supported(dt))
            fl_die(
                "oneDNN matmul: %s is not supported (bf16 only, on a CPU with AVX512_BF16 or AMX)",
                fl_dtype_name(dt));
        dbias_accumulate(dbias, dout, N, OC);
    }
}
