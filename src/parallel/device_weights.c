// device_weights.c: weight offload on one device (ZeRO-3 with
// offload_param.device cpu under ZeRO-Offload). The whole 16-bit weights
// live in a pinned host copy (the optimizer's, device_offload.c; under LoRA
// the frozen base's own, run.c); the device
// holds the resident units (the embedding and the units under the stage-3
// persistence thresholds) and a ring of buffers for the others, laid out as
// zero.c's stage 3 (fl_stage3_layout). In the model's pre_unit hook a unit's
// weights go up on an upload stream (the compute stream waits by event) and
// the next units of the pass are prefetched into the ring, as zero.c gathers
// them, the all-gather being an H2D copy; a ring unit is dropped when its
// buffer is needed (or at a change of pass without stage3_max_reuse_distance).
// The host updates its copy after the backward pass; the next forward pass
// uploads again (a frozen base, LoRA's, stays valid: the residents go up
// once, and with reuse the ring keeps what the backward pass left). The
// arithmetic is the plain path's: bitwise its run. Under
// offload_param.device nvme (ZeRO-Infinity) there is no host copy:
// the weights live in the optimizer's NVMe file (offload.c, which the step
// updates chunk by chunk); a unit's fetch reads it there, piece by piece,
// on the offload's reader thread into buffer_count pinned buffers of at
// most buffer_size elements (DeepSpeed's parameter swap buffers), and each
// piece goes up from its buffer once its read has landed (at the latest
// when the unit is needed; a buffer is reused once its upload is done).
#include <string.h>

#include "fitlm/device.h"
#include "fitlm/dist.h"
#include "fitlm/model.h"
#include "fitlm/offload.h"

// A pinned buffer a piece of a unit is read into from the NVMe file.
typedef struct {
    void *buf;
    int ticket;     // its read on the offload's reader thread, or -1
    char *dst;      // where the piece goes on the device
    const void *to; // the device buffer of the unit it belongs to
    size_t bytes;
    fl_event *done; // its upload (NULL: none in flight)
} staging;

struct fl_dev_weights {
    fl_model *m;
    const fl_device *dev;
    const char *host;  // the pinned host copy of the whole weights (offload_param cpu)
    fl_offload *store; // or the NVMe file holding them (offload_param nvme)
    staging *stage;
    int n_stage, next_stage;
    size_t stage_numel;
    size_t D;
    fl_stage3_layout y;
    int n_ring, depth;
    void **ring;      // n_ring device buffers of y.ring_size elements
    int *ring_unit;   // unit index held, or -2
    fl_event **ready; // per ring buffer: its upload (NULL: waited on)
    void **own;       // per unit: a resident unit's device buffer
    int *valid;       // per unit: a resident unit uploaded since the last update
    fl_event **own_ready;
    fl_stream *up;
    int last_pass;
    int reuse;              // stage3_max_reuse_distance > 0
    int frozen;             // every row frozen (LoRA's base): no update makes a copy stale
    fl_model_hooks chained; // device_offload.c's pre_unit (its gradient ring) and grad_ready
};

// Units outside the resident set that hold weights (the ring's candidates).
static int ring_units(const fl_stage3_layout *y) {
    int n = 0;
    for (int ui = 0; ui < y->n_units; ui++) n += !y->resident[ui] && y->hi[ui] > y->lo[ui];
    return n;
}

// zero.c's ring, no larger than the units it can hold
static int ring_count(const fl_stage3_layout *y) {
    int n = ring_units(y);
    return y->n_ring < n ? y->n_ring : n;
}

size_t fl_dev_weights_bytes(const fl_zero_config *cfg, const fl_param_table *t, int n_layer,
                            fl_dtype dt) {
    fl_stage3_layout y;
    fl_stage3_layout_init(&y, t, n_layer, cfg);
    size_t bytes = (y.resident_total + (size_t)ring_count(&y) * y.ring_size) * fl_dtype_size(dt);
    fl_stage3_layout_free(&y);
    return bytes;
}

// Elements of one pinned staging buffer: buffer_size, or the largest unit
// when every unit is smaller (no buffer larger than what goes through it).
static size_t staging_numel(const fl_offload_config *oc, const fl_stage3_layout *y) {
    size_t most = 0;
    for (int ui = 0; ui < y->n_units; ui++)
        if (y->hi[ui] - y->lo[ui] > most) most = y->hi[ui] - y->lo[ui];
    double want = oc->staging_size;
    return want < (double)most ? (size_t)want : most;
}

