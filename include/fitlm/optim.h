// optim.h: optimizers, mixed precision, loss scaling, gradient clipping and
// learning-rate schedules.
//
// The update rules work on a range of a row of the flat parameter buffer,
// so the same code serves a whole model, one block (LOMO-style fused updates
// after each gradient is ready) or one rank's shard (ZeRO). fl_optimizer
// puts them together into a training step: fp32 master weights under
// bf16/fp16 (none for the fused LOMO and AdaLomo, which update the 16-bit
// weights by stochastic rounding), gradient accumulation in fp32, loss
// scaling, overflow skipping and global-norm clipping folded into the update.
#ifndef FITLM_OPTIM_H
#define FITLM_OPTIM_H

#include <stddef.h>

#include "fitlm/config.h"
#include "fitlm/dtype.h"
#include "fitlm/params.h"
#include "fitlm/tp.h"

struct fl_device; // device.h

// ----------------------------------------------------------------------------
// Update rules (AdamW, SGD; LOMO, AdaLomo, offloaded AdamW plug in the same
// way). A rule updates any range [offset, offset+count) of one row of the
// parameter table, offsets being element indices into the flat buffer; it
// sees the row (shape, flags: decay from FL_PARAM_DECAY, FL_PARAM_FROZEN rows
// are skipped). Its state covers the elements [state_begin, state_end): the
// whole model or one rank's shard (ZeRO), and every update falls inside.
// A step is fl_optim_begin_step (t++, the step's constants), updates of
// disjoint ranges in any order and split any way (bitwise the same result),
// then fl_optim_end_step. A rule's state is memory of the device that was
// fl_device_default() when the rule was made (rule.dev); fl_optim_update is
// the cpu's update (the cpu table's), and on another device updates go
// through its table's update (device.h).

// What one update reads and writes: every pointer is at element `offset` of
// the range. Gradients may be of any dtype (so they may live in per-block
// scratch) and are multiplied by grad_scale (loss unscaling and the clip
// coefficient folded together) as they are read; the fp32 weights are updated
// in place and, under mixed precision, rounded into the 16-bit copy the model
// computes with.
//
// Without a master copy (LOMO, AdaLomo: params NULL, params_lowp set) the
// 16-bit weights themselves are updated: each block is loaded to fp32,
// updated and stored back, rounded to nearest even or, with `stochastic`,
// by stochastic rounding (fl_store_f32_stochastic) whose random bits for
// element e of the flat buffer come from (sr_seed, e): first_index is the
// flat-buffer index of the range's first element, so the result is the same
// for any thread count and any split of a row into ranges.
typedef struct {
    float *params;     // fp32 weights (the master copy under mixed precision), or NULL
    void *params_lowp; // NULL, or the model's 16-bit weights: refreshed from params, or
                       // (params NULL) updated in place
    fl_dtype lowp_dtype;
    const void *grads;
    fl_dtype grads_dtype;
    float grad_scale;
    // LOMO/AdaLomo only: the factor applied after clipping by value (the
    // global-norm clip coefficient; 0 reads as 1). AdamW and SGD ignore it:
    // for them grad_scale already holds the clip coefficient.
    float clip_coef;
    int stochastic;       // params NULL: stochastic rounding instead of nearest even
    uint64_t sr_seed;     // the step's stochastic-rounding seed
    uint64_t first_index; // flat-buffer index of the range's first element
    // 1: called by every thread of the caller's parallel region, which share
    // the range's blocks (rules with team_rows only; see fl_update_range)
    int team;
    // tensor parallelism (NULL or size 1: none): AdaLomo sums a split row's
    // statistics over the TP group (every rank of it updates the same rows in
    // the same order)
    const fl_tp *tp;
    // NULL, or the step's verdict in the device's memory (fl_step_gate):
    // read where the update runs, it skips the update (gate->skip) or
    // supplies grad_scale and clip_coef (fl_gate_factors), so the host need
    // not wait for the norm before issuing the update
    const struct fl_step_gate *gate;
} fl_update_args;

typedef struct fl_optim_ops fl_optim_ops; // a rule's functions (src/optim/update.h)

