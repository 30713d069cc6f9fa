// device_weights.c: weight offload on one device (ZeRO-3 with
// offload_param.device cpu under ZeRO-Offload). The whole 16-bit weights
// live in the optimizer's pinned host copy (device_offload.c); the device
// holds the resident units (the embedding and the units under the stage-3
// persistence thresholds) and a ring of buffers for the others, laid out as
// zero.c's stage 3 (fl_stage3_layout). In the model's pre_unit hook a unit's
// weights go up on an upload stream (the compute stream waits by event) and
// the next units of the pass are prefetched into the ring, as zero.c gathers
// them, the all-gather being an H2D copy; a ring unit is dropped when its
// buffer is needed (or at a change of pass without stage3_max_reuse_distance).
// The host updates its copy after the backward pass; the next forward pass
// uploads again. The arithmetic is the plain path's: bitwise its run.
#include <string.h>

#include "fitlm/device.h"
#include "fitlm/dist.h"
#include "fitlm/model.h"
#include "fitlm/offload.h"

struct fl_dev_weights {
    fl_model *m;
    const fl_device *dev;
    const char *host; // the pinned host copy of the whole weights
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
    fl_model_hooks chained; // device_offload.c's grad_ready
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

// Unit ui's weights up into buf, after the compute stream's work issued so
// far (which may still read the buffer's previous unit); returns the
// upload's event.
static fl_event *upload(fl_dev_weights *w, int ui, void *buf) {
    const fl_device *d = w->dev;
    fl_event *e = d->event_record(d, NULL);
    d->stream_wait(d, w->up, e);
    d->event_destroy(d, e);
    d->copy_async(d, buf, w->host + w->y.lo[ui] * w->D, (w->y.hi[ui] - w->y.lo[ui]) * w->D,
                  FL_COPY_H2D, w->up);
    return d->event_record(d, w->up);
}

// the compute stream waits for an upload (once)
static void use(fl_dev_weights *w, fl_event **e) {
    if (!*e) return;
    w->dev->stream_wait(w->dev, NULL, *e);
    w->dev->event_destroy(w->dev, *e);
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
    if (pass == FL_PASS_FWD && w->last_pass == FL_PASS_BWD) {
        drop_ring(w);
        for (int u = 0; u < w->y.n_units; u++) w->valid[u] = 0;
    } else if (pass != w->last_pass && !w->reuse) {
        drop_ring(w); // no reuse: what the forward pass uploaded is not kept for the backward
    }
    w->last_pass = pass;
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
            use(w, &w->own_ready[v]);
            buf = w->own[v];
        } else {
            int pinned[64], np = 0; // the unit and up to depth < 64 more
            pinned[np++] = v;
            for (int u = v, i = 0; i < w->depth && (u = next_unit(w, u, pass)) >= 0; i++)
                pinned[np++] = u;
            int b = ring_fetch(w, v, pinned, np);
            use(w, &w->ready[b]);
            buf = w->ring[b];
            for (int i = 1; i < np; i++) ring_fetch(w, pinned[i], pinned, np); // prefetch
        }
        fl_model_bind_params(m, v - 1, buf);
    }
    // the backward pass's last unit: the host may update its copy once the
    // uploads that read it are done
    if (pass == FL_PASS_BWD && unit == FL_UNIT_EMBED) {
        fl_event *e = w->dev->event_record(w->dev, w->up);
        w->dev->event_sync(w->dev, e);
        w->dev->event_destroy(w->dev, e);
    }
}

static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fl_dev_weights *w = ctx;
    if (w->chained.grad_ready) w->chained.grad_ready(w->chained.ctx, m, first, n);
}

fl_dev_weights *fl_dev_weights_attach(fl_model *m, void *host_params, const fl_zero_config *cfg) {
    const fl_device *d = m->dev;
    FL_ASSERT(!d->host && m->params && host_params && !fl_model_sharded(m));
    fl_dev_weights *w = fl_alloc(FL_MEM_OTHER, sizeof *w);
    memset(w, 0, sizeof *w);
    w->m = m;
    w->dev = d;
    w->host = host_params;
    w->D = fl_dtype_size(m->dtype);
    fl_stage3_layout_init(&w->y, &m->table, m->config.n_layer, cfg);
    w->n_ring = ring_count(&w->y);
    w->depth = w->n_ring > 0 ? w->n_ring - 1 : 0;
    FL_ASSERT(w->depth < 64); // the layout's depth is under zero.c's 64 buffers
    // the whole weights leave the device: its params are the ring and the residents
    d->free(d, m->params);
    m->params = NULL;
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
    w->up = d->stream_create(d);
    w->reuse = cfg->max_reuse_distance > 0;
    w->last_pass = FL_PASS_BWD; // the first forward pass uploads
    w->chained = m->hooks;
    m->hooks = (fl_model_hooks){on_pre_unit, on_grad_ready, w};
    return w;
}

void fl_dev_weights_free(fl_dev_weights *w) {
    if (!w) return;
    const fl_device *d = w->dev;
    d->sync(d);
    for (int i = 0; i < w->n_ring; i++) {
        if (w->ready[i]) d->event_destroy(d, w->ready[i]);
        d->free(d, w->ring[i]);
    }
    for (int u = 0; u < w->y.n_units; u++) {
        if (w->own_ready[u]) d->event_destroy(d, w->own_ready[u]);
        d->free(d, w->own[u]);
    }
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
