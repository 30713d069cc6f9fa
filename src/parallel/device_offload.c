// device_offload.c: ZeRO-Offload on one device. The model (its 16-bit or
// fp32 weights and activations) stays on the device; the optimizer (fp32
// master weights, state, fp32 gradient sum) lives in the device's pinned
// host memory and updates there with the cpu's vectorised rules
// (fl_device_pinned). Its params and grads are pinned host copies of the
// model's. The device holds no whole gradient (the model has none,
// FL_GRADS_HOOK): in the backward pass each unit's gradients live in a
// ring of two device buffers of the largest unit (the tied embedding's in
// one of its own, from the LM head to the embedding), bound before the unit
// runs; each goes down on a copy stream as soon as the backward pass
// reports it (grad_ready, ordered after the compute stream's work by an
// event), so the copies overlap the rest of the backward pass, and a buffer
// is reused once its copy is done. Accumulation keeps the cpu's arithmetic:
// 16-bit gradients are per micro-batch, summed on the host into the fp32
// sum a unit at a time as each download lands, while the backward pass
// goes on (or, with accumulate_on_device, into an fp32 sum on the device,
// which goes down once, after the last micro-batch); fp32 ones sum in the
// gradients themselves, so a unit's sum so far goes up into its buffer and
// the backward adds to it there, as the cpu's adds in place (DeepSpeed's
// async_accumulate_grad_in_cpu_via_gpu), or with accumulate_on_device the
// units' gradients are the device's sum, which the backward adds to in
// place and which goes down once (no ring, no round trip). After
// the last micro-batch the step reads the whole gradient on the host (the
// global norm, clipping and fp16's overflow check need all of it first),
// updates there, and the new weights go up. Without clipping, fp16 or the
// spike guard no whole gradient is needed: the host updates each unit of
// the last micro-batch as soon as its gradient is down
// (fl_optimizer_begin_overlap), during the backward pass of the units
// before it. The host runs the plain path's arithmetic on the same values:
// bitwise the cpu's run.
//
// The delayed update (offload_optimizer.delayed_update, the ZeRO-Offload
// paper's DPU; fl_optimizer_delays): a step's update is begun, not run, and
// the device goes on with the next step at once, with the weights it has.
// The step's gradient (its fp32 sum under 16-bit accumulation, else the
// gradients) stays in its buffer, and the next step's go to a second one
// (the two swap at each delayed step). The host runs the update in slices
// during the next step, at each point the model reports (a unit about to
// run, a unit's gradient ready), while the device runs the work queued
// before it: rows from the last to the first, as many as keep its share
// of the step even (the points counted in the step before). In the last
// micro-batch, as each unit's gradient is ready, the device is done with
// its old weights: its rows are updated now if they are not yet, and its
// new weights go up. The weights a step computes with are thus one update
// old, every other value is the plain step's; fl_dev_offload_flush runs a
// pending update whole (before a checkpoint, an evaluation or the end).
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

enum { RING = 2 }; // gradient buffers: one written by the backward pass, one going down

