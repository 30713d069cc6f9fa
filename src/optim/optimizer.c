// optimizer.c: the optimizer side of a training step. Under bf16/fp16 the
// model computes with 16-bit weights while the update runs on fp32 master
// weights (mixed precision, as DeepSpeed's bf16/fp16 optimizers and
// Megatron's main params); gradients of several micro-batches are summed in
// fp32; under fp16 the loss is scaled up before the backward pass and an
// overflowing step is skipped without touching any weight or state. The
// update itself is the rule's (fl_optim_rule), one range per table row, over
// the whole table or over one shard of it. The fused kinds (LOMO, AdaLomo)
// keep no master: their update runs on the model's weights, 16-bit ones
// stored back by stochastic rounding seeded from (cfg.seed, t). Every
// buffer is the optimizer's device's (o->dev), and every pass over one is a
// call of its table: the host sees scalars (norms) only.
#include <math.h>
#include <string.h>

#include "fitlm/device.h"
#include "fitlm/optim.h"

#include "gate.h"
#include "update.h"

static int needs_accum_buffer(const fl_optimizer_config *cfg, fl_dtype dt) {
    // fp32 accumulates in the model's grads
    return dt != FL_F32 && cfg->grad_accum > 1 && !cfg->sharded_grads;
}

static int has_master(const fl_optimizer_config *cfg, fl_dtype dt) {
    return dt != FL_F32 && !fl_optim_kind_fused(cfg->kind);
}

void fl_optimizer_memory(const fl_optimizer_config *cfg, fl_dtype dt, size_t numel,
                         size_t bytes[FL_MEM_NTAGS]) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    if (needs_accum_buffer(cfg, dt)) bytes[FL_MEM_GRADS] = numel * sizeof(float);
    if (cfg->paged) return; // the master and state are the pager's
    if (has_master(cfg, dt)) bytes[FL_MEM_MASTER] = numel * sizeof(float);
    if (cfg->kind == FL_OPT_ADAMW)
        bytes[FL_MEM_OPTIM] = 2 * numel * sizeof(float);
    else if (cfg->kind == FL_OPT_SGD && cfg->momentum > 0.0f)
        bytes[FL_MEM_OPTIM] = numel * sizeof(float);
    else if (cfg->kind == FL_OPT_ADALOMO) // an upper bound: see fl_optimizer_memory_table
        bytes[FL_MEM_OPTIM] = numel * sizeof(float);
}

// the gate's verdict, then its rows' sums (64-byte aligned)
#define GATE_HEAD ((sizeof(fl_step_gate) + 63) / 64 * 64)

size_t fl_optimizer_gate_bytes(int rows) {
    return GATE_HEAD + (size_t)rows * sizeof(double);
}

void fl_optimizer_memory_table(const fl_optimizer_config *cfg, fl_dtype dt,
                               const fl_param_table *table, size_t begin, size_t end,
                               size_t bytes[FL_MEM_NTAGS]) {
    fl_optimizer_memory(cfg, dt, end - begin, bytes);
    if (needs_accum_buffer(cfg, dt)) bytes[FL_MEM_GRADS] = table->numel * sizeof(float);
    if (cfg->kind == FL_OPT_ADALOMO && !cfg->paged)
        bytes[FL_MEM_OPTIM] = fl_adalomo_state_numel(table, begin, end) * sizeof(float);
}

int fl_optimizer_paged_tensors(const fl_optimizer_config *cfg, fl_dtype dt) {
    int n = has_master(cfg, dt);
    if (cfg->kind == FL_OPT_ADAMW) n += 2;
    if (cfg->kind == FL_OPT_SGD && cfg->momentum > 0.0f) n += 1;
    return n;
}

void fl_optimizer_init_range(fl_optimizer *o, const fl_optimizer_config *cfg,
                             const fl_param_table *table, fl_dtype dt, void *params, void *grads,
                             size_t begin, size_t end) {
    fl_optimizer_init_at(o, cfg, table, dt, params, 0, grads, begin, end);
}