size_t fl_dev_weights_staging_bytes(const fl_offload_config *oc, const fl_zero_config *cfg,
                                    const fl_param_table *t, int n_layer, fl_dtype dt) {
    fl_stage3_layout y;
    fl_stage3_layout_init(&y, t, n_layer, cfg);
    size_t bytes = (size_t)oc->staging_count * staging_numel(oc, &y) * fl_dtype_size(dt);
    fl_stage3_layout_free(&y);
    return bytes;
}

// The staging buffer's read has landed: its piece goes up on the upload
// stream (after the eviction's wait that fetch put there).
static void land(fl_dev_weights *w, staging *s) {
    if (s->ticket < 0) return;
    fl_offload_wait_read(w->store, s->ticket);
    s->ticket = -1;
    w->dev->copy_async(w->dev, s->dst, s->buf, s->bytes, FL_COPY_H2D, w->up);
    s->done = w->dev->event_record(w->dev, w->up);
}

// The staging buffer free for another read: its piece up and the upload done.
static void retire(fl_dev_weights *w, staging *s) {
    land(w, s);
    if (!s->done) return;
    w->dev->event_sync(w->dev, s->done);
    w->dev->event_destroy(w->dev, s->done);
    s->done = NULL;
}

// Unit ui's weights up into buf, after the compute stream's work issued so
// far (which may still read the buffer's previous unit); returns the
// upload's event, or under NVMe NULL: its pieces are read into the staging
// buffers and go up as they land (`await`).
static fl_event *upload(fl_dev_weights *w, int ui, void *buf) {
    const fl_device *d = w->dev;
    fl_event *e = d->event_record(d, NULL);
    d->stream_wait(d, w->up, e);
    d->event_destroy(d, e);
    size_t lo = w->y.lo[ui], n = w->y.hi[ui] - lo;
    if (!w->store) {
        d->copy_async(d, buf, w->host + lo * w->D, n * w->D, FL_COPY_H2D, w->up);
        return d->event_record(d, w->up);
    }
    // pieces of an earlier fetch into buf not up yet go first: the new ones land over them
    for (int i = 0; i < w->n_stage; i++)
        if (w->stage[i].to == buf) land(w, &w->stage[i]);
    for (size_t at = 0; at < n; at += w->stage_numel) {
        staging *s = &w->stage[w->next_stage];
        w->next_stage = (w->next_stage + 1) % w->n_stage;
        retire(w, s); // the oldest: its read was asked for first
        size_t k = n - at < w->stage_numel ? n - at : w->stage_numel;
        s->ticket = fl_offload_read_weights_async(w->store, lo + at, k, s->buf);
        s->dst = (char *)buf + at * w->D;
        s->to = buf;
        s->bytes = k * w->D;
    }
    return NULL;
}

// The pieces whose reads have landed go up now, without waiting.
static void progress(fl_dev_weights *w) {
    for (int i = 0; w->store && i < w->n_stage; i++)
        if (w->stage[i].ticket >= 0 && fl_offload_read_done(w->store, w->stage[i].ticket))
            land(w, &w->stage[i]);
}

// the compute stream waits for buf's upload (its event once; under NVMe
// its pieces, landed first)
static void await(fl_dev_weights *w, const void *buf, fl_event **e) {
    const fl_device *d = w->dev;
    for (int i = 0; w->store && i < w->n_stage; i++) {
        staging *s = &w->stage[i];
        if (s->to != buf) continue;
        land(w, s);
        if (s->done) d->stream_wait(d, NULL, s->done);
    }
    if (!*e) return;
    d->stream_wait(d, NULL, *e);
    d->event_destroy(d, *e);
    *e = NULL;
}

static int ring_of(const fl_dev_weights *w, int ui) {
    for (int i = 0; i < w->n_ring; i++)
        if (w->ring_unit[i] == ui) return i;
    return -1;
}