struct fl_dev_offload {
    fl_model *m;
    fl_optimizer *o;
    const fl_device *dev;
    fl_stream *down;   // device-to-host copies of the gradients
    fl_stream *up;     // host-to-device copies of the updated weights
    fl_event *up_done; // the last step's weights are up (NULL: none in flight)
    size_t down_bytes; // gradient bytes this backward pass sent down
    // the unit whose gradient is on its way down, taken by the host when the
    // next is reported (or at the end): added into the fp32 sum (16-bit
    // gradients under accumulation; written by micro-batch 0's), or under
    // the overlapped step (fl_optimizer_begin_overlap) updated
    fl_event *pending;
    int pending_first, pending_n, pending_micro;
    int pending_update;     // an overlapped step's unit (else a sum; a micro-batch's taken
                            // late, in the next one, is a sum)
    void *params, *grads;   // the pinned host copies (the optimizer's params and grads)
    fl_optim_offload hooks; // the optimizer's calls back
    // the gradient ring: RING buffers of the largest unit, then the tied
    // embedding's (NULL untied); each one's last download (NULL: none in flight)
    void *slot[RING + 1];
    fl_event *slot_free[RING + 1];
    int tied; // the LM head's gradient is the embedding's (bound at the head)
    int next_slot;
    int *unit_slot; // per unit + 1: the buffer its gradients are bound to
    // the delayed update: the other gradient buffer (see above), the points
    // the model reported in this step and the last, and the next row to
    // update (from the last down: the rows above it are done)
    void *spare;
    const fl_device *spare_dev; // its memory's (the host's, or pinned)
    int points, points_last, next_row;
    // accumulate_on_device: the pinned fp32 sums this offload allocated
    // (the optimizer's and the delayed update's second one; else NULL)
    void *sums[2];
    // accumulate_on_device: the fp32 gradient sum on the device (else NULL);
    // fp32 gradients are bound to it in place (no ring)
    float *dsum;
    int in_place;
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

// the optimizer zeroes the host's gradients, a micro-batch begins (the
// device's are zeroed unit by unit in the ring): the step's timer starts,
// and the wait for the host's accumulation of the last one ends
static void on_zero_grad(void *ctx) {
    fl_dev_offload *f = ctx;
    if (f->o->micro == 0) { // a step begins: the points the model reports in it
        f->points_last = f->points;
        f->points = 0;
    }
    if (!f->start) f->start = f->dev->event_record_timed(f->dev, NULL);
    wait_end(f); // a micro-batch's accumulation on the host is done
}

// Gradient elements of the ring's buffers and of the tied embedding's.
static void ring_sizes(const fl_param_table *t, int tied, size_t *unit, size_t *embed) {
    *unit = *embed = 0;
    for (int r = 0, u0 = 0; r < t->count; r = u0) {
        size_t n = 0;
        for (u0 = r; u0 < t->count && t->views[u0].unit == t->views[r].unit; u0++)
            n += t->views[u0].numel;
        if (tied && t->views[r].unit == FL_UNIT_EMBED)
            *embed = n;
        else if (n > *unit)
            *unit = n;
    }
}

size_t fl_dev_offload_grad_bytes(const fl_param_table *t, int tie_embeddings, fl_dtype dt) {
    size_t unit, embed;
    ring_sizes(t, tie_embeddings, &unit, &embed);
    return (RING * unit + embed) * fl_dtype_size(dt);
}

// The device's gradients of `unit` into buffer s, once its last download
// is done: zeroed, or under fp32 accumulation (the cpu sums micro-batches
// in the gradients) after the first micro-batch the host's sum so far,
// which the backward adds to as the cpu's does in place. Under fp32
// accumulate_on_device the unit's part of the device's sum instead, zeroed
// in the first micro-batch and then added to in place.
static void bind_slot(fl_dev_offload *f, int unit, int s) {
    const fl_device *d = f->dev;
    int first, count;
    fl_model_unit_rows(f->m, unit, &first, &count);
    if (!count) return;
    const fl_param_view *a = &f->m->table.views[first], *b = &f->m->table.views[first + count - 1];
    size_t es = fl_dtype_size(f->m->dtype), lo = a->offset * es,
           bytes = (b->offset + b->numel) * es - lo;
    if (f->in_place) {
        if (f->o->micro == 0) d->zero(d, f->dsum + a->offset, bytes);
        fl_model_bind_grads(f->m, unit, f->dsum + a->offset);
        return;
    }
    if (f->slot_free[s]) {
        d->stream_wait(d, NULL, f->slot_free[s]);
        d->event_destroy(d, f->slot_free[s]);
        f->slot_free[s] = NULL;
    }
    if (f->o->micro > 0 && !f->o->grad_accum)
        d->copy_async(d, f->slot[s], (const char *)f->grads + lo, bytes, FL_COPY_H2D, NULL);
    else
        d->zero(d, f->slot[s], bytes);
    fl_model_bind_grads(f->m, unit, f->slot[s]);
    f->unit_slot[unit + 1] = s;
}

// the host copy of the weights is free to change once its upload is done
static void wait_up(fl_dev_offload *f) {
    if (!f->up_done) return;
    f->dev->event_sync(f->dev, f->up_done);
    f->dev->event_destroy(f->dev, f->up_done);
    f->up_done = NULL;
}

// The delayed update's rows from the next one down to `row`, while the
// device runs the work queued before this point.
static void delayed_down_to(fl_dev_offload *f, int row) {
    if (f->next_row < row) return;
    wait_begin(f);
    wait_up(f); // the host copy of the weights is free to change
    fl_optimizer_delayed_rows(f->o, row, f->next_row + 1 - row);
    f->next_row = row - 1;
    wait_end(f);
}

// A point the model reports: the delayed update's rows down to this
// point's share of the step (its elements in proportion to the points so
// far of those the last step had).
static void delayed_slice(fl_dev_offload *f) {
    f->points++;
    if (!f->o->delayed || f->next_row < 0) return;
    const fl_param_table *t = &f->m->table;
    int expect = f->points_last > f->points ? f->points_last : f->points;
    double share = (double)t->numel * f->points / expect;
    // the rows from `row` on hold numel - views[row].offset elements: down to
    // the first row that reaches the share
    int row = f->next_row + 1;
    while (row > 0 && (row == t->count || (double)(t->numel - t->views[row].offset) < share)) row--;
    if (row <= f->next_row) delayed_down_to(f, row);
}

// before a unit's backward: its gradients into the next ring buffer (the
// tied LM head's the embedding's too, which the embedding's backward
// completes)
static void on_pre_unit(void *ctx, fl_model *m, int unit, int pass) {
    fl_dev_offload *f = ctx;
    delayed_slice(f);
    if (pass != FL_PASS_BWD) return;
    if (f->tied && unit == FL_UNIT_HEAD(m->config.n_layer)) bind_slot(f, FL_UNIT_EMBED, RING);
    if (f->tied && unit == FL_UNIT_EMBED) return; // bound at the head
    bind_slot(f, unit, f->next_slot);
    f->next_slot = (f->next_slot + 1) % RING;
}

// the pending unit's gradient (or its fp32 sum) has landed: the cpu sums
// it, or updates it (its new weights go up on the upload stream), while
// the device goes on with the backward pass of the units before it
static void take_pending(fl_dev_offload *f) {
    if (!f->pending) return;
    f->dev->event_sync(f->dev, f->pending);
    f->dev->event_destroy(f->dev, f->pending);
    f->pending = NULL;
    fl_optimizer *o = f->o;
    if (f->pending_update) {
        wait_up(f);
        fl_optimizer_update_unit(o, f->pending_first, f->pending_n);
        return;
    }
    // the plain step's sum (fl_optimizer_micro_done), a unit at a time
    fl_optimizer_accum_rows(o, f->pending_first, f->pending_n, f->pending_micro == 0);
}

// rows [first, first + n) are complete on the compute stream: send them down
static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fl_dev_offload *f = ctx;
    const fl_device *d = f->dev;
    const fl_param_view *a = &m->table.views[first], *b = &m->table.views[first + n - 1];
    size_t es = fl_dtype_size(m->dtype), lo = a->offset * es,
           bytes = (b->offset + b->numel) * es - lo;
    fl_optimizer *o = f->o;
    delayed_slice(f);
    int last = o->micro == o->cfg.grad_accum - 1;
    // the step is done with these rows' weights: the new ones (units report
    // from the last row down)
    if (o->delayed && last) delayed_down_to(f, first);
    size_t count = b->offset + b->numel - a->offset;
    if (f->dsum && !f->in_place) { // into the fp32 sum on the device, the cpu's arithmetic
                                   // (0 + g, then + g)
        float *sum = f->dsum + a->offset;
        if (o->micro == 0)
            d->convert(FL_F32, sum, m->dtype, m->gp[first], count);
        else
            d->accumulate(sum, m->dtype, m->gp[first], count);
    }
    fl_event *e = d->event_record(d, NULL);
    d->stream_wait(d, f->down, e);
    if (o->delayed && last) {
        d->stream_wait(d, f->up, e);
        d->copy_async(d, (char *)m->params + lo, (const char *)f->params + lo, bytes, FL_COPY_H2D,
                      f->up);
    }
    d->event_destroy(d, e);
    f->down_bytes += bytes;
    if (f->dsum) { // the sum goes down after the last micro-batch (fp32: into the gradients);
                   // the ring buffer is free once the kernel above has read it (the compute
                   // stream's order)
        if (!last) return;
        float *into = f->in_place ? (float *)f->grads : o->grad_accum;
        d->copy_async(d, into + a->offset, f->dsum + a->offset, count * sizeof(float), FL_COPY_D2H,
                      f->down);
        if (!o->overlap_sq) return;
    } else {
        d->copy_async(d, (char *)f->grads + lo, m->gp[first], bytes, FL_COPY_D2H, f->down);
        // its buffer is free for another unit once the copy is done
        int s = f->unit_slot[a->unit + 1];
        FL_ASSERT(!f->slot_free[s]);
        f->slot_free[s] = d->event_record(d, f->down);
        if (!o->overlap_sq && !o->grad_accum) return;
    }
    if (f->pending) { // one unit behind: its download ran beside this unit's backward
        wait_begin(f);
        take_pending(f);
        wait_end(f);
    }
    f->pending = d->event_record(d, f->down);
    f->pending_first = first;
    f->pending_n = n;
    f->pending_micro = o->micro; // (fl_optimizer_micro_done counts it after)
    f->pending_update = o->overlap_sq != NULL;
}

