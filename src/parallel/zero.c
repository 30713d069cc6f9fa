// zero.c: DDP and ZeRO stages 1-3 (dist.h) through the model's hooks and the
// optimizer's sync. What each zero_optimization key means here:
//
//   reduce_bucket_size     elements per gradient reduction. The backward
//                          pass completes units from the end of the flat
//                          buffer towards its start, so a bucket is one
//                          contiguous range, filled downwards; a unit larger
//                          than a bucket is split.
//   overlap_comm           reductions start from grad_ready while the
//                          backward pass goes on (stages 0/1: in the last
//                          micro-batch; 2/3: in every one); false: stages 0/1
//                          reduce after the backward pass, 2/3 wait for each
//                          unit's reduction before going on.
//   reduce_scatter         false: buckets are all-reduced and each rank keeps
//                          its part (DeepSpeed's all-reduce fallback).
//   allgather_bucket_size  elements per all-gather of new weights (1/2).
//   stage3_prefetch_bucket_size  elements gathered ahead of the unit running:
//                          as many whole units as fit.
//   stage3_max_live_parameters  gathered elements alive at once: limits the
//                          prefetch; below what one unit needs is an error.
//   stage3_max_reuse_distance  0: a unit's gathered weights are dropped once
//                          it has run; otherwise they are reused while their
//                          buffer has not been recycled (the last blocks and
//                          the head between forward and backward).
//   stage3_param_persistence_threshold  units smaller than this stay gathered
//                          for the whole step (gathered once per step, not
//                          twice), as does the embedding, which the tied LM
//                          head reads at both ends of both passes.
//   stage3_model_persistence_threshold  at most this many elements in all
//                          such small units together.
//
// LOMO and AdaLomo (optimizers fused into the backward pass) reduce each
// unit's gradient as it is ready (sync_reduce_rows) and update the part they
// own at once: reduce-scattered under ZeRO (half the bytes of the reference's
// all-reduce), all-reduced under DDP. AdaLomo's statistics are per tensor,
// so its shards end at row boundaries (cfg.whole_rows) and need no reduction
// of their own.
#include "fitlm/dist.h"

#include <string.h>

#include "fitlm/comm.h"
#include "fitlm/profile.h"
#include "fitlm/train.h"

enum { MAX_INFLIGHT = 32, MAX_RING = 64 };

typedef struct {
    fl_comm_req req;
    float *keep_from; // reduce_scatter false: copy this rank's part out of the bucket
    float *keep_to;
    size_t keep_n;
    int bucket; // the staging bucket it reads (-1: none)
} inflight;

struct fl_dist {
    fl_zero_config cfg;
    fl_model *m;
    fl_optimizer *o;
    const fl_comm_group *g; // the data-parallel group: rank and world are within it
    int rank, world, stage;
    fl_dtype dt;
    size_t D, numel, begin, end;
    size_t *lo, *hi; // every rank's shard
    size_t *counts, *displs;
    // the reduced fp32 gradient of [begin, end); under DDP and ZeRO-1 with
    // fp32 weights, that range of the model's own gradient buffer
    float *gred;
    int gred_owned;
    // gradient buckets: the open one holds [open_lo, open_hi), staged at the
    // end of its buffer (ZeRO) or in place in gred (DDP)
    size_t cap;
    float *bucket[2];
    int bucket_busy[2], cur;
    size_t open_lo, open_hi;
    int micro_first; // stages 2/3: gred holds nothing of this step yet
    // fused optimizers (cfg.fused_units): one unit's gradient at a time, sent
    // from fsend, this rank's part received in frecv
    size_t unit_cap;
    float *fsend, *frecv;
    inflight fly[MAX_INFLIGHT];
    int n_fly;
    fl_optim_sync sync;
    // stage 3
    void *pshard;        // this rank's weights, or NULL when they are in pstore
    fl_offload *pstore;  // offload_params: the NVMe offload file holding them
    int L, n_units;      // units -1..L stored at index u + 1
    size_t *u_lo, *u_hi; // each unit's range of the flat buffer
    int *resident;       // kept for the whole step, in its own buffer
    void **own_buf;      // a resident unit's buffer
    int *u_valid;        // resident: gathered since the last update
    int n_ring, depth;
    size_t ring_size;
    void *ring[MAX_RING];
    int ring_unit[MAX_RING]; // unit index held (valid), or -2
    int ring_req[MAX_RING];  // gather in flight, or -1
    int ring_read[MAX_RING]; // offload_params: this rank's part being read from disk (a
                             // ticket; the gather starts once it is in), or -1
    int last_pass;
};