// The part every rule shares; a rule's own struct starts with it.
typedef struct fl_optim_rule {
    const fl_optim_ops *ops;
    size_t state_begin, state_end; // flat-buffer elements the state covers
    // the flat element the state's memory starts at: state_begin, or the
    // first element of the chunk paged in (fl_optim_pager)
    size_t window_begin;
    int nstate; // state tensors: elementwise ones, (state_end - state_begin) floats each,
                // or per-row ones (AdaLomo) of fl_optim_state_numel floats per row
    // the device the state is allocated on: fl_device_default() when the
    // rule was made (its updates run there through the table's update)
    const struct fl_device *dev;
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
// Per row, tensor k holds fl_optim_state_numel(r, k, row) floats from
// fl_optim_state_ptr(r, k, row->offset): row->numel for the elementwise
// rules (AdamW, SGD); AdaLomo's state is per row (row and column statistics
// of a matrix), and only a row's first element may be asked for (0 floats
// where a tensor does not apply to the row). The address is the rule's
// device's (r->dev): on a device other than the cpu the host reads and
// writes the state through its copies (fl_dev_download, fl_dev_upload).
int fl_optim_state_count(const fl_optim_rule *r);
const char *fl_optim_state_name(const fl_optim_rule *r, int k);
float *fl_optim_state_ptr(fl_optim_rule *r, int k, size_t offset);
size_t fl_optim_state_numel(const fl_optim_rule *r, int k, const fl_param_view *row);
// Tensor k of row's state as a row of its own: numel its floats; shape, and
// tp_dim, tp_parts and tp_global how it splits over a tensor-parallel group
// (the row itself for elementwise rules; AdaLomo's row statistics split as a
// column-parallel matrix's rows and are whole on every rank of a
// row-parallel one, its column statistics the reverse), so that
// fl_params_blocks on a one-row table of it (with the rank's tp_size and
// tp_rank) places a rank's state in the whole row's.
fl_param_view fl_optim_state_view(const fl_optim_rule *r, int k, const fl_param_view *row);
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
    int no_bias_correction;   // DeepSpeed's bias_correction false: bc1 = bc2 = 1
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
// LOMO (Lv et al., lomo_optim/lomo.py): SGD without momentum, fused into the
// backward pass, no state. Per element: g = grad * grad_scale; g clamped to
// +-clip_value when clip_value > 0 (clip_grad_value); g *= clip_coef (the
// global-norm coefficient, fl_update_args.clip_coef); p = p * (1 - lr*wd) -
// lr*g, the decoupled decay on FL_PARAM_DECAY rows only. On fp32 weights
// with wd 0 and no clipping this is fl_sgd (momentum 0, wd 0) bitwise.

typedef struct {
    fl_optim_rule rule; // first: &opt->rule is the rule
    float weight_decay, clip_value;
    int t;          // steps begun
    float lr, keep; // this step's: lr and 1 - lr*wd
} fl_lomo;

void fl_lomo_init_range(fl_lomo *opt, size_t begin, size_t end, float weight_decay,
                        float clip_value);
void fl_lomo_free(fl_lomo *opt);

// ----------------------------------------------------------------------------
// AdaLomo (Lv et al., lomo_optim/adalomo.py): per row (tensor) at step t,
// with g processed as LOMO's (clamp, clip_coef):
//   beta2t = 1 - t^decay_rate;  u = g^2 + eps1
//   matrices (R x K: K the last dimension, R the product of the others):
//     row (R) = beta2t*row + (1-beta2t)*mean over columns of u
//     col (K) = beta2t*col + (1-beta2t)*mean over rows of u
//     u = g * rsqrt(row / mean(row)) * rsqrt(col)   (Adafactor's factored v)
//   vectors: v = beta2t*v + (1-beta2t)*u;  u = g * rsqrt(v)
//   u /= max(1, RMS(u) / clip_threshold)
//   lr_t = lr * max(eps2, RMS(p))       (p before the update)
//   p = p * (1 - lr_t*wd) - lr_t*u      (decay on FL_PARAM_DECAY rows only)
// The means and RMS are summed in double in a fixed order (bitwise the same
// for any thread count). An update must cover a whole row; under tensor
// parallelism (fl_update_args.tp) a rank's slice of it, the means and RMS
// those of the whole row (a rank's vocabulary padding rows counting in none). State, O(R + K)
// per matrix and O(numel) per vector: "exp_avg_sq_row", "exp_avg_sq_col"
// (0 floats for vectors) and "exp_avg_sq" (0 floats for matrices), in one
// FL_MEM_OPTIM buffer laid out row by row in table order.

typedef struct {
    fl_optim_rule rule;          // first: &opt->rule is the rule
    const fl_param_table *table; // must outlive the rule
    int first_row, end_row;      // the rows [first_row, end_row) make up [begin, end)
    float eps1, eps2, clip_threshold, decay_rate, weight_decay, clip_value;
    float *state;     // FL_MEM_OPTIM, numel floats
    size_t numel;     // fl_adalomo_state_numel(table, begin, end)
    int t;            // steps begun
    float lr, beta2t; // this step's
} fl_adalomo;

// Floats of AdaLomo state for the rows in [begin, end) (whole rows only).
size_t fl_adalomo_state_numel(const fl_param_table *t, size_t begin, size_t end);
// [begin, end) must be made of whole rows of t. clip_value: as LOMO's (0: off).
void fl_adalomo_init_range(fl_adalomo *opt, const fl_param_table *t, size_t begin, size_t end,
                           float eps1, float eps2, float clip_threshold, float decay_rate,
                           float weight_decay, float clip_value);
void fl_adalomo_free(fl_adalomo *opt);

// ----------------------------------------------------------------------------
// gradient norm and clipping, as torch.nn.utils.clip_grad_norm_: the L2 norm
// is summed in double over fixed chunks in a fixed order (the same for any
// thread count); the clip coefficient is max_norm / (norm + 1e-6) when
// max_norm > 0 and norm > max_norm, else 1.

float fl_grad_norm(fl_dtype dt, const void *grads, size_t n);
// The sum of squares fl_grad_norm takes the root of (in double; inf or NaN
// when a value is), for norms gathered piece by piece. Both read host
// memory: fl_grad_sumsq is the cpu table's sumsq, and the optimizer sums a
// device's gradients with its table's.
double fl_grad_sumsq(fl_dtype dt, const void *grads, size_t n);
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
// the spike guard (src/optim/spike_guard.c): llm.c's outlier detector
// (-sl/-sg, llmc/outlier_detector.h). A step whose loss or gradient norm lies
// more than a z-score threshold above the window of the last normal steps'
// values is an outlier: it is not applied. One-sided (a low value is never
// one); unlike llm.c the value judged is not part of the window it is judged
// against (there, z can never exceed (n - 1) / sqrt(n), so a short window
// could not flag anything), and an outlier's values never enter it (after a
// bad update every later step is an outlier, and must stay one).

typedef struct {
    float loss_z, grad_z; // z-scores above which a step is skipped; 0 = that test off
    int window;           // values each series keeps (the last normal steps')
    int min_count;        // values a series needs before it judges
    int max_in_row;       // consecutive outliers before the caller stops training
} fl_spike_config;

typedef struct {
    double v[FL_SPIKE_WINDOW_MAX]; // a ring of the last `count` values, the oldest at
    int count, next;               // v[(next - count) mod window]; the next goes at v[next]
} fl_spike_series;

typedef struct {
    fl_spike_config cfg;
    fl_spike_series loss, norm;
    int in_row;   // consecutive outliers up to the last step judged
    long skipped; // outliers in all
} fl_spike_guard;

// The verdict on one step: z-scores (NAN where not judged: the test off, too
// few values, or the value unknown or not finite).
typedef struct {
    int outlier;
    float loss_z, grad_z;
} fl_spike_verdict;

void fl_spike_guard_init(fl_spike_guard *g, const fl_spike_config *cfg);
// Whether the guard judges at all (a threshold is set).
int fl_spike_guard_on(const fl_spike_guard *g);
// The z-score of v against the series (its window's mean and standard
// deviation, the deviation at least 1% of |mean|: a series of equal values
// does not make every small rise infinite); NAN with fewer than min_count
// values.
double fl_spike_z(const fl_spike_series *s, int window, int min_count, double v);
// Adds v to the series (a window of `window` values; a non-finite v is not added).
void fl_spike_push(fl_spike_series *s, int window, double v);
// Judges a step by its loss and gradient norm (NAN: unknown, not judged):
// an outlier counts in in_row and skipped; a normal step's finite values
// enter their windows and end the row. Every rank must pass the same
// (all-reduced) values: they decide identically.
fl_spike_verdict fl_spike_judge(fl_spike_guard *g, double loss, double grad_norm);
// fl_spike_z in two halves, for a verdict formed elsewhere (a device's
// gate): the series' statistics now, and (src/optim/gate.h) the z-score of a
// value against them. fl_spike_record is fl_spike_judge's bookkeeping of a
// verdict so formed.
typedef struct {
    double mean, sd; // the window's; sd floored at 1% of |mean|
    int ok;          // enough values to judge
} fl_spike_stat;
fl_spike_stat fl_spike_stat_of(const fl_spike_series *s, int window, int min_count);
void fl_spike_record(fl_spike_guard *g, const fl_spike_verdict *v, double loss, double grad_norm);

// ----------------------------------------------------------------------------
// the step's gate: the verdict on a step, formed in the optimizer's device
// memory by the device (fl_device.gate, src/optim/gate.h's arithmetic on
// every device) from the loss and the gradient's sums of squares, which
// stay there: the batch's loss, the norm, an fp16 overflow or non-finite
// gradient, the spike guard's test and the clip coefficient. The updates
// read it (fl_update_args.gate), so a step is issued without the host
// waiting; the host reads it once, after the step's last update, for its
// own bookkeeping (the step count, the loss scale, the guard's window).

enum { FL_SKIP_NONE, FL_SKIP_OVERFLOW, FL_SKIP_NONFINITE, FL_SKIP_SPIKE, FL_SKIP_PARENT };

typedef struct fl_step_gate {
    double loss_raw;      // the model's loss sink: a micro-batch's sum of token losses
    double loss_sum;      // the sum over micro-batches of (double)loss * targets
    double sumsq;         // the (loss-scaled) gradient's sum of squares
    float loss;           // the batch's mean loss
    float grad_norm;      // of the unscaled gradient before clipping (0 after an overflow)
    float grad_scale;     // AdamW and SGD's factor on the gradient: unscale * clip_coef
    float unscale;        // 1 / the loss scale
    float clip_coef;      // the global-norm clip coefficient
    float loss_z, grad_z; // the spike guard's (NAN where not judged)
    int skip;             // FL_SKIP_*: nothing is updated unless FL_SKIP_NONE
    int judged; // the spike guard judged (1 the loss alone, 2 with the norm): its books move
} fl_step_gate;

enum { FL_GATE_LOSS, FL_GATE_JUDGE_LOSS, FL_GATE_VERDICT, FL_GATE_NORM };

// One operation on a gate, passed by value (a device runs it in one thread).
typedef struct {
    int op;
    // FL_GATE_LOSS: loss_sum gains a micro-batch's mean loss times its n
    // targets (the first replaces it)
    long n;
    int first;
    // the rest: rows (device memory) are summed in order into sumsq (nrows
    // -1: sumsq as the host set it, a sum over ranks); the loss is loss_sum /
    // total targets, or `loss` when loss_given
    const double *rows;
    int nrows;
    long total;
    int loss_given;
    float loss;
    float scale;         // the loss scale
    float max_grad_norm; // 0: no clipping
    int overflow_skips;  // a non-finite sum of squares skips as an fp16 overflow
    int nonfinite_skips; // a non-finite norm skips
    // the spike guard: 0 off, else the thresholds (0: that test off) and the
    // series' statistics; FL_GATE_JUDGE_LOSS judges the loss alone
    int judge;
    float loss_z, grad_z;
    fl_spike_stat loss_stat, norm_stat;
    // NULL, or a gate (the same memory's) whose skip skips this step too
    const fl_step_gate *parent;
} fl_gate_op;

// ----------------------------------------------------------------------------
// the optimizer of a training step

// LOMO and AdaLomo are the fused kinds: no fp32 master weights (the update
// runs on the model's weights, 16-bit ones by stochastic rounding or nearest
// even), meant to be called row by row from the backward pass.
typedef enum { FL_OPT_ADAMW, FL_OPT_SGD, FL_OPT_LOMO, FL_OPT_ADALOMO } fl_optim_kind;

typedef struct {
    fl_optim_kind kind;
    float beta1, beta2, eps, weight_decay, momentum; // eps: AdamW's, and AdaLomo's eps1 (1e-30)
    int no_bias_correction; // AdamW without bias correction (DeepSpeed's Adam's option)
    float max_grad_norm;    // 0 = no clipping
    int grad_accum;         // micro-batches per step
    // fp16 loss scaling (ignored for fp32/bf16)
    float loss_scale; // 0 = dynamic
    int initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis;
    float min_loss_scale;
    // LOMO / AdaLomo
    float clip_value; // clip_grad_value: clamp the unscaled gradient to +-clip_value; 0 = off
    int stochastic_rounding; // 16-bit weights: 1 stochastic rounding (the intended default), 0
                             // round to nearest even
    uint64_t seed;        // stochastic rounding: step t uses fl_sr_bits(seed, t) (the run's seed)
    float eps2;           // AdaLomo: floor of RMS(p) in the step size (1e-3)
    float clip_threshold; // AdaLomo: update RMS clip (1.0)
    float decay_rate;     // AdaLomo: beta2t = 1 - t^decay_rate (-0.8)
    int sharded_grads;    // ZeRO-2/3 sum the micro-batches' gradients themselves (in their
                          // shard): no whole fp32 sum here
    int in_backward;      // AdamW/SGD updated unit by unit from the backward pass, as LOMO is
                          // (optimizer_in_backward): no whole gradient buffer
    int paged; // the master weights and the rule's state live outside RAM (NVMe offload):
               // not allocated here; a pager (fl_optim_pager) is attached before the first step
    // ZeRO-Offload's delayed update (offload_optimizer.delayed_update): after
    // delayed_warmup updates, a step's update runs during the next step
    // (fl_optimizer_delayed_rows), which computes with the weights before it
    int delayed_update, delayed_warmup;
    // ZeRO-Offload (offload_optimizer.accumulate_on_device): the 16-bit
    // gradients' fp32 sum over the micro-batches is made on the device and
    // downloaded into grad_accum, which the offload allocates (pinned) and
    // sets, not fl_optimizer_init
    int accumulate_on_device;
    // ZeRO-Offload from a device (offload_optimizer.pin_memory): the state
    // (master weights, moments, fp32 sum) in pinned host memory too, not
    // only what crosses to the device
    int pin_memory;
    fl_spike_config spike; // the spike guard (all zero: off)
} fl_optimizer_config;

// The optimizer section of a run's config (src/optim/optim_config.c):
// options the chosen optimizers would ignore are refused, AdaLomo's own eps
// and clipping defaults set, stochastic rounding only on 16-bit weights,
// optimizer_in_backward's limits, an eps that can only give NaN refused.
// After the precision (cfg->dtype) and the LoRA section are checked.
void fl_optim_check_config(fl_train_config *cfg);

// LOMO or AdaLomo
static inline int fl_optim_kind_fused(fl_optim_kind k) {
    return k == FL_OPT_LOMO || k == FL_OPT_ADALOMO;
}

// Whether the update runs from the backward pass, unit by unit: LOMO and
// AdaLomo always, AdamW and SGD with in_backward.
static inline int fl_optim_in_backward(const fl_optimizer_config *c) {
    return fl_optim_kind_fused(c->kind) || c->in_backward;
}

// Data parallelism (dist.h) joins the step here; NULL for one process.
// Its gradients are host memory: the cpu device's only.
typedef struct {
    void *ctx;
    // The reduced gradient once every micro-batch is done: fp32 values of
    // the elements [state_begin, state_end) (waits for reductions in flight).
    const float *(*grads)(void *ctx);
    void (*sum)(void *ctx, double *v, int n); // over ranks, in place
    void (*max)(void *ctx, double *v, int n);
    void (*updated)(void *ctx); // after the update: share the new weights
    int replicated;             // every rank holds the whole range (DDP): norms need no sum
    // Fused kinds (LOMO, AdaLomo): the gradient of rows [first_row,
    // first_row + n_rows) (grads: of the model's dtype, from the first row's
    // first element) summed over ranks; returns the fp32 values of the part
    // [*lo, *hi) of those rows this rank updates (possibly empty).
    const float *(*reduce_rows)(void *ctx, int first_row, int n_rows, const void *grads, size_t *lo,
                                size_t *hi);
} fl_optim_sync;

// Optimizer state paged from storage (NVMe offload, offload.h): the fp32
// master weights (when there are some) and the rule's elementwise state of
// [state_begin, state_end) are brought into RAM a chunk at a time. A step
// walks the chunks in order: acquire makes chunk c resident and fills
// tensors[k] with the RAM address of its first element (k = 0 the master
// when there is one, then each state tensor), release hands it back to be
// written. map puts every chunk's tensors in memory at once, writable
// (checkpoints read and restore through it), and unmap writes them back.
// With `weights`, the model's weights of the range are paged too: *weights
// is the chunk's (the mapping's) first weight, and o->params points there
// only while a chunk is acquired or the state mapped. Chunks are host
// memory: a paged optimizer is the cpu device's.
enum { FL_OPTIM_MAX_TENSORS = 4 };
typedef struct {
    void *ctx;
    int n_chunks;
    int weights;
    void (*acquire)(void *ctx, int c, size_t *lo, size_t *hi, float **tensors, void **weights);
    void (*release)(void *ctx, int c);
    void (*map)(void *ctx, float **tensors, void **weights);
    void (*unmap)(void *ctx);
    size_t chunk; // elements per chunk: chunk c starts at state_begin + c * chunk
} fl_optim_pager;

// The model on a device, the optimizer in its pinned host memory
// (ZeRO-Offload, offload.h's fl_dev_offload): o->params and o->grads are
// host copies of the model's weights and gradients, which these keep in step
// with the device's (the device holds no whole gradient: each unit's comes
// down from a small ring during the backward pass).
typedef struct {
    void *ctx;
    void (*zero_grad)(void *ctx);  // o's gradients were zeroed: a micro-batch begins
    void (*grads_down)(void *ctx); // after a backward: o->grads holds the device's
    // the step updates groups of whole rows of about `chunk` elements in
    // order; the weights of elements [first, end) are final: they go up
    // while the next group is updated
    void (*rows_updated)(void *ctx, size_t first, size_t end);
    void (*updated)(void *ctx); // after the step's last group (NULL: nothing to do)
    size_t chunk;
    // each unit's gradient comes down as the backward pass reports it, so
    // the step may update units during the last one (fl_optimizer_can_overlap)
    int per_unit;
} fl_optim_offload;

struct fl_optim_pp {
    const fl_tp_ops *ops;  // over the pipeline group (its sum: the same bits on every rank)
    int whole_rows;        // rows of the whole model's table
    const int *row_global; // each local row's index there
    // each local row's offset in the rank's table of the whole model (its
    // tensor-parallel slices): the index stochastic rounding draws by
    const size_t *row_offset;
};

// The optimizer updates the elements [begin, end) of the model's flat buffer
// (fl_optimizer_init: all of them; fl_optimizer_init_range: one shard, as a
// ZeRO rank does): its master weights and rule state cover that range, while
// gradients (and their fp32 sum) cover the whole buffer.
typedef struct {
    fl_optimizer_config cfg;
    const fl_param_table *table;
    // fl_device_default() at init: params, grads, master, grad_accum and the
    // rule's state are its memory, and every pass over them is its table's
    const struct fl_device *dev;
    fl_dtype dtype;    // the model's weight and gradient dtype
    void *params;      // the model's weights (dtype)
    void *grads;       // the model's gradients (dtype)
    float *master;     // fp32 weights (FL_MEM_MASTER) under bf16/fp16 (not for the fused
                       // kinds), else NULL; element i of the flat buffer at
                       // master[i - rule->state_begin]
    float *grad_accum; // fp32 gradient sum (FL_MEM_GRADS) for bf16/fp16 with accumulation
    union {            // the rule of cfg.kind
        fl_adamw adamw;
        fl_sgd sgd;
        fl_lomo lomo;
        fl_adalomo adalomo;
    };
    fl_optim_rule *rule;       // &adamw.rule, &sgd.rule, &lomo.rule or &adalomo.rule
    fl_loss_scaler scaler;     // fp16; scale 1 otherwise
    int micro;                 // micro-batches seen in this step
    size_t params_first;       // flat-buffer element of params[0] (ZeRO-3 keeps one shard)
    const fl_optim_sync *sync; // data parallelism, or NULL
    // tensor parallelism (NULL or size 1: none): the gradient norm counts
    // each element once (a replicated row on TP rank 0 only) and sums over
    // the TP group; an fp16 overflow anywhere in it skips every rank's step
    const fl_tp *tp;
    // pipeline parallelism (NULL: none): each stage's rows' sums of squares
    // go to their place in the whole table (row_global) and are summed over
    // the stages, so the norm adds every tensor's in one global order, as
    // one process does; an fp16 overflow on any stage skips every step
    const struct fl_optim_pp *pp;
    const fl_optim_pager *pager;     // cfg.paged: where the master and state are, else NULL
    const fl_optim_offload *offload; // a device's model, this optimizer on the host, or NULL
    int mapped;                      // the pager's map is in place (fl_optimizer_map)
    // the step updating in the last micro-batch's backward pass
    // (fl_optimizer_begin_overlap): each row's sum of squares, and whether
    // the row is updated yet; NULL when the step updates after it
    double *overlap_sq;
    unsigned char *overlap_done;
    // the delayed update (cfg.delayed_update): the last step's, begun (its
    // rule's step, its factors in the gate) and run by the offload during
    // this step (fl_optimizer_delayed_rows): delayed while it is pending,
    // and the gradient it reads (the buffer the last step left, which the
    // offload then swaps out of grads or grad_accum for this step's)
    int delayed;
    const void *delayed_grads;
    fl_dtype delayed_dtype;
    fl_spike_guard spike; // judges fl_optimizer_step_loss's and the fused steps' updates
    // the step's verdict (FL_MEM_WORKSPACE, on dev), followed by a sum of
    // squares per table row; gating: the updates now read it
    fl_step_gate *gate;
    double *gate_rows;
    int gating;
    // NULL, or another optimizer's gate (the same device's) whose skip skips
    // this one's steps too (LoRA + LOMO: the adapters' by the base's)
    const fl_step_gate *parent_gate;
} fl_optimizer;

typedef struct {
    float loss;      // the batch's mean loss (as the step was given or summed it)
    float grad_norm; // of the unscaled gradient, before clipping
    int skipped;     // nothing was updated: an fp16 overflow (grad_norm 0), or a
                     // non-finite gradient in another precision (grad_norm inf/NaN)
    float loss_scale;
    fl_spike_verdict spike; // fl_optimizer_step_loss: an outlier was not applied either
} fl_step_result;

// Bytes the optimizer allocates per tag (master, optim, grads) for numel
// parameters of dtype dt: the same sizes fl_optimizer_init allocates.
// AdaLomo's state depends on the rows' shapes: without a table this reports
// an upper bound (numel floats); fl_optimizer_memory_table is exact for
// every kind (the rows in [begin, end) of the table; the gradient sum, when
// there is one, covers the whole table).
void fl_optimizer_memory(const fl_optimizer_config *cfg, fl_dtype dt, size_t numel,
                         size_t bytes[FL_MEM_NTAGS]);
void fl_optimizer_memory_table(const fl_optimizer_config *cfg, fl_dtype dt,
                               const fl_param_table *table, size_t begin, size_t end,
                               size_t bytes[FL_MEM_NTAGS]);
// Takes the model's table and buffers (memory of fl_device_default(), the
// device the optimizer is put on); under bf16/fp16 the master weights start
// as the fp32 values of the 16-bit weights.
void fl_optimizer_init(fl_optimizer *o, const fl_optimizer_config *cfg, const fl_param_table *table,
                       fl_dtype dt, void *params, void *grads);
// The same for the shard [begin, end) of the flat buffer: it allocates
// fl_optimizer_memory's master and optim bytes for end - begin parameters,
// and the fp32 gradient sum (when there is one) for the whole buffer.
void fl_optimizer_init_range(fl_optimizer *o, const fl_optimizer_config *cfg,
                             const fl_param_table *table, fl_dtype dt, void *params, void *grads,
                             size_t begin, size_t end);
// fl_optimizer_init_range over weights that hold the flat elements from
// params_first on (a ZeRO-3 shard, fl_model_init_from).
void fl_optimizer_init_at(fl_optimizer *o, const fl_optimizer_config *cfg,
                          const fl_param_table *table, fl_dtype dt, void *params,
                          size_t params_first, void *grads, size_t begin, size_t end);
void fl_optimizer_free(fl_optimizer *o);
// Tensors of a paged optimizer's state per element: the master (when there
// is one) and the rule's elementwise state.
int fl_optimizer_paged_tensors(const fl_optimizer_config *cfg, fl_dtype dt);
// A paged optimizer's state in memory for a while (a checkpoint's save or
// restore, a finiteness check): o->master and the rule's state pointers
// cover the whole range until fl_optimizer_unmap, which writes changes back.
// Both do nothing when the optimizer is not paged.
void fl_optimizer_map(fl_optimizer *o);
void fl_optimizer_unmap(fl_optimizer *o);
// The factor the backward pass multiplies the loss by: scale / grad_accum.
float fl_optimizer_loss_scale(const fl_optimizer *o);
// The current loss scale alone (1 for fp32/bf16), for a driver that
// normalises the loss itself (e.g. by the target tokens of the whole batch).
float fl_optimizer_scale(const fl_optimizer *o);
// Before each micro-batch's backward: zeroes the gradients it will write.
// Returns the bytes it cleared on the optimizer's device (the profile's).
size_t fl_optimizer_zero_grad(fl_optimizer *o);
// The least bytes a step's norm and update move on the device (the
// gradient read twice, the weights, master and state read and written),
// for the profile's floor: AdamW and SGD on one process without offload;
// 0 (not known) otherwise.
double fl_optimizer_step_io(const fl_optimizer *o);
// After each micro-batch's backward (accumulates into fp32 when needed).
void fl_optimizer_micro_done(fl_optimizer *o);
// The fp32 sum (grad_accum) gains the gradient elements [first, end): what
// fl_optimizer_micro_done does for the whole buffer, for a pipeline stage's
// chunk whose micro-batches' backwards interleave with another chunk's.
void fl_optimizer_accum_range(fl_optimizer *o, size_t first, size_t end);
// The same for rows [first_row, first_row + n_rows) as they arrive (a
// device's offload, one unit at a time); first_micro: the step's first
// micro-batch, whose gradient is written into the sum (nothing cleared
// before it: fl_optimizer_zero_grad leaves an offload's sum alone).
void fl_optimizer_accum_rows(fl_optimizer *o, int first_row, int n_rows, int first_micro);
// After the last micro-batch: the norm's rows into the gate, its verdict
// (overflow check, norm, clipping), then begin_step, the update over the
// whole table reading the verdict, and fl_optimizer_settle. Dies with a
// clear message when the fp16 loss scale is stuck at its minimum. A
// non-finite gradient norm in any precision skips the step (skipped = 1),
// changing no weight or state.
fl_step_result fl_optimizer_step(fl_optimizer *o, float lr);
// The same, with the step's loss (over every rank) for the spike guard,
// which judges the loss and the norm before anything is updated; an outlier
// changes no weight or state (spike.outlier = 1, skipped = 0).
fl_step_result fl_optimizer_step_loss(fl_optimizer *o, float lr, float loss);
// The same with the loss where the model left it on the device: the
// micro-batches' losses summed by fl_optimizer_add_loss into the gate, over
// `total` target tokens (every rank's: under data parallelism the host sums
// the gate's loss over the ranks first, so the device must be the host's).
// Nothing on the way waits for the device but the read of the verdict after
// the last update.
fl_step_result fl_optimizer_step_gated(fl_optimizer *o, float lr, long total);
// Where a model on model_dev sums its micro-batch's loss for the gate (its
// loss sink): the gate's loss_raw when the gate is that device's memory,
// else NULL (the model's loss comes to the host: ZeRO-Offload's optimizer
// on the host).
double *fl_optimizer_loss_sink(fl_optimizer *o, const struct fl_device *model_dev);
// After a micro-batch's forward into the loss sink: the gate's loss sum
// gains its mean loss times its n target tokens (the first replaces it).
void fl_optimizer_add_loss(fl_optimizer *o, int first, long n);
// The gate's bytes for a table of `rows` rows (step workspace: allocated
// with the optimizer under FL_MEM_WORKSPACE, not a model state).
size_t fl_optimizer_gate_bytes(int rows);
// Runs op on o's gate (op->rows, if any, the gate's own rows).
void fl_optimizer_gate_run(fl_optimizer *o, const fl_gate_op *op);
// The op's spike-guard fields from o's guard (judge: FL_GATE_JUDGE_LOSS or
// FL_GATE_VERDICT's tests, or 0 for none).
void fl_optimizer_gate_spike(const fl_optimizer *o, int judge, fl_gate_op *op);
// The gate as the host sees it: o->gate itself when the device's memory is
// the host's (free to read at any time), else NULL.
const fl_step_gate *fl_optimizer_gate_host(const fl_optimizer *o);
// A gated step's end: reads the verdict back (the step's one wait on a
// device) and keeps the host's books by it: a skipped step's count is taken
// back (begun: begin_step was called) and the loss scaler, the spike guard's
// window and counters move as fl_optimizer_step's would; the result is the
// step's. Dies as fl_optimizer_step does when the fp16 loss scale is stuck.
fl_step_result fl_optimizer_settle(fl_optimizer *o, int begun);

// The pieces of fl_optimizer_step, for a driver that updates block by block
// as gradients become ready (LOMO, ZeRO-2) and does its own overflow check
// and clipping. update_rows updates the part of rows [first_row,
// first_row + n_rows) inside [begin, end): `grads` (of grads_dtype) is the
// gradient of the first row's first element on, multiplied by grad_scale
// (1 / scale, times the clip coefficient) as it is read. end_step, after the
// step's last update and micro_done, records a clean step in the loss scaler.
//
// The fused kinds (LOMO, AdaLomo) work the same way on the model's weights
// (no master): 16-bit weights are stored back by stochastic rounding when
// cfg.stochastic_rounding (seeded by (cfg.seed, t), so a resume is bitwise),
// else by nearest even. AdaLomo needs whole rows in update_rows (a shard's
// range must be whole rows). update_rows_clip passes the clip coefficient
// apart from the unscaling, for LOMO/AdaLomo's order (clamp to +-clip_value
// the unscaled gradient, then multiply by clip_coef); for AdamW/SGD it is
// update_rows with grad_scale * clip_coef.
void fl_optimizer_begin_step(fl_optimizer *o, float lr);

// ZeRO-Offload's overlap (docs/offload.md): an offloaded AdamW or SGD step
// with no global-norm clipping, no fp16 and no spike test on the norm needs
// no whole gradient before its first update, so the host updates each unit
// as soon as its gradient is down, during the last micro-batch's backward
// pass. fl_optimizer_can_overlap: this optimizer's steps may;
// begin_overlap (before that backward, with the batch's mean loss) judges
// the loss by the spike guard and, unless it is a spike (0: the step goes
// the plain way and is skipped), begins the step at lr; update_unit updates rows
// [first_row, first_row + n_rows) whose gradient o->grads holds complete;
// fl_optimizer_step_loss then updates any row not reported and ends the
// step, its norm summed from the rows' in table order (the plain step's
// bits). A non-finite gradient cannot skip the step then: it is updated
// with, as the cpu's optimizer_in_backward is, and the norm reports it.
int fl_optimizer_can_overlap(const fl_optimizer *o);
int fl_optimizer_begin_overlap(fl_optimizer *o, float lr, float loss);
void fl_optimizer_update_unit(fl_optimizer *o, int first_row, int n_rows);

// ZeRO-Offload's one-step delayed update (cfg.delayed_update; the
// ZeRO-Offload paper's DPU): after cfg.delayed_warmup updates, a step that
// updates ends with its update begun (the verdict, norm and clipping are
// its own) but not run; the offload runs it during the next step
// (delayed_rows: rows [first_row, first_row + n_rows), each row once, from
// the gradient the step left in o->grads or the fp32 sum, o->delayed_grads,
// which the offload keeps apart from the next step's), and delayed_end ends
// it once every row is done.
// The next step computes with the weights before it. fl_optimizer_delays:
// whether this step's update will be delayed (asked before its last
// backward pass, which then does not overlap it: can_overlap is 0).
int fl_optimizer_delays(const fl_optimizer *o);
void fl_optimizer_delayed_rows(fl_optimizer *o, int first_row, int n_rows);
void fl_optimizer_delayed_end(fl_optimizer *o);
void fl_optimizer_update_rows(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                              fl_dtype grads_dtype, float grad_scale);
void fl_optimizer_update_rows_clip(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                                   fl_dtype grads_dtype, float grad_scale, float clip_coef);
// update_rows_clip with `grads` holding the gradient of flat element
// grads_first on (a reduced shard's part of the rows).
void fl_optimizer_update_range(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                               size_t grads_first, fl_dtype grads_dtype, float grad_scale,
                               float clip_coef);
void fl_optimizer_end_step(fl_optimizer *o);

// ----------------------------------------------------------------------------
// learning-rate schedules: fitlm's (linear warmup from 0 over warmup_steps,
// then constant, cosine or linear decay to min_lr_ratio * lr at
// total_steps), indexed by the step; DeepSpeed's WarmupLR, WarmupDecayLR
// and WarmupCosineLR, indexed as its scheduler is, by the updates applied
// before (it steps after each update an fp16 overflow did not skip).

typedef enum {
    FL_SCHED_CONSTANT,
    FL_SCHED_COSINE,
    FL_SCHED_LINEAR,
    FL_SCHED_WARMUP_LR,       // DeepSpeed's WarmupLR: warmup from `from` to lr, then lr
    FL_SCHED_WARMUP_DECAY_LR, // WarmupLR, then a line down to `from` at total_steps
    FL_SCHED_WARMUP_COSINE_LR // warmup from `from`, then a cosine to min_lr_ratio * lr
} fl_sched_kind;

typedef struct {
    fl_sched_kind kind;
    float lr; // the rate after warmup
    int warmup_steps;
    int total_steps;
    float min_lr_ratio; // the floor (WarmupCosineLR: cos_min_ratio)
    // DeepSpeed's: the rate warmup starts from (and WarmupDecayLR ends at;
    // WarmupCosineLR's as a fraction of lr), and warmup along
    // log(i + 1) / log(warmup_steps) rather than a line
    float from;
    int log_warmup;
} fl_schedule;

// The run's schedule from its config (fl_optim_check_config has checked it).
fl_schedule fl_schedule_of(const fl_train_config *cfg);
// Whether the schedule is DeepSpeed's, indexed by the updates applied.
int fl_schedule_by_updates(const fl_schedule *s);
// Learning rate for step n (0-based); for DeepSpeed's schedules, n is the
// updates applied before this one.
float fl_lr_at(const fl_schedule *s, int n);

#endif
