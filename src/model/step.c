// step.c: fl_train_step (see train.h).
#include "fitlm/profile.h"
#include "fitlm/train.h"

long fl_batch_targets(const fl_optimizer *o, const int *targets, size_t n) {
    double count = 0.0;
    for (size_t i = 0; i < n; i++) count += targets[i] != -1;
    if (o->sync) o->sync->sum(o->sync->ctx, &count, 1);
    return (long)count;
}

fl_train_result fl_train_step(fl_model *m, fl_optimizer *o, const int *inputs, const int *targets,
                              int micro, int B, int T, float lr) {
    FL_ASSERT(micro == o->cfg.grad_accum);
    // an optimizer fused into the backward pass, one micro-batch (with
    // accumulation, ZeRO-2/3's unit gradients go through the loop below)
    if (m->unit_grads && fl_optim_in_backward(&o->cfg) && micro == 1) {
        return fl_fused_step(m, o, inputs, targets, B, T, lr);
    }
    size_t BT = (size_t)B * T;
    const fl_optim_sync *sync = o->sync; // data parallelism: the batch is every rank's
    long total = fl_batch_targets(o, targets, (size_t)micro * BT);
    // d(scaled mean loss)/d(loss_i): the same weight for every target token
    float dloss = total ? fl_optimizer_scale(o) / (float)total : 0.0f;
    double loss_sum = 0.0;
    uint64_t t = (uint64_t)*fl_optim_step_count(o->rule); // steps done: the dropout masks' key
    for (int k = 0; k < micro; k++) {
        FL_PROFILE(FL_OP_ZERO_GRAD, FL_STEP, 0.0, fl_optimizer_zero_grad(o));
        m->lora.dropout_step = t * (uint64_t)micro + (uint64_t)k + 1;
        fl_model_forward_train(m, inputs + k * BT, targets + k * BT, B, T, dloss);
        loss_sum += (double)m->loss * m->n_targets;
        fl_model_backward(m, dloss);
        FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, fl_optimizer_micro_done(o));
    }
    m->lora.dropout_step = 0; // evaluation and sampling run without dropout
    if (sync) sync->sum(sync->ctx, &loss_sum, 1);
    fl_step_result s;
    FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, s = fl_optimizer_step(o, lr));
    return (fl_train_result){total ? (float)(loss_sum / total) : 0.0f, total, s.grad_norm,
                             s.skipped, s.loss_scale};
}
