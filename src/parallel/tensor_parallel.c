// tensor_parallel.c: tensor parallelism's collectives (tp.h's fl_tp_ops)
// over a process group, on comm.h's requests, so they keep its deadline
// and traffic counters. A sum is never left to MPI's reduction, whose order
// may depend on the algorithm it picks: the ranks exchange the parts all to
// all, each sums its part in fp32 in group-rank order and rounds it once to
// the dtype, and all_reduce all-gathers the sums. Every rank then holds the
// same bits, and a given group size always gives the same ones.
#include <string.h>

#include "fitlm/comm.h"
#include "fitlm/core.h"

typedef struct tp_table {
    const fl_comm_group *g;
    fl_tp_ops ops;
    int t, rank;
    size_t *counts, *displs; // all_reduce's parts: t entries
    void *scratch;           // grown to the largest call so far
    size_t cap;
    struct tp_table *next;
} tp_table;

static tp_table *tables; // one per group that asked for its table

static void *scratch(tp_table *c, size_t bytes) {
    if (bytes > c->cap) {
        fl_free(c->scratch);
        c->scratch = fl_alloc(FL_MEM_COMM, bytes);
        c->cap = bytes;
    }
    return c->scratch;
}

// sum[i] = parts[0][i] + parts[1][i] + ... + parts[t-1][i], left to right in
// fp32, where part q holds n values of dt at parts + q*n.
static void sum_parts(fl_dtype dt, const void *parts, int t, size_t n, float *sum) {
    size_t nblocks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t blk = 0; blk < nblocks; blk++) {
        size_t i = blk * 4096, len = n - i < 4096 ? n - i : 4096;
        float tmp[4096];
        for (int q = 0; q < t; q++) {
            const float *x = fl_load_f32(dt, fl_at_const(dt, parts, (size_t)q * n + i), len, tmp);
            if (q == 0)
                memcpy(sum + i, x, len * sizeof(float));
            else
                for (size_t k = 0; k < len; k++) sum[i + k] += x[k];
        }
    }
}

// The scratch bytes of t parts of n values of dt, rounded up so that the
// fp32 sums after them are aligned.
static size_t parts_bytes(int t, fl_dtype dt, size_t n) {
    return ((size_t)t * n * fl_dtype_size(dt) + 15) / 16 * 16;
}

size_t fl_tp_scratch_bytes(int t, fl_tp_call call, fl_dtype dt, size_t n) {
    if (t == 1 || n == 0) return 0;
    if (call == FL_TP_REDUCE_SCATTER) return parts_bytes(t, dt, n) + n * sizeof(float);
    size_t T = (size_t)t, S = (n + T - 1) / T;
    // a reduce-scatter to S values, and when t does not divide n the padded copy
    return fl_tp_scratch_bytes(t, FL_TP_REDUCE_SCATTER, dt, S) +
           (n % T ? T * S * fl_dtype_size(dt) : 0);
}

size_t fl_tp_ops_bytes(int t) {
    return sizeof(tp_table) + 2 * (size_t)t * sizeof(size_t);
}

// The t parts of send (n values each) to their ranks; this rank's part of
// the sum, rounded once to dt, into out (n values of dt).
static void exchange_and_sum(tp_table *c, fl_dtype dt, const void *send, void *out, size_t n) {
    char *parts = scratch(c, fl_tp_scratch_bytes(c->t, FL_TP_REDUCE_SCATTER, dt, n));
    float *sum = (void *)(parts + parts_bytes(c->t, dt, n));
    fl_comm_wait(fl_comm_ialltoall(c->g, dt, send, parts, n));
    sum_parts(dt, parts, c->t, n, sum);
    fl_store_f32(dt, out, sum, n);
}

static void tp_reduce_scatter(void *ctx, fl_dtype dt, const void *send, void *recv, size_t n) {
    tp_table *c = ctx;
    if (c->t == 1) {
        if (n && recv != send) memmove(recv, send, n * fl_dtype_size(dt));
        return;
    }
    exchange_and_sum(c, dt, send, recv, n);
}

