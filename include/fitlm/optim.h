// optim.h: optimizers, mixed precision, loss scaling, gradient clipping and
// learning-rate schedules.
//
// The update rules work on a range of a row of the flat parameter buffer,
// so the same code serves a whole model, one block (LOMO-style fused updates
// after each gradient is ready) or one rank's shard (ZeRO). fl_optimizer
// puts them together into a training step: fp32 master weights under
// bf16/fp16, gradient accumulation in fp32, loss scaling, overflow skipping
// and global-norm clipping folded into the update.
#ifndef FITLM_OPTIM_H
#define FITLM_OPTIM_H

#include <stddef.h>

#include "fitlm/dtype.h"
#include "fitlm/params.h"

// ----------------------------------------------------------------------------
// Update rules (AdamW, SGD; LOMO, AdaLomo, offloaded AdamW plug in the same
// way). A rule updates any range [offset, offset+count) of one row of the
// parameter table, offsets being element indices into the flat buffer; it
// sees the row (shape, flags: decay from FL_PARAM_DECAY, FL_PARAM_FROZEN rows
// are skipped). Its state covers the elements [state_begin, state_end): the
// whole model or one rank's shard (ZeRO), and every update falls inside.
// A step is fl_optim_begin_step (t++, the step's constants), updates of
// disjoint ranges in any order and split any way (bitwise the same result),
// then fl_optim_end_step.

// What one update reads and writes: every pointer is at element `offset` of
// the range. Gradients may be of any dtype (so they may live in per-block
// scratch) and are multiplied by grad_scale (loss unscaling and the clip
// coefficient folded together) as they are read; the fp32 weights are updated
// in place and, under mixed precision, rounded into the 16-bit copy the model
// computes with.
typedef struct {
    float *params;     // fp32 weights (the master copy under mixed precision)
    void *params_lowp; // NULL, or the model's 16-bit weights to refresh
    fl_dtype lowp_dtype;
    const void *grads;
    fl_dtype grads_dtype;
    float grad_scale;
} fl_update_args;

typedef struct fl_optim_ops fl_optim_ops; // a rule's functions (src/optim/update.h)

// The part every rule shares; a rule's own struct starts with it.
typedef struct fl_optim_rule {
    const fl_optim_ops *ops;
    size_t state_begin, state_end; // flat-buffer elements the state covers
    int nstate; // elementwise state tensors, (state_end - state_begin) floats each
} fl_optim_rule;

void fl_optim_begin_step(fl_optim_rule *r, float lr);
void fl_optim_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                     const fl_update_args *a);
void fl_optim_end_step(fl_optim_rule *r);
void fl_optim_free(fl_optim_rule *r);

// The state by range, for checkpoints (optim/<name>/<row> per row) and
// paging: tensor k (0 <= k < count) is named fl_optim_state_name(r, k) and
// fl_optim_state_ptr(r, k, offset) points at its value for flat-buffer
// element `offset` (state_begin <= offset < state_end). The scalar state is
// the step count t (steps begun), read and set through fl_optim_step_count.
int fl_optim_state_count(const fl_optim_rule *r);
const char *fl_optim_state_name(const fl_optim_rule *r, int k);
float *fl_optim_state_ptr(fl_optim_rule *r, int k, size_t offset);
int *fl_optim_step_count(fl_optim_rule *r);

// ----------------------------------------------------------------------------
// AdamW (Loshchilov & Hutter), as torch.optim.AdamW: decoupled weight decay
// p -= lr*wd*p, then p -= lr * mhat / (sqrt(vhat) + eps) with bias correction.
// State "m", "v".

typedef struct {
    fl_optim_rule rule; // first: &opt->rule is the rule
    float beta1, beta2, eps, weight_decay;
    float *m, *v;             // FL_MEM_OPTIM; element i of the flat buffer at [i - state_begin]
    size_t numel;             // of m and v: rule.state_end - rule.state_begin
    int t;                    // steps begun, for bias correction
    float lr, bc1, bc2, keep; // this step's, set by fl_optim_begin_step
} fl_adamw;

// State over the whole buffer [0, numel), or over [begin, end).
void fl_adamw_init(fl_adamw *opt, size_t numel, float beta1, float beta2, float eps,
                   float weight_decay);