static void on_grads_down(void *ctx) {
    fl_dev_offload *f = ctx;
    const fl_device *d = f->dev;
    // every unit reported its gradient: the device holds none besides
    FL_ASSERT(f->down_bytes == f->m->table.numel * fl_dtype_size(f->m->dtype));
    if (f->in_place && f->o->micro < f->o->cfg.grad_accum) { // the sum stays on the device
        f->down_bytes = 0;
        return;
    }
    if (f->o->grad_accum && f->o->micro < f->o->cfg.grad_accum) {
        // 16-bit gradients with a micro-batch to come: the device goes on
        // with its forward pass while the last unit's download lands; the
        // host sums it when the next backward reports its first unit (the
        // embedding's, the largest, no longer idles the device between
        // micro-batches), before anything overwrites it. The ring's buffers
        // are reused after their downloads by their events, on the device.
        f->down_bytes = 0;
        f->next_slot = 0;
        return;
    }
    wait_begin(f); // until the next micro-batch's zero_grad, or the uploads
    take_pending(f);
    // after the last micro-batch, the last step's delayed update: every
    // unit's rows updated and sent up
    if (f->o->delayed && f->o->micro == f->o->cfg.grad_accum) {
        FL_ASSERT(f->next_row < 0);
        fl_optimizer_delayed_end(f->o);
    }
    wait_up(f); // long done: the backward pass ran after it
    fl_event *e = d->event_record(d, f->down);
    d->event_sync(d, e);
    d->event_destroy(d, e);
    for (int s = 0; s <= RING; s++) { // every download is done
        if (f->slot_free[s]) d->event_destroy(d, f->slot_free[s]);
        f->slot_free[s] = NULL;
    }
    f->down_bytes = 0;
    f->next_slot = 0;
    // fp32 sums on the device from the host's sum so far (uploaded at each
    // unit): the next micro-batch follows at once
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
    // (a delayed update's uploads, issued in the backward pass, were not
    // waited for: the new event, later on the same stream, stands for them)
    if (f->up_done) f->dev->event_destroy(f->dev, f->up_done);
    f->up_done = f->dev->event_record(f->dev, f->up);
    fl_optimizer *o = f->o;
    if (o->delayed) { // begun: it reads this buffer, the next step writes the other
        if (o->grad_accum) {
            float *sum = o->grad_accum;
            o->grad_accum = f->spare;
            f->spare = sum;
        } else {
            void *g = o->grads;
            o->grads = f->grads = f->spare;
            f->spare = g;
        }
        f->next_row = f->m->table.count - 1;
    }
    f->dev->stream_wait(f->dev, NULL, f->up_done);
    if (f->start) step_timed(f);
}