static void tp_all_gather(void *ctx, fl_dtype dt, const void *send, void *recv, size_t n) {
    tp_table *c = ctx;
    for (int r = 0; r < c->t; r++) {
        c->counts[r] = n;
        c->displs[r] = (size_t)r * n;
    }
    fl_comm_wait(fl_comm_iallgather(c->g, dt, send, recv, c->counts, c->displs));
}

// A reduce-scatter into the parts of S = ceil(n/t) values (the last ones
// shorter, or empty), then an all-gather of the sums in place. When t does
// not divide n the send buffer is buf padded with zeros to t*S values.
static void tp_all_reduce(void *ctx, fl_dtype dt, void *buf, size_t n) {
    tp_table *c = ctx;
    if (c->t == 1 || n == 0) return;
    size_t D = fl_dtype_size(dt), T = (size_t)c->t, S = (n + T - 1) / T;
    const void *send = buf;
    size_t used = fl_tp_scratch_bytes(c->t, FL_TP_REDUCE_SCATTER, dt, S); // exchange_and_sum's
    char *base = scratch(c, fl_tp_scratch_bytes(c->t, FL_TP_ALL_REDUCE, dt, n));
    if (n % T) { // the padded copy, after what exchange_and_sum takes
        char *pad = base + used;
        memcpy(pad, buf, n * D);
        memset(pad + n * D, 0, (T * S - n) * D);
        send = pad;
    }
    // this rank's sums land at the start of the scratch (over the parts,
    // summed by then), then go to their place in buf, where every rank's
    // are gathered
    exchange_and_sum(c, dt, send, base, S);
    for (int r = 0; r < c->t; r++) {
        size_t a = (size_t)r * S < n ? (size_t)r * S : n, b = a + S < n ? a + S : n;
        c->counts[r] = b - a;
        c->displs[r] = a;
    }
    void *at = fl_at(dt, buf, c->displs[c->rank]);
    memcpy(at, base, c->counts[c->rank] * D);
    fl_comm_wait(fl_comm_iallgather(c->g, dt, at, buf, c->counts, c->displs));
}

static void tp_all_reduce_max(void *ctx, float *buf, size_t n) {
    tp_table *c = ctx;
    fl_comm_wait(fl_comm_iallreduce_max(c->g, buf, n));
}

static void tp_sum(void *ctx, double *v, int n) {
    tp_table *c = ctx;
    if (c->t > 1) fl_comm_sum(c->g, v, n);
}

const fl_tp_ops *fl_tp_ops_group(const fl_comm_group *g) {
    for (tp_table *c = tables; c; c = c->next)
        if (c->g == g) return &c->ops;
    // fl_tp_ops_bytes's
    tp_table *c = fl_alloc(FL_MEM_OTHER, sizeof *c);
    *c = (tp_table){.g = g, .t = fl_comm_group_size(g), .rank = fl_comm_group_rank(g)};
    c->ops =
        (fl_tp_ops){c, tp_all_reduce, tp_all_reduce_max, tp_all_gather, tp_reduce_scatter, tp_sum};
    c->counts = fl_alloc(FL_MEM_OTHER, (size_t)c->t * sizeof(size_t));
    c->displs = fl_alloc(FL_MEM_OTHER, (size_t)c->t * sizeof(size_t));
    c->next = tables;
    tables = c;
    return &c->ops;
}

void fl_tp_ops_drop(const fl_comm_group *g) {
    for (tp_table **at = &tables; *at; at = &(*at)->next)
        if ((*at)->g == g) {
            tp_table *c = *at;
            *at = c->next;
            fl_free(c->counts);
            fl_free(c->displs);
            fl_free(c->scratch);
            fl_free(c);
            return;
        }
}
