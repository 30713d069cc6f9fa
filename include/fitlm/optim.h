// optim.h: optimizers, mixed precision, loss scaling, gradient clipping and
// learning-rate schedules.
//
// The update rules work on a range of a flat parameter buffer, so the same
// code serves a whole model, one parameter view (LOMO-style fused updates
// after each gradient is ready) or one rank's shard (ZeRO). fl_optimizer
// puts them together into a training step: fp32 master weights under
// bf16/fp16, gradient accumulation in fp32, loss scaling, overflow skipping
// and global-norm clipping folded into the update.
#ifndef FITLM_OPTIM_H
#define FITLM_OPTIM_H

#include <stddef.h>

#include "fitlm/dtype.h"
#include "fitlm/model.h"

// What one update reads and writes. Gradients may be of any dtype and are
// multiplied by grad_scale (loss unscaling and the clip coefficient folded
// together) as they are read; the fp32 weights are updated in place and, under
// mixed precision, rounded into the 16-bit copy the model computes with.
typedef struct {
    float *params;     // fp32 weights (the master copy under mixed precision)
    void *params_lowp; // NULL, or the model's 16-bit weights to refresh
    fl_dtype lowp_dtype;
    const void *grads;
    fl_dtype grads_dtype;
    float grad_scale;
} fl_update_args;

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
void fl_adamw_step(fl_adamw *opt, const fl_param_table *table, const fl_update_args *a, float lr);
// The update of elements [offset, offset+n) at step t (t >= 1).
void fl_adamw_update(fl_adamw *opt, const fl_update_args *a, size_t offset, size_t n, int t,
                     float lr, int decay);

// ----------------------------------------------------------------------------
// SGD with optional momentum (torch.optim.SGD, dampening 0, no Nesterov):
// g += wd*p (coupled decay, FL_PARAM_DECAY views only); buf = g at the first
// step, else momentum*buf + g; p -= lr*buf.

typedef struct {
    float momentum, weight_decay;
    float *buf; // (numel) when momentum > 0, else NULL
    size_t numel;
    int t;
} fl_sgd;

void fl_sgd_init(fl_sgd *opt, size_t numel, float momentum, float weight_decay);
void fl_sgd_free(fl_sgd *opt);
void fl_sgd_step(fl_sgd *opt, const fl_param_table *table, const fl_update_args *a, float lr);

// ----------------------------------------------------------------------------
// gradient norm and clipping, as torch.nn.utils.clip_grad_norm_: the L2 norm
// is summed in double over fixed chunks in a fixed order (the same for any
// thread count); the clip coefficient is max_norm / (norm + 1e-6) when
// max_norm > 0 and norm > max_norm, else 1.

float fl_grad_norm(fl_dtype dt, const void *grads, size_t n);
float fl_clip_coef(float norm, float max_norm);

// ----------------------------------------------------------------------------
// dynamic loss scaling for fp16, DeepSpeed's DynamicLossScaler semantics:
// an overflow (inf/nan in any gradient) skips the step and, once hysteresis
// overflows have been seen, halves the scale (not below min_scale); after
// `window` clean steps since the last overflow the scale doubles (and the
// hysteresis is refilled). consecutive_hysteresis refills it after every
// clean step instead. An overflow with the scale already at min_scale and no
// hysteresis left means training cannot continue.

typedef struct {
    float scale;
    int dynamic;
    float min_scale;
    int window;
    int hysteresis, cur_hysteresis;
    int consecutive_hysteresis;
    long iter, last_overflow_iter;
} fl_loss_scaler;

// static_scale > 0: a fixed scale (DeepSpeed loss_scale != 0); 0: dynamic,
// starting at 2^initial_scale_power.
void fl_loss_scaler_init(fl_loss_scaler *s, float static_scale, int initial_scale_power, int window,
                         int hysteresis, int consecutive_hysteresis, float min_scale);
// Records one step; returns 0, or -1 when an overflow came with the scale
// already at its minimum and no hysteresis left (the caller stops training).
int fl_loss_scaler_update(fl_loss_scaler *s, int overflow);

// ----------------------------------------------------------------------------
// the optimizer of a training step

typedef enum { FL_OPT_ADAMW, FL_OPT_SGD } fl_optim_kind;

typedef struct {
    fl_optim_kind kind;
    float beta1, beta2, eps, weight_decay, momentum;
    float max_grad_norm; // 0 = no clipping
    int grad_accum;      // micro-batches per step
    // fp16 loss scaling (ignored for fp32/bf16)
    float loss_scale; // 0 = dynamic
    int initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis;
    float min_loss_scale;
} fl_optimizer_config;

typedef struct {
    fl_optimizer_config cfg;
    const fl_param_table *table;
    fl_dtype dtype;    // the model's weight and gradient dtype
    void *params;      // the model's weights (dtype)
    void *grads;       // the model's gradients (dtype)
    float *master;     // fp32 weights (FL_MEM_MASTER) under bf16/fp16, else NULL
    float *grad_accum; // fp32 gradient sum (FL_MEM_GRADS) for bf16/fp16 with accumulation
    fl_adamw adamw;
    fl_sgd sgd;
    fl_loss_scaler scaler; // fp16; scale 1 otherwise
    int micro;             // micro-batches seen in this step
} fl_optimizer;

typedef struct {
    float grad_norm; // of the unscaled gradient, before clipping
    int skipped;     // fp16 overflow: nothing was updated
    float loss_scale;
} fl_step_result;

// Bytes the optimizer allocates per tag (master, optim, grads) for numel
// parameters of dtype dt: the same sizes fl_optimizer_init allocates.
void fl_optimizer_memory(const fl_optimizer_config *cfg, fl_dtype dt, size_t numel,
                         size_t bytes[FL_MEM_NTAGS]);
// Takes the model's table and buffers; under bf16/fp16 the master weights
// start as the fp32 values of the 16-bit weights.
void fl_optimizer_init(fl_optimizer *o, const fl_optimizer_config *cfg, const fl_param_table *table,
                       fl_dtype dt, void *params, void *grads);
void fl_optimizer_free(fl_optimizer *o);
// The factor the backward pass multiplies the loss by: scale / grad_accum.
float fl_optimizer_loss_scale(const fl_optimizer *o);
// Before each micro-batch's backward: zeroes the gradients it will write.
void fl_optimizer_zero_grad(fl_optimizer *o);
// After each micro-batch's backward (accumulates into fp32 when needed).
void fl_optimizer_micro_done(fl_optimizer *o);
// After the last micro-batch: overflow check, norm, clipping, the update and
// the loss-scale update. Dies with a clear message when the fp16 loss scale
// is stuck at its minimum.
fl_step_result fl_optimizer_step(fl_optimizer *o, float lr);

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
