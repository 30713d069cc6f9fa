// encoder.cu: token + position embedding and its tensor-parallel pieces
// (src/kernels/encoder.c), forward and backward.
//
// The token embedding's gradient sums dout's rows into the rows of their
// tokens without atomics, in the cpu's order: the ids are brought to the
// host (N ints; the backward's last op, so the wait costs little) and
// grouped by token there, stable (a counting sort: positions in (b,t)
// order within each token), as llm.c's encoder_backward buckets them on
// the CPU; then one block per (token, channel range) starts from the row's
// gradient and adds its positions' rows in that order, rounding once: the
// cpu's sums, bit for bit in fp32.
#include <limits.h>
#include <string.h>

#include "common.cuh"

#define ENC_THREADS 256

// out (N,C) = wte[inp - first] (0 outside [first, first + rows)) + wpe[t]
// (wpe NULL: none), t = n % T
__global__ void lookup_kernel(fl_dtype dt, void *out, const int *inp, const void *wte,
                              const void *wpe, int first, int rows, int T, size_t n, int C) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i / (size_t)C, c = i % (size_t)C;
        unsigned id = (unsigned)inp[bt] - (unsigned)first; // below first: out of range too
        int mine = id < (unsigned)rows;
        float e = mine ? fl_d_load(dt, wte, (size_t)id * C + c) : 0.0f;
        float y = e;
        if (wpe) {
            float p = fl_d_load(dt, wpe, (bt % (size_t)T) * C + c);
            y = mine ? e + p : p;
        }
        fl_d_store(dt, out, i, y);
    }
}

__global__ void position_forward_kernel(fl_dtype dt, void *out, const void *wpe, int T, size_t n,
                                        int C) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t bt = i / (size_t)C, c = i % (size_t)C;
        fl_d_store(dt, out, i,
                   fl_d_load(dt, out, i) + fl_d_load(dt, wpe, (bt % (size_t)T) * C + c));
    }
}

// dwpe[t,c] += dout[b,t,c] over b in order: each thread owns (t, c)
__global__ void position_backward_kernel(fl_dtype dt, void *dwpe, const void *dout, int B, int T,
                                         int C) {
    size_t n = (size_t)T * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float acc = fl_d_load(dt, dwpe, i);
        for (int b = 0; b < B; b++) acc += fl_d_load(dt, dout, (size_t)b * n + i);
        fl_d_store(dt, dwpe, i, acc);
    }
}

// Block (bucket, channel range): bucket k holds the positions pos[start[k]
// .. start[k+1]) of token tok[k] (a row of dwte), in order.
__global__ void token_rows_kernel(fl_dtype dt, void *dwte, const void *dout, const int *pos,
                                  const int *start, const int *tok, int C) {
    int k = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    size_t row = (size_t)tok[k] * C + c;
    float acc = fl_d_load(dt, dwte, row);
    for (int j = start[k]; j < start[k + 1]; j++)
        acc += fl_d_load(dt, dout, (size_t)pos[j] * C + c);
    fl_d_store(dt, dwte, row, acc);
}

static void lookup(fl_dtype dt, void *out, const int *inp, const void *wte, const void *wpe,
                   int first, int rows, int T, int N, int C) {
    size_t n = (size_t)N * C;
    if (!n) return;
    lookup_kernel<<<fl_cuda_blocks(n, ENC_THREADS), ENC_THREADS, 0, fl_cuda_stream()>>>(
        dt, out, inp, wte, wpe, first, rows, T, n, C);
    FL_CUDA_LAUNCHED("lookup_kernel");
}

extern "C" void fl_cuda_encoder_forward(fl_dtype dt, void *out, const int *inp, const void *wte,
                                        const void *wpe, int B, int T, int C) {
    lookup(dt, out, inp, wte, wpe, 0, INT_MAX, T, B * T, C);
}

extern "C" void fl_cuda_embedding_shard_forward(fl_dtype dt, void *out, const int *inp,
                                                const void *wte, int first, int rows, int N,
                                                int C) {
    lookup(dt, out, inp, wte, NULL, first, rows, N ? N : 1, N, C);
}

extern "C" void fl_cuda_position_forward(fl_dtype dt, void *out, const void *wpe, int B, int T,
                                         int C) {
    size_t n = (size_t)B * T * C;
    if (!n) return;
    position_forward_kernel<<<fl_cuda_blocks(n, ENC_THREADS), ENC_THREADS, 0, fl_cuda_stream()>>>(
        dt, out, wpe, T, n, C);
    FL_CUDA_LAUNCHED("position_forward_kernel");
}

extern "C" void fl_cuda_position_backward(fl_dtype dt, void *dwpe, const void *dout, int B, int T,
                                          int C) {
    size_t n = (size_t)T * C;
    if (!n || !B) return;
    position_backward_kernel<<<fl_cuda_blocks(n, ENC_THREADS), ENC_THREADS, 0, fl_cuda_stream()>>>(
        dt, dwpe, dout, B, T, C);
    FL_CUDA_LAUNCHED("position_backward_kernel");
}

// The host's side of the buckets, kept between calls (FL_MEM_OTHER; buf
// pinned, FL_MEM_WORKSPACE: its copy up is asynchronous, where one from
// pageable memory may wait for the stream), and the host's copy of the ids
// last uploaded to known.dev (ids_known).
static struct {
    int *ids, *count;
    int *buf; // pos (N), start (buckets + 1), tok (buckets): at most 3 N + 1
    size_t ids_cap, count_cap, buf_rows;
    cudaEvent_t buf_read; // buf's last copy up (NULL: none yet), issued at point buf_point
    long buf_point;
} host;

