// gate.h: the step's verdict (optim.h's fl_step_gate) as one inline
// function, compiled for the host (the cpu and test devices' gate entry)
// and for one thread of a GPU (src/cuda/step.cu), so that a device decides
// a step with the cpu's arithmetic, bit for bit: the batch's loss from its
// micro-batches' sums, the gradient norm from the rows' sums of squares in
// table order, an fp16 overflow, the spike guard's z-scores (the window's
// statistics formed by the host before the step) and the clip coefficient.
#ifndef FITLM_OPTIM_GATE_H
#define FITLM_OPTIM_GATE_H

#include <math.h>

#include "fitlm/optim.h"

#ifdef __CUDACC__
#define FL_HD __host__ __device__
#else
#define FL_HD
#endif

// torch.nn.utils.clip_grad_norm_'s coefficient (fl_clip_coef)
FL_HD static inline float fl_gate_clip_coef(float norm, float max_norm) {
    return max_norm > 0.0f && norm > max_norm ? max_norm / (norm + 1e-6f) : 1.0f;
}

// v's z-score against a series' statistics (fl_spike_z)
FL_HD static inline double fl_gate_z(const fl_spike_stat *s, double v) {
    if (!s->ok || !isfinite(v)) return NAN;
    if (s->sd == 0.0) return v > s->mean ? INFINITY : 0.0;
    return (v - s->mean) / s->sd;
}

FL_HD static inline double fl_gate_rows_sum(const fl_gate_op *a, double s) {
    for (int r = 0; r < a->nrows; r++) s += a->rows[r];
    return s;
}

// The order of the host's steps (optimizer.c's optimizer_step, step.c's
// fused step): an overflow skips before the norm is formed, a non-finite
// norm before the spike guard judges, and the guard judges a finite norm.
FL_HD static inline void fl_gate_apply(fl_step_gate *g, const fl_gate_op *a) {
    if (a->op == FL_GATE_LOSS) { // model.c's mean loss, then step.c's sum
        float mean = a->n ? (float)(g->loss_raw / (double)a->n) : 0.0f;
        g->loss_sum = (a->first ? 0.0 : g->loss_sum) + (double)mean * (double)a->n;
        return;
    }
    if (a->op == FL_GATE_NORM) { // after an update that needed no norm: the norm, to report
        if (g->skip) return;
        if (a->nrows >= 0) g->sumsq = fl_gate_rows_sum(a, 0.0);
        g->grad_norm = (float)sqrt(g->sumsq) * g->unscale;
        return;
    }
    g->loss = a->loss_given ? a->loss : a->total ? (float)(g->loss_sum / (double)a->total) : 0.0f;
    g->unscale = 1.0f / a->scale;
    g->grad_norm = 0.0f;
    g->grad_scale = g->unscale;
    g->clip_coef = 1.0f;
    g->loss_z = g->grad_z = NAN;
    g->skip = FL_SKIP_NONE;
    g->judged = 0;
    if (a->parent && a->parent->skip) {
        g->skip = FL_SKIP_PARENT;
        return;
    }
    double norm = NAN; // the norm the guard judges: unknown before the gradient
    if (a->op == FL_GATE_VERDICT) {
        if (a->nrows >= 0) g->sumsq = fl_gate_rows_sum(a, 0.0);
        // finite floats' squares sum to a finite double: an inf or NaN shows here
        if (a->overflow_skips && !isfinite(g->sumsq)) {
            g->skip = FL_SKIP_OVERFLOW;
            return;
        }
        g->grad_norm = (float)sqrt(g->sumsq) * g->unscale;
        if (isfinite(g->grad_norm))
            norm = g->grad_norm;
        else if (a->nonfinite_skips) {
            g->skip = FL_SKIP_NONFINITE;
            return;
        }
        g->clip_coef = fl_gate_clip_coef(g->grad_norm, a->max_grad_norm);
        g->grad_scale = g->unscale * g->clip_coef;
    }
    if (a->judge && (a->op == FL_GATE_JUDGE_LOSS || isfinite(norm))) {
        g->judged = a->op == FL_GATE_JUDGE_LOSS ? 1 : 2; // 1: the loss alone
        if (a->loss_z > 0.0f) g->loss_z = (float)fl_gate_z(&a->loss_stat, (double)g->loss);
        if (a->grad_z > 0.0f) g->grad_z = (float)fl_gate_z(&a->norm_stat, norm);
        if (g->loss_z > a->loss_z || g->grad_z > a->grad_z) g->skip = FL_SKIP_SPIKE; // NAN: no
    }
}

// The factors an update reads from a gate: a fused rule's (LOMO, AdaLomo)
// unscaling and clip coefficient apart, the others' folded into one.
FL_HD static inline void fl_gate_factors(const fl_step_gate *g, int fused, float *grad_scale,
                                         float *clip_coef) {
    *grad_scale = fused ? g->unscale : g->grad_scale;
    *clip_coef = fused ? g->clip_coef : 1.0f;
}

#endif