// Starts uploading ring unit ui unless it is there; `pinned` (the unit
// running and the ones prefetched for it) are not evicted.
static int ring_fetch(fl_dev_weights *w, int ui, const int *pinned, int n_pinned) {
    int b = ring_of(w, ui);
    if (b >= 0) return b;
    for (int i = 0; i < w->n_ring && b < 0; i++) {
        int keep = 0;
        for (int k = 0; k < n_pinned; k++) keep |= w->ring_unit[i] == pinned[k];
        if (!keep) b = i;
    }
    FL_ASSERT(b >= 0);
    if (w->ready[b]) w->dev->event_destroy(w->dev, w->ready[b]);
    w->ring_unit[b] = ui;
    w->ready[b] = upload(w, ui, w->ring[b]);
    return b;
}

static int next_unit(const fl_dev_weights *w, int ui, int pass) {
    for (;;) {
        ui += pass == FL_PASS_FWD ? 1 : -1;
        if (ui < 0 || ui >= w->y.n_units) return -1;
        if (!w->y.resident[ui] && w->y.hi[ui] > w->y.lo[ui]) return ui;
    }
}

static void drop_ring(fl_dev_weights *w) {
    for (int i = 0; i < w->n_ring; i++) w->ring_unit[i] = -2;
}

static void on_pre_unit(void *ctx, fl_model *m, int unit, int pass) {
    fl_dev_weights *w = ctx;
    // a forward pass after a backward one may follow an update: every copy is stale
    if (pass == FL_PASS_FWD && w->last_pass == FL_PASS_BWD && !w->frozen) {
        drop_ring(w);
        for (int u = 0; u < w->y.n_units; u++) w->valid[u] = 0;
    } else if (pass != w->last_pass && !w->reuse) {
        drop_ring(w); // no reuse: what the forward pass uploaded is not kept for the backward
    }
    w->last_pass = pass;
    progress(w);
    int ui = unit + 1, L = m->config.n_layer;
    // the tied LM head reads the embedding's weights
    int need[2] = {ui, m->config.tie_embeddings && unit == L ? 0 : -1};
    for (int k = 0; k < 2; k++) {
        int v = need[k];
        if (v < 0 || w->y.hi[v] == w->y.lo[v]) continue;
        void *buf;
        if (w->y.resident[v]) {
            if (!w->valid[v]) {
                if (w->own_ready[v]) w->dev->event_destroy(w->dev, w->own_ready[v]);
                w->own_ready[v] = upload(w, v, w->own[v]);
                w->valid[v] = 1;
            }
            await(w, w->own[v], &w->own_ready[v]);
            buf = w->own[v];
        } else {
            int pinned[64], np = 0; // the unit and up to depth < 64 more
            pinned[np++] = v;
            for (int u = v, i = 0; i < w->depth && (u = next_unit(w, u, pass)) >= 0; i++)
                pinned[np++] = u;
            int b = ring_fetch(w, v, pinned, np);
            await(w, w->ring[b], &w->ready[b]);
            buf = w->ring[b];
            for (int i = 1; i < np; i++) ring_fetch(w, pinned[i], pinned, np); // prefetch
        }
        fl_model_bind_params(m, v - 1, buf);
    }
    // the backward pass's last unit: the host may update its copy once the
    // uploads that read it are done
    if (pass == FL_PASS_BWD && unit == FL_UNIT_EMBED && !w->frozen) {
        fl_event *e = w->dev->event_record(w->dev, w->up);
        w->dev->event_sync(w->dev, e);
        w->dev->event_destroy(w->dev, e);
    }
    if (w->chained.pre_unit) w->chained.pre_unit(w->chained.ctx, m, unit, pass);
}

static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fl_dev_weights *w = ctx;
    if (w->chained.grad_ready) w->chained.grad_ready(w->chained.ctx, m, first, n);
}

