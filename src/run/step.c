// step.c: a training step (train.h), and the one place that picks its kind:
// LoRA + LOMO, an optimizer fused into the backward pass, or the plain step
// over the micro-batches of an accumulated batch (step_of).
//
// The fused step: optimizers fused into the backward pass, as LOMO (Lv et al. 2023)
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

#include "fitlm/device.h"
#include "fitlm/profile.h"
#include "fitlm/run.h"
#include "fitlm/train.h"

long fl_batch_targets(const fl_optimizer *o, const int *targets, size_t n) {
    double count = 0.0;
    for (size_t i = 0; i < n; i++) count += targets[i] != -1;
    if (o->sync) o->sync->sum(o->sync->ctx, &count, 1);
    return (long)count;
}

// The step's tokens go up without a wait (the caller keeps them until the
// step returns) and its losses stay where the optimizer's gate is, when that
// is the model's device (not ZeRO-Offload's host optimizer): between its
// first kernel and the read of its verdict the host only issues work.
static double *begin_losses(fl_model *m, fl_optimizer *o) {
    double *sink = fl_optimizer_loss_sink(o, m->dev);
    m->loss_sink = sink;
    m->async_tokens = 1;
    return sink;
}

static void end_losses(fl_model *m) {
    m->loss_sink = NULL;
    m->async_tokens = 0;
    m->lora.dropout_step = 0; // evaluation and sampling run without dropout
}

// The gate's loss summed over the data-parallel ranks (the host's memory).
static void sum_gate_loss(fl_optimizer *o) {
    if (!o->sync) return;
    FL_ASSERT(fl_optimizer_gate_host(o));
    o->sync->sum(o->sync->ctx, &o->gate->loss_sum, 1);
}

static fl_train_result train_result(const fl_optimizer *o, const fl_step_result *s, long total) {
    return (fl_train_result){s->loss,       total,    s->grad_norm,    s->skipped,
                             s->loss_scale, s->spike, o->spike.in_row, o->spike.skipped};
}

// The plain step: forward and backward over each micro-batch, then the
// optimizer's step on the accumulated gradient.
static fl_train_result plain_step(fl_model *m, fl_optimizer *o, const int *inputs,
                                  const int *targets, int micro, int B, int T, float lr) {
    size_t BT = (size_t)B * T;
    const fl_optim_sync *sync = o->sync; // data parallelism: the batch is every rank's
    long total = fl_batch_targets(o, targets, (size_t)micro * BT);
    // d(scaled mean loss)/d(loss_i): the same weight for every target token
    float dloss = total ? fl_optimizer_scale(o) / (float)total : 0.0f;
    double loss_sum = 0.0;                                // on the host, without a loss sink
    uint64_t t = (uint64_t)*fl_optim_step_count(o->rule); // steps done: the dropout masks' key
    double *sink = begin_losses(m, o);
    for (int k = 0; k < micro; k++) {
        size_t cleared = 0; // bytes, for the profile
        FL_PROFILE_IO(FL_OP_ZERO_GRAD, FL_STEP, 0.0, cleared, cleared = fl_optimizer_zero_grad(o));
        m->lora.dropout_step = t * (uint64_t)micro + (uint64_t)k + 1;
        fl_model_forward_train(m, inputs + k * BT, targets + k * BT, B, T, dloss);
        if (sink)
            fl_optimizer_add_loss(o, k == 0, m->n_targets);
        else
            loss_sum += (double)m->loss * m->n_targets;
        // ZeRO-Offload: the host updates each unit during the last backward
        if (k == micro - 1 && fl_optimizer_can_overlap(o)) {
            FL_ASSERT(!sink); // the host's optimizer: the losses came to the host
            fl_optimizer_begin_overlap(o, lr, total ? (float)(loss_sum / total) : 0.0f);
        }
        fl_model_backward(m, dloss);
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_micro_done(o));
    }
    end_losses(m);
    fl_step_result s;
    if (sink) {
        sum_gate_loss(o);
        FL_PROFILE_IO(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_step_io(o),
                      s = fl_optimizer_step_gated(o, lr, total));
    } else {
        if (sync) sync->sum(sync->ctx, &loss_sum, 1);
        float loss = total ? (float)(loss_sum / total) : 0.0f;
        FL_PROFILE_IO(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_step_io(o),
                      s = fl_optimizer_step_loss(o, lr, loss));
    }
    return train_result(o, &s, total);
}