void fl_optimizer_init_at(fl_optimizer *o, const fl_optimizer_config *cfg,
                          const fl_param_table *table, fl_dtype dt, void *params,
                          size_t params_first, void *grads, size_t begin, size_t end) {
    memset(o, 0, sizeof *o);
    FL_ASSERT(cfg->grad_accum >= 1);
    FL_ASSERT(begin <= end && end <= table->numel && params_first <= begin);
    o->cfg = *cfg;
    fl_spike_guard_init(&o->spike, &cfg->spike);
    o->table = table;
    const fl_device *d = o->dev = fl_device_default();
    o->dtype = dt;
    o->params = params;
    o->params_first = params_first;
    o->grads = grads;
    // a paged optimizer's pager holds the master and the state
    FL_ASSERT(!cfg->paged || cfg->kind == FL_OPT_ADAMW || cfg->kind == FL_OPT_SGD);
    FL_ASSERT(!cfg->paged || d->host); // a pager's memory is the host's
    if (has_master(cfg, dt) && !cfg->paged) {
        o->master = d->alloc(d, FL_MEM_MASTER, (end - begin) * sizeof(float));
        d->convert(FL_F32, o->master, dt, fl_at(dt, params, begin - params_first), end - begin);
    }
    if (needs_accum_buffer(cfg, dt) && !cfg->accumulate_on_device)
        o->grad_accum = d->alloc(d, FL_MEM_GRADS, table->numel * sizeof(float));
    o->gate = d->alloc(d, FL_MEM_WORKSPACE, fl_optimizer_gate_bytes(table->count));
    o->gate_rows = (double *)(void *)((char *)o->gate + GATE_HEAD);
    if (cfg->kind == FL_OPT_ADAMW) {
        fl_adamw_setup(&o->adamw, begin, end, cfg->beta1, cfg->beta2, cfg->eps, cfg->weight_decay,
                       !cfg->paged);
        o->adamw.no_bias_correction = cfg->no_bias_correction;
        o->rule = &o->adamw.rule;
    } else if (cfg->kind == FL_OPT_SGD) {
        fl_sgd_setup(&o->sgd, begin, end, cfg->momentum, cfg->weight_decay, !cfg->paged);
        o->rule = &o->sgd.rule;
    } else if (cfg->kind == FL_OPT_LOMO) {
        fl_lomo_init_range(&o->lomo, begin, end, cfg->weight_decay, cfg->clip_value);
        o->rule = &o->lomo.rule;
    } else {
        FL_ASSERT(cfg->kind == FL_OPT_ADALOMO);
        fl_adalomo_init_range(&o->adalomo, table, begin, end, cfg->eps, cfg->eps2,
                              cfg->clip_threshold, cfg->decay_rate, cfg->weight_decay,
                              cfg->clip_value);
        o->rule = &o->adalomo.rule;
    }
    if (dt == FL_F16)
        fl_loss_scaler_init(&o->scaler, cfg->loss_scale, cfg->initial_scale_power,
                            cfg->loss_scale_window, cfg->hysteresis, cfg->consecutive_hysteresis,
                            cfg->min_loss_scale);
    else
        fl_loss_scaler_init(&o->scaler, 1.0f, 0, 1, 1, 0, 1.0f); // static 1: no scaling
}

void fl_optimizer_init(fl_optimizer *o, const fl_optimizer_config *cfg, const fl_param_table *table,
                       fl_dtype dt, void *params, void *grads) {
    fl_optimizer_init_range(o, cfg, table, dt, params, grads, 0, table->numel);
}

void fl_optimizer_free(fl_optimizer *o) {
    FL_ASSERT(!o->mapped);
    if (o->dev) {
        o->dev->free(o->dev, o->master);
        if (!o->cfg.accumulate_on_device) o->dev->free(o->dev, o->grad_accum); // (the offload's)
        o->dev->free(o->dev, o->gate);
    }
    if (o->rule) fl_optim_free(o->rule);
    memset(o, 0, sizeof *o);
}

float fl_optimizer_loss_scale(const fl_optimizer *o) {
    return o->scaler.scale / (float)o->cfg.grad_accum;
}

size_t fl_optimizer_zero_grad(fl_optimizer *o) {
    const fl_device *d = o->dev;
    size_t n = o->table->numel, bytes = 0;
    // offloaded from a device, the host's gradients are written whole by
    // each micro-batch's downloads, and its fp32 sum by micro-batch 0's
    // (device_offload.c): nothing to clear here, while the device waits
    if (o->micro == 0 && o->grad_accum && !o->offload) {
        d->zero(d, o->grad_accum, n * sizeof(float));
        bytes += n * sizeof(float);
    }
    // fp32 sums micro-batches in the model's own gradients; 16-bit gradients
    // are per micro-batch and summed into the fp32 buffer
    if (o->micro == 0 || o->grad_accum) {
        if (o->offload) { // (no host copy of the gradients with the sum made on the device)
            o->offload->zero_grad(o->offload->ctx);
        } else if (o->grads) {
            d->zero(d, o->grads, n * fl_dtype_size(o->dtype));
            bytes += n * fl_dtype_size(o->dtype);
        }
    }
    return bytes;
}

