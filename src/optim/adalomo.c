// adalomo.c: AdaLomo (lomo_optim/adalomo.py, fuse_update): LOMO with an
// Adafactor-style factored second moment per tensor, grouped update
// normalisation and a step size relative to the tensor's RMS. See optim.h
// for the formulas. The update of a row runs in three passes over its
// gradient (converted, unscaled and clipped again in each pass rather than
// kept in an fp32 copy of the row):
//   A. the second-moment statistics: row and column means of g^2 + eps1 for
//      a matrix (then the row, col state), or the elementwise v of a vector;
//   B. the sums of squares of the update u and of the weights (the RMSs);
//   C. the weights themselves.
// Every sum is taken in double, per fixed chunk and then over chunks in
// order, so the result is the same for any thread count.
//
// Tensor parallelism: a rank holds a slice of a split row, so the statistics
// its slice alone cannot complete are summed over the TP group where they
// are formed: a column-parallel matrix's (rows split) column sums and the
// sum of its row statistics, a row-parallel one's (columns split) row sums,
// and every split row's sums of squares; the means divide by the whole
// row's sizes. Rows a rank holds beyond the whole table (vocabulary
// padding) count in no sum. Each slice's update is then the one-process
// update of its elements.
#include "fitlm/optim.h"

#include <math.h>

#include "fitlm/device.h"

#include "update.h"

#define BLOCK      FL_UPDATE_BLOCK
#define MAX_CHUNKS 4096
#define COL_TILE   256
#define SUMS       4096 // row or column sums formed (and summed over the TP group) at a time

// A row's shape as AdaLomo sees it: a matrix of R x K (K the last dimension)
// when it has two dimensions or more, else a vector.
static int is_matrix(const fl_param_view *v) {
    return v->ndim >= 2 && v->numel > 0;
}

static size_t row_cols(const fl_param_view *v) {
    return v->shape[v->ndim - 1];
}

// Floats of state tensor k (0 row, 1 col, 2 exp_avg_sq) of view v.
static size_t state_floats(const fl_param_view *v, int k) {
    if (is_matrix(v)) return k == 0 ? v->numel / row_cols(v) : k == 1 ? row_cols(v) : 0;
    return k == 2 ? v->numel : 0;
}

// A matrix's rows are split over the TP group (column-parallel, the
// vocabulary), or its columns (row-parallel).
static int rows_split(const fl_param_view *v) {
    return v->tp_dim >= 0 && v->tp_dim < v->ndim - 1;
}

static int cols_split(const fl_param_view *v) {
    return v->tp_dim >= 0 && v->tp_dim == v->ndim - 1;
}

// Dimension d of the whole row (a rank's table records it as tp_global).
static size_t whole_dim(const fl_param_view *v, int d) {
    return v->tp_dim == d && v->tp_global ? v->tp_global : v->shape[d];
}

static size_t whole_rows(const fl_param_view *v) {
    size_t R = 1;
    for (int d = 0; d < v->ndim - 1; d++) R *= whole_dim(v, d);
    return R;
}

// State tensor k of row as a row of its own (fl_optim_state_view): the row
// statistics split as a column-parallel matrix's rows (its Q, K, V parts
// too), the column statistics as a row-parallel one's columns; else whole.
static fl_param_view state_view(const fl_param_view *row, int k) {
    if (!is_matrix(row)) return *row; // the elementwise v splits as the row
    fl_param_view s = *row;
    int split = k == 0 ? rows_split(row) : cols_split(row);
    s.ndim = 1;
    s.shape[0] = state_floats(row, k);
    s.numel = s.shape[0];
    s.tp_dim = split ? 0 : -1;
    s.tp_parts = k == 0 && split ? row->tp_parts : 1;
    s.tp_global = k == 0 ? whole_rows(row) : whole_dim(row, row->ndim - 1);
    s.live_rows = 0;
    return s;
}

static size_t row_state_floats(const fl_param_view *v) {
    return state_floats(v, 0) + state_floats(v, 1) + state_floats(v, 2);
}

size_t fl_adalomo_state_numel(const fl_param_table *t, size_t begin, size_t end) {
    size_t n = 0;
    for (int k = 0; k < t->count; k++) {
        const fl_param_view *v = &t->views[k];
        if (v->offset >= begin && v->offset + v->numel <= end && v->numel > 0)
            n += row_state_floats(v);
    }
    return n;
}