typedef struct {
    fl_optimizer *o;
    int update;           // 0: gather the norm; 1: update
    int two_pass;         // the norm was gathered by a first pass
    fl_model_hooks outer; // a data-parallel strategy's (ZeRO-3 gathers weights before a unit)
} fused_pass;

static void on_pre_unit(void *ctx, fl_model *m, int unit, int pass) {
    fused_pass *p = ctx;
    if (p->outer.pre_unit) p->outer.pre_unit(p->outer.ctx, m, unit, pass);
}

enum { UNIT_ROWS = 64 }; // rows per sumsq_rows call: a unit's all at once

// A unit's gradient is complete: its rows' sums of squares go to the gate's
// rows (on the device), and in the update pass the unit is updated by the
// factors the gate holds (or skipped, by its verdict).
static void on_grad_ready(void *ctx, fl_model *m, int first, int n) {
    fused_pass *p = ctx;
    const fl_optim_sync *sync = p->o->sync;
    // the unit's gradient: its scratch, or under data parallelism its sum
    // over ranks, of the part [lo, hi) this rank updates
    const fl_param_view *v = m->table.views;
    const void *g = m->gp[first];
    fl_dtype dt = m->dtype;
    size_t lo = v[first].offset, hi = v[first + n - 1].offset + v[first + n - 1].numel;
    if (sync) {
        g = sync->reduce_rows(sync->ctx, first, n, g, &lo, &hi);
        dt = FL_F32;
    }
    if (!p->update || !p->two_pass) // the norm, to clip by or to report: the unit's rows at once
        for (int r0 = first; r0 < first + n; r0 += UNIT_ROWS) {
            size_t offsets[UNIT_ROWS], counts[UNIT_ROWS];
            int k = 0;
            for (int r = r0; r < first + n && r < r0 + UNIT_ROWS; r++, k++) {
                size_t a = v[r].offset > lo ? v[r].offset : lo;
                size_t b = v[r].offset + v[r].numel < hi ? v[r].offset + v[r].numel : hi;
                offsets[k] = b > a ? a - lo : 0, counts[k] = b > a ? b - a : 0;
            }
            p->o->dev->sumsq_rows(dt, g, k, offsets, counts, p->o->gate_rows + r0);
        }
    if (p->update)
        FL_PROFILE(FL_OP_OPTIMIZER, FL_BWD, 0.0,
                   fl_optimizer_update_range(p->o, first, n, g, lo, dt, 1.0f, 1.0f));
}

// The mean loss over every rank's target tokens (total of them), on the
// host: a pipeline's passes bring it there.
static float batch_loss(const fl_optimizer *o, const fl_model *m, long total) {
    if (!o->sync) return m->loss;
    double sum = (double)m->loss * m->n_targets;
    o->sync->sum(o->sync->ctx, &sum, 1);
    return total ? (float)(sum / total) : 0.0f;
}

// The rows' sums of squares for the verdict (op): on one process the gate's
// rows as they are, added in table order on the device. Over ranks the host
// adds them (a host device's memory) with an overflow flag, and leaves the
// total in the gate: under data parallelism over every rank's part; under
// tensor parallelism over the TP group, a replicated row counted on TP rank
// 0 only; under pipeline parallelism over the stages, each row at its place
// in the whole table. Added in (the whole) table order: the same for any
// unit order, thread count or pipeline split.
static void gather_norm(fl_optimizer *o, fl_gate_op *op) {
    const fl_optim_sync *sync = o->sync;
    int rows = o->table->count;
    op->rows = o->gate_rows;
    op->nrows = rows;
    if (!o->tp && !o->pp && !sync) return;
    FL_ASSERT(fl_optimizer_gate_host(o));
    double overflow = 0.0, *sq = o->gate_rows;
    for (int r = 0; r < rows; r++)
        if (!isfinite(sq[r])) overflow = 1.0;
    if (o->tp) {
        for (int r = 0; r < rows; r++)
            if (o->table->views[r].tp_dim < 0 && o->tp->rank > 0) sq[r] = 0.0;
        o->tp->ops->sum(o->tp->ops->ctx, sq, rows);
        o->tp->ops->sum(o->tp->ops->ctx, &overflow, 1);
    }
    if (o->pp) { // each stage's rows in the whole table's order, summed over the stages
        int whole = o->pp->whole_rows;
        sq = fl_alloc(FL_MEM_WORKSPACE, (size_t)whole * sizeof(double));
        memset(sq, 0, (size_t)whole * sizeof(double));
        for (int r = 0; r < rows; r++)
            if (!(o->table->views[r].flags & FL_PARAM_TIED_COPY))
                sq[o->pp->row_global[r]] = o->gate_rows[r];
        o->pp->ops->sum(o->pp->ops->ctx, sq, whole);
        o->pp->ops->sum(o->pp->ops->ctx, &overflow, 1);
        rows = whole;
    }
    if (sync) {
        if (!sync->replicated) sync->sum(sync->ctx, sq, rows);
        sync->max(sync->ctx, &overflow, 1);
    }
    double s = 0.0;
    for (int i = 0; i < rows; i++) s += sq[i];
    if (sq != o->gate_rows) fl_free(sq);
    // an overflow anywhere skips every rank (a NaN sum stays one, for the report)
    o->gate->sumsq = overflow != 0.0 && isfinite(s) ? INFINITY : s;
    op->nrows = -1;
}

