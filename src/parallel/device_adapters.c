// device_adapters.c: ZeRO-Offload of LoRA adapters on one device
// (offload_optimizer.device cpu under LoRA or QLoRA). The model, its frozen
// base and the adapters compute on the device; the adapters' optimizer
// (fp32 master weights, state, fp32 gradient sum) lives in host memory
// beside pinned copies of the adapters and their gradients, and updates
// there with the cpu's rules, as device_offload.c does for a whole model.
// The adapters are a few per cent of the model at most, so they move whole,
// with no ring and no overlap: after a micro-batch's backward pass their
// gradients come down (16-bit ones each micro-batch, summed into the fp32
// sum on the host as the cpu sums them; fp32 ones sum on the device in
// place, as the cpu's do, and come down after the last), the host steps,
// and the new adapters go up on the compute stream, ahead of the next
// forward pass. The host runs the plain path's arithmetic on the same
// values: bitwise the cpu's run.
#include "fitlm/device.h"
#include "fitlm/model.h"
#include "fitlm/offload.h"

struct fl_dev_adapters {
    fl_model *m;
    fl_optimizer *o;
    const fl_device *dev;
    void *params, *grads; // the pinned copies (the optimizer's params and grads)
    fl_optim_offload hooks;
};

static size_t adapter_bytes(const fl_dev_adapters *a) {
    return a->m->lora.table.numel * fl_dtype_size(a->m->dtype);
}

// a micro-batch begins whose gradients start from zero on the device
static void on_zero_grad(void *ctx) {
    fl_dev_adapters *a = ctx;
    a->dev->zero(a->dev, a->m->lora.grads, adapter_bytes(a));
}

// after a backward pass: 16-bit gradients come down into the host's copy
// and its fp32 sum; fp32 ones, the sum, after the last micro-batch
static void on_grads_down(void *ctx) {
    fl_dev_adapters *a = ctx;
    fl_optimizer *o = a->o;
    if (!o->grad_accum && o->micro < o->cfg.grad_accum) return;
    fl_dev_download(a->dev, a->grads, a->m->lora.grads, adapter_bytes(a));
    if (o->grad_accum) fl_optimizer_accum_rows(o, 0, o->table->count, o->micro == 1);
}

// updated rows go up, ahead of the next forward pass on the same stream
// (the host writes the copy again only after the next backward pass,
// whose download waits for it)
static void on_rows_updated(void *ctx, size_t first, size_t end) {
    fl_dev_adapters *a = ctx;
    size_t es = fl_dtype_size(a->m->dtype);
    a->dev->copy_async(a->dev, (char *)a->m->lora.params + first * es,
                       (const char *)a->params + first * es, (end - first) * es, FL_COPY_H2D, NULL);
}

fl_dev_adapters *fl_dev_adapters_init(fl_model *m, fl_optimizer *o,
                                      const fl_optimizer_config *cfg) {
    const fl_device *d = m->dev, *pin = fl_device_pinned(d);
    FL_ASSERT(!d->host && m->lora.cfg.r && m->lora.grads && !cfg->delayed_update &&
              !cfg->accumulate_on_device);
    fl_dev_adapters *a = fl_alloc(FL_MEM_OTHER, sizeof *a);
    a->m = m;
    a->o = o;
    a->dev = d;
    size_t bytes = adapter_bytes(a);
    a->params = pin->alloc(pin, FL_MEM_PARAMS, bytes);
    a->grads = pin->alloc(pin, FL_MEM_GRADS, bytes);
    fl_dev_download(d, a->params, m->lora.params, bytes);
    fl_dev_offload_optimizer_init(o, cfg, &m->lora.table, m->dtype, a->params, a->grads, d);
    // one group, the whole table, going up at once; no unit's gradient
    // comes down alone (per_unit 0: the step never overlaps the backward)
    a->hooks = (fl_optim_offload){.ctx = a,
                                  .zero_grad = on_zero_grad,
                                  .grads_down = on_grads_down,
                                  .rows_updated = on_rows_updated,
                                  .chunk = m->lora.table.numel};
    o->offload = &a->hooks;
    return a;
}

void fl_dev_adapters_upload(fl_dev_adapters *a) {
    fl_dev_upload(a->dev, a->m->lora.params, a->params, adapter_bytes(a));
}

void fl_dev_adapters_free(fl_dev_adapters *a) {
    if (!a) return;
    const fl_device *pin = fl_device_pinned(a->dev);
    a->dev->sync(a->dev); // the last uploads read the pinned copy
    pin->free(pin, a->params);
    pin->free(pin, a->grads);
    fl_free(a);
}