void fl_zero_shard(size_t numel, int world, int rank, size_t *begin, size_t *end) {
    size_t S = (numel + (size_t)world - 1) / (size_t)world;
    size_t b = S * (size_t)rank, e = b + S;
    *begin = b < numel ? b : numel;
    *end = e < numel ? e : numel;
}

int fl_dist_wanted(const fl_zero_config *cfg) {
    return cfg->stage > 0 || fl_comm_size() > 1;
}

void fl_dist_derive(fl_zero_config *cfg, const fl_optimizer_config *o) {
    cfg->fused_units = fl_optimizer_unit_grads(o);
    cfg->whole_rows = o->kind == FL_OPT_ADALOMO;
}

int fl_dist_unit_grads(const fl_zero_config *cfg) {
    return cfg->stage >= 2 || cfg->fused_units;
}

// the first row boundary at or after element x
static size_t row_boundary(const fl_param_table *t, size_t x) {
    for (int r = 0; r < t->count; r++)
        if (t->views[r].offset >= x) return t->views[r].offset;
    return t->numel;
}

void fl_dist_shard(const fl_zero_config *cfg, const fl_param_table *t, int world, int rank,
                   size_t *begin, size_t *end) {
    if (cfg->stage == 0) {
        *begin = 0;
        *end = t->numel;
        return;
    }
    fl_zero_shard(t->numel, world, rank, begin, end);
    if (cfg->whole_rows) {
        *begin = row_boundary(t, *begin);
        *end = row_boundary(t, *end);
    }
}

void fl_dist_range(const fl_zero_config *cfg, const fl_param_table *t, const fl_comm_group *dp,
                   size_t *begin, size_t *end) {
    fl_dist_shard(cfg, t, fl_comm_group_size(dp), fl_comm_group_rank(dp), begin, end);
}

static size_t min_sz(size_t a, size_t b) {
    return a < b ? a : b;
}
static size_t max_sz(size_t a, size_t b) {
    return a > b ? a : b;
}

// counts/displs of [a, b) over the ranks' shards
static void split(fl_dist *d, size_t a, size_t b) {
    for (int r = 0; r < d->world; r++) {
        size_t x = max_sz(a, d->lo[r]), y = min_sz(b, d->hi[r]);
        d->counts[r] = y > x ? y - x : 0;
        d->displs[r] = y > x ? x - a : 0;
    }
}

// ----------------------------------------------------------------------------
// gradients

static void land(fl_dist *d, inflight *f) {
    fl_comm_wait(f->req);
    if (f->keep_n) memcpy(f->keep_to, f->keep_from, f->keep_n * sizeof(float));
    if (f->bucket >= 0) d->bucket_busy[f->bucket] = 0;
}

static void wait_all(fl_dist *d) {
    for (int i = 0; i < d->n_fly; i++) land(d, &d->fly[i]);
    d->n_fly = 0;
}

// lets MPI progress the reductions in flight, and lands the finished ones
static void progress(fl_dist *d) {
    int k = 0;
    for (int i = 0; i < d->n_fly; i++) {
        if (fl_comm_test(d->fly[i].req))
            land(d, &d->fly[i]); // completed: no wait
        else
            d->fly[k++] = d->fly[i];
    }
    d->n_fly = k;
}

static void push(fl_dist *d, inflight f) {
    if (d->n_fly == MAX_INFLIGHT) { // the oldest first
        land(d, &d->fly[0]);
        memmove(d->fly, d->fly + 1, (size_t)(MAX_INFLIGHT - 1) * sizeof(inflight));
        d->n_fly--;
    }
    d->fly[d->n_fly++] = f;
}

// Starts the reduction of the open bucket.
static void flush(fl_dist *d) {
    size_t a = d->open_lo, b = d->open_hi, n = b - a;
    if (!n) return;
    d->open_lo = d->open_hi = 0;
    if (d->stage == 0) { // staged in place in gred
        push(d, (inflight){fl_comm_iallreduce(d->g, d->gred + a, n), NULL, NULL, 0, -1});
        return;
    }
    float *send = d->bucket[d->cur] + (d->cap - n);
    d->bucket_busy[d->cur] = 1;
    size_t x = max_sz(a, d->begin), y = min_sz(b, d->end);
    if (d->cfg.reduce_scatter) {
        split(d, a, b);
        push(d, (inflight){fl_comm_ireduce_scatter(
                               d->g, send, y > x ? d->gred + (x - d->begin) : NULL, d->counts),
                           NULL, NULL, 0, d->cur});
    } else {
        push(d, (inflight){fl_comm_iallreduce(d->g, send, n), y > x ? send + (x - a) : NULL,
                           y > x ? d->gred + (x - d->begin) : NULL, y > x ? y - x : 0, d->cur});
    }
    d->cur ^= 1;
}