double fl_optimizer_step_io(const fl_optimizer *o) {
    int adamw = o->cfg.kind == FL_OPT_ADAMW, sgd = o->cfg.kind == FL_OPT_SGD;
    if ((!adamw && !sgd) || o->sync || o->tp || o->pp || o->pager || o->offload) return 0.0;
    double n = (double)o->table->numel, D = (double)fl_dtype_size(o->dtype);
    double g = o->grad_accum ? 4.0 : D;             // the gradient summed in
    double w = o->master ? 2.0 * 4.0 + D : 2.0 * D; // fp32 master read and written, weights written
    double state = adamw ? 2.0 * 8.0 : o->sgd.buf ? 8.0 : 0.0;
    return n * (2.0 * g + w + state);
}

void fl_optimizer_accum_range(fl_optimizer *o, size_t first, size_t end) {
    o->dev->accumulate(o->grad_accum + first, o->dtype, fl_at(o->dtype, o->grads, first),
                       end - first);
}

// The flat elements [*lo, *hi) of rows [first_row, first_row + n_rows).
static void rows_range(const fl_optimizer *o, int first_row, int n_rows, size_t *lo, size_t *hi) {
    const fl_param_view *a = &o->table->views[first_row],
                        *b = &o->table->views[first_row + n_rows - 1];
    *lo = a->offset;
    *hi = b->offset + b->numel;
}

void fl_optimizer_accum_rows(fl_optimizer *o, int first_row, int n_rows, int first_micro) {
    size_t lo, hi;
    rows_range(o, first_row, n_rows, &lo, &hi);
    if (first_micro) // 0 + g's bits
        o->dev->convert(FL_F32, o->grad_accum + lo, o->dtype, fl_at(o->dtype, o->grads, lo),
                        hi - lo);
    else
        fl_optimizer_accum_range(o, lo, hi);
}

void fl_optimizer_micro_done(fl_optimizer *o) {
    o->micro++;
    if (o->offload) o->offload->grads_down(o->offload->ctx);
    // offloaded, each unit was summed as its download landed (overlapped:
    // by fl_optimizer_update_unit)
    if (o->grad_accum && !o->offload) fl_optimizer_accum_range(o, 0, o->table->numel);
}

float fl_optimizer_scale(const fl_optimizer *o) {
    return o->scaler.scale;
}

void fl_optimizer_begin_step(fl_optimizer *o, float lr) {
    fl_optim_begin_step(o->rule, lr);
}

void fl_optimizer_update_rows(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                              fl_dtype grads_dtype, float grad_scale) {
    fl_optimizer_update_rows_clip(o, first_row, n_rows, grads, grads_dtype, grad_scale, 1.0f);
}

// Points the master and the rule's state (and paged weights) at memory
// holding flat element `begin` on (tensors as the pager orders them), or at
// nothing (tensors NULL).
static void bind_window(fl_optimizer *o, size_t begin, float *const *tensors, void *weights) {
    float *t[FL_OPTIM_MAX_TENSORS] = {0};
    int n = fl_optimizer_paged_tensors(&o->cfg, o->dtype), m = has_master(&o->cfg, o->dtype);
    for (int k = 0; tensors && k < n; k++) t[k] = tensors[k];
    o->master = m ? t[0] : NULL;
    fl_optim_set_window(o->rule, tensors ? begin : o->rule->state_begin, t + m);
    if (o->pager->weights) {
        o->params = weights;
        o->params_first = tensors ? begin : o->rule->state_begin;
    }
}