extern "C" size_t fl_cuda_host_scratch_bytes(int N) {
    return (3 * (size_t)N + 1) * sizeof(int);
}

// The pinned buckets' buffer for calls on N rows, free to write: its last
// copy up is done (long since: a step's work came after it)
static int *bucket_buffer(int N) {
    if (host.buf_read) {
        fl_cuda_waited_for(host.buf_point);
        FL_CUDA_CHECK(cudaEventSynchronize(host.buf_read));
    }
    if ((size_t)N > host.buf_rows) {
        fl_cuda_host_free(host.buf);
        host.buf = (int *)fl_cuda_host_alloc(FL_MEM_WORKSPACE, fl_cuda_host_scratch_bytes(N));
        host.buf_rows = (size_t)N;
    }
    return host.buf;
}

static struct {
    const int *dev, *host;
    size_t n;
} known;

extern "C" void fl_cuda_ids_known(const fl_device *d, const int *ids, const int *host_ids,
                                  size_t n) {
    (void)d;
    if (host_ids)
        known.dev = ids, known.host = host_ids, known.n = n;
    else if (known.dev == ids)
        known.dev = known.host = NULL, known.n = 0;
}

// The ids on the host: the copy the host kept, or (tensor parallelism's
// local targets, a call outside a step) copied back, a wait.
static const int *ids_on_host(const int *inp, int N) {
    if (inp == known.dev && (size_t)N <= known.n) return known.host;
    host.ids = (int *)fl_reserve(FL_MEM_OTHER, host.ids, &host.ids_cap, 0, (size_t)N, sizeof(int));
    fl_cuda_waited();
    FL_CUDA_CHECK(cudaMemcpyAsync(host.ids, inp, (size_t)N * sizeof(int), cudaMemcpyDeviceToHost,
                                  fl_cuda_stream()));
    FL_CUDA_CHECK(cudaStreamSynchronize(fl_cuda_stream()));
    return host.ids;
}

extern "C" void fl_cuda_embedding_shard_backward(fl_dtype dt, void *dwte, const void *dout,
                                                 const int *inp, int first, int rows, int N,
                                                 int C) {
    if (N <= 0 || C <= 0) return;
    const int *ids = ids_on_host(inp, N);
    // the rows this call touches: [0, span) of the shard
    int span = 0;
    for (int j = 0; j < N; j++) {
        unsigned id = (unsigned)ids[j] - (unsigned)first;
        if (id < (unsigned)rows && (int)id + 1 > span) span = (int)id + 1;
    }
    if (!span) return;
    host.count = (int *)fl_reserve(FL_MEM_OTHER, host.count, &host.count_cap, 0, (size_t)span + 1,
                                   sizeof(int));
    memset(host.count, 0, ((size_t)span + 1) * sizeof(int));
    for (int j = 0; j < N; j++) {
        unsigned id = (unsigned)ids[j] - (unsigned)first;
        if (id < (unsigned)rows) host.count[id + 1]++;
    }
    int buckets = 0;
    for (int r = 0; r < span; r++) buckets += host.count[r + 1] > 0;
    // count[r] becomes the first slot of row r (exclusive prefix sum)
    for (int r = 0; r < span; r++) host.count[r + 1] += host.count[r];
    int used = host.count[span];
    size_t need = (size_t)used + 2 * (size_t)buckets + 1;
    int *pos = bucket_buffer(N), *start = pos + used, *tok = start + buckets + 1;
    int k = 0;
    for (int r = 0; r < span; r++)
        if (host.count[r + 1] > host.count[r]) {
            start[k] = host.count[r];
            tok[k++] = r;
        }
    start[buckets] = used;
    for (int j = 0; j < N; j++) { // stable: positions in order within a row
        unsigned id = (unsigned)ids[j] - (unsigned)first;
        if (id < (unsigned)rows) pos[host.count[id]++] = j;
    }
    int *d = (int *)fl_cuda_scratch(need * sizeof(int));
    fl_cuda_issued();
    FL_CUDA_CHECK(
        cudaMemcpyAsync(d, host.buf, need * sizeof(int), cudaMemcpyHostToDevice, fl_cuda_stream()));
    if (!host.buf_read)
        FL_CUDA_CHECK(cudaEventCreateWithFlags(&host.buf_read, cudaEventDisableTiming));
    FL_CUDA_CHECK(cudaEventRecord(host.buf_read, fl_cuda_stream()));
    host.buf_point = fl_cuda_issue_point();
    dim3 grid((unsigned)buckets, (unsigned)((C + ENC_THREADS - 1) / ENC_THREADS));
    token_rows_kernel<<<grid, ENC_THREADS, 0, fl_cuda_stream()>>>(dt, dwte, dout, d, d + used,
                                                                  d + used + buckets + 1, C);
    FL_CUDA_LAUNCHED("token_rows_kernel");
}

extern "C" void fl_cuda_encoder_backward(fl_dtype dt, void *dwte, void *dwpe, const void *dout,
                                         const int *inp, int B, int T, int C) {
    if (dwte) fl_cuda_embedding_shard_backward(dt, dwte, dout, inp, 0, INT_MAX, B * T, C);
    if (dwpe) fl_cuda_position_backward(dt, dwpe, dout, B, T, C);
}