void fl_dev_offload_flush(fl_dev_offload *f) {
    if (!f || !f->o->delayed) return;
    const fl_device *d = f->dev;
    wait_up(f);
    fl_optimizer_delayed_rows(f->o, 0, f->next_row + 1); // (a flush is no step: not timed)
    f->next_row = -1;
    fl_optimizer_delayed_end(f->o);
    fl_event *e = d->event_record(d, NULL); // after the kernels that read the old weights
    d->stream_wait(d, f->up, e);
    d->event_destroy(d, e);
    d->copy_async(d, f->m->params, f->params, f->m->table.numel * fl_dtype_size(f->m->dtype),
                  FL_COPY_H2D, f->up);
    on_updated(f); // the next forward pass waits for it (no step is timed here)
}

void fl_dev_offload_waits_get(const fl_dev_offload *f, fl_dev_offload_waits *w) {
    *w = f->timed;
}

void fl_dev_offload_optimizer_init(fl_optimizer *o, const fl_optimizer_config *cfg,
                                   const fl_param_table *t, fl_dtype dt, void *params, void *grads,
                                   const fl_device *d) {
    // the optimizer's state never crosses to the device: host memory, pinned
    // only when offload_optimizer.pin_memory asks
    fl_device_use(cfg->pin_memory ? fl_device_pinned(d) : NULL);
    fl_optimizer_init(o, cfg, t, dt, params, grads);
    fl_device_use(d);
}