// dst[i] = (acc ? acc[i] : 0) + src[i] for n elements of dtype dt
static void stage_values(float *dst, const float *acc, fl_dtype dt, const void *src, size_t n) {
    size_t nblocks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t blk = 0; blk < nblocks; blk++) {
        size_t i = blk * 4096, len = min_sz(4096, n - i);
        float scratch[4096];
        const float *g = fl_load_f32(dt, fl_at_const(dt, src, i), len, scratch);
        if (acc)
            for (size_t k = 0; k < len; k++) dst[i + k] = acc[i + k] + g[k];
        else if (dst + i != g)
            memcpy(dst + i, g, len * sizeof(float));
    }
}

// Stages the gradient of [a, b) (src: its values, of dtype dt, plus acc when
// not NULL) into the open bucket, flushing as buckets fill.
static void collect(fl_dist *d, size_t a, size_t b, fl_dtype dt, const void *src,
                    const float *acc) {
    if (d->open_lo != d->open_hi && d->open_lo != b) flush(d); // not adjacent
    while (b > a) {
        if (d->open_lo == d->open_hi) d->open_lo = d->open_hi = b;
        size_t room = d->cap - (d->open_hi - d->open_lo), take = min_sz(room, b - a);
        size_t s = b - take; // [s, b) goes in now
        const void *from = fl_at_const(dt, src, s - a);
        const float *plus = acc ? acc + (s - a) : NULL;
        if (d->stage == 0) {
            if (from != (const void *)(d->gred + s) || plus)
                stage_values(d->gred + s, plus, dt, from, take);
        } else {
            if (d->bucket_busy[d->cur]) { // its last reduction must have landed
                wait_all(d);
            }
            float *buf = d->bucket[d->cur] + (d->cap - (d->open_hi - s));
            stage_values(buf, plus, dt, from, take);
            // stages 2/3 after the first micro-batch: the owner adds what it
            // has summed so far, so the reduction lands the running sum
            if (d->stage >= 2 && !d->micro_first) {
                size_t x = max_sz(s, d->begin), y = min_sz(b, d->end);
                for (size_t i = x; i < y; i++) buf[i - s] += d->gred[i - d->begin];
            }
        }
        d->open_lo = s;
        b = s;
        if (d->open_hi - d->open_lo == d->cap) flush(d);
    }
}

static int communicating(const fl_dist *d) {
    // stages 0/1 reduce the sum of every micro-batch once, in the last one
    return d->stage >= 2 || d->o->micro == d->o->cfg.grad_accum - 1;
}

static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fl_dist *d = ctx;
    if (!communicating(d)) return;
    if (d->stage <= 1 && !d->cfg.overlap_comm) return; // all of it after the backward pass
    const fl_param_view *va = &m->table.views[first], *vz = &m->table.views[first + n - 1];
    size_t a = va->offset, b = vz->offset + vz->numel;
    FL_PROFILE(FL_OP_COMM, FL_BWD, 0.0, {
        if (d->stage >= 2) {
            collect(d, a, b, d->dt, m->gp[first], NULL); // the unit's scratch
            if (!d->cfg.overlap_comm) {
                flush(d);
                wait_all(d);
            }
        } else {
            const float *acc = d->o->grad_accum ? d->o->grad_accum + a : NULL;
            collect(d, a, b, d->dt, fl_at(d->dt, m->grads, a), acc);
        }
        if (a == 0) { // the backward pass is over
            flush(d);
            if (d->stage >= 2) {
                wait_all(d); // the next micro-batch adds to gred
                d->micro_first = 0;
            }
        } else {
            progress(d);
        }
    });
}

static const float *sync_grads(void *ctx) {
    fl_dist *d = ctx;
    FL_PROFILE(FL_OP_COMM, FL_STEP, 0.0, {
        if (d->stage <= 1 && !d->cfg.overlap_comm) {
            // after micro_done: a 16-bit run's fp32 sum holds every micro-batch
            if (d->o->grad_accum)
                collect(d, 0, d->numel, FL_F32, d->o->grad_accum, NULL);
            else
                collect(d, 0, d->numel, d->dt, d->m->grads, NULL);
        }
        flush(d);
        wait_all(d);
    });
    d->micro_first = 1; // the next step starts a new sum
    return d->gred;
}