// The update of the rows' elements inside [lo, hi); team: called by every
// thread of a parallel region, which share each row's blocks.
static void update_rows(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                        size_t grads_first, fl_dtype grads_dtype, float grad_scale, float clip_coef,
                        size_t span_lo, size_t span_hi, int team) {
    fl_optim_rule *r = o->rule;
    int fused = fl_optim_kind_fused(o->cfg.kind);
    if (!fused) grad_scale *= clip_coef; // folded, as the whole-step path does
    // the step's stochastic-rounding seed (t counts steps begun)
    uint64_t sr_seed = fl_sr_bits(o->cfg.seed, (uint64_t)*fl_optim_step_count(r));
    // a device that takes rows in batches gets them so (update_rows)
    const fl_param_view *batch_rows[FL_UPDATE_ROWS];
    size_t batch_lo[FL_UPDATE_ROWS], batch_n[FL_UPDATE_ROWS];
    fl_update_args batch_args[FL_UPDATE_ROWS];
    int batched = 0, batching = o->dev->update_rows != NULL;
    for (int k = first_row; k < first_row + n_rows; k++) {
        const fl_param_view *v = &o->table->views[k];
        size_t lo = v->offset > span_lo ? v->offset : span_lo;
        size_t hi = v->offset + v->numel < span_hi ? v->offset + v->numel : span_hi;
        if (lo >= hi) continue;           // outside this optimizer's range
        size_t at = lo - o->params_first; // in o->params
        float *params = o->master            ? o->master + (lo - r->window_begin)
                        : o->dtype == FL_F32 ? (float *)o->params + at
                                             : NULL; // fused: the 16-bit weights themselves
        fl_update_args a = {
            .params = params,
            .params_lowp = o->dtype != FL_F32 ? fl_at(o->dtype, o->params, at) : NULL,
            .lowp_dtype = o->dtype,
            .grads = fl_at_const(grads_dtype, grads, lo - grads_first),
            .grads_dtype = grads_dtype,
            .grad_scale = grad_scale,
            .clip_coef = fused ? clip_coef : 1.0f,
            .stochastic = o->cfg.stochastic_rounding,
            .sr_seed = sr_seed,
            // the element's place in the rank's whole table: a pipeline
            // stage's rows draw the bits one process's would
            .first_index = o->pp ? o->pp->row_offset[k] + (lo - v->offset) : lo,
            .team = team,
            .tp = o->tp,
            .gate = o->gating ? o->gate : NULL,
        };
        if (!batching) {
            o->dev->update(o->rule, v, lo, hi - lo, &a);
            continue;
        }
        batch_rows[batched] = v, batch_lo[batched] = lo, batch_n[batched] = hi - lo;
        batch_args[batched++] = a;
        if (batched == FL_UPDATE_ROWS) {
            o->dev->update_rows(o->rule, batched, batch_rows, batch_lo, batch_n, batch_args);
            batched = 0;
        }
    }
    if (batched) o->dev->update_rows(o->rule, batched, batch_rows, batch_lo, batch_n, batch_args);
}

// The rows' update: on the cpu, for a rule whose rows can share a team, all
// of them in one parallel region; otherwise (and on any other device, whose
// update is one call per row) each row opens its own. With
// OMP_WAIT_POLICY=PASSIVE a region costs ~60 us of waking the other thread
// (one with 5 us of work took 65 us here, 11 with spinning threads): a
// region per row held the clip+AdamW phase of SmolLM-135M's 273 rows at
// 114-132 ms against 98-117 in one (Zen 4, alternated runs).
static void update_span(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                        size_t grads_first, fl_dtype grads_dtype, float grad_scale, float clip_coef,
                        size_t span_lo, size_t span_hi) {
    if (!o->rule->ops->team_rows || !o->dev->host) {
        update_rows(o, first_row, n_rows, grads, grads_first, grads_dtype, grad_scale, clip_coef,
                    span_lo, span_hi, 0);
        return;
    }
#pragma omp parallel
    update_rows(o, first_row, n_rows, grads, grads_first, grads_dtype, grad_scale, clip_coef,
                span_lo, span_hi, 1);
}