fl_dev_offload *fl_dev_offload_init(fl_model *m, fl_optimizer *o, const fl_optimizer_config *cfg,
                                    void *host_params) {
    const fl_device *d = m->dev;
    FL_ASSERT(!d->host && !m->params != !host_params && !m->grads && !m->unit_grads &&
              !fl_model_sharded(m));
    fl_dev_offload *f = fl_alloc(FL_MEM_OTHER, sizeof *f);
    memset(f, 0, sizeof *f);
    f->m = m;
    f->o = o;
    f->dev = d;
    size_t bytes = m->table.numel * fl_dtype_size(m->dtype);
    const fl_device *pin = fl_device_pinned(d);
    // weight offload: the weights built in pinned memory are the host copy;
    // with the fp32 sum made on the device only the sum comes down (into the
    // optimizer's), so there is no host copy of 16-bit gradients (fp32 ones
    // are the sum: it comes down into them)
    int sum16 = cfg->accumulate_on_device && m->dtype != FL_F32;
    f->in_place = cfg->accumulate_on_device && !sum16;
    void *params = host_params ? host_params : pin->alloc(pin, FL_MEM_PARAMS, bytes),
         *grads = sum16 ? NULL : pin->alloc(pin, FL_MEM_GRADS, bytes);
    f->params = params;
    f->grads = grads;
    if (!host_params) fl_dev_download(d, params, m->params, bytes);
    fl_dev_offload_optimizer_init(o, cfg, &m->table, m->dtype, params, grads, d);
    size_t sum_bytes = m->table.numel * sizeof(float);
    if (sum16) // the device's sum is downloaded into it
        o->grad_accum = f->sums[0] = pin->alloc(pin, FL_MEM_GRADS, sum_bytes);
    // the delayed update: a second buffer of what the update reads, of the
    // same memory (the two swap)
    f->spare_dev = o->grad_accum && !sum16 ? o->dev : pin;
    if (cfg->delayed_update)
        f->spare =
            f->spare_dev->alloc(f->spare_dev, FL_MEM_GRADS, o->grad_accum ? sum_bytes : bytes);
    if (sum16) f->sums[1] = f->spare;
    size_t unit, embed, es = fl_dtype_size(m->dtype);
    ring_sizes(&m->table, m->config.tie_embeddings, &unit, &embed);
    for (int s = 0; s < RING && !f->in_place; s++)
        f->slot[s] = d->alloc(d, FL_MEM_GRADS, unit * es);
    if (cfg->accumulate_on_device) {
        FL_ASSERT(o->grad_accum || f->in_place);
        f->dsum = d->alloc(d, FL_MEM_GRADS, sum_bytes);
    }
    f->tied = embed != 0;
    f->slot[RING] = embed && !f->in_place ? d->alloc(d, FL_MEM_GRADS, embed * es) : NULL;
    f->unit_slot = fl_alloc(FL_MEM_OTHER, ((size_t)m->config.n_layer + 2) * sizeof(int));
    f->down = d->stream_create(d);
    f->up = d->stream_create(d);
    // eight groups a step (at least 64 Ki elements each): the upload of one
    // overlaps the update of the next
    size_t chunk = m->table.numel / 8 > (1u << 16) ? m->table.numel / 8 : (1u << 16);
    f->hooks =
        (fl_optim_offload){f, on_zero_grad, on_grads_down, on_rows_updated, on_updated, chunk, 1};
    o->offload = &f->hooks;
    m->hooks = (fl_model_hooks){on_pre_unit, on_grad_ready, f};
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
    for (int s = 0; s <= RING; s++) {
        if (f->slot_free[s]) f->dev->event_destroy(f->dev, f->slot_free[s]);
        f->dev->free(f->dev, f->slot[s]);
    }
    f->dev->free(f->dev, f->dsum);
    for (int u = FL_UNIT_EMBED; u <= f->m->config.n_layer; u++) fl_model_bind_grads(f->m, u, NULL);
    fl_free(f->unit_slot);
    if (f->params) pin->free(pin, f->params); // (NVMe weight offload: dropped)
    if (f->sums[0]) { // accumulate_on_device: both sums are this offload's, however swapped
        pin->free(pin, f->sums[0]);
        pin->free(pin, f->sums[1]);
    } else { // the spare swaps with the optimizer's buffer, which it frees
        f->spare_dev->free(f->spare_dev, f->spare);
        pin->free(pin, f->grads);
    }
    fl_free(f);
}