static void sync_sum(void *ctx, double *v, int n) {
    fl_dist *d = ctx;
    fl_comm_sum(d->g, v, n);
}

static void sync_max(void *ctx, double *v, int n) {
    fl_dist *d = ctx;
    fl_comm_max(d->g, v, n);
}

// LOMO and AdaLomo: one unit's gradient summed over ranks, now; this rank
// updates its part of it in the backward pass.
static const float *sync_reduce_rows(void *ctx, int first, int n, const void *grads, size_t *lo,
                                     size_t *hi) {
    fl_dist *d = ctx;
    const fl_param_view *v = d->m->table.views;
    size_t a = v[first].offset, b = v[first + n - 1].offset + v[first + n - 1].numel;
    const float *out = d->fsend;
    FL_PROFILE(FL_OP_COMM, FL_BWD, 0.0, {
        stage_values(d->fsend, NULL, d->dt, grads, b - a);
        *lo = a;
        *hi = b;
        if (d->stage == 0) {
            fl_comm_wait(fl_comm_iallreduce(d->g, d->fsend, b - a));
        } else {
            size_t x = max_sz(a, d->begin), y = min_sz(b, d->end);
            *lo = x;
            *hi = y > x ? y : x;
            if (d->cfg.reduce_scatter) {
                split(d, a, b);
                fl_comm_wait(fl_comm_ireduce_scatter(d->g, d->fsend, d->frecv, d->counts));
                out = d->frecv;
            } else {
                fl_comm_wait(fl_comm_iallreduce(d->g, d->fsend, b - a));
                out = d->fsend + (x - a);
            }
        }
    });
    return out;
}

// ----------------------------------------------------------------------------
// stage 3: gathering units

// This rank's part of [a, b) (split() done) as the send buffer of a gather
// into buf: in the shard, or read from the offload file into its place in buf.
static const void *own_part(fl_dist *d, size_t a, void *buf) {
    size_t n = d->counts[d->rank], x = max_sz(a, d->begin);
    if (!n) return buf;
    if (!d->pstore) return fl_at(d->dt, d->pshard, x - d->begin);
    void *at = fl_at(d->dt, buf, d->displs[d->rank]);
    fl_offload_read_weights(d->pstore, x, n, at); // counted in the caller's communication time
    return at;
}

static fl_comm_req start_gather(fl_dist *d, int ui, void *buf) {
    split(d, d->u_lo[ui], d->u_hi[ui]);
    const void *send = own_part(d, d->u_lo[ui], buf);
    return fl_comm_iallgather(d->g, d->dt, send, buf, d->counts, d->displs);
}

// the ring buffer holding unit index ui (or -1)
static int ring_of(const fl_dist *d, int ui) {
    for (int i = 0; i < d->n_ring; i++)
        if (d->ring_unit[i] == ui) return i;
    return -1;
}

// Ring buffer b's gather, once its part read from disk is in (offload_params).
static void ring_gather_read(fl_dist *d, int b) {
    fl_offload_wait_read(d->pstore, d->ring_read[b]);
    d->ring_read[b] = -1;
    int ui = d->ring_unit[b];
    split(d, d->u_lo[ui], d->u_hi[ui]);
    void *mine = fl_at(d->dt, d->ring[b], d->displs[d->rank]); // gathered in place
    d->ring_req[b] = fl_comm_iallgather(d->g, d->dt, mine, d->ring[b], d->counts, d->displs);
}

// Ring buffer b's unit complete: read, gathered.
static void ring_wait(fl_dist *d, int b) {
    if (d->ring_read[b] >= 0) ring_gather_read(d, b);
    if (d->ring_req[b] >= 0) fl_comm_wait(d->ring_req[b]);
    d->ring_req[b] = -1;
}

// Starts the gathers whose parts have come in from disk, without waiting.
static void ring_progress(fl_dist *d) {
    for (int b = 0; d->pstore && b < d->n_ring; b++)
        if (d->ring_read[b] >= 0 && fl_offload_read_done(d->pstore, d->ring_read[b]))
            ring_gather_read(d, b);
}