void fl_optimizer_update_range(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                               size_t grads_first, fl_dtype grads_dtype, float grad_scale,
                               float clip_coef) {
    FL_ASSERT(first_row >= 0 && n_rows >= 0 && first_row + n_rows <= o->table->count);
    const fl_optim_rule *r = o->rule;
    if (!o->cfg.paged || o->mapped) {
        update_span(o, first_row, n_rows, grads, grads_first, grads_dtype, grad_scale, clip_coef,
                    r->state_begin, r->state_end);
        return;
    }
    FL_ASSERT(o->pager);
    if (!n_rows) return;
    // the chunks holding the rows' part of the range, one at a time, from
    // the last: the order in which the backward pass completes units
    const fl_param_view *first = &o->table->views[first_row],
                        *last = &o->table->views[first_row + n_rows - 1];
    size_t a = first->offset > r->state_begin ? first->offset : r->state_begin;
    size_t b =
        last->offset + last->numel < r->state_end ? last->offset + last->numel : r->state_end;
    if (a >= b) return;
    const fl_optim_pager *p = o->pager;
    int c_first = (int)((a - r->state_begin) / p->chunk),
        c_last = (int)((b - 1 - r->state_begin) / p->chunk);
    for (int c = c_last; c >= c_first; c--) {
        size_t lo, hi;
        float *t[FL_OPTIM_MAX_TENSORS];
        void *w;
        p->acquire(p->ctx, c, &lo, &hi, t, &w);
        bind_window(o, lo, t, w);
        if (lo < b && hi > a)
            update_span(o, first_row, n_rows, grads, grads_first, grads_dtype, grad_scale,
                        clip_coef, lo, hi);
        bind_window(o, 0, NULL, NULL);
        p->release(p->ctx, c);
    }
}

void fl_optimizer_map(fl_optimizer *o) {
    if (!o->cfg.paged || o->mapped) return;
    float *t[FL_OPTIM_MAX_TENSORS];
    void *w;
    o->pager->map(o->pager->ctx, t, &w);
    bind_window(o, o->rule->state_begin, t, w);
    o->mapped = 1;
}

void fl_optimizer_unmap(fl_optimizer *o) {
    if (!o->mapped) return;
    bind_window(o, 0, NULL, NULL);
    o->pager->unmap(o->pager->ctx);
    o->mapped = 0;
}

void fl_optimizer_update_rows_clip(fl_optimizer *o, int first_row, int n_rows, const void *grads,
                                   fl_dtype grads_dtype, float grad_scale, float clip_coef) {
    size_t base = n_rows ? o->table->views[first_row].offset : 0; // where `grads` starts
    fl_optimizer_update_range(o, first_row, n_rows, grads, base, grads_dtype, grad_scale,
                              clip_coef);
}

void fl_optimizer_end_step(fl_optimizer *o) {
    if (!o->delayed) fl_optim_end_step(o->rule); // a delayed update's ends when it has run
    fl_loss_scaler_update(&o->scaler, 0);
    o->micro = 0;
}

// Whether row v's elements inside [first, first + n) count in the norm, and
// which ([*a, *b)): each element once over the model-parallel ranks (a
// replicated row on TP rank 0 only, a pipeline's tied copy never).
static int norm_range(const fl_optimizer *o, const fl_param_view *v, size_t first, size_t n,
                      size_t *a, size_t *b) {
    *a = v->offset > first ? v->offset : first;
    *b = v->offset + v->numel < first + n ? v->offset + v->numel : first + n;
    int counted =
        !(v->flags & FL_PARAM_TIED_COPY) && (!o->tp || v->tp_dim >= 0 || o->tp->rank == 0);
    return *b > *a && counted;
}

// The squares of the gradient elements [first, first + n) of dtype dt, each
// element counted once (norm_range), summed row by row in table order into
// the gate's rows on the device: returns how many, for the verdict to add
// (the host never sees them). Across ranks the host adds them instead (its
// memory: a host device) and leaves the total in the gate's sumsq (returns
// -1): over the TP group; with `dp`, over the data-parallel ranks too; under
// pipeline parallelism each row's sum goes to its place in the whole table,
// the places are summed over the stages (one holds each) and added in that
// order: the same bits as one process's for the same gradient.
enum { NORM_BATCH = 256 }; // rows per sumsq_rows call: a GPT-2's or a LLaMA-1B's all at once