// The state of the row starting at flat element `offset` (k: which tensor):
// its first float, and the row's view.
static float *row_state(const fl_adalomo *o, size_t offset, int k, const fl_param_view **view) {
    size_t at = 0;
    for (int r = o->first_row; r < o->end_row; r++) {
        const fl_param_view *v = &o->table->views[r];
        if (v->numel == 0) continue;
        if (v->offset == offset) {
            for (int j = 0; j < k; j++) at += state_floats(v, j);
            if (view) *view = v;
            return o->state + at;
        }
        at += row_state_floats(v);
    }
    FL_ASSERT(!"AdaLomo: no row starts at this offset");
    return NULL;
}

// The processed gradient of the range's elements [i, i+n): unscaled,
// clamped to +-clip (clip > 0; NaN stays NaN), times coef.
static const float *grad_block(const fl_update_args *a, size_t i, size_t n, float clip, float coef,
                               float *out) {
    const float *g = fl_load_f32(a->grads_dtype, fl_at_const(a->grads_dtype, a->grads, i), n, out);
    float s = a->grad_scale;
    for (size_t k = 0; k < n; k++) {
        float d = g[k] * s;
        if (clip > 0.0f) d = d < -clip ? -clip : d > clip ? clip : d;
        out[k] = d * coef;
    }
    return out;
}

// Fixed chunks of whole blocks over n elements (at most MAX_CHUNKS).
static size_t chunk_size(size_t n) {
    size_t chunk = n / MAX_CHUNKS + 1;
    if (chunk < 4 * BLOCK) chunk = 4 * BLOCK;
    return (chunk + BLOCK - 1) / BLOCK * BLOCK;
}

static void count_block(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                        size_t count) {
    (void)local, (void)first, (void)run, (void)stride;
    *(size_t *)ctx += count;
}

// Sums v[0, n) over the TP group when the row is split (a row's whole
// statistic from its slices), else leaves them.
static void tp_sum(const fl_update_args *a, int split, double *v, size_t n) {
    if (split && a->tp && a->tp->size > 1) a->tp->ops->sum(a->tp->ops->ctx, v, (int)n);
}

// What passes B and C share for one row.
typedef struct {
    const fl_update_args *a;
    float clip, coef;
    int matrix;
    size_t K;
    const float *row, *col, *v; // state (row, col for a matrix; v for a vector)
    float mean_row;
} row_ctx;

// u for the range's elements [i, i+n) into u, from the processed gradient g.
static void update_block(const row_ctx *c, size_t i, size_t n, const float *g, float *u) {
    if (!c->matrix) {
        for (size_t k = 0; k < n; k++) u[k] = (1.0f / sqrtf(c->v[i + k])) * g[k];
        return;
    }
    size_t r = i / c->K, j = i % c->K;
    float rf = 1.0f / sqrtf(c->row[r] / c->mean_row);
    for (size_t k = 0; k < n; k++) {
        u[k] = (rf * (1.0f / sqrtf(c->col[j]))) * g[k];
        if (++j == c->K && k + 1 < n) {
            j = 0;
            rf = 1.0f / sqrtf(c->row[++r] / c->mean_row);
        }
    }
}