static void model_forward(void *ctx, const int *inputs, const int *targets, int B, int T,
                          float dloss, int head_only) {
    fl_model *m = ctx;
    if (head_only)
        fl_model_forward_head_train(m, dloss);
    else
        fl_model_forward_train(m, inputs, targets, B, T, dloss);
}

static void model_backward(void *ctx, float dloss) {
    fl_model_backward(ctx, dloss);
}

// A forward (the whole model, or, for the second pass, only the head: the
// first backward overwrote nothing else) with the hook, which backward_half
// (the backward) or a skip known at once (no backward) takes off again;
// the adapters' gradients, if any, start from zero.
static void forward_half(fl_model *m, fused_pass *p, const fl_step_passes *passes,
                         const int *inputs, const int *targets, int B, int T, float dloss,
                         int head_only) {
    if (m->lora.grads) fl_model_zero_grad(m);
    p->outer = m->hooks;
    m->hooks = (fl_model_hooks){on_pre_unit, on_grad_ready, p};
    passes->forward(passes->ctx, inputs, targets, B, T, dloss, head_only);
}

static void backward_half(fl_model *m, fused_pass *p, const fl_step_passes *passes, float dloss) {
    passes->backward(passes->ctx, dloss);
    m->hooks = p->outer;
}

// The verdict comes before the update: with clipping or fp16, from the
// first pass's norm (an overflow found there leaves every weight
// unchanged); otherwise the spike guard judges the loss alone before the
// one backward, which updates. On a device the verdict stays there: the
// update pass runs and its updates skip themselves when told to; where the
// host sees the verdict for free (its own memory) a skipped step stops.
static fl_train_result fused_step(fl_model *m, fl_optimizer *o, fl_optimizer *adapters,
                                  const fl_step_passes *passes, const int *inputs,
                                  const int *targets, int B, int T, float lr, float adapter_lr) {
    FL_ASSERT(m->unit_grads && !m->grads);
    fl_step_passes own = {m, model_forward, model_backward};
    if (!passes) passes = &own;
    // dropout masks: one per step, the same in both passes
    m->lora.dropout_step = (uint64_t)*fl_optim_step_count(o->rule) + 1;
    size_t BT = (size_t)B * T;
    long total = fl_batch_targets(o, targets, BT);
    float scale = fl_optimizer_scale(o);
    float dloss = total ? scale / (float)total : 0.0f;
    int two_pass = o->cfg.max_grad_norm > 0.0f || m->dtype == FL_F16;
    fused_pass p = {o, 0, two_pass, {0}};
    // a pipeline's passes bring the loss to the host; the model's own leave it in the gate
    double *sink = passes == &own ? begin_losses(m, o) : NULL;
    fl_gate_op op = {.op = two_pass ? FL_GATE_VERDICT : FL_GATE_JUDGE_LOSS,
                     .total = total,
                     .scale = scale,
                     .max_grad_norm = o->cfg.max_grad_norm,
                     .overflow_skips = 1};
    fl_optimizer_gate_spike(o, 1, &op);
    forward_half(m, &p, passes, inputs, targets, B, T, dloss, 0);
    if (sink) {
        fl_optimizer_add_loss(o, 1, m->n_targets);
        sum_gate_loss(o);
    } else {
        op.loss_given = 1;
        op.loss = batch_loss(o, m, total);
    }
    if (two_pass) {
        backward_half(m, &p, passes, dloss);
        gather_norm(o, &op);
    }
    fl_optimizer_gate_run(o, &op);
    const fl_step_gate *known = fl_optimizer_gate_host(o);
    int run = !(known && known->skip);
    if (run) {
        p.update = 1;
        if (two_pass) forward_half(m, &p, passes, inputs, targets, B, T, dloss, 1);
        fl_optimizer_begin_step(o, lr);
        o->gating = 1;
        backward_half(m, &p, passes, dloss);
        o->gating = 0;
        if (o->sync) o->sync->updated(o->sync->ctx); // ZeRO-1/2: every rank's new weights
        if (!two_pass) {                             // the norm, to report
            fl_gate_op norm = {.op = FL_GATE_NORM};
            gather_norm(o, &norm);
            fl_optimizer_gate_run(o, &norm);
        }
        if (adapters) { // skipped with the base's step
            adapters->parent_gate = o->gate;
            fl_optimizer_micro_done(adapters);
            FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_step(adapters, adapter_lr));
        }
    } else if (!two_pass) {
        m->hooks = p.outer; // no backward
    }
    end_losses(m);
    fl_step_result s = fl_optimizer_settle(o, run);
    return train_result(o, &s, total);
}