static int grad_sumsq(fl_optimizer *o, fl_dtype dt, const void *grads, size_t first, size_t n,
                      int dp) {
    const fl_param_table *t = o->table;
    int rows = 0;
    for (int r0 = 0; r0 < t->count; r0 += NORM_BATCH) {
        size_t offsets[NORM_BATCH], counts[NORM_BATCH], a, b;
        int k = 0;
        for (int r = r0; r < t->count && r < r0 + NORM_BATCH; r++)
            if (norm_range(o, &t->views[r], first, n, &a, &b))
                offsets[k] = a - first, counts[k++] = b - a;
        o->dev->sumsq_rows(dt, grads, k, offsets, counts, o->gate_rows + rows);
        rows += k;
    }
    if (!o->tp && !o->pp && !dp) return rows;
    FL_ASSERT(o->dev->host); // several ranks: a host device's memory
    double s = 0.0;
    if (o->pp) {
        int whole = o->pp->whole_rows, i = 0;
        double *sq = fl_alloc(FL_MEM_WORKSPACE, (size_t)whole * sizeof(double));
        memset(sq, 0, (size_t)whole * sizeof(double));
        for (int r = 0; r < t->count; r++) {
            size_t a, b;
            if (norm_range(o, &t->views[r], first, n, &a, &b))
                sq[o->pp->row_global[r]] = o->gate_rows[i++];
        }
        if (o->tp) o->tp->ops->sum(o->tp->ops->ctx, sq, whole);
        o->pp->ops->sum(o->pp->ops->ctx, sq, whole);
        if (dp) o->sync->sum(o->sync->ctx, sq, whole);
        for (int r = 0; r < whole; r++) s += sq[r];
        fl_free(sq);
    } else {
        for (int i = 0; i < rows; i++) s += o->gate_rows[i];
        if (o->tp) o->tp->ops->sum(o->tp->ops->ctx, &s, 1);
        if (dp) o->sync->sum(o->sync->ctx, &s, 1);
    }
    o->gate->sumsq = s;
    return -1;
}

// AdamW or SGD offloaded from a device: groups of whole rows of about
// o->offload->chunk elements, each handed to the offload to go up as soon as
// it is updated (updates of disjoint ranges: bitwise one update's).
static void update_offloaded(fl_optimizer *o, const void *grads, size_t first, fl_dtype dt,
                             float grad_scale) {
    const fl_param_table *t = o->table;
    const fl_optim_offload *f = o->offload;
    for (int row = 0, end; row < t->count; row = end) {
        size_t lo = t->views[row].offset;
        for (end = row + 1; end < t->count; end++)
            if (t->views[end].offset + t->views[end].numel - lo > f->chunk) break;
        fl_optimizer_update_range(o, row, end - row, grads, first, dt, grad_scale, 1.0f);
        f->rows_updated(f->ctx, lo, t->views[end - 1].offset + t->views[end - 1].numel);
    }
}

int fl_optimizer_delays(const fl_optimizer *o) {
    return o->offload && o->cfg.delayed_update &&
           *fl_optim_step_count(o->rule) >= o->cfg.delayed_warmup;
}

void fl_optimizer_delayed_rows(fl_optimizer *o, int first_row, int n_rows) {
    FL_ASSERT(o->delayed && first_row >= 0 && first_row + n_rows <= o->table->count);
    o->gating = 1; // the factors of the step's verdict, which the gate keeps until the next
    fl_optimizer_update_range(o, first_row, n_rows, o->delayed_grads, 0, o->delayed_dtype, 1.0f,
                              1.0f);
    o->gating = 0;
}

void fl_optimizer_delayed_end(fl_optimizer *o) {
    FL_ASSERT(o->delayed);
    o->delayed = 0;
    fl_optim_end_step(o->rule);
}

int fl_optimizer_can_overlap(const fl_optimizer *o) {
    return o->offload && o->offload->per_unit && !fl_optimizer_delays(o) &&
           o->cfg.max_grad_norm <= 0.0f && o->dtype != FL_F16 &&
           !fl_optim_kind_fused(o->cfg.kind) && !o->sync && !o->tp && !o->pp &&
           !(fl_spike_guard_on(&o->spike) && o->spike.cfg.grad_z > 0.0f);
}

int fl_optimizer_begin_overlap(fl_optimizer *o, float lr, float loss) {
    FL_ASSERT(fl_optimizer_can_overlap(o) && o->micro == o->cfg.grad_accum - 1);
    // the spike guard's loss test, made now (its verdict is the step's:
    // the norm has no say): a spike steps after the backward pass, skipped
    const fl_spike_guard *g = &o->spike;
    if (fl_spike_guard_on(g) && g->cfg.loss_z > 0.0f &&
        (float)fl_spike_z(&g->loss, g->cfg.window, g->cfg.min_count, loss) > g->cfg.loss_z)
        return 0;
    size_t rows = (size_t)o->table->count;
    o->overlap_sq = fl_alloc(FL_MEM_WORKSPACE, rows * sizeof(double));
    o->overlap_done = fl_alloc(FL_MEM_WORKSPACE, rows);
    memset(o->overlap_done, 0, rows);
    fl_optimizer_begin_step(o, lr);
    return 1;
}