fl_dev_weights *fl_dev_weights_attach(fl_model *m, void *host_params, fl_offload *store,
                                      const fl_zero_config *cfg, const fl_offload_config *oc) {
    const fl_device *d = m->dev;
    FL_ASSERT(!d->host && !m->params && !host_params != !store && !fl_model_sharded(m));
    fl_dev_weights *w = fl_alloc(FL_MEM_OTHER, sizeof *w);
    memset(w, 0, sizeof *w);
    w->m = m;
    w->dev = d;
    w->host = host_params;
    w->store = store;
    w->D = fl_dtype_size(m->dtype);
    fl_stage3_layout_init(&w->y, &m->table, m->config.n_layer, cfg);
    w->n_ring = ring_count(&w->y);
    w->depth = w->n_ring > 0 ? w->n_ring - 1 : 0;
    FL_ASSERT(w->depth < 64); // the layout's depth is under zero.c's 64 buffers
    // the device holds the residents and the ring (the whole weights were
    // built in pinned host memory, run.c)
    for (int r = 0; r < m->table.count; r++) m->wp[r] = NULL; // bound when uploaded
    size_t nu = (size_t)w->y.n_units, nr = (size_t)w->n_ring;
    w->own = fl_alloc(FL_MEM_OTHER, nu * sizeof(void *));
    w->valid = fl_alloc(FL_MEM_OTHER, nu * sizeof(int));
    w->own_ready = fl_alloc(FL_MEM_OTHER, nu * sizeof(fl_event *));
    for (int ui = 0; ui < w->y.n_units; ui++) {
        size_t n = w->y.hi[ui] - w->y.lo[ui];
        w->own[ui] = w->y.resident[ui] && n ? d->alloc(d, FL_MEM_PARAMS, n * w->D) : NULL;
        w->valid[ui] = 0;
        w->own_ready[ui] = NULL;
    }
    w->ring = fl_alloc(FL_MEM_OTHER, (nr ? nr : 1) * sizeof(void *));
    w->ring_unit = fl_alloc(FL_MEM_OTHER, (nr ? nr : 1) * sizeof(int));
    w->ready = fl_alloc(FL_MEM_OTHER, (nr ? nr : 1) * sizeof(fl_event *));
    for (size_t i = 0; i < nr; i++) {
        w->ring[i] = d->alloc(d, FL_MEM_PARAMS, w->y.ring_size * w->D);
        w->ring_unit[i] = -2;
        w->ready[i] = NULL;
    }
    if (store) { // the pinned staging buffers (offload_param.buffer_count, buffer_size)
        FL_ASSERT(oc->staging_count >= 1 && oc->staging_count <= FL_OFFLOAD_MAX_STAGING);
        const fl_device *pin = fl_device_pinned(d);
        w->n_stage = oc->staging_count;
        w->stage_numel = staging_numel(oc, &w->y);
        w->stage = fl_alloc(FL_MEM_OTHER, (size_t)w->n_stage * sizeof(staging));
        for (int i = 0; i < w->n_stage; i++)
            w->stage[i] = (staging){
                pin->alloc(pin, FL_MEM_OFFLOAD, w->stage_numel * w->D), -1, NULL, NULL, 0, NULL};
    }
    w->up = d->stream_create(d);
    w->reuse = cfg->max_reuse_distance > 0;
    w->frozen = 1;
    for (int r = 0; r < m->table.count; r++)
        w->frozen &= !!(m->table.views[r].flags & FL_PARAM_FROZEN);
    w->last_pass = FL_PASS_BWD; // the first forward pass uploads
    w->chained = m->hooks;
    m->hooks = (fl_model_hooks){on_pre_unit, on_grad_ready, w};
    return w;
}

void fl_dev_weights_free(fl_dev_weights *w) {
    if (!w) return;
    const fl_device *d = w->dev;
    for (int i = 0; i < w->n_stage; i++) retire(w, &w->stage[i]); // no read left in flight
    d->sync(d);
    for (int i = 0; i < w->n_ring; i++) {
        if (w->ready[i]) d->event_destroy(d, w->ready[i]);
        d->free(d, w->ring[i]);
    }
    for (int u = 0; u < w->y.n_units; u++) {
        if (w->own_ready[u]) d->event_destroy(d, w->own_ready[u]);
        d->free(d, w->own[u]);
    }
    const fl_device *pin = fl_device_pinned(d);
    for (int i = 0; i < w->n_stage; i++) pin->free(pin, w->stage[i].buf);
    fl_free(w->stage);
    d->stream_destroy(d, w->up);
    w->m->hooks = w->chained;
    for (int r = 0; r < w->m->table.count; r++) w->m->wp[r] = NULL;
    fl_stage3_layout_free(&w->y);
    fl_free(w->own);
    fl_free(w->valid);
    fl_free(w->own_ready);
    fl_free(w->ring);
    fl_free(w->ring_unit);
    fl_free(w->ready);
    fl_free(w);
}