// Starts gathering ring unit ui unless it is there or on its way; `pinned`
// (n_pinned unit indices) must not be evicted. With offload_params this
// rank's part is first read from disk on the offload's reader thread.
static int ring_fetch(fl_dist *d, int ui, const int *pinned, int n_pinned) {
    int b = ring_of(d, ui);
    if (b >= 0) return b;
    for (int i = 0; i < d->n_ring && b < 0; i++) {
        int keep = 0;
        for (int k = 0; k < n_pinned; k++) keep |= d->ring_unit[i] == pinned[k];
        if (!keep) b = i;
    }
    FL_ASSERT(b >= 0);
    ring_wait(d, b);
    d->ring_unit[b] = ui;
    split(d, d->u_lo[ui], d->u_hi[ui]);
    size_t n = d->counts[d->rank];
    if (d->pstore && n) {
        void *mine = fl_at(d->dt, d->ring[b], d->displs[d->rank]);
        d->ring_read[b] =
            fl_offload_read_weights_async(d->pstore, max_sz(d->u_lo[ui], d->begin), n, mine);
    } else {
        d->ring_req[b] = start_gather(d, ui, d->ring[b]);
    }
    return b;
}

// the next ring unit after ui in this pass's order, or -1
static int next_unit(const fl_dist *d, int ui, int pass) {
    for (;;) {
        ui += pass == FL_PASS_FWD ? 1 : -1;
        if (ui < 0 || ui >= d->n_units) return -1;
        if (!d->resident[ui]) return ui;
    }
}

// every ring copy dropped (its gather landed first)
static void clear_ring(fl_dist *d) {
    for (int i = 0; i < d->n_ring; i++) {
        ring_wait(d, i);
        d->ring_unit[i] = -2;
    }
}

static void on_pre_unit(void *ctx, fl_model *m, int unit, int pass) {
    fl_dist *d = ctx;
    if (d->stage < 3) return;
    // no reuse: what the forward pass gathered is not kept for the backward
    if (d->cfg.max_reuse_distance <= 0 && pass != d->last_pass) clear_ring(d);
    d->last_pass = pass;
    FL_PROFILE(FL_OP_COMM, pass == FL_PASS_FWD ? FL_FWD : FL_BWD, 0.0, {
        int ui = unit + 1;
        // the tied LM head reads the embedding's weights
        int need[2] = {ui, m->config.tie_embeddings && unit == d->L ? 0 : -1};
        for (int k = 0; k < 2; k++) {
            int v = need[k];
            if (v < 0 || d->u_hi[v] == d->u_lo[v]) continue;
            void *buf;
            if (d->resident[v]) {
                buf = d->own_buf[v];
                if (!d->u_valid[v]) {
                    fl_comm_wait(start_gather(d, v, buf));
                    d->u_valid[v] = 1;
                }
            } else {
                int pinned[MAX_RING + 1], np = 0;
                pinned[np++] = v;
                for (int w = v, i = 0; i < d->depth && (w = next_unit(d, w, pass)) >= 0; i++)
                    pinned[np++] = w;
                int b = ring_fetch(d, v, pinned, np);
                ring_wait(d, b);
                buf = d->ring[b];
                for (int i = 1; i < np; i++) ring_fetch(d, pinned[i], pinned, np); // prefetch
                ring_progress(d);
            }
            fl_model_bind_params(m, v - 1, buf);
        }
    });
}

static void sync_updated(void *ctx) {
    fl_dist *d = ctx;
    FL_PROFILE(FL_OP_COMM, FL_STEP, 0.0, {
        if (d->stage == 1 || d->stage == 2) {
            // every rank's new weights, in buckets, gathered in place
            size_t cap = (size_t)d->cfg.allgather_bucket_size;
            if (cap < 1) cap = 1;
            for (size_t a = 0; a < d->numel; a += cap) {
                size_t b = min_sz(d->numel, a + cap);
                split(d, a, b);
                void *at = fl_at(d->dt, d->m->params, a);
                fl_comm_req r = fl_comm_iallgather(
                    d->g, d->dt, fl_at(d->dt, at, d->displs[d->rank]), at, d->counts, d->displs);
                push(d, (inflight){r, NULL, NULL, 0, -1});
            }
            wait_all(d);
        } else if (d->stage == 3) { // every gathered copy is stale now
            clear_ring(d);
            for (int u = 0; u < d->n_units; u++) d->u_valid[u] = 0;
        }
    });
}

// ----------------------------------------------------------------------------