void fl_optimizer_update_unit(fl_optimizer *o, int first_row, int n_rows) {
    FL_ASSERT(o->overlap_sq && n_rows > 0);
    size_t lo, hi;
    rows_range(o, first_row, n_rows, &lo, &hi);
    if (o->grad_accum && !o->cfg.accumulate_on_device) fl_optimizer_accum_range(o, lo, hi);
    const void *grads = o->grad_accum ? (const void *)o->grad_accum : o->grads;
    fl_dtype dt = o->grad_accum ? FL_F32 : o->dtype;
    for (int r0 = first_row; r0 < first_row + n_rows; r0 += NORM_BATCH) { // grad_sumsq's per row
        size_t offsets[NORM_BATCH], counts[NORM_BATCH];
        int k = 0;
        for (int r = r0; r < first_row + n_rows && r < r0 + NORM_BATCH; r++, k++) {
            const fl_param_view *v = &o->table->views[r];
            offsets[k] = v->offset;
            counts[k] = v->flags & FL_PARAM_TIED_COPY ? 0 : v->numel;
            o->overlap_done[r] = 1;
        }
        o->dev->sumsq_rows(dt, grads, k, offsets, counts, o->overlap_sq + r0);
    }
    fl_optimizer_update_range(o, first_row, n_rows, grads, 0, dt, 1.0f, 1.0f);
    o->offload->rows_updated(o->offload->ctx, lo, hi);
}

// The overlapped step's end: the rows no unit reported, then the norm.
// judge: the spike guard records the step's loss and norm, as the plain
// step does for a finite norm.
static fl_step_result overlap_end(fl_optimizer *o, float loss, int judge) {
    for (int r = 0; r < o->table->count; r++)
        if (!o->overlap_done[r]) fl_optimizer_update_unit(o, r, 1);
    double sumsq = 0.0;
    for (int r = 0; r < o->table->count; r++) sumsq += o->overlap_sq[r];
    fl_free(o->overlap_sq);
    fl_free(o->overlap_done);
    o->overlap_sq = NULL;
    o->overlap_done = NULL;
    fl_optimizer_end_step(o);
    if (o->offload->updated) o->offload->updated(o->offload->ctx);
    fl_step_result r = {loss, (float)sqrt(sumsq), 0, o->scaler.scale, {0, NAN, NAN}};
    if (judge && isfinite(r.grad_norm)) r.spike = fl_spike_judge(&o->spike, loss, r.grad_norm);
    FL_ASSERT(!r.spike.outlier); // the loss passed before the update, and the norm has no say
    return r;
}

// judge: the spike guard looks at the loss and the norm before the update;
// the loss is *loss, or the gate's sum over total target tokens (NULL).
static fl_step_result optimizer_step(fl_optimizer *o, float lr, int judge, const float *loss,
                                     long total) {
    FL_ASSERT(o->micro == o->cfg.grad_accum);
    FL_ASSERT(!o->delayed); // the offload ended the last step's during the backward (grads_down)
    if (o->overlap_sq) return overlap_end(o, loss ? *loss : NAN, judge);
    const fl_optim_sync *sync = o->sync;
    // the gradient the update reads: the whole local one, or under data
    // parallelism the reduced one over this rank's range
    size_t n = o->table->numel, first = 0;
    const void *grads = o->grad_accum ? (const void *)o->grad_accum : o->grads;
    fl_dtype grads_dtype = o->grad_accum ? FL_F32 : o->dtype;
    if (sync) {
        grads = sync->grads(sync->ctx);
        grads_dtype = FL_F32;
        first = o->rule->state_begin;
        n = o->rule->state_end - first;
    }
    // the verdict, on the device: an fp16 overflow, or an inf or NaN
    // gradient in another precision (the caller sees the norm and decides
    // whether training has diverged), or a spike, skips the step; no
    // weight, master or optimizer-state byte changes then
    fl_gate_op op = {.op = FL_GATE_VERDICT,
                     .total = total,
                     .loss_given = loss != NULL,
                     .loss = loss ? *loss : 0.0f,
                     .scale = o->scaler.scale,
                     .max_grad_norm = o->cfg.max_grad_norm,
                     .overflow_skips = o->dtype == FL_F16,
                     .nonfinite_skips = 1,
                     .parent = o->parent_gate};
    op.nrows = grad_sumsq(o, grads_dtype, grads, first, n, sync && !sync->replicated);
    op.rows = o->gate_rows;
    fl_optimizer_gate_spike(o, judge ? FL_GATE_VERDICT : 0, &op);
    fl_optimizer_gate_run(o, &op);
    // the update reads its factors, or its skip, from the gate (where the
    // host sees the verdict for free, a skipped step issues nothing)
    const fl_step_gate *known = fl_optimizer_gate_host(o);
    int begun = !(known && known->skip);
    if (begun) {
        int delay = fl_optimizer_delays(o); // (before the step count moves)
        fl_optimizer_begin_step(o, lr);
        o->gating = 1;
        if (delay) { // run by the offload during the next step
            FL_ASSERT(known && !o->delayed);
            o->delayed = 1;
            o->delayed_grads = grads;
            o->delayed_dtype = grads_dtype;
        } else if (o->offload)
            update_offloaded(o, grads, first, grads_dtype, 1.0f);
        else
            fl_optimizer_update_range(o, 0, o->table->count, grads, first, grads_dtype, 1.0f, 1.0f);
        o->gating = 0;
        if (sync) sync->updated(sync->ctx);
        if (o->offload && o->offload->updated) o->offload->updated(o->offload->ctx);
    }
    return fl_optimizer_settle(o, begun);
}