static void adalomo_update(fl_optim_rule *rule, const fl_param_view *row, size_t offset,
                           size_t count, const fl_update_args *a) {
    const fl_adalomo *o = (const fl_adalomo *)rule;
    FL_ASSERT(offset == row->offset && count == row->numel); // whole rows only
    size_t n = count;
    if (n == 0) return;
    const fl_param_view *v;
    float *st = row_state(o, offset, 0, &v);
    FL_ASSERT(v->numel == row->numel && v->ndim == row->ndim);
    row_ctx c = {.a = a,
                 .clip = o->clip_value,
                 .coef = a->clip_coef > 0.0f ? a->clip_coef : 1.0f,
                 .matrix = is_matrix(row)};
    float b2 = o->beta2t, one_b2 = 1.0f - o->beta2t, eps1 = o->eps1;

    // A: the second-moment statistics
    if (c.matrix) {
        size_t K = row_cols(row), R = n / K, Kw = whole_dim(row, row->ndim - 1);
        // the rows that are the whole row's: the first `live` (only the
        // vocabulary, in one part, has padding rows, at its end)
        size_t Rw = whole_rows(row), live = 0;
        fl_params_blocks(o->table, (int)(v - o->table->views), 0, n, count_block, &live);
        live /= K;
        float *rs = st, *cs = st + R;
        double sums[SUMS];
        c.K = K;
        c.row = rs;
        c.col = cs;
        for (size_t r0 = 0; r0 < R; r0 += SUMS) { // row means, each row in order
            size_t nr = R - r0 < SUMS ? R - r0 : SUMS;
#pragma omp parallel for schedule(static)
            for (size_t i = 0; i < nr; i++) {
                float g[BLOCK];
                double s = 0.0;
                for (size_t j = 0; j < K; j += BLOCK) {
                    size_t len = K - j < BLOCK ? K - j : BLOCK;
                    const float *gb = grad_block(a, (r0 + i) * K + j, len, c.clip, c.coef, g);
                    for (size_t k = 0; k < len; k++) s += (double)(gb[k] * gb[k] + eps1);
                }
                sums[i] = s;
            }
            tp_sum(a, cols_split(row), sums, nr);
            for (size_t i = 0; i < nr; i++)
                rs[r0 + i] = b2 * rs[r0 + i] + one_b2 * (float)(sums[i] / (double)Kw);
        }
        for (size_t j0 = 0; j0 < K; j0 += SUMS) { // column means over the live rows, in order
            size_t nc = K - j0 < SUMS ? K - j0 : SUMS, ntiles = (nc + COL_TILE - 1) / COL_TILE;
#pragma omp parallel for schedule(static)
            for (size_t tile = 0; tile < ntiles; tile++) {
                size_t t0 = tile * COL_TILE, len = nc - t0 < COL_TILE ? nc - t0 : COL_TILE;
                double *s = sums + t0;
                float g[COL_TILE];
                for (size_t k = 0; k < len; k++) s[k] = 0.0;
                for (size_t r = 0; r < live; r++) {
                    const float *gb = grad_block(a, r * K + j0 + t0, len, c.clip, c.coef, g);
                    for (size_t k = 0; k < len; k++) s[k] += (double)(gb[k] * gb[k] + eps1);
                }
            }
            tp_sum(a, rows_split(row), sums, nc);
            for (size_t k = 0; k < nc; k++)
                cs[j0 + k] = b2 * cs[j0 + k] + one_b2 * (float)(sums[k] / (double)Rw);
        }
        double s = 0.0;
        for (size_t r = 0; r < live; r++) s += rs[r];
        tp_sum(a, rows_split(row), &s, 1);
        c.mean_row = (float)(s / (double)Rw);
    } else {
        float *vs = st + state_floats(row, 0) + state_floats(row, 1);
        c.v = vs;
        size_t nblocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
        for (size_t b = 0; b < nblocks; b++) {
            size_t i = b * BLOCK, len = n - i < BLOCK ? n - i : BLOCK;
            float g[BLOCK];
            const float *gb = grad_block(a, i, len, c.clip, c.coef, g);
            for (size_t k = 0; k < len; k++)
                vs[i + k] = b2 * vs[i + k] + one_b2 * (gb[k] * gb[k] + eps1);
        }
    }

    // B: sums of squares of u and of the weights, per fixed chunk
    size_t chunk = chunk_size(n), nchunks = (n + chunk - 1) / chunk;
    double su[MAX_CHUNKS], sp[MAX_CHUNKS];
#pragma omp parallel for schedule(static)
    for (size_t ch = 0; ch < nchunks; ch++) {
        size_t end = (ch + 1) * chunk < n ? (ch + 1) * chunk : n;
        double u2 = 0.0, p2 = 0.0;
        float g[BLOCK], u[BLOCK], pbuf[BLOCK];
        for (size_t i = ch * chunk; i < end; i += BLOCK) {
            size_t len = end - i < BLOCK ? end - i : BLOCK;
            update_block(&c, i, len, grad_block(a, i, len, c.clip, c.coef, g), u);
            const float *p = fl_update_load_params(a, i, len, pbuf);
            for (size_t k = 0; k < len; k++) {
                u2 += (double)u[k] * u[k];
                p2 += (double)p[k] * p[k];
            }
        }
        su[ch] = u2;
        sp[ch] = p2;
    }
    double sq[2] = {0.0, 0.0}; // of u and of the weights (padding rows add zeros)
    for (size_t ch = 0; ch < nchunks; ch++) {
        sq[0] += su[ch];
        sq[1] += sp[ch];
    }
    tp_sum(a, row->tp_dim >= 0, sq, 2);
    double nw = (double)fl_params_whole_numel(o->table, (int)(v - o->table->views));
    float rms_u = (float)sqrt(sq[0] / nw), rms_p = (float)sqrt(sq[1] / nw);
    float denom = fmaxf(rms_u / o->clip_threshold, 1.0f);
    float lr = o->lr * fmaxf(o->eps2, rms_p);
    float keep = (row->flags & FL_PARAM_DECAY) ? 1.0f - lr * o->weight_decay : 1.0f;

    // C: the weights
    size_t nblocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t i = b * BLOCK, len = n - i < BLOCK ? n - i : BLOCK;
        float g[BLOCK], u[BLOCK], pbuf[BLOCK];
        update_block(&c, i, len, grad_block(a, i, len, c.clip, c.coef, g), u);
        float *p = fl_update_load_params(a, i, len, pbuf);
        for (size_t k = 0; k < len; k++) p[k] = p[k] * keep - lr * (u[k] / denom);
        fl_update_store_params(a, i, len, p);
    }
}