static void check_supported(const fl_model *m, const fl_optimizer *o, const fl_zero_config *cfg) {
    const char *what = cfg->stage ? "ZeRO" : "data parallelism over several ranks";
    if (m->lora.cfg.r)
        fl_die("LoRA with %s is not supported yet: train adapters on one rank", what);
    if (m->quant.cfg.enabled)
        fl_die("NF4 base weights (--quantize) with %s are not supported yet", what);
    if ((m->unit_grads != NULL) != fl_dist_unit_grads(cfg))
        fl_die("internal: a ZeRO-%d model %s unit gradients", cfg->stage,
               fl_dist_unit_grads(cfg) ? "needs" : "must not have");
    if (cfg->fused_units != fl_optimizer_unit_grads(&o->cfg))
        fl_die("internal: zero_optimization's fused_units does not match the optimizer");
    if (o->cfg.kind == FL_OPT_ADALOMO && cfg->stage > 0 && !cfg->whole_rows)
        fl_die("internal: AdaLomo's shards must hold whole rows");
}

// The elements of the largest unit (the embedding, a block or the head).
static size_t largest_unit(const fl_param_table *t) {
    size_t best = 0, run = 0;
    for (int r = 0; r < t->count; r++) {
        run = r && t->views[r].unit == t->views[r - 1].unit ? run + t->views[r].numel
                                                            : t->views[r].numel;
        best = run > best ? run : best;
    }
    return best;
}

void fl_stage3_layout_init(fl_stage3_layout *y, const fl_param_table *t, int L,
                           const fl_zero_config *c) {
    y->n_units = L + 2;
    y->lo = fl_alloc(FL_MEM_OTHER, (size_t)y->n_units * sizeof(size_t));
    y->hi = fl_alloc(FL_MEM_OTHER, (size_t)y->n_units * sizeof(size_t));
    y->resident = fl_alloc(FL_MEM_OTHER, (size_t)y->n_units * sizeof(int));
    for (int ui = 0; ui < y->n_units; ui++) y->lo[ui] = y->hi[ui] = 0;
    for (int r = t->count - 1; r >= 0; r--) { // a unit's rows are contiguous
        const fl_param_view *v = &t->views[r];
        int ui = v->unit + 1;
        FL_ASSERT(ui >= 0 && ui < y->n_units);
        if (y->hi[ui] == 0) y->hi[ui] = v->offset + v->numel;
        y->lo[ui] = v->offset;
    }
    y->resident_total = y->ring_size = 0;
    double persistent = 0.0; // stage3_model_persistence_threshold caps these together
    for (int ui = 0; ui < y->n_units; ui++) {
        size_t n = y->hi[ui] - y->lo[ui];
        int small = ui > 0 && (double)n < c->param_persistence_threshold &&
                    persistent + (double)n <= c->model_persistence_threshold;
        if (small) persistent += (double)n;
        y->resident[ui] = ui == 0 || small;
        if (y->resident[ui])
            y->resident_total += n;
        else if (n > y->ring_size)
            y->ring_size = n;
    }
    // stage3_max_live_parameters caps what is prefetched, as DeepSpeed's
    // coordinator does: the running unit is gathered whatever it says, so
    // below the residents and one block nothing is prefetched
    double live = c->max_live_parameters - (double)y->resident_total;
    y->depth = 0;
    if (y->ring_size) { // whole units within the prefetch bucket and the live limit
        double by_bucket = c->prefetch_bucket_size / (double)y->ring_size;
        double by_live = live / (double)y->ring_size - 1.0;
        double dd = by_bucket < by_live ? by_bucket : by_live;
        dd = dd < L ? dd : L;
        dd = dd < MAX_RING - 1 ? dd : MAX_RING - 1;
        y->depth = dd > 0 ? (int)dd : 0;
    }
    y->n_ring = y->ring_size ? y->depth + 1 : 0;
}

void fl_stage3_layout_free(fl_stage3_layout *y) {
    fl_free(y->lo);
    fl_free(y->hi);
    fl_free(y->resident);
}