fl_train_result fl_fused_step(fl_model *m, fl_optimizer *o, const int *inputs, const int *targets,
                              int B, int T, float lr) {
    return fused_step(m, o, NULL, NULL, inputs, targets, B, T, lr, 0.0f);
}

fl_train_result fl_fused_step_passes(fl_model *m, fl_optimizer *o, const fl_step_passes *passes,
                                     const int *inputs, const int *targets, int B, int T,
                                     float lr) {
    return fused_step(m, o, NULL, passes, inputs, targets, B, T, lr, 0.0f);
}

fl_train_result fl_lora_lomo_step(fl_model *m, fl_optimizer *adapters, fl_optimizer *base,
                                  const int *inputs, const int *targets, int B, int T, float lr,
                                  float base_lr) {
    FL_ASSERT(m->lora.cfg.train_base && m->dtype != FL_F16);
    return fused_step(m, base, adapters, NULL, inputs, targets, B, T, base_lr, lr);
}

// The step's kind, chosen here only: LoRA + LOMO (a base optimizer), an
// optimizer fused into the backward pass on one micro-batch (with
// accumulation, ZeRO-2/3's unit gradients go through the plain step), or
// the plain step.
static fl_train_result step_of(fl_model *m, fl_optimizer *o, fl_optimizer *base, const int *inputs,
                               const int *targets, int micro, int B, int T, float lr,
                               float base_lr) {
    FL_ASSERT(micro == o->cfg.grad_accum);
    if (base) return fl_lora_lomo_step(m, o, base, inputs, targets, B, T, lr, base_lr);
    if (m->unit_grads && fl_optim_in_backward(&o->cfg) && micro == 1)
        return fl_fused_step(m, o, inputs, targets, B, T, lr);
    return plain_step(m, o, inputs, targets, micro, B, T, lr);
}

fl_train_result fl_train_step(fl_model *m, fl_optimizer *o, const int *inputs, const int *targets,
                              int micro, int B, int T, float lr) {
    return step_of(m, o, NULL, inputs, targets, micro, B, T, lr, 0.0f);
}

fl_train_result fl_run_step_batch(fl_run *r, const int *inputs, const int *targets, float lr) {
    const fl_train_config *c = &r->cfg;
    if (r->pipe) return fl_pipeline_step(r->pipe, inputs, targets, lr);
    return step_of(&r->model, &r->optim, r->base, inputs, targets, c->grad_accum, c->micro_batch,
                   c->seq_len, lr, lr * (r->base_lr / c->lr));
}

fl_train_result fl_run_step(fl_run *r, int step) {
    const fl_train_config *c = &r->cfg;
    FL_ASSERT(r->has_train); // own_batches: the caller steps with fl_run_step_batch
    size_t micro_tokens = (size_t)c->micro_batch * c->seq_len;
    for (int micro = 0; micro < c->grad_accum; micro++)
        FL_PROFILE(FL_OP_LOADER, FL_STEP, 0.0,
                   fl_loader_next(&r->train, r->inputs + micro * micro_tokens,
                                  r->targets + micro * micro_tokens, c->micro_batch));
    return fl_run_step_batch(r, r->inputs, r->targets, fl_run_lr(r, step));
}

float fl_run_lr(fl_run *r, int step) {
    int n = fl_schedule_by_updates(&r->schedule) ? *fl_optim_step_count(r->optim.rule) : step;
    return fl_lr_at(&r->schedule, n);
}
