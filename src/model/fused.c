// fused.c: optimizers fused into the backward pass, as LOMO (Lv et al. 2023)
// and AdaLomo do it: each unit's parameters are updated as soon as the
// backward pass has completed their gradients, in a buffer that then serves
// the next unit, so no whole-model gradient is ever held (the model is made
// by fl_model_init_unit_grads).
//
// Clipping by the global norm, and fp16's overflow check, need the whole
// gradient before the first update. Then, as in the paper, a first backward
// only gathers each row's sum of squares (and finds infs and NaNs) without
// touching a weight, and a second backward updates. Between them only the
// head is run again: the first backward overwrote the logits with their own
// gradient and nothing else, so the kept activations serve the second one
// (the paper's trainer re-runs the whole forward). An fp16 overflow is found
// in the first pass, so a skipped step leaves every weight unchanged.
//
// LoRA + LOMO (the LOMO authors' LOMOLoRATrainer): the base is updated as
// above while the backward also accumulates the adapters' gradients, which
// an ordinary optimizer (AdamW) then steps with its own learning rate and
// clipping. The global norm LOMO clips by is the base's, as there.
#include <math.h>
#include <string.h>

#include "fitlm/profile.h"
#include "fitlm/train.h"

typedef struct {
    fl_optimizer *o;
    int update;      // 0: gather the norm; 1: update
    int two_pass;    // the norm was gathered by a first pass
    double *row_sq;  // (rows) sums of squares of each row's gradient
    int overflow;    // an inf or NaN was seen
    float unscale;   // 1 / loss scale
    float clip_coef; // the global-norm clip coefficient (after clip_grad_value's clamp)
} fused_pass;

static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fused_pass *p = ctx;
    if (!p->update || !p->two_pass) // the norm, to clip by or to report
        for (int r = first; r < first + n; r++) {
            p->row_sq[r] = fl_grad_sumsq(m->dtype, m->gp[r], m->table.views[r].numel);
            if (!isfinite(p->row_sq[r])) p->overflow = 1;
        }
    if (p->update)
        FL_PROFILE(FL_OP_OPTIMIZER, FL_BWD, 0.0,
                   fl_optimizer_update_rows_clip(p->o, first, n, m->gp[first], m->dtype, p->unscale,
                                                 p->clip_coef));
}

// in table order: the same for any unit order or thread count
static double sum_rows(const double *row_sq, int rows) {
    double s = 0.0;
    for (int i = 0; i < rows; i++) s += row_sq[i];
    return s;
}

// A forward (the whole model, or, for the second pass, only the head: the
// first backward overwrote nothing else) and a backward with the hook; the
// adapters' gradients, if any, start from zero.
static float backward_pass(fl_model *m, fused_pass *p, const int *inputs, const int *targets, int B,
                           int T, float dloss, int head_only) {
    if (m->lora.grads) fl_model_zero_grad(m);
    m->hooks = (fl_model_hooks){NULL, on_grad_ready, p};
    float loss = head_only ? fl_model_forward_head(m) : fl_model_forward(m, inputs, targets, B, T);
    fl_model_backward(m, dloss);
    m->hooks = (fl_model_hooks){0};
    return loss;
}

static fl_train_result fused_step(fl_model *m, fl_optimizer *o, fl_optimizer *adapters,
                                  const int *inputs, const int *targets, int B, int T, float lr,
                                  float adapter_lr) {
    FL_ASSERT(m->unit_grads && !m->grads);
    // dropout masks: one per step, the same in both passes
    m->lora.dropout_step = (uint64_t)*fl_optim_step_count(o->rule) + 1;
    size_t BT = (size_t)B * T;
    long total = 0;
    for (size_t i = 0; i < BT; i++) total += targets[i] != -1;
    float scale = fl_optimizer_scale(o), unscale = 1.0f / scale;
    float dloss = total ? scale / (float)total : 0.0f;
    fl_train_result r = {0.0f, total, 0.0f, 0, scale};
    double *row_sq = fl_alloc(FL_MEM_WORKSPACE, (size_t)m->table.count * sizeof(double));
    int two_pass = o->cfg.max_grad_norm > 0.0f || m->dtype == FL_F16;
    fused_pass p = {o, 0, two_pass, row_sq, 0, unscale, 1.0f};
    if (two_pass) {
        r.loss = backward_pass(m, &p, inputs, targets, B, T, dloss, 0);
        double sq = sum_rows(row_sq, m->table.count);
        if (p.overflow) {
            r.skipped = 1;
            if (fl_loss_scaler_update(&o->scaler, 1) != 0)
                fl_die("fp16 gradients overflow with the loss scale already at its minimum (%g): "
                       "training cannot continue. Lower the learning rate, raise "
                       "fp16.min_loss_scale, or train in bf16 (--precision bf16)",
                       o->scaler.min_scale);
            fl_free(row_sq);
            m->lora.dropout_step = 0;
            return r;
        }
        r.grad_norm = (float)sqrt(sq) * unscale;
        p.clip_coef = fl_clip_coef(r.grad_norm, o->cfg.max_grad_norm);
    }
    p.update = 1;
    fl_optimizer_begin_step(o, lr);
    float loss = backward_pass(m, &p, inputs, targets, B, T, dloss, two_pass);
    fl_optimizer_end_step(o);
    if (!two_pass) {
        r.loss = loss;
        r.grad_norm = (float)sqrt(sum_rows(row_sq, m->table.count)) * unscale;
    }
    fl_free(row_sq);
    if (adapters) {
        fl_optimizer_micro_done(adapters);
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_step(adapters, adapter_lr));
    }
    m->lora.dropout_step = 0;
    return r;
}

fl_train_result fl_fused_step(fl_model *m, fl_optimizer *o, const int *inputs, const int *targets,
                              int B, int T, float lr) {
    return fused_step(m, o, NULL, inputs, targets, B, T, lr, 0.0f);
}

fl_train_result fl_lora_lomo_step(fl_model *m, fl_optimizer *adapters, fl_optimizer *base,
                                  const int *inputs, const int *targets, int B, int T, float lr,
                                  float base_lr) {
    FL_ASSERT(m->lora.cfg.train_base && m->dtype != FL_F16);
    return fused_step(m, base, adapters, inputs, targets, B, T, base_lr, lr);
}