static void setup_stage3(fl_dist *d) {
    fl_model *m = d->m;
    fl_stage3_layout y;
    fl_stage3_layout_init(&y, &m->table, m->config.n_layer, &d->cfg);
    d->L = m->config.n_layer;
    d->n_units = y.n_units;
    d->u_lo = y.lo;
    d->u_hi = y.hi;
    d->resident = y.resident;
    d->ring_size = y.ring_size;
    d->depth = y.depth;
    d->n_ring = y.n_ring;
    d->u_valid = fl_alloc(FL_MEM_OTHER, (size_t)d->n_units * sizeof(int));
    d->own_buf = fl_alloc(FL_MEM_OTHER, (size_t)d->n_units * sizeof(void *));
    for (int ui = 0; ui < d->n_units; ui++) {
        size_t n = d->u_hi[ui] - d->u_lo[ui];
        d->own_buf[ui] = d->resident[ui] && n ? fl_alloc(FL_MEM_PARAMS, n * d->D) : NULL;
    }
    for (int i = 0; i < d->n_ring; i++) {
        d->ring[i] = fl_alloc(FL_MEM_COMM, d->ring_size * d->D);
        d->ring_unit[i] = -2;
        d->ring_req[i] = -1;
        d->ring_read[i] = -1;
    }
    // keep only this rank's shard of the weights: the model's own, when it
    // was initialised as that shard (fl_model_init_from); or none in RAM,
    // handed to the offload file
    if (d->pstore) {
        const void *shard = fl_at(d->dt, m->params, d->begin - m->params_begin);
        fl_offload_write_weights(d->pstore, shard);
        fl_free(m->params);
    } else if (fl_model_sharded(m)) {
        if (m->params_begin != d->begin || m->params_end != d->end)
            fl_die("internal: the model holds [%zu, %zu), not this rank's shard [%zu, %zu)",
                   m->params_begin, m->params_end, d->begin, d->end);
        d->pshard = m->params;
    } else {
        d->pshard = fl_alloc(FL_MEM_PARAMS, (d->end - d->begin) * d->D);
        memcpy(d->pshard, fl_at(d->dt, m->params, d->begin), (d->end - d->begin) * d->D);
        fl_free(m->params);
    }
    m->params = NULL;
    for (int r = 0; r < m->table.count; r++) m->wp[r] = NULL; // bound when gathered
    d->o->params = d->pshard; // paged: the pager binds a chunk's at a time
    d->o->params_first = d->begin;
}

void fl_dist_memory(const fl_zero_config *cfg, const fl_param_table *t, int n_layer, fl_dtype dt,
                    int accum_buffer, int world, int rank, size_t bytes[FL_MEM_NTAGS],
                    size_t *params_freed) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    *params_freed = 0;
    // the strategy and its per-rank tables (lo, hi, counts, displs)
    bytes[FL_MEM_OTHER] += sizeof(fl_dist) + 4 * (size_t)world * sizeof(size_t);
    size_t numel = t->numel, D = fl_dtype_size(dt), begin, end;
    fl_dist_shard(cfg, t, world, rank, &begin, &end);
    double bucket = cfg->reduce_bucket_size < 1 ? 1 : cfg->reduce_bucket_size;
    size_t cap = (size_t)bucket < numel ? (size_t)bucket : numel;
    if (cfg->fused_units) {
        bytes[FL_MEM_COMM] += (cfg->stage > 0 ? 2 : 1) * largest_unit(t) * sizeof(float);
    } else {
        if (!(cfg->stage <= 1 && dt == FL_F32 && !accum_buffer))
            bytes[FL_MEM_GRADS] += (end - begin) * sizeof(float);
        if (cfg->stage > 0) bytes[FL_MEM_COMM] += 2 * cap * sizeof(float);
    }
    if (cfg->stage == 3) {
        fl_stage3_layout y;
        fl_stage3_layout_init(&y, t, n_layer, cfg);
        bytes[FL_MEM_PARAMS] += y.resident_total * D + (cfg->offload_params ? 0 : end - begin) * D;
        bytes[FL_MEM_COMM] += (size_t)y.n_ring * y.ring_size * D;
        // per unit: its range, residency, validity and own buffer
        bytes[FL_MEM_OTHER] +=
            (size_t)y.n_units * (2 * sizeof(size_t) + 2 * sizeof(int) + sizeof(void *));
        *params_freed = numel * D;
        fl_stage3_layout_free(&y);
    }
}

