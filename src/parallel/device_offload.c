// device_offload.c: ZeRO-Offload on one device. The model (its 16-bit or
// fp32 weights, gradients and activations) stays on the device; the
// optimizer (fp32 master weights, state, fp32 gradient sum) lives in the
// device's pinned host memory and updates there with the cpu's vectorised
// rules (fl_device_pinned). Its params and grads are pinned host copies of
// the model's: each unit's gradient goes down on a copy stream as soon as
// the backward pass reports it (grad_ready, ordered after the compute
// stream's work by an event), so the copies overlap the rest of the
// backward pass; after the last micro-batch the step reads the whole
// gradient (the global norm, clipping and fp16's overflow check need all of
// it first), updates on the host, and the new weights go up. Without
// clipping, fp16 or the spike guard no whole gradient is needed: the host
// updates each unit of the last micro-batch as soon as its gradient is down
// (fl_optimizer_begin_overlap), during the backward pass of the units before
// it. The host runs the plain path's arithmetic on the same values: bitwise
// the cpu's run.
//
// The share of the step the device waits on the host (fl_dev_offload_waits_get)
// is timed on the compute stream (event_record_timed): a step runs from its
// first zero_grad to the event after the uploads the next forward pass
// waits for; a wait, from where the host starts work the device then waits
// for (the gradients' downloads, the update, the uploads) to where it next
// gives the device work. Two timed events with nothing queued between them
// are the stream's idle time: zero when the device still had work queued.
#include <string.h>

#include "fitlm/device.h"
#include "fitlm/model.h"
#include "fitlm/offload.h"

struct fl_dev_offload {
    fl_model *m;
    fl_optimizer *o;
    const fl_device *dev;
    fl_stream *down;   // device-to-host copies of the gradients
    fl_stream *up;     // host-to-device copies of the updated weights
    fl_event *up_done; // the last step's weights are up (NULL: none in flight)
    size_t down_bytes; // gradient bytes this backward pass sent down
    // overlapped step (fl_optimizer_begin_overlap): the unit whose gradient
    // is on its way down, updated when the next is reported (or at the end)
    fl_event *pending;
    int pending_first, pending_n;
    void *params, *grads;   // the pinned host copies (the optimizer's params and grads)
    fl_optim_offload hooks; // the optimizer's calls back
    // timing: the step's start, the open wait's start, and the step's waits
    // as pairs (idle, resumed), read once the step's uploads are done
    fl_event *start, *idle, **waits;
    size_t n_waits, cap_waits;
    fl_dev_offload_waits timed;
};

// the host starts work the device will wait for
static void wait_begin(fl_dev_offload *f) {
    if (!f->idle) f->idle = f->dev->event_record_timed(f->dev, NULL);
}

// the host gives the device work again
static void wait_end(fl_dev_offload *f) {
    if (!f->idle) return;
    f->waits = fl_reserve(FL_MEM_OTHER, f->waits, &f->cap_waits, f->n_waits, f->n_waits + 2,
                          sizeof *f->waits);
    f->waits[f->n_waits++] = f->idle;
    f->waits[f->n_waits++] = f->dev->event_record_timed(f->dev, NULL);
    f->idle = NULL;
}

// the step's end (after the uploads): its time and its waits, the open
// one (since the gradients came down) ending here
static void step_timed(fl_dev_offload *f) {
    const fl_device *d = f->dev;
    fl_event *end = d->event_record_timed(d, NULL);
    double wait = f->idle ? d->event_elapsed_ms(d, f->idle, end) : 0.0; // waits for all
    for (size_t i = 0; i < f->n_waits; i += 2)
        wait += d->event_elapsed_ms(d, f->waits[i], f->waits[i + 1]);
    f->timed.wait_ms += wait;
    f->timed.step_ms += d->event_elapsed_ms(d, f->start, end);
    f->timed.steps++;
    for (size_t i = 0; i < f->n_waits; i++) d->event_destroy(d, f->waits[i]);
    d->event_destroy(d, f->idle);
    d->event_destroy(d, f->start);
    d->event_destroy(d, end);
    f->n_waits = 0;
    f->idle = f->start = NULL;
}

static void on_zero_grad(void *ctx) {
    fl_dev_offload *f = ctx;
    if (!f->start) f->start = f->dev->event_record_timed(f->dev, NULL);
    wait_end(f); // a micro-batch's accumulation on the host is done
    f->dev->zero(f->dev, f->m->grads, f->m->table.numel * fl_dtype_size(f->m->dtype));
}

// the host copy of the weights is free to change once its upload is done
static void wait_up(fl_dev_offload *f) {
    if (!f->up_done) return;
    f->dev->event_sync(f->dev, f->up_done);
    f->dev->event_destroy(f->dev, f->up_done);
    f->up_done = NULL;
}

// the pending unit's gradient has landed: the cpu updates it (its new
// weights go up on the upload stream) while the device goes on with the
// backward pass of the units before it
static void update_pending(fl_dev_offload *f) {
    if (!f->pending) return;
    wait_up(f);
    f->dev->event_sync(f->dev, f->pending);
    f->dev->event_destroy(f->dev, f->pending);
    f->pending = NULL;
    fl_optimizer_update_unit(f->o, f->pending_first, f->pending_n);
}