void fl_adamw_init_range(fl_adamw *opt, size_t begin, size_t end, float beta1, float beta2,
                         float eps, float weight_decay);
void fl_adamw_free(fl_adamw *opt);

// ----------------------------------------------------------------------------
// SGD with optional momentum (torch.optim.SGD, dampening 0, no Nesterov):
// g += wd*p (coupled decay, FL_PARAM_DECAY rows only); buf = g at the first
// step, else momentum*buf + g; p -= lr*buf. State "momentum" when momentum > 0,
// none otherwise.

typedef struct {
    fl_optim_rule rule; // first: &opt->rule is the rule
    float momentum, weight_decay;
    float *buf;   // FL_MEM_OPTIM when momentum > 0, else NULL; indexed as fl_adamw's m
    size_t numel; // rule.state_end - rule.state_begin
    int t;        // steps begun (the first one starts the momentum buffer)
    float lr;     // this step's
} fl_sgd;

void fl_sgd_init(fl_sgd *opt, size_t numel, float momentum, float weight_decay);
void fl_sgd_init_range(fl_sgd *opt, size_t begin, size_t end, float momentum, float weight_decay);
void fl_sgd_free(fl_sgd *opt);

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

// The optimizer updates the elements [begin, end) of the model's flat buffer
// (fl_optimizer_init: all of them; fl_optimizer_init_range: one shard, as a
// ZeRO rank does): its master weights and rule state cover that range, while
// gradients (and their fp32 sum) cover the whole buffer.
typedef struct {
    fl_optimizer_config cfg;
    const fl_param_table *table;
    fl_dtype dtype;    // the model's weight and gradient dtype
    void *params;      // the model's weights (dtype)
    void *grads;       // the model's gradients (dtype)
    float *master;     // fp32 weights (FL_MEM_MASTER) under bf16/fp16, else NULL; element i of
                       // the flat buffer at master[i - rule->state_begin]
    float *grad_accum; // fp32 gradient sum (FL_MEM_GRADS) for bf16/fp16 with accumulation
    union {            // the rule of cfg.kind
        fl_adamw adamw;
        fl_sgd sgd;
    };
    fl_optim_rule *rule;   // &adamw.rule or &sgd.rule
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
// The same for the shard [begin, end) of the flat buffer: it allocates
// fl_optimizer_memory's master and optim bytes for end - begin parameters,
// and the fp32 gradient sum (when there is one) for the whole buffer.
void fl_optimizer_init_range(fl_optimizer *o, const fl_optimizer_config *cfg,
                             const fl_param_table *table, fl_dtype dt, void *params, void *grads,
                             size_t begin, size_t end);
void fl_optimizer_free(fl_optimizer *o);
// The factor the backward pass multiplies the loss by: scale / grad_accum.
float fl_optimizer_loss_scale(const fl_optimizer *o);
// The current loss scale alone (1 for fp32/bf16), for a driver that
// normalises the loss itself (e.g. by the target tokens of the whole batch).
float fl_optimizer_scale(const fl_optimizer *o);
// Before each micro-batch's backward: zeroes the gradients it will write.
void fl_optimizer_zero_grad(fl_optimizer *o);
// After each micro-batch's backward (accumulates into fp32 when needed).
void fl_optimizer_micro_done(fl_optimizer *o);
// After the last micro-batch: overflow check, norm, clipping, then
// begin_step, update_rows over the whole table, end_step. Dies with a clear
// message when the fp16 loss scale is stuck at its minimum.
fl_step_result fl_optimizer_step(fl_optimizer *o, float lr);

// The pieces of fl_optimizer_step, for a driver that updates block by block
// as gradients become ready (LOMO, ZeRO-2) and does its own overflow check
// and clipping. update_rows updates the part of rows [first_row,
// first_row + n_rows) inside [begin, end): `grads` (of grads_dtype) is the
// gradient of the first row's first element on, multiplied by grad_scale
// (1 / scale, times the clip coefficient) as it is read. end_step, after the
// step's last update and micro_done, records a clean step in the loss scaler.
void fl_optimizer_begin_step(fl_optimizer *o, float lr);
void fl_optimizer_update_rows(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                              fl_dtype grads_dtype, float grad_scale);
void fl_optimizer_end_step(fl_optimizer *o);

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