fl_dist *fl_dist_attach(fl_model *m, fl_optimizer *o, const fl_zero_config *cfg, fl_offload *store,
                        const fl_comm_group *dp) {
    check_supported(m, o, cfg);
    if (cfg->offload_params && (cfg->stage != 3 || !store || !o->pager || !o->pager->weights))
        fl_die("internal: offload_params needs stage 3 and an NVMe offload with paged weights");
    fl_dist *d = fl_alloc(FL_MEM_OTHER, sizeof *d);
    memset(d, 0, sizeof *d);
    d->cfg = *cfg;
    d->m = m;
    d->o = o;
    d->g = dp;
    d->rank = fl_comm_group_rank(dp);
    d->world = fl_comm_group_size(dp);
    d->stage = cfg->stage;
    d->dt = m->dtype;
    d->D = fl_dtype_size(m->dtype);
    d->numel = m->table.numel;
    fl_dist_range(cfg, &m->table, dp, &d->begin, &d->end);
    if (o->rule->state_begin != d->begin || o->rule->state_end != d->end)
        fl_die("internal: the optimizer covers [%zu, %zu), not this rank's [%zu, %zu)",
               o->rule->state_begin, o->rule->state_end, d->begin, d->end);
    size_t W = (size_t)d->world;
    d->lo = fl_alloc(FL_MEM_OTHER, W * sizeof(size_t));
    d->hi = fl_alloc(FL_MEM_OTHER, W * sizeof(size_t));
    d->counts = fl_alloc(FL_MEM_OTHER, W * sizeof(size_t));
    d->displs = fl_alloc(FL_MEM_OTHER, W * sizeof(size_t));
    for (int r = 0; r < d->world; r++)
        fl_dist_shard(cfg, &m->table, d->world, r, &d->lo[r], &d->hi[r]);
    if (cfg->fused_units) { // one unit at a time: no reduced gradient, no buckets
        d->unit_cap = largest_unit(&m->table);
        d->fsend = fl_alloc(FL_MEM_COMM, d->unit_cap * sizeof(float));
        if (d->stage > 0) d->frecv = fl_alloc(FL_MEM_COMM, d->unit_cap * sizeof(float));
    } else if (d->stage <= 1 && d->dt == FL_F32 && !o->grad_accum) {
        // fp32: reduced into the model's own gradient buffer (DDP: in place;
        // ZeRO-1: the shard's range, whose values are in the buckets by then)
        d->gred = (float *)m->grads + d->begin;
    } else {
        d->gred = fl_alloc(FL_MEM_GRADS, (d->end - d->begin) * sizeof(float));
        d->gred_owned = 1;
    }
    double bucket = cfg->reduce_bucket_size < 1 ? 1 : cfg->reduce_bucket_size;
    d->cap = (size_t)bucket < d->numel ? (size_t)bucket : d->numel;
    if (d->stage > 0 && !cfg->fused_units)
        for (int i = 0; i < 2; i++) d->bucket[i] = fl_alloc(FL_MEM_COMM, d->cap * sizeof(float));
    d->micro_first = 1;
    d->pstore = cfg->offload_params ? store : NULL;
    if (d->stage == 3) setup_stage3(d);
    d->sync = (fl_optim_sync){
        d, sync_grads, sync_sum, sync_max, sync_updated, d->stage == 0, sync_reduce_rows};
    o->sync = &d->sync;
    m->hooks = (fl_model_hooks){on_pre_unit, on_grad_ready, d};
    return d;
}

void fl_dist_free(fl_dist *d) {
    if (!d) return;
    wait_all(d);
    if (d->gred_owned) fl_free(d->gred);
    fl_free(d->fsend);
    fl_free(d->frecv);
    for (int i = 0; i < 2; i++) fl_free(d->bucket[i]);
    if (d->stage == 3) {
        clear_ring(d);
        for (int i = 0; i < d->n_ring; i++) fl_free(d->ring[i]);
        for (int u = 0; u < d->n_units; u++) fl_free(d->own_buf[u]);
        fl_free(d->pshard);
        fl_stage3_layout y = {.lo = d->u_lo, .hi = d->u_hi, .resident = d->resident};
        fl_stage3_layout_free(&y);
        fl_free(d->u_valid);
        fl_free(d->own_buf);
        d->o->params = NULL;
    }
    d->o->sync = NULL;
    d->m->hooks = (fl_model_hooks){0};
    fl_free(d->lo);
    fl_free(d->hi);
    fl_free(d->counts);
    fl_free(d->displs);
    fl_free(d);
}

void *fl_dist_params_shard(fl_dist *d) {
    return d->stage == 3 ? d->pshard : d->m->params;
}

void fl_dist_gather_row(fl_dist *d, int row, void *out) {
    const fl_param_view *v = &d->m->table.views[row];
    if (d->stage < 3) {
        fl_dev_download(d->m->dev, out, fl_at(d->dt, d->m->params, v->offset), v->numel * d->D);
        return;
    }
    size_t a = v->offset, b = a + v->numel;
    split(d, a, b);
    fl_comm_wait(fl_comm_iallgather(d->g, d->dt, own_part(d, a, out), out, d->counts, d->displs));
}