// rows [first, first + n) are complete on the compute stream: send them down
static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fl_dev_offload *f = ctx;
    const fl_device *d = f->dev;
    const fl_param_view *a = &m->table.views[first], *b = &m->table.views[first + n - 1];
    size_t es = fl_dtype_size(m->dtype), lo = a->offset * es,
           bytes = (b->offset + b->numel) * es - lo;
    fl_event *e = d->event_record(d, NULL);
    d->stream_wait(d, f->down, e);
    d->event_destroy(d, e);
    d->copy_async(d, (char *)f->grads + lo, (const char *)m->grads + lo, bytes, FL_COPY_D2H,
                  f->down);
    f->down_bytes += bytes;
    if (!f->o->overlap_sq) return;
    if (f->pending) { // one unit behind: its download ran beside this unit's backward
        wait_begin(f);
        update_pending(f);
        wait_end(f);
    }
    f->pending = d->event_record(d, f->down);
    f->pending_first = first;
    f->pending_n = n;
}

static void on_grads_down(void *ctx) {
    fl_dev_offload *f = ctx;
    const fl_device *d = f->dev;
    wait_begin(f); // until the next micro-batch's zero_grad, or the uploads
    update_pending(f);
    wait_up(f); // long done: the backward pass ran after it
    size_t all = f->m->table.numel * fl_dtype_size(f->m->dtype);
    fl_event *e = d->event_record(d, f->down);
    d->event_sync(d, e);
    d->event_destroy(d, e);
    // a backward pass that reported only some units (none, or not all):
    // the whole gradient, after the compute stream's work
    if (f->down_bytes != all) fl_dev_download(d, f->grads, f->m->grads, all);
    f->down_bytes = 0;
    // fp32 accumulates on the device: the next micro-batch follows at once
    if (!f->o->grad_accum && f->o->micro < f->o->cfg.grad_accum) wait_end(f);
}

void fl_dev_offload_upload(fl_dev_offload *f) {
    if (!f->m->params) return; // weight offload: each unit goes up before it runs
    fl_dev_upload(f->dev, f->m->params, f->params, f->m->table.numel * fl_dtype_size(f->m->dtype));
}

// a group's new weights go up on the upload stream while the cpu updates the next
static void on_rows_updated(void *ctx, size_t first, size_t end) {
    fl_dev_offload *f = ctx;
    if (!f->m->params) return; // weight offload: each unit goes up before it runs
    size_t es = fl_dtype_size(f->m->dtype);
    f->dev->copy_async(f->dev, (char *)f->m->params + first * es,
                       (const char *)f->params + first * es, (end - first) * es, FL_COPY_H2D,
                       f->up);
}

// the next forward pass (compute stream) runs after the uploads
// (timed: the host waits for the uploads here, where the device must wait
// for them anyway; the next forward's first kernels follow a few
// microseconds later than they might)
static void on_updated(void *ctx) {
    fl_dev_offload *f = ctx;
    f->up_done = f->dev->event_record(f->dev, f->up);
    f->dev->stream_wait(f->dev, NULL, f->up_done);
    if (f->start) step_timed(f);
}

void fl_dev_offload_waits_get(const fl_dev_offload *f, fl_dev_offload_waits *w) {
    *w = f->timed;
}

fl_dev_offload *fl_dev_offload_init(fl_model *m, fl_optimizer *o, const fl_optimizer_config *cfg,
                                    void *host_params) {
    const fl_device *d = m->dev;
    FL_ASSERT(!d->host && !m->params != !host_params && m->grads && !fl_model_sharded(m));
    fl_dev_offload *f = fl_alloc(FL_MEM_OTHER, sizeof *f);
    f->m = m;
    f->o = o;
    f->dev = d;
    size_t bytes = m->table.numel * fl_dtype_size(m->dtype);
    const fl_device *pin = fl_device_pinned(d);
    // weight offload: the weights built in pinned memory are the host copy
    void *params = host_params ? host_params : pin->alloc(pin, FL_MEM_PARAMS, bytes),
         *grads = pin->alloc(pin, FL_MEM_GRADS, bytes);
    f->params = params;
    f->grads = grads;
    if (!host_params) fl_dev_download(d, params, m->params, bytes);
    fl_device_use(pin); // the optimizer's memory is pinned host memory
    fl_optimizer_init(o, cfg, &m->table, m->dtype, params, grads);
    fl_device_use(d);
    f->down = d->stream_create(d);
    f->up = d->stream_create(d);
    // eight groups a step (at least 64 Ki elements each): the upload of one
    // overlaps the update of the next
    size_t chunk = m->table.numel / 8 > (1u << 16) ? m->table.numel / 8 : (1u << 16);
    f->hooks =
        (fl_optim_offload){f, on_zero_grad, on_grads_down, on_rows_updated, on_updated, chunk};
    o->offload = &f->hooks;
    m->hooks = (fl_model_hooks){NULL, on_grad_ready, f};
    return f;
}

void fl_dev_offload_drop_params(fl_dev_offload *f) {
    const fl_device *pin = fl_device_pinned(f->dev);
    FL_ASSERT(!f->m->params && f->o->params == f->params);
    pin->free(pin, f->params);
    f->params = f->o->params = NULL; // the pager binds a chunk's at a time
}

void fl_dev_offload_free(fl_dev_offload *f) {
    if (!f) return;
    const fl_device *pin = fl_device_pinned(f->dev);
    f->dev->sync(f->dev);
    wait_up(f);
    for (size_t i = 0; i < f->n_waits; i++) f->dev->event_destroy(f->dev, f->waits[i]);
    f->dev->event_destroy(f->dev, f->idle);
    f->dev->event_destroy(f->dev, f->start);
    fl_free(f->waits);
    f->dev->stream_destroy(f->dev, f->down);
    f->dev->stream_destroy(f->dev, f->up);
    f->m->hooks = (fl_model_hooks){0};
    if (f->params) pin->free(pin, f->params); // (NVMe weight offload: dropped)
    pin->free(pin, f->grads);
    fl_free(f);
}
