// optimizer.c: the optimizer side of a training step. Under bf16/fp16 the
// model computes with 16-bit weights while the update runs on fp32 master
// weights (mixed precision, as DeepSpeed's bf16/fp16 optimizers and
// Megatron's main params); gradients of several micro-batches are summed in
// fp32; under fp16 the loss is scaled up before the backward pass and an
// overflowing step is skipped without touching any weight or state.
#include <string.h>

#include "fitlm/optim.h"

static int needs_accum_buffer(const fl_optimizer_config *cfg, fl_dtype dt) {
    return dt != FL_F32 && cfg->grad_accum > 1; // fp32 accumulates in the model's grads
}

void fl_optimizer_memory(const fl_optimizer_config *cfg, fl_dtype dt, size_t numel,
                         size_t bytes[FL_MEM_NTAGS]) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    if (dt != FL_F32) bytes[FL_MEM_MASTER] = numel * sizeof(float);
    if (needs_accum_buffer(cfg, dt)) bytes[FL_MEM_GRADS] = numel * sizeof(float);
    if (cfg->kind == FL_OPT_ADAMW)
        bytes[FL_MEM_OPTIM] = 2 * numel * sizeof(float);
    else if (cfg->momentum > 0.0f)
        bytes[FL_MEM_OPTIM] = numel * sizeof(float);
}

void fl_optimizer_init(fl_optimizer *o, const fl_optimizer_config *cfg, const fl_param_table *table,
                       fl_dtype dt, void *params, void *grads) {
    memset(o, 0, sizeof *o);
    FL_ASSERT(cfg->grad_accum >= 1);
    o->cfg = *cfg;
    o->table = table;
    o->dtype = dt;
    o->params = params;
    o->grads = grads;
    size_t n = table->numel;
    if (dt != FL_F32) {
        o->master = fl_alloc(FL_MEM_MASTER, n * sizeof(float));
        fl_convert(FL_F32, o->master, dt, params, n);
    }
    if (needs_accum_buffer(cfg, dt)) o->grad_accum = fl_alloc(FL_MEM_GRADS, n * sizeof(float));
    if (cfg->kind == FL_OPT_ADAMW)
        fl_adamw_init(&o->adamw, n, cfg->beta1, cfg->beta2, cfg->eps, cfg->weight_decay);
    else
        fl_sgd_init(&o->sgd, n, cfg->momentum, cfg->weight_decay);
    if (dt == FL_F16)
        fl_loss_scaler_init(&o->scaler, cfg->loss_scale, cfg->initial_scale_power,
                            cfg->loss_scale_window, cfg->hysteresis, cfg->consecutive_hysteresis,
                            cfg->min_loss_scale);
    else
        fl_loss_scaler_init(&o->scaler, 1.0f, 0, 1, 1, 0, 1.0f); // static 1: no scaling
}

void fl_optimizer_free(fl_optimizer *o) {
    fl_free(o->master);
    fl_free(o->grad_accum);
    if (o->cfg.kind == FL_OPT_ADAMW)
        fl_adamw_free(&o->adamw);
    else
        fl_sgd_free(&o->sgd);
    memset(o, 0, sizeof *o);
}

float fl_optimizer_loss_scale(const fl_optimizer *o) {
    return o->scaler.scale / (float)o->cfg.grad_accum;
}

void fl_optimizer_zero_grad(fl_optimizer *o) {
    size_t n = o->table->numel;
    if (o->micro == 0 && o->grad_accum) memset(o->grad_accum, 0, n * sizeof(float));
    // fp32 sums micro-batches in the model's own gradients; 16-bit gradients
    // are per micro-batch and summed into the fp32 buffer
    if (o->micro == 0 || o->grad_accum) memset(o->grads, 0, n * fl_dtype_size(o->dtype));
}

void fl_optimizer_micro_done(fl_optimizer *o) {
    o->micro++;
    if (!o->grad_accum) return;
    size_t n = o->table->numel, block = 4096, nblocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t i = b * block, len = n - i < block ? n - i : block;
        float scratch[4096];
        const float *g = fl_load_f32(o->dtype, fl_at(o->dtype, o->grads, i), len, scratch);
        for (size_t k = 0; k < len; k++) o->grad_accum[i + k] += g[k];
    }
}

fl_step_result fl_optimizer_step(fl_optimizer *o, float lr) {
    FL_ASSERT(o->micro == o->cfg.grad_accum);
    o->micro = 0;
    size_t n = o->table->numel;
    fl_update_args a = {
        .params = o->master ? o->master : o->params,
        .params_lowp = o->master ? o->params : NULL,
        .lowp_dtype = o->dtype,
        .grads = o->grad_accum ? (const void *)o->grad_accum : o->grads,
        .grads_dtype = o->grad_accum ? FL_F32 : o->dtype,
    };
    fl_step_result r = {0.0f, 0, o->scaler.scale};
    if (o->dtype == FL_F16 && fl_has_inf_or_nan(a.grads_dtype, a.grads, n)) {
        // skip the step: no weight, master or optimizer-state byte changes
        r.skipped = 1;
        if (fl_loss_scaler_update(&o->scaler, 1) != 0)
            fl_die("fp16 gradients overflow with the loss scale already at its minimum (%g): "
                   "training cannot continue. Lower the learning rate, raise "
                   "fp16.min_loss_scale, or train in bf16 (--precision bf16)",
                   o->scaler.min_scale);
        return r;
    }
    float unscale = 1.0f / o->scaler.scale;
    r.grad_norm = fl_grad_norm(a.grads_dtype, a.grads, n) * unscale;
    a.grad_scale = unscale * fl_clip_coef(r.grad_norm, o->cfg.max_grad_norm);
    if (o->cfg.kind == FL_OPT_ADAMW)
        fl_adamw_step(&o->adamw, o->table, &a, lr);
    else
        fl_sgd_step(&o->sgd, o->table, &a, lr);
    fl_loss_scaler_update(&o->scaler, 0);
    return r;
}