static void adalomo_begin_step(fl_optim_rule *r, float lr) {
    fl_adalomo *o = (fl_adalomo *)r;
    o->t++;
    o->lr = lr;
    o->beta2t = (float)(1.0 - pow((double)o->t, (double)o->decay_rate));
}

static float *adalomo_state_ptr(fl_optim_rule *r, int k, size_t offset) {
    return row_state((const fl_adalomo *)r, offset, k, NULL);
}

static fl_param_view adalomo_state_view(const fl_optim_rule *r, int k, const fl_param_view *row) {
    (void)r;
    fl_param_view s = state_view(row, k);
    s.numel = state_floats(row, k); // 0 where the tensor does not apply to the row
    return s;
}

static int *adalomo_step_count(fl_optim_rule *r) {
    return &((fl_adalomo *)r)->t;
}

static void adalomo_free(fl_optim_rule *r) {
    fl_adalomo_free((fl_adalomo *)r);
}

static const char *const adalomo_state_names[] = {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"};
static const fl_optim_ops adalomo_ops = {.state_names = adalomo_state_names,
                                         .begin_step = adalomo_begin_step,
                                         .update = adalomo_update,
                                         .state_ptr = adalomo_state_ptr,
                                         .state_view = adalomo_state_view,
                                         .step_count = adalomo_step_count,
                                         .free = adalomo_free};

void fl_adalomo_init_range(fl_adalomo *opt, const fl_param_table *t, size_t begin, size_t end,
                           float eps1, float eps2, float clip_threshold, float decay_rate,
                           float weight_decay, float clip_value) {
    FL_ASSERT(begin <= end && end <= t->numel);
    int first = t->count, last = 0;
    for (int k = 0; k < t->count; k++) {
        const fl_param_view *v = &t->views[k];
        if (v->numel == 0) continue;
        int inside = v->offset >= begin && v->offset + v->numel <= end;
        FL_ASSERT(inside || v->offset + v->numel <= begin || v->offset >= end); // whole rows
        if (inside) {
            if (k < first) first = k;
            last = k + 1;
        }
    }
    if (first > last) first = last;
    *opt = (fl_adalomo){.rule = {&adalomo_ops, begin, end, begin, 3, fl_device_default()},
                        .table = t,
                        .first_row = first,
                        .end_row = last,
                        .eps1 = eps1,
                        .eps2 = eps2,
                        .clip_threshold = clip_threshold,
                        .decay_rate = decay_rate,
                        .weight_decay = weight_decay,
                        .clip_value = clip_value,
                        .numel = fl_adalomo_state_numel(t, begin, end)};
    const fl_device *d = opt->rule.dev;
    opt->state =
        opt->numel ? d->alloc(d, FL_MEM_OPTIM, opt->numel * sizeof(float)) : NULL; // zeroed
}

void fl_adalomo_free(fl_adalomo *opt) {
    opt->rule.dev->free(opt->rule.dev, opt->state);
    opt->state = NULL;
}
