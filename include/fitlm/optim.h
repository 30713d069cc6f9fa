// optim.h: optimizers, gradient clipping and learning-rate schedules.
//
// Optimizers update a range of a flat parameter buffer, so the same code
// serves a whole model, one parameter view (LOMO-style fused updates after
// each gradient is ready) or one rank's shard (ZeRO).
#ifndef FITLM_OPTIM_H
#define FITLM_OPTIM_H

#include <stddef.h>

#include "fitlm/model.h"

// ----------------------------------------------------------------------------
// AdamW (Loshchilov & Hutter), as torch.optim.AdamW: decoupled weight decay
// p -= lr*wd*p, then p -= lr * mhat / (sqrt(vhat) + eps) with bias correction.

typedef struct {
    float beta1, beta2, eps, weight_decay;
    float *m, *v; // (numel) each, tagged FL_MEM_OPTIM
    size_t numel;
    int t; // steps taken, for bias correction
} fl_adamw;

void fl_adamw_init(fl_adamw *opt, size_t numel, float beta1, float beta2, float eps,
                   float weight_decay);
void fl_adamw_free(fl_adamw *opt);
// One step over the whole table: decay only on views with FL_PARAM_DECAY.
void fl_adamw_step(fl_adamw *opt, const fl_param_table *table, float *params, const float *grads,
                   float lr);
// The update of elements [offset, offset+n) at step t (t >= 1), with or
// without decay; m and v are the optimizer's full-length buffers.
void fl_adamw_update(fl_adamw *opt, float *params, const float *grads, size_t offset, size_t n,
                     int t, float lr, int decay);

// ----------------------------------------------------------------------------
// SGD with optional momentum (torch.optim.SGD, dampening 0, no Nesterov):
// buf = momentum*buf + g (buf = g at the first step); p -= lr*(buf); weight
// decay (coupled, as torch) adds wd*p to g on FL_PARAM_DECAY views.

typedef struct {
    float momentum, weight_decay;
    float *buf; // (numel) when momentum > 0, else NULL
    size_t numel;
    int t;
} fl_sgd;

void fl_sgd_init(fl_sgd *opt, size_t numel, float momentum, float weight_decay);
void fl_sgd_free(fl_sgd *opt);
void fl_sgd_step(fl_sgd *opt, const fl_param_table *table, float *params, const float *grads,
                 float lr);

// ----------------------------------------------------------------------------
// global-norm clipping: returns the L2 norm of grads (computed in double, in a
// fixed order) and, when max_norm > 0 and norm > max_norm, scales grads by
// max_norm / (norm + 1e-6) as torch.nn.utils.clip_grad_norm_.

float fl_grad_norm(const float *grads, size_t n);
float fl_clip_grad_norm(float *grads, size_t n, float max_norm);

// ----------------------------------------------------------------------------
// learning-rate schedules: linear warmup from 0 over warmup_steps, then
// constant, cosine or linear decay to min_lr_ratio * lr at total_steps.

typedef enum { FL_SCHED_CONSTANT, FL_SCHED_COSINE, FL_SCHED_LINEAR } fl_sched_kind;

typedef struct {
    fl_sched_kind kind;
    float lr;
    int warmup_steps;
    int total_steps;
    float min_lr_ratio;
} fl_schedule;

// Learning rate for step (0-based).
float fl_lr_at(const fl_schedule *s, int step);

#endif