fl_step_result fl_optimizer_step(fl_optimizer *o, float lr) {
    return optimizer_step(o, lr, 0, NULL, 0);
}

fl_step_result fl_optimizer_step_loss(fl_optimizer *o, float lr, float loss) {
    return optimizer_step(o, lr, 1, &loss, 0);
}

fl_step_result fl_optimizer_step_gated(fl_optimizer *o, float lr, long total) {
    return optimizer_step(o, lr, 1, NULL, total);
}

double *fl_optimizer_loss_sink(fl_optimizer *o, const fl_device *model_dev) {
    return o->dev == model_dev ? &o->gate->loss_raw : NULL;
}

void fl_optimizer_gate_run(fl_optimizer *o, const fl_gate_op *op) {
    o->dev->gate(o->gate, op);
}

void fl_optimizer_add_loss(fl_optimizer *o, int first, long n) {
    fl_gate_op op = {.op = FL_GATE_LOSS, .n = n, .first = first};
    fl_optimizer_gate_run(o, &op);
}

void fl_optimizer_gate_spike(const fl_optimizer *o, int judge, fl_gate_op *op) {
    const fl_spike_guard *g = &o->spike;
    op->judge = judge && fl_spike_guard_on(g);
    if (!op->judge) return;
    op->loss_z = g->cfg.loss_z;
    op->grad_z = g->cfg.grad_z;
    op->loss_stat = fl_spike_stat_of(&g->loss, g->cfg.window, g->cfg.min_count);
    op->norm_stat = fl_spike_stat_of(&g->norm, g->cfg.window, g->cfg.min_count);
}

const fl_step_gate *fl_optimizer_gate_host(const fl_optimizer *o) {
    return o->dev->host ? o->gate : NULL;
}

fl_step_result fl_optimizer_settle(fl_optimizer *o, int begun) {
    fl_step_gate g;
    if (o->dev->host)
        g = *o->gate;
    else
        o->dev->copy_d2h(o->dev, &g, o->gate, sizeof g); // the step's one wait
    fl_step_result r = {
        g.loss, g.grad_norm, g.skip != FL_SKIP_NONE, o->scaler.scale, {0, NAN, NAN}};
    if (g.judged) { // the guard's books: a loss-alone judgement saw no norm
        r.spike = (fl_spike_verdict){g.skip == FL_SKIP_SPIKE, g.loss_z, g.grad_z};
        fl_spike_record(&o->spike, &r.spike, g.loss, g.judged == 2 ? g.grad_norm : NAN);
    }
    if (g.skip == FL_SKIP_NONE) {
        fl_optimizer_end_step(o);
        return r;
    }
    r.skipped = g.skip == FL_SKIP_OVERFLOW || g.skip == FL_SKIP_NONFINITE; // not a spike's
    if (begun) (*fl_optim_step_count(o->rule))--; // the updates skipped themselves
    o->micro = 0;
    if (g.skip == FL_SKIP_OVERFLOW && fl_loss_scaler_update(&o->scaler, 1) != 0)
        fl_die("fp16 gradients overflow with the loss scale already at its minimum (%g): "
               "training cannot continue. Lower the learning rate, raise "
               "fp16.min_loss_scale, or train in bf16 (--precision bf16)",
               o->scaler.min_scale);
    return r;
}
