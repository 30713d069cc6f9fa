// test_optim.c: optimizers, clipping and schedules against hand-written
// double-precision versions of torch.optim's update rules. Everything runs in
// a forked child with the portable paths (FITLM_ISA=portable), with AVX2
// where the CPU has more, then with the CPU's own paths; and the elementwise
// updates and sums of squares of all paths are compared bit for bit.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fitlm/config.h"
#include "fitlm/device.h"
#include "fitlm/train.h"
#include "fitlm/optim.h"
#include "testlib.h"

// A table of two views: a "matrix" that is decayed and a "bias" that is not.
static void make_table(fl_param_table *t) {
    size_t w[2] = {3, 5}, b[1] = {7};
    fl_params_add(t, "w", FL_PARAM_DECAY, 2, w);
    fl_params_add(t, "b", 0, 1, b);
}

// One step of a rule over the whole table, one update per row in table
// order (what fl_optimizer_step does); p and g are the flat fp32 buffers;
// coef is the clip coefficient LOMO and AdaLomo apply after clamping.
static void rule_step_clip(fl_optim_rule *r, const fl_param_table *t, float *p, const float *g,
                           float gscale, float coef, float lr) {
    fl_optim_begin_step(r, lr);
    for (int k = 0; k < t->count; k++) {
        const fl_param_view *v = &t->views[k];
        fl_update_args a = {.params = p + v->offset,
                            .grads = g + v->offset,
                            .grads_dtype = FL_F32,
                            .grad_scale = gscale,
                            .clip_coef = coef};
        fl_optim_update(r, v, v->offset, v->numel, &a);
    }
    fl_optim_end_step(r);
}

// coef 0 reads as 1 (and only LOMO and AdaLomo read it)
static void rule_step(fl_optim_rule *r, const fl_param_table *t, float *p, const float *g,
                      float gscale, float lr) {
    rule_step_clip(r, t, p, g, gscale, 0.0f, lr);
}

// AdamW against torch.optim.AdamW's rule over 5 steps in doubles; without
// bias correction (DeepSpeed's Adam with bias_correction false: FusedAdam's
// bias_correction1 = bias_correction2 = 1) the moments as they are.
static void adamw_matches_rule(int corrected) {
    fl_param_table t = {0};
    make_table(&t);
    size_t n = t.numel;
    float p[22], g[22];
    double pd[22], m[22] = {0}, v[22] = {0};
    t_fill(p, n, 1, 1.0f);
    for (size_t i = 0; i < n; i++) pd[i] = p[i];
    fl_adamw opt;
    double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    fl_adamw_init(&opt, n, (float)b1, (float)b2, (float)eps, (float)wd);
    opt.no_bias_correction = !corrected;
    for (int step = 1; step <= 5; step++) {
        t_fill(g, n, 100 + step, 0.5f);
        rule_step(&opt.rule, &t, p, g, 1.0f, (float)lr);
        double bc1 = corrected ? 1 - pow(b1, step) : 1, bc2 = corrected ? 1 - pow(b2, step) : 1;
        for (size_t i = 0; i < n; i++) { // torch.optim.AdamW, amsgrad=False
            if (i < 15) pd[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * (double)g[i] * g[i];
            pd[i] -= lr * (m[i] / bc1) / (sqrt(v[i] / bc2) + eps);
        }
    }
    float want[22];
    for (size_t i = 0; i < n; i++) want[i] = (float)pd[i];
    // float32 arithmetic over 5 steps of size ~lr: a few ulps of |p| ~ 1
    t_close(corrected ? "adamw params after 5 steps" : "adamw without bias correction", p, want, n,
            1e-6, 1e-5);
    t_check(opt.t == 5, "adamw counts its steps (t=%d)", opt.t);
    fl_adamw_free(&opt);
    fl_params_free(&t);
}

static void test_adamw_matches_torch_rule(void) {
    adamw_matches_rule(1);
    adamw_matches_rule(0);
}

static void test_sgd_momentum_matches_torch_rule(void) {
    fl_param_table t = {0};
    make_table(&t);
    size_t n = t.numel;
    float p[22], g[22];
    double pd[22], buf[22] = {0};
    t_fill(p, n, 2, 1.0f);
    for (size_t i = 0; i < n; i++) pd[i] = p[i];
    double lr = 0.05, mu = 0.9, wd = 0.01;
    fl_sgd opt;
    fl_sgd_init(&opt, n, (float)mu, (float)wd);
    for (int step = 1; step <= 4; step++) {
        t_fill(g, n, 200 + step, 0.5f);
        rule_step(&opt.rule, &t, p, g, 1.0f, (float)lr);
        for (size_t i = 0; i < n; i++) { // torch.optim.SGD, dampening 0
            double d = g[i] + (i < 15 ? wd * pd[i] : 0.0);
            buf[i] = step == 1 ? d : mu * buf[i] + d;
            pd[i] -= lr * buf[i];
        }
    }
    float want[22];
    for (size_t i = 0; i < n; i++) want[i] = (float)pd[i];
    t_close("sgd+momentum params after 4 steps", p, want, n, 1e-6, 1e-5);
    fl_sgd_free(&opt);

    fl_sgd plain; // no momentum: no buffer is allocated
    fl_sgd_init(&plain, n, 0.0f, 0.0f);
    t_check(plain.buf == NULL, "plain SGD keeps no momentum buffer");
    float q[22], want_q[22];
    t_fill(q, n, 3, 1.0f);
    t_fill(g, n, 4, 1.0f);
    for (size_t i = 0; i < n; i++) want_q[i] = q[i] - 0.5f * g[i];
    rule_step(&plain.rule, &t, q, g, 1.0f, 0.5f);
    t_close("plain sgd step", q, want_q, n, 0, 0);
    fl_sgd_free(&plain);
    fl_params_free(&t);
}

static void test_norm_and_clipping(void) {
    enum { N = 100003 }; // several chunks, odd size
    static float g[N];
    static uint16_t h[N];
    t_fill(g, N, 5, 1.0f);
    double sq = 0;
    for (int i = 0; i < N; i++) sq += (double)g[i] * g[i];
    float norm_want = (float)sqrt(sq);
    omp_set_num_threads(1);
    float n1 = fl_grad_norm(FL_F32, g, N);
    omp_set_num_threads(2);
    float n2 = fl_grad_norm(FL_F32, g, N);
    t_check(n1 == n2, "grad norm is bitwise the same on 1 and 2 threads (%.9g vs %.9g)", n1, n2);
    t_check(fabsf(n2 - norm_want) <= 1e-6f * norm_want, "grad norm %.7g want %.7g", n2, norm_want);
    fl_convert(FL_BF16, h, FL_F32, g, N);
    float nb = fl_grad_norm(FL_BF16, h, N);
    t_check(fabsf(nb - norm_want) <= 4e-3f * norm_want, "bf16 grad norm %.7g ~ %.7g", nb,
            norm_want);
    t_check(fl_clip_coef(0.5f, 1.0f) == 1.0f, "no clipping under max_norm");
    t_check(fl_clip_coef(4.0f, 0.0f) == 1.0f, "max_norm 0 disables clipping");
    t_check(fabsf(fl_clip_coef(4.0f, 1.0f) * 4.0f - 1.0f) < 1e-6f, "clipping scales to max_norm");
}

// DeepSpeed's DynamicLossScaler on crafted overflow sequences (defaults
// window 1000, hysteresis 2; small windows here to keep the sequences short).
static void test_loss_scaler(void) {
    fl_loss_scaler s;
    fl_loss_scaler_init(&s, 0.0f, 16, 1000, 2, 0, 1.0f);
    t_check(s.scale == 65536.0f && s.dynamic, "dynamic scaling starts at 2^16");

    fl_loss_scaler_init(&s, 0.0f, 4, 3, 2, 0, 1.0f); // 16, window 3, hysteresis 2
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 16.0f && s.cur_hysteresis == 1, "first overflow only uses up hysteresis");
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 8.0f, "second overflow halves the scale (%g)", s.scale);
    fl_loss_scaler_update(&s, 0);
    fl_loss_scaler_update(&s, 0);
    t_check(s.scale == 8.0f, "no growth before a full window");
    fl_loss_scaler_update(&s, 0);
    t_check(s.scale == 16.0f && s.cur_hysteresis == 2,
            "a window of clean steps doubles the scale and refills the hysteresis (%g, %d)",
            s.scale, s.cur_hysteresis);
    fl_loss_scaler_update(&s, 1); // uses hysteresis, no halving
    fl_loss_scaler_update(&s, 0);
    fl_loss_scaler_update(&s, 1); // hysteresis not refilled: halves now
    t_check(s.scale == 8.0f, "without consecutive_hysteresis one clean step does not refill it");

    fl_loss_scaler_init(&s, 0.0f, 4, 100, 2, 1, 1.0f);
    fl_loss_scaler_update(&s, 1);
    fl_loss_scaler_update(&s, 0);
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 16.0f, "consecutive_hysteresis refills after every clean step");

    fl_loss_scaler_init(&s, 0.0f, 2, 100, 1, 0, 1.0f); // 4, hysteresis 1
    int st = fl_loss_scaler_update(&s, 1) | fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 1.0f && st == 0, "backs off to the minimum");
    t_check(fl_loss_scaler_update(&s, 1) == -1, "an overflow at the minimum is reported as stuck");
    fl_loss_scaler_init(&s, 0.0f, 1, 100, 1, 0, 1.5f);
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 1.5f, "never below min_loss_scale (%g)", s.scale);

    fl_loss_scaler_init(&s, 128.0f, 16, 2, 2, 0, 1.0f);
    for (int i = 0; i < 5; i++) fl_loss_scaler_update(&s, i == 2);
    t_check(s.scale == 128.0f && !s.dynamic, "a static scale never moves");
}

// A two-view model-like table with 16-bit weights, for the mixed-precision
// optimizer.
typedef struct {
    fl_param_table table;
    uint16_t params[22], grads[22];
} lowp_model;

static void lowp_init(lowp_model *m, fl_dtype dt) {
    memset(m, 0, sizeof *m);
    make_table(&m->table);
    float p[22];
    t_fill(p, 22, 9, 1.0f);
    fl_convert(dt, m->params, FL_F32, p, 22);
}

// `fitlm train`'s defaults: AdamW 0.9/0.95, eps 1e-8, wd 0.1, clip 1.0,
// fp16 scaling from 2^16 with window 1000 and hysteresis 2
static fl_optimizer_config adamw_config(int accum) {
    fl_train_config defaults;
    fl_config_defaults(&defaults);
    fl_optimizer_config c = fl_config_optimizer(&defaults);
    c.grad_accum = accum;
    return c;
}

// One micro-batch whose backward pass yields the gradients g (multiplied by
// the loss scale the optimizer asks for, as a real backward would be).
static void fake_micro_batch(fl_optimizer *o, lowp_model *m, const float *g) {
    fl_optimizer_zero_grad(o);
    float scaled[22];
    for (int i = 0; i < 22; i++) scaled[i] = g[i] * fl_optimizer_loss_scale(o);
    fl_accumulate_f32(o->dtype, m->grads, scaled, 22);
    fl_optimizer_micro_done(o);
}

static void test_mixed_precision_step(void) {
    lowp_model m;
    lowp_init(&m, FL_BF16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(2);
    fl_optimizer_init(&o, &cfg, &m.table, FL_BF16, m.params, m.grads);
    t_check(o.master && o.grad_accum, "bf16 with accumulation keeps fp32 master and grad sum");
    float master0[22], g1[22], g2[22];
    memcpy(master0, o.master, sizeof master0);
    t_fill(g1, 22, 11, 0.1f);
    t_fill(g2, 22, 12, 0.1f);
    for (int micro = 0; micro < 2; micro++) {
        fake_micro_batch(&o, &m, micro ? g2 : g1);
    }
    fl_step_result r = fl_optimizer_step(&o, 1e-2f);
    // reference: fp32 AdamW on the fp32 sum of the two bf16-rounded half gradients
    float sum[22], p[22];
    for (int i = 0; i < 22; i++) {
        float a = fl_bf16_to_f32(fl_f32_to_bf16(g1[i] * 0.5f));
        float b = fl_bf16_to_f32(fl_f32_to_bf16(g2[i] * 0.5f));
        sum[i] = a + b;
    }
    memcpy(p, master0, sizeof p);
    fl_adamw ref;
    fl_adamw_init(&ref, 22, 0.9f, 0.95f, 1e-8f, 0.1f);
    float norm = t_adamw_step_fp32(&ref, &m.table, p, sum, 1e-2f, 1.0f);
    t_check(r.grad_norm == norm && !r.skipped, "norm of the fp32 sum (%g vs %g)", r.grad_norm,
            norm);
    t_close("bf16 master after one step", o.master, p, 22, 0, 0);
    int rounded = 1;
    for (int i = 0; i < 22; i++) rounded &= m.params[i] == fl_f32_to_bf16(o.master[i]);
    t_check(rounded, "bf16 weights are the master rounded to nearest even");
    fl_adamw_free(&ref);
    fl_optimizer_free(&o);
    fl_params_free(&m.table);
}

static void test_fp16_overflow_skips_the_step(void) {
    lowp_model m;
    lowp_init(&m, FL_F16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(1);
    fl_optimizer_init(&o, &cfg, &m.table, FL_F16, m.params, m.grads);
    t_check(fl_optimizer_loss_scale(&o) == 65536.0f, "fp16 scales the loss by 2^16");
    float g[22];
    t_fill(g, 22, 13, 0.01f);
    fake_micro_batch(&o, &m, g);
    fl_step_result r = fl_optimizer_step(&o, 1e-3f);
    t_check(!r.skipped && o.adamw.t == 1, "a clean step updates");
    t_check(fabsf(r.grad_norm - fl_grad_norm(FL_F32, g, 22)) < 2e-3f * r.grad_norm,
            "the reported norm is unscaled (%g)", r.grad_norm);

    uint16_t params0[22];
    float master0[22], m0[22], v0[22];
    memcpy(params0, m.params, sizeof params0);
    memcpy(master0, o.master, sizeof master0);
    memcpy(m0, o.adamw.m, sizeof m0);
    memcpy(v0, o.adamw.v, sizeof v0);
    g[3] = 1e4f; // times 2^16 overflows fp16
    fake_micro_batch(&o, &m, g);
    r = fl_optimizer_step(&o, 1e-3f);
    t_check(r.skipped, "an inf gradient skips the step");
    t_check(!memcmp(params0, m.params, sizeof params0) && !memcmp(master0, o.master, sizeof m0) &&
                !memcmp(m0, o.adamw.m, sizeof m0) && !memcmp(v0, o.adamw.v, sizeof v0) &&
                o.adamw.t == 1,
            "a skipped step leaves weights, master and optimizer state bitwise unchanged");
    t_check(o.scaler.scale == 65536.0f && o.scaler.cur_hysteresis == 1,
            "the first overflow uses up hysteresis");
    fl_optimizer_free(&o);
    fl_params_free(&m.table);
}

static void stuck_scaler(void *arg) {
    (void)arg;
    lowp_model m;
    lowp_init(&m, FL_F16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(1);
    cfg.initial_scale_power = 1;
    cfg.hysteresis = 1;
    fl_optimizer_init(&o, &cfg, &m.table, FL_F16, m.params, m.grads);
    float g[22] = {0};
    g[0] = INFINITY;
    for (int i = 0; i < 10; i++) {
        fake_micro_batch(&o, &m, g);
        fl_optimizer_step(&o, 1e-3f);
    }
}

// ----------------------------------------------------------------------------
// the rule interface by range

// A model-sized table: rows of several update blocks (4096 elements), decayed
// and not, with sizes that are no multiple of a block.
static void make_big_table(fl_param_table *t) {
    size_t wte[2] = {70, 100}, ln[1] = {100}, fc[2] = {100, 90}, b[1] = {90};
    fl_params_add(t, "wte", FL_PARAM_DECAY, 2, wte);
    fl_params_add(t, "ln", 0, 1, ln);
    fl_params_add(t, "fc", FL_PARAM_DECAY, 2, fc);
    fl_params_add(t, "b", 0, 1, b);
}

// A rule of either kind over [begin, end).
typedef union {
    fl_optim_rule rule;
    fl_adamw adamw;
    fl_sgd sgd;
} any_rule;

static fl_optim_rule *rule_init(any_rule *u, fl_optim_kind kind, size_t begin, size_t end) {
    if (kind == FL_OPT_ADAMW) {
        fl_adamw_init_range(&u->adamw, begin, end, 0.9f, 0.95f, 1e-8f, 0.1f);
        return &u->adamw.rule;
    }
    fl_sgd_init_range(&u->sgd, begin, end, 0.9f, 0.01f);
    return &u->sgd.rule;
}

// Bitwise equality of two rules' state over their common range.
static int same_state(fl_optim_rule *a, fl_optim_rule *b) {
    if (*fl_optim_step_count(a) != *fl_optim_step_count(b) ||
        fl_optim_state_count(a) != fl_optim_state_count(b))
        return 0;
    size_t n = a->state_end - a->state_begin;
    for (int k = 0; k < fl_optim_state_count(a); k++)
        if (memcmp(fl_optim_state_ptr(a, k, a->state_begin),
                   fl_optim_state_ptr(b, k, b->state_begin), n * sizeof(float)))
            return 0;
    return 1;
}

// One update of [offset, offset+count) of row v, on flat fp32 buffers.
static void update_range(fl_optim_rule *r, const fl_param_view *v, size_t offset, size_t count,
                         float *p, const float *g, float gscale) {
    fl_update_args a = {
        .params = p + offset, .grads = g + offset, .grads_dtype = FL_F32, .grad_scale = gscale};
    fl_optim_update(r, v, offset, count, &a);
}

// Updating rows in reverse order, or each row as two ranges (the second
// first, split inside an update block), gives the table-order step bitwise.
static void test_ranges_match_whole_step(void) {
    fl_param_table t = {0};
    make_big_table(&t);
    size_t n = t.numel;
    float *p[3], *g = malloc(n * sizeof(float));
    for (int kind = FL_OPT_ADAMW; kind <= FL_OPT_SGD; kind++) {
        any_rule u[3];
        fl_optim_rule *r[3];
        for (int c = 0; c < 3; c++) {
            p[c] = malloc(n * sizeof(float));
            t_fill(p[c], n, 21, 1.0f);
            r[c] = rule_init(&u[c], (fl_optim_kind)kind, 0, n);
        }
        for (int step = 1; step <= 3; step++) {
            t_fill(g, n, 300 + step, 0.5f);
            float lr = 1e-2f * step, gscale = 0.75f;
            rule_step(r[0], &t, p[0], g, gscale, lr);
            fl_optim_begin_step(r[1], lr);
            for (int k = t.count - 1; k >= 0; k--)
                update_range(r[1], &t.views[k], t.views[k].offset, t.views[k].numel, p[1], g,
                             gscale);
            fl_optim_end_step(r[1]);
            fl_optim_begin_step(r[2], lr);
            for (int k = 0; k < t.count; k++) {
                const fl_param_view *v = &t.views[k];
                size_t cut = v->numel * 2 / 5 + 1;
                update_range(r[2], v, v->offset + cut, v->numel - cut, p[2], g, gscale);
                update_range(r[2], v, v->offset, cut, p[2], g, gscale);
            }
            fl_optim_end_step(r[2]);
        }
        const char *name = kind == FL_OPT_ADAMW ? "adamw" : "sgd";
        t_check(!memcmp(p[0], p[1], n * sizeof(float)) && same_state(r[0], r[1]),
                "%s: rows in reverse order give the table-order step bitwise", name);
        t_check(!memcmp(p[0], p[2], n * sizeof(float)) && same_state(r[0], r[2]),
                "%s: rows split into two ranges give the table-order step bitwise", name);
        for (int c = 0; c < 3; c++) {
            fl_optim_free(r[c]);
            free(p[c]);
        }
    }
    free(g);
    fl_params_free(&t);
}

// A model with a table and heap buffers of any dtype.
typedef struct {
    fl_param_table table;
    fl_dtype dt;
    void *params, *grads;
} big_model;

static void big_init(big_model *m, fl_dtype dt, unsigned seed) {
    memset(m, 0, sizeof *m);
    make_big_table(&m->table);
    size_t n = m->table.numel;
    m->dt = dt;
    m->params = malloc(n * fl_dtype_size(dt));
    m->grads = malloc(n * fl_dtype_size(dt));
    float *p = malloc(n * sizeof(float));
    t_fill(p, n, seed, 1.0f);
    fl_convert(dt, m->params, FL_F32, p, n);
    free(p);
}

static void big_free(big_model *m) {
    free(m->params);
    free(m->grads);
    fl_params_free(&m->table);
}

// The micro-batches of one step, with gradients drawn from `seed` (times
// the loss scale the optimizer asks for, as a real backward would be).
static void big_micro_batches(fl_optimizer *o, big_model *m, unsigned seed) {
    size_t n = m->table.numel;
    float *g = malloc(n * sizeof(float));
    for (int micro = 0; micro < o->cfg.grad_accum; micro++) {
        fl_optimizer_zero_grad(o);
        t_fill(g, n, seed + 17 * micro, 0.05f);
        for (size_t i = 0; i < n; i++) g[i] *= fl_optimizer_loss_scale(o);
        fl_accumulate_f32(m->dt, m->grads, g, n);
        fl_optimizer_micro_done(o);
    }
    free(g);
}

// The pieces (begin_step, update_rows per row from per-row scratch
// gradients in reverse order, end_step) give fl_optimizer_step bitwise.
static void test_optimizer_pieces(void) {
    big_model a, b;
    big_init(&a, FL_BF16, 31);
    big_init(&b, FL_BF16, 31);
    size_t n = a.table.numel;
    fl_optimizer oa, ob;
    fl_optimizer_config cfg = adamw_config(2);
    cfg.max_grad_norm = 0.5f; // clips
    fl_optimizer_init(&oa, &cfg, &a.table, FL_BF16, a.params, a.grads);
    fl_optimizer_init(&ob, &cfg, &b.table, FL_BF16, b.params, b.grads);
    float *scratch = malloc(n * sizeof(float));
    int clipped = 1;
    for (int step = 0; step < 3; step++) {
        big_micro_batches(&oa, &a, 40 + step);
        big_micro_batches(&ob, &b, 40 + step);
        fl_step_result r = fl_optimizer_step(&oa, 1e-2f);
        float unscale = 1.0f / fl_optimizer_scale(&ob);
        float norm = fl_grad_norm(FL_F32, ob.grad_accum, n) * unscale;
        float coef = fl_clip_coef(norm, cfg.max_grad_norm);
        clipped &= coef < 1.0f && norm == r.grad_norm;
        fl_optimizer_begin_step(&ob, 1e-2f);
        for (int k = b.table.count - 1; k >= 0; k--) {
            const fl_param_view *v = &b.table.views[k];
            memcpy(scratch, ob.grad_accum + v->offset, v->numel * sizeof(float));
            fl_optimizer_update_rows(&ob, k, 1, scratch, FL_F32, unscale * coef);
        }
        fl_optimizer_end_step(&ob);
    }
    t_check(clipped, "the pieces see the step's norm, and it clips");
    t_check(!memcmp(a.params, b.params, n * sizeof(uint16_t)) &&
                !memcmp(oa.master, ob.master, n * sizeof(float)) && same_state(oa.rule, ob.rule) &&
                ob.micro == 0,
            "begin_step + update_rows (reverse order, scratch gradients) + end_step give "
            "fl_optimizer_step bitwise");
    free(scratch);
    fl_optimizer_free(&oa);
    fl_optimizer_free(&ob);
    big_free(&a);
    big_free(&b);
}

// Two optimizers over [0, k) and [k, n), k inside a row and an update block,
// give the whole-table optimizer's weights, master and state exactly
// (ZeRO-1's equivalence at the optimizer level).
static void check_shards(fl_dtype dt, fl_optim_kind kind, int accum) {
    big_model w, s[2];
    big_init(&w, dt, 51);
    for (int h = 0; h < 2; h++) big_init(&s[h], dt, 51);
    size_t n = w.table.numel, k = w.table.views[2].offset + 4321, ds = fl_dtype_size(dt);
    size_t lo[2] = {0, k}, hi[2] = {k, n};
    fl_optimizer_config cfg = adamw_config(accum);
    cfg.kind = kind;
    cfg.momentum = 0.9f;
    fl_optimizer ow, os[2];
    fl_optimizer_init(&ow, &cfg, &w.table, dt, w.params, w.grads);
    for (int h = 0; h < 2; h++)
        fl_optimizer_init_range(&os[h], &cfg, &s[h].table, dt, s[h].params, s[h].grads, lo[h],
                                hi[h]);
    int same_norm = 1;
    for (int step = 0; step < 3; step++) {
        big_micro_batches(&ow, &w, 60 + step);
        fl_step_result rw = fl_optimizer_step(&ow, 1e-2f);
        for (int h = 0; h < 2; h++) {
            big_micro_batches(&os[h], &s[h], 60 + step);
            same_norm &= fl_optimizer_step(&os[h], 1e-2f).grad_norm == rw.grad_norm;
        }
    }
    int params = 1, master = 1, state = 1;
    for (int h = 0; h < 2; h++) {
        fl_optim_rule *rw = ow.rule, *rs = os[h].rule;
        size_t len = hi[h] - lo[h];
        params &= !memcmp(fl_at(dt, w.params, lo[h]), fl_at(dt, s[h].params, lo[h]), len * ds);
        if (dt != FL_F32) master &= !memcmp(ow.master + lo[h], os[h].master, len * sizeof(float));
        state &= rs->state_begin == lo[h] && rs->state_end == hi[h] &&
                 *fl_optim_step_count(rs) == *fl_optim_step_count(rw) &&
                 fl_optim_state_count(rs) == fl_optim_state_count(rw);
        for (int j = 0; j < fl_optim_state_count(rw); j++)
            state &= !memcmp(fl_optim_state_ptr(rw, j, lo[h]), fl_optim_state_ptr(rs, j, lo[h]),
                             len * sizeof(float));
    }
    const char *what = kind == FL_OPT_ADAMW ? "adamw" : "sgd+momentum";
    t_check(same_norm, "%s %s: each shard sees the global norm", fl_dtype_name(dt), what);
    t_check(params && master && state,
            "%s %s: shards [0,k) + [k,n) give the whole table's weights%s and state bitwise",
            fl_dtype_name(dt), what, dt != FL_F32 ? ", master" : "");
    fl_optimizer_free(&ow);
    for (int h = 0; h < 2; h++) {
        fl_optimizer_free(&os[h]);
        big_free(&s[h]);
    }
    big_free(&w);
}

// The whole step's rows share one parallel team (update_span), each row's
// blocks split among its threads: 1, 2 and 3 threads (row blocks in any
// split, rows of fewer blocks than threads) give the same weights, master
// and state bitwise.
static void check_thread_counts(fl_dtype dt, fl_optim_kind kind) {
    enum { RUNS = 3 };
    big_model m[RUNS];
    fl_optimizer o[RUNS];
    fl_optimizer_config cfg = adamw_config(kind == FL_OPT_LOMO ? 1 : 2);
    cfg.kind = kind;
    cfg.momentum = 0.9f;
    for (int c = 0; c < RUNS; c++) {
        big_init(&m[c], dt, 71);
        fl_optimizer_init(&o[c], &cfg, &m[c].table, dt, m[c].params, m[c].grads);
        omp_set_num_threads(c + 1);
        for (int step = 0; step < 2; step++) {
            big_micro_batches(&o[c], &m[c], 80 + step);
            fl_optimizer_step(&o[c], 1e-2f);
        }
    }
    omp_set_num_threads(2);
    size_t n = m[0].table.numel;
    int same = 1;
    for (int c = 1; c < RUNS; c++) {
        same &= !memcmp(m[0].params, m[c].params, n * fl_dtype_size(dt)) &&
                same_state(o[0].rule, o[c].rule);
        if (o[0].master) same &= !memcmp(o[0].master, o[c].master, n * sizeof(float));
    }
    const char *what = kind == FL_OPT_ADAMW ? "adamw"
                       : kind == FL_OPT_SGD ? "sgd+momentum"
                                            : "lomo";
    t_check(same, "%s %s: 1, 2 and 3 threads give the same weights, master and state bitwise",
            fl_dtype_name(dt), what);
    for (int c = 0; c < RUNS; c++) {
        fl_optimizer_free(&o[c]);
        big_free(&m[c]);
    }
}

static void test_thread_counts(void) {
    fl_dtype dts[] = {FL_F32, FL_BF16, FL_F16};
    for (int d = 0; d < 3; d++) {
        check_thread_counts(dts[d], FL_OPT_ADAMW);
        check_thread_counts(dts[d], FL_OPT_SGD);
    }
    check_thread_counts(FL_F32, FL_OPT_LOMO);
    check_thread_counts(FL_BF16, FL_OPT_LOMO);
}

static void test_shards_match_whole(void) {
    check_shards(FL_BF16, FL_OPT_ADAMW, 2);
    check_shards(FL_F16, FL_OPT_ADAMW, 1);
    check_shards(FL_F32, FL_OPT_SGD, 1);

    // a shard allocates master and state for its range only
    big_model m;
    big_init(&m, FL_BF16, 1);
    fl_optimizer_config cfg = adamw_config(1);
    size_t master0 = fl_mem_current(FL_MEM_MASTER), optim0 = fl_mem_current(FL_MEM_OPTIM);
    fl_optimizer o;
    fl_optimizer_init_range(&o, &cfg, &m.table, FL_BF16, m.params, m.grads, 1000, 3000);
    t_check(fl_mem_current(FL_MEM_MASTER) - master0 == 2000 * sizeof(float) &&
                fl_mem_current(FL_MEM_OPTIM) - optim0 == 2 * 2000 * sizeof(float),
            "a shard's master and AdamW state cover its 2000 elements");
    fl_optimizer_free(&o);
    big_free(&m);
}

// Frozen rows keep their weights and their state stays zero, whatever
// their gradient; the other rows train.
static void test_frozen_rows(void) {
    for (int kind = FL_OPT_ADAMW; kind <= FL_OPT_SGD; kind++) {
        big_model m;
        big_init(&m, FL_F32, 71);
        fl_param_view *fz = &m.table.views[2];
        fz->flags |= FL_PARAM_FROZEN;
        size_t n = m.table.numel;
        float *p0 = malloc(n * sizeof(float));
        memcpy(p0, m.params, n * sizeof(float));
        fl_optimizer_config cfg = adamw_config(1);
        cfg.kind = (fl_optim_kind)kind;
        cfg.momentum = 0.9f;
        fl_optimizer o;
        fl_optimizer_init(&o, &cfg, &m.table, FL_F32, m.params, m.grads);
        for (int step = 0; step < 2; step++) {
            big_micro_batches(&o, &m, 80 + step);
            fl_optimizer_step(&o, 1e-2f);
        }
        const float *p = m.params;
        int kept = !memcmp(p + fz->offset, p0 + fz->offset, fz->numel * sizeof(float));
        int zero = 1;
        for (int j = 0; j < fl_optim_state_count(o.rule); j++) {
            const float *st = fl_optim_state_ptr(o.rule, j, fz->offset);
            for (size_t i = 0; i < fz->numel; i++) zero &= st[i] == 0.0f;
        }
        int trained = 1;
        for (int k = 0; k < m.table.count; k++) {
            const fl_param_view *v = &m.table.views[k];
            if (k != 2)
                trained &= !!memcmp(p + v->offset, p0 + v->offset, v->numel * sizeof(float));
        }
        const char *what = kind == FL_OPT_ADAMW ? "adamw" : "sgd+momentum";
        t_check(kept && zero && trained,
                "%s: a frozen row keeps its weights and zero state; the others train", what);
        fl_optimizer_free(&o);
        free(p0);
        big_free(&m);
    }
}

// The state listing: names, and pointers that cover the state exactly.
static void test_state_listing(void) {
    fl_adamw a;
    size_t mem0 = fl_mem_current(FL_MEM_OPTIM);
    fl_adamw_init_range(&a, 5, 17, 0.9f, 0.95f, 1e-8f, 0.1f);
    fl_optim_rule *r = &a.rule;
    t_check(fl_optim_state_count(r) == 2 && !strcmp(fl_optim_state_name(r, 0), "m") &&
                !strcmp(fl_optim_state_name(r, 1), "v"),
            "adamw lists its state as m, v");
    t_check(fl_mem_current(FL_MEM_OPTIM) - mem0 == 2 * 12 * sizeof(float),
            "adamw's listed state is all its FL_MEM_OPTIM memory");
    for (int k = 0; k < 2; k++)
        for (size_t i = 5; i < 17; i++) *fl_optim_state_ptr(r, k, i) = 100.0f * k + i;
    int ok = 1;
    for (size_t i = 5; i < 17; i++) ok &= a.m[i - 5] == i && a.v[i - 5] == 100.0f + i;
    t_check(ok, "fl_optim_state_ptr addresses the state by flat-buffer element");
    fl_optim_free(r);

    fl_sgd s;
    mem0 = fl_mem_current(FL_MEM_OPTIM);
    fl_sgd_init_range(&s, 3, 10, 0.9f, 0.0f);
    t_check(fl_optim_state_count(&s.rule) == 1 &&
                !strcmp(fl_optim_state_name(&s.rule, 0), "momentum") &&
                fl_mem_current(FL_MEM_OPTIM) - mem0 == 7 * sizeof(float),
            "sgd with momentum lists its buffer as momentum");
    *fl_optim_state_ptr(&s.rule, 0, 9) = 42.0f;
    t_check(s.buf[6] == 42.0f, "sgd's state pointer is its momentum buffer");
    fl_optim_free(&s.rule);
    fl_sgd_init(&s, 10, 0.0f, 0.0f);
    t_check(fl_optim_state_count(&s.rule) == 0, "plain sgd lists no state");
    fl_optim_free(&s.rule);
}

static void test_scale(void) {
    lowp_model m;
    lowp_init(&m, FL_F16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(4);
    fl_optimizer_init(&o, &cfg, &m.table, FL_F16, m.params, m.grads);
    t_check(fl_optimizer_scale(&o) == 65536.0f && fl_optimizer_loss_scale(&o) == 16384.0f,
            "fp16: the scale is 2^16, the loss factor scale / accumulation");
    fl_optimizer_free(&o);
    fl_optimizer_init(&o, &cfg, &m.table, FL_BF16, m.params, m.grads);
    t_check(fl_optimizer_scale(&o) == 1.0f, "bf16: no loss scale");
    fl_optimizer_free(&o);
    fl_params_free(&m.table);
}

static void test_schedules(void) {
    fl_schedule s = {FL_SCHED_COSINE, 1.0f, 10, 110, 0.1f, 0.0f, 0};
    t_check(fabsf(fl_lr_at(&s, 0) - 0.1f) < 1e-7f, "warmup step 0 = lr/warmup");
    t_check(fabsf(fl_lr_at(&s, 9) - 1.0f) < 1e-7f, "warmup ends at lr");
    t_check(fabsf(fl_lr_at(&s, 10) - 1.0f) < 1e-6f, "cosine starts at lr");
    t_check(fabsf(fl_lr_at(&s, 60) - 0.55f) < 1e-6f, "cosine midpoint = (lr+floor)/2 (%g)",
            fl_lr_at(&s, 60));
    t_check(fabsf(fl_lr_at(&s, 110) - 0.1f) < 1e-7f, "cosine ends at the floor");
    t_check(fabsf(fl_lr_at(&s, 500) - 0.1f) < 1e-7f, "stays at the floor after the end");
    s.kind = FL_SCHED_LINEAR;
    t_check(fabsf(fl_lr_at(&s, 35) - 0.775f) < 1e-6f, "linear quarter way (%g)", fl_lr_at(&s, 35));
    s.kind = FL_SCHED_CONSTANT;
    t_check(fl_lr_at(&s, 100) == 1.0f, "constant after warmup");
    fl_schedule nowarm = {FL_SCHED_CONSTANT, 0.5f, 0, 10, 0.0f, 0.0f, 0};
    t_check(fl_lr_at(&nowarm, 0) == 0.5f, "no warmup: lr from step 0");
}

// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR at n updates
// applied: the rates deepspeed/runtime/lr_schedules.py gives at iteration
// n - 1 (-1 before its scheduler's first step), worked out in doubles from
// its formulas.
static void test_deepspeed_schedules(void) {
    const struct {
        fl_schedule s;
        int n;
        double want;
        const char *what;
    } at[] = {
        // WarmupLR, log warmup over 10 from 0 to 1e-3
        {{FL_SCHED_WARMUP_LR, 1e-3f, 10, 0, 0, 0.0f, 1}, 0, 0.0, "before the first step: from"},
        {{FL_SCHED_WARMUP_LR, 1e-3f, 10, 0, 0, 0.0f, 1}, 1, 0.0, "iteration 0: log 1 = 0"},
        {{FL_SCHED_WARMUP_LR, 1e-3f, 10, 0, 0, 0.0f, 1}, 2, 0.00030102999566398113, "log 2/log 10"},
        {{FL_SCHED_WARMUP_LR, 1e-3f, 10, 0, 0, 0.0f, 1}, 5, 0.0006989700043360187, "log 5/log 10"},
        {{FL_SCHED_WARMUP_LR, 1e-3f, 10, 0, 0, 0.0f, 1}, 10, 1e-3, "the end of warmup"},
        {{FL_SCHED_WARMUP_LR, 1e-3f, 10, 0, 0, 0.0f, 1}, 50, 1e-3, "then lr"},
        {{FL_SCHED_WARMUP_LR, 1e-3f, 1, 0, 0, 0.0f, 1}, 2, 1e-3, "warmup at least 2"},
        // WarmupDecayLR, linear warmup over 10 from 1e-4 to 1e-3, total 110
        {{FL_SCHED_WARMUP_DECAY_LR, 1e-3f, 10, 110, 0, 1e-4f, 0}, 0, 1e-4, "from"},
        {{FL_SCHED_WARMUP_DECAY_LR, 1e-3f, 10, 110, 0, 1e-4f, 0}, 5, 0.00046, "4/10 of the way"},
        {{FL_SCHED_WARMUP_DECAY_LR, 1e-3f, 10, 110, 0, 1e-4f, 0}, 11, 1e-3, "the decay's start"},
        {{FL_SCHED_WARMUP_DECAY_LR, 1e-3f, 10, 110, 0, 1e-4f, 0}, 61, 0.00055, "halfway down"},
        {{FL_SCHED_WARMUP_DECAY_LR, 1e-3f, 10, 110, 0, 1e-4f, 0}, 111, 1e-4, "back at from"},
        {{FL_SCHED_WARMUP_DECAY_LR, 1e-3f, 10, 110, 0, 1e-4f, 0}, 500, 1e-4, "and stays there"},
        // WarmupCosineLR, linear warmup over 10 from 0.1 lr, to 0.01 lr at 110
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0}, 0, 0.0, "0 before"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0}, 1, 1e-4, "from 0.1 lr"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0}, 6, 0.00055, "halfway up"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0},
         11,
         0.0009997557473810372,
         "the cosine's first step, 1/100 in"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0}, 60, 0.000505, "halfway"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0}, 110, 1e-5, "the floor"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 0}, 1000, 1e-5, "stays"},
        {{FL_SCHED_WARMUP_COSINE_LR, 1e-3f, 10, 110, 0.01f, 0.1f, 1},
         4,
         0.000641853992195166,
         "log warmup"}};
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        float got = fl_lr_at(&at[i].s, at[i].n);
        t_check(fl_schedule_by_updates(&at[i].s) &&
                    fabs(got - at[i].want) <= 1e-6 * at[i].want + 1e-12,
                "DeepSpeed's schedule %d after %d updates: %s (%.9g, want %.9g)", at[i].s.kind,
                at[i].n, at[i].what, got, at[i].want);
    }
}

// ----------------------------------------------------------------------------
// LOMO

// One LOMO update of the whole table on fp32 weights, with a clip coefficient.

static void test_lomo_rule(void) {
    fl_param_table t = {0};
    make_table(&t);
    size_t n = t.numel;
    float p[22], g[22], want[22];
    t_fill(p, n, 12, 1.0f);
    memcpy(want, p, sizeof p);
    size_t mem0 = fl_mem_current(FL_MEM_OPTIM);
    fl_lomo lomo;
    float lr = 0.05f, wd = 0.1f, clip = 0.3f, gscale = 0.75f, coef = 0.5f;
    fl_lomo_init_range(&lomo, 0, n, wd, clip);
    t_check(fl_optim_state_count(&lomo.rule) == 0 && fl_mem_current(FL_MEM_OPTIM) == mem0,
            "lomo keeps no state");
    for (int step = 1; step <= 3; step++) {
        t_fill(g, n, 400 + step, 1.0f);
        rule_step_clip(&lomo.rule, &t, p, g, gscale, coef, lr);
        float keep = 1.0f - lr * wd;
        for (size_t i = 0; i < n; i++) { // clamp the unscaled g, then the coefficient
            float d = g[i] * gscale;
            d = d < -clip ? -clip : d > clip ? clip : d;
            d *= coef;
            want[i] = want[i] * (i < 15 ? keep : 1.0f) - lr * d;
        }
    }
    t_check(!memcmp(p, want, sizeof p),
            "lomo: p*(1 - lr*wd) - lr*clamp(g*scale)*coef, decay on decayed rows, bitwise");
    t_check(lomo.t == 3, "lomo counts its steps");
    fl_optim_free(&lomo.rule);

    // without decay and clipping, LOMO on fp32 weights is plain SGD bitwise
    float q[22];
    t_fill(p, n, 13, 1.0f);
    memcpy(q, p, sizeof p);
    fl_sgd sgd;
    fl_lomo_init_range(&lomo, 0, n, 0.0f, 0.0f);
    fl_sgd_init(&sgd, n, 0.0f, 0.0f);
    for (int step = 1; step <= 3; step++) {
        t_fill(g, n, 500 + step, 2.0f);
        rule_step_clip(&lomo.rule, &t, p, g, gscale, 0.0f, 0.1f * step);
        rule_step(&sgd.rule, &t, q, g, gscale, 0.1f * step);
    }
    t_check(!memcmp(p, q, sizeof p), "lomo with wd 0 equals sgd (momentum 0, wd 0) bitwise");
    fl_optim_free(&lomo.rule);
    fl_optim_free(&sgd.rule);
    fl_params_free(&t);
}

// ----------------------------------------------------------------------------
// AdaLomo against the PyTorch reference (scripts/make_adalomo_reference.py)

typedef struct {
    unsigned char *data;
    size_t size;
} ref_file;

static size_t count_outside(const float *got, const float *want, size_t n, double atol,
                            double rtol) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += !(fabs((double)got[i] - want[i]) <= atol + rtol * fabs(want[i]));
    return bad;
}

// Copies the float32 record `name` of n elements into dst; 0 when absent.
static int ref_floats(const ref_file *f, const char *name, float *dst, size_t n) {
    size_t at = 12;
    while (at + 12 <= f->size) {
        uint32_t len, dtype, ndim;
        memcpy(&len, f->data + at, 4);
        const char *nm = (const char *)f->data + at + 4;
        at += 4 + len;
        memcpy(&dtype, f->data + at, 4);
        memcpy(&ndim, f->data + at + 4, 4);
        at += 8;
        size_t numel = 1;
        for (uint32_t d = 0; d < ndim; d++) {
            uint64_t s;
            memcpy(&s, f->data + at + 8 * d, 8);
            numel *= s;
        }
        at += 8 * ndim;
        if (len == strlen(name) && !memcmp(nm, name, len)) {
            if (dtype != 0 || numel != n || at + 4 * n > f->size) return 0;
            memcpy(dst, f->data + at, 4 * n);
            return 1;
        }
        at += 4 * numel;
    }
    return 0;
}

// Record "<what>/<step>/<tensor>" (step > 0) or "<what>" into dst.
static void ref_get(const ref_file *f, const char *what, int step, const char *tensor, float *dst,
                    size_t n) {
    char name[64];
    if (step > 0)
        snprintf(name, sizeof name, "%s/%d/%s", what, step, tensor);
    else
        snprintf(name, sizeof name, "%s", what);
    if (!ref_floats(f, name, dst, n)) {
        t_check(0, "adalomo fixture: record %s of %zu floats", name, n);
        exit(1);
    }
}

// The fixture's tensors as a table: w (7x5, decayed) then b (6).
static void adalomo_table(fl_param_table *t) {
    size_t w[2] = {7, 5}, b[1] = {6};
    fl_params_add(t, "w", FL_PARAM_DECAY, 2, w);
    fl_params_add(t, "b", 0, 1, b);
}

static void adalomo_rule_step(fl_optim_rule *r, const fl_param_table *t, float *p, const float *g,
                              float lr) {
    rule_step(r, t, p, g, 1.0f, lr);
}

static void test_adalomo_matches_reference(void) {
    size_t size;
    unsigned char *data = t_read_file(t_source_path("tests/fixtures/adalomo_ref.bin"), &size);
    t_check(data && size > 12 && !memcmp(data, "FITLMREF", 8), "adalomo fixture is there");
    if (!data) return;
    ref_file f = {data, size};
    float h[6];
    ref_get(&f, "hyper", 0, NULL, h, 6);
    float lr = h[0];
    fl_param_table t = {0};
    adalomo_table(&t);
    enum { N = 41 };
    float p[N], g[N];
    ref_get(&f, "param/w", 0, NULL, p, 35);
    ref_get(&f, "param/b", 0, NULL, p + 35, 6);
    size_t mem0 = fl_mem_current(FL_MEM_OPTIM);
    fl_adalomo o, o2;
    fl_adalomo_init_range(&o, &t, 0, N, h[1], h[2], h[3], h[4], h[5], 0.0f);
    fl_optim_rule *r = &o.rule;
    const fl_param_view *w = &t.views[0], *b = &t.views[1];
    t_check(fl_mem_current(FL_MEM_OPTIM) - mem0 == (7 + 5 + 6) * sizeof(float) &&
                fl_adalomo_state_numel(&t, 0, N) == 18,
            "adalomo: state is R + K for the matrix and n for the vector (%zu bytes)",
            fl_mem_current(FL_MEM_OPTIM) - mem0);
    t_check(fl_optim_state_count(r) == 3 && !strcmp(fl_optim_state_name(r, 0), "exp_avg_sq_row") &&
                !strcmp(fl_optim_state_name(r, 1), "exp_avg_sq_col") &&
                !strcmp(fl_optim_state_name(r, 2), "exp_avg_sq"),
            "adalomo names its state exp_avg_sq_row, exp_avg_sq_col, exp_avg_sq");
    t_check(fl_optim_state_numel(r, 0, w) == 7 && fl_optim_state_numel(r, 1, w) == 5 &&
                fl_optim_state_numel(r, 2, w) == 0 && fl_optim_state_numel(r, 0, b) == 0 &&
                fl_optim_state_numel(r, 1, b) == 0 && fl_optim_state_numel(r, 2, b) == 6,
            "adalomo: per-row state sizes (7, 5, 0) for w and (0, 0, 6) for b");
    fl_optimizer_config cfg = {.kind = FL_OPT_ADALOMO, .grad_accum = 1};
    size_t bytes[FL_MEM_NTAGS];
    fl_optimizer_memory_table(&cfg, FL_BF16, &t, 0, N, bytes);
    t_check(bytes[FL_MEM_OPTIM] == 18 * sizeof(float) && bytes[FL_MEM_MASTER] == 0 &&
                bytes[FL_MEM_GRADS] == 0,
            "fl_optimizer_memory_table: adalomo's exact state, no master");
    cfg.kind = FL_OPT_LOMO;
    cfg.grad_accum = 2;
    fl_optimizer_memory(&cfg, FL_BF16, N, bytes);
    t_check(bytes[FL_MEM_OPTIM] == 0 && bytes[FL_MEM_MASTER] == 0 &&
                bytes[FL_MEM_GRADS] == N * sizeof(float),
            "lomo: no state, no master; an fp32 gradient sum only with accumulation");

    float saved_p[N], saved_state[18];
    int saved_t = 0;
    // float32 against float64: after 5 steps the weights (|p| <~ 2.5, steps
    // ~1e-2) agree to a few float32 ulps; the state (relative) likewise
    const double atol = 2e-6, rtol = 2e-6;
    int all = 1;
    for (int step = 1; step <= 5; step++) {
        ref_get(&f, "grad", step, "w", g, 35);
        ref_get(&f, "grad", step, "b", g + 35, 6);
        adalomo_rule_step(r, &t, p, g, lr);
        float want[N];
        ref_get(&f, "after", step, "w", want, 35);
        ref_get(&f, "after", step, "b", want + 35, 6);
        all &= count_outside(p, want, N, atol, rtol) == 0;
        if (step == 5) t_close("adalomo weights after step 5", p, want, N, atol, rtol);
        if (step == 3) { // a checkpoint of the state through the listing
            memcpy(saved_p, p, sizeof p);
            size_t at = 0;
            for (int k = 0; k < 3; k++)
                for (int v = 0; v < 2; v++) {
                    size_t m = fl_optim_state_numel(r, k, &t.views[v]);
                    memcpy(saved_state + at, fl_optim_state_ptr(r, k, t.views[v].offset),
                           m * sizeof(float));
                    at += m;
                }
            saved_t = *fl_optim_step_count(r);
        }
    }
    t_check(all,
            "adalomo: weights after each of 5 steps match the float64 reference within "
            "atol %g + rtol %g",
            atol, rtol);
    float want_row[7], want_col[5], want_sq[6];
    ref_get(&f, "state", 5, "exp_avg_sq_row", want_row, 7);
    ref_get(&f, "state", 5, "exp_avg_sq_col", want_col, 5);
    ref_get(&f, "state", 5, "exp_avg_sq", want_sq, 6);
    t_close("adalomo exp_avg_sq_row after 5 steps", fl_optim_state_ptr(r, 0, 0), want_row, 7, 0,
            1e-5);
    t_close("adalomo exp_avg_sq_col after 5 steps", fl_optim_state_ptr(r, 1, 0), want_col, 5, 0,
            1e-5);
    t_close("adalomo exp_avg_sq after 5 steps", fl_optim_state_ptr(r, 2, 35), want_sq, 6, 0, 1e-5);

    // restore the step-3 state into a new rule and continue: bitwise the same
    fl_adalomo_init_range(&o2, &t, 0, N, h[1], h[2], h[3], h[4], h[5], 0.0f);
    size_t at = 0;
    for (int k = 0; k < 3; k++)
        for (int v = 0; v < 2; v++) {
            size_t m = fl_optim_state_numel(&o2.rule, k, &t.views[v]);
            memcpy(fl_optim_state_ptr(&o2.rule, k, t.views[v].offset), saved_state + at,
                   m * sizeof(float));
            at += m;
        }
    *fl_optim_step_count(&o2.rule) = saved_t;
    for (int step = 4; step <= 5; step++) {
        ref_get(&f, "grad", step, "w", g, 35);
        ref_get(&f, "grad", step, "b", g + 35, 6);
        adalomo_rule_step(&o2.rule, &t, saved_p, g, lr);
    }
    t_check(!memcmp(saved_p, p, sizeof p) && !memcmp(o.state, o2.state, 18 * sizeof(float)),
            "adalomo: state saved and restored through fl_optim_state_ptr continues bitwise");
    fl_optim_free(r);
    fl_optim_free(&o2.rule);
    fl_params_free(&t);
    free(data);
}

// ----------------------------------------------------------------------------
// the fused kinds on 16-bit weights without master

// A table whose matrix spans several sum chunks (> 16384 elements) and update
// blocks, and a long vector.
static void make_fused_table(fl_param_table *t) {
    size_t m[2] = {300, 70}, v[1] = {9000}, w[2] = {40, 33};
    fl_params_add(t, "m", FL_PARAM_DECAY, 2, m);
    fl_params_add(t, "v", 0, 1, v);
    fl_params_add(t, "w", FL_PARAM_DECAY, 2, w);
}

typedef struct {
    fl_param_table table;
    fl_dtype dt;
    void *params;
    fl_optimizer o;
} fused_run;

// steps with gradients 1 (+ noise when `noisy`), lr 1e-5, from weights in [1, 1.9]
static void fused_start(fused_run *f, fl_optim_kind kind, fl_dtype dt, int sr, uint64_t seed) {
    memset(f, 0, sizeof *f);
    make_fused_table(&f->table);
    size_t n = f->table.numel;
    f->dt = dt;
    f->params = malloc(n * fl_dtype_size(dt));
    float *p = malloc(n * sizeof(float));
    t_fill(p, n, 91, 0.45f);
    for (size_t i = 0; i < n; i++) p[i] += 1.45f;
    fl_convert(dt, f->params, FL_F32, p, n);
    free(p);
    fl_optimizer_config cfg = {.kind = kind,
                               .eps = 1e-30f,
                               .weight_decay = 0.0f,
                               .grad_accum = 1,
                               .stochastic_rounding = sr,
                               .seed = seed,
                               .eps2 = 1e-3f,
                               .clip_threshold = 1.0f,
                               .decay_rate = -0.8f};
    fl_optimizer_init(&f->o, &cfg, &f->table, dt, f->params, NULL);
}

static void fused_steps(fused_run *f, int steps, float lr, fl_dtype gdt) {
    size_t n = f->table.numel;
    float *g = malloc(n * sizeof(float));
    void *g16 = malloc(n * sizeof(float));
    for (int s = 0; s < steps; s++) {
        t_fill(g, n, 600 + *fl_optim_step_count(f->o.rule), 0.25f);
        for (size_t i = 0; i < n; i++) g[i] += 1.0f;
        fl_convert(gdt, g16, FL_F32, g, n);
        fl_optimizer_begin_step(&f->o, lr);
        for (int k = f->table.count - 1; k >= 0; k--) // per row, reverse order, as backward
            fl_optimizer_update_rows(&f->o, k, 1, fl_at(gdt, g16, f->table.views[k].offset), gdt,
                                     1.0f);
        fl_optimizer_end_step(&f->o);
    }
    free(g);
    free(g16);
}

static void fused_free(fused_run *f) {
    fl_optimizer_free(&f->o);
    free(f->params);
    fl_params_free(&f->table);
}

// The mean change of the weights from `before` (fp32 values)
static double mean_change(const fused_run *f, const float *before) {
    size_t n = f->table.numel;
    float *now = malloc(n * sizeof(float));
    fl_convert(FL_F32, now, f->dt, f->params, n);
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)now[i] - before[i];
    free(now);
    return s / (double)n;
}

static void check_fused_kind(fl_optim_kind kind) {
    const char *name = kind == FL_OPT_LOMO ? "lomo" : "adalomo";
    enum { STEPS = 20 };
    float lr = 1e-5f;
    fused_run ref, rne, sr1, sr2, sr3;
    size_t master0 = fl_mem_current(FL_MEM_MASTER);
    fused_start(&ref, kind, FL_F32, 0, 0);
    fused_start(&rne, kind, FL_BF16, 0, 0);
    fused_start(&sr1, kind, FL_BF16, 1, 7);
    fused_start(&sr2, kind, FL_BF16, 1, 7);
    fused_start(&sr3, kind, FL_BF16, 1, 8);
    t_check(fl_mem_current(FL_MEM_MASTER) == master0 && !sr1.o.master,
            "%s on bf16: no master weights", name);
    size_t n = ref.table.numel;
    float *before = malloc(n * sizeof(float));
    uint16_t *rne0 = malloc(n * sizeof(uint16_t));
    fl_convert(FL_F32, before, FL_BF16, sr1.params, n);
    memcpy(rne0, rne.params, n * sizeof(uint16_t));
    memcpy(ref.params, before, n * sizeof(float)); // the same start in fp32
    omp_set_num_threads(1);
    fused_steps(&ref, STEPS, lr, FL_F32);
    fused_steps(&rne, STEPS, lr, FL_F32);
    fused_steps(&sr1, STEPS, lr, FL_F32);
    fused_steps(&sr3, STEPS, lr, FL_F32);
    omp_set_num_threads(2);
    fused_steps(&sr2, STEPS, lr, FL_F32);
    double want = mean_change(&ref, before), got = mean_change(&sr1, before);
    t_check(!memcmp(rne.params, rne0, n * sizeof(uint16_t)),
            "%s bf16, lr 1e-5, weights ~1: round to nearest leaves every weight unchanged", name);
    // the mean over n = 23320 weights of 20 stochastic roundings, each off by
    // up to a bf16 spacing (2^-7) with probability ~2e-3: 20% is > 4 sigma
    t_check(got < 0.0 && fabs(got - want) <= 0.2 * fabs(want),
            "%s bf16: stochastic rounding moves the weights, mean change %.4g ~ fp32's %.4g", name,
            got, want);
    t_check(!memcmp(sr1.params, sr2.params, n * sizeof(uint16_t)),
            "%s bf16 SR: the same seed gives the same weights on 1 and 2 threads", name);
    t_check(memcmp(sr1.params, sr3.params, n * sizeof(uint16_t)) != 0,
            "%s bf16 SR: another seed gives other weights", name);
    if (kind == FL_OPT_ADALOMO)
        t_check(
            !memcmp(sr1.o.adalomo.state, sr2.o.adalomo.state, sr1.o.adalomo.numel * sizeof(float)),
            "adalomo state is the same on 1 and 2 threads");

    // resume: a new optimizer with the weights, state and t of step 10
    // continues as the uninterrupted run (the SR seed follows t); bf16 grads
    fused_run a, b;
    fused_start(&a, kind, FL_BF16, 1, 99);
    fused_start(&b, kind, FL_BF16, 1, 99);
    fused_steps(&a, 6, 1e-3f, FL_BF16);
    fused_steps(&b, 3, 1e-3f, FL_BF16);
    fl_optimizer c;
    fl_optimizer_init(&c, &b.o.cfg, &b.table, FL_BF16, b.params, NULL);
    if (kind == FL_OPT_ADALOMO)
        memcpy(c.adalomo.state, b.o.adalomo.state, b.o.adalomo.numel * sizeof(float));
    *fl_optim_step_count(c.rule) = *fl_optim_step_count(b.o.rule);
    fl_optimizer_free(&b.o);
    b.o = c;
    fused_steps(&b, 3, 1e-3f, FL_BF16);
    t_check(!memcmp(a.params, b.params, n * sizeof(uint16_t)),
            "%s bf16 SR: a restart from the weights, state and t continues bitwise", name);
    fused_free(&a);
    fused_free(&b);
    free(before);
    free(rne0);
    fused_free(&ref);
    fused_free(&rne);
    fused_free(&sr1);
    fused_free(&sr2);
    fused_free(&sr3);
}

static void test_fused_lowp(void) {
    check_fused_kind(FL_OPT_LOMO);
    check_fused_kind(FL_OPT_ADALOMO);
}

// ----------------------------------------------------------------------------
// the optimizer on a device

#define DEV_STEPS 4

// What DEV_STEPS steps left: the weights, master and rule state (downloaded)
// and each step's result.
typedef struct {
    void *params;                       // n values of the dtype
    float *master;                      // n floats, or NULL
    float *state[FL_OPTIM_MAX_TENSORS]; // state_n floats each
    int nstate;
    size_t state_n;
    size_t n, bytes; // elements, bytes of params
    fl_step_result r[DEV_STEPS];
} dev_outcome;

// The fused step's two passes (step.c's fused_step, one micro-batch): the
// rows' sums of squares through the device, an overflow skipped, then the
// rows updated from the last one by one with the global-norm coefficient.
static fl_step_result rows_step(fl_optimizer *o, const fl_device *d, void *grads, float lr) {
    const fl_param_table *t = o->table;
    fl_step_result r = {0.0f, 0.0f, 0, o->scaler.scale, {0, NAN, NAN}};
    double sq = 0.0;
    for (int k = 0; k < t->count; k++)
        sq += d->sumsq(o->dtype, fl_at(o->dtype, grads, t->views[k].offset), t->views[k].numel);
    o->micro = 0;
    if (!isfinite(sq)) {
        r.skipped = 1;
        fl_loss_scaler_update(&o->scaler, 1);
        return r;
    }
    float unscale = 1.0f / o->scaler.scale;
    r.grad_norm = (float)sqrt(sq) * unscale;
    float coef = fl_clip_coef(r.grad_norm, o->cfg.max_grad_norm);
    fl_optimizer_begin_step(o, lr);
    for (int k = t->count - 1; k >= 0; k--)
        fl_optimizer_update_rows_clip(o, k, 1, fl_at(o->dtype, grads, t->views[k].offset), o->dtype,
                                      fl_optim_kind_fused(o->cfg.kind) ? unscale : unscale * coef,
                                      fl_optim_kind_fused(o->cfg.kind) ? coef : 1.0f);
    fl_optimizer_end_step(o);
    return r;
}

// DEV_STEPS steps of cfg's optimizer over the big table, with the weights
// and gradients in d's memory (filled by upload) and the optimizer put on d.
// Each micro-batch's "backward" adds its gradient (times the loss scale) to
// the device's through the copies, as a backward accumulates; at step
// `overflow` (-1: none) one gradient overflows fp16 once scaled. Off the
// cpu the optimizer's own buffers must be the device's, in
// fl_optimizer_memory_table's sizes. by_rows: each step as the fused step
// (step.c) takes it: the norm from the rows' sums of squares (d->sumsq),
// then the rows updated one at a time from the last, each with its own
// gradient rows, as units complete in the backward pass.
static void dev_run(const fl_device *d, fl_dtype dt, const fl_optimizer_config *cfg, int overflow,
                    int by_rows, dev_outcome *out) {
    fl_param_table t = {0};
    make_big_table(&t);
    size_t n = t.numel, ds = fl_dtype_size(dt), want[FL_MEM_NTAGS];
    float *f = malloc(n * sizeof(float));
    void *host = malloc(n * ds);
    t_fill(f, n, 61, 1.0f);
    fl_convert(dt, host, FL_F32, f, n);
    void *params = d->alloc(d, FL_MEM_PARAMS, n * ds), *grads = d->alloc(d, FL_MEM_GRADS, n * ds);
    fl_dev_upload(d, params, host, n * ds);
    const fl_mem_tag tags[] = {FL_MEM_MASTER, FL_MEM_GRADS, FL_MEM_OPTIM};
    size_t before[3];
    for (int k = 0; k < 3; k++) before[k] = fl_mem_device_current(tags[k]);
    fl_optimizer o;
    fl_device_use(d);
    fl_optimizer_init(&o, cfg, &t, dt, params, grads);
    fl_device_use(fl_device_cpu());
    fl_optimizer_memory_table(cfg, dt, &t, 0, n, want);
    int placed = o.dev == d && o.rule->dev == d;
    for (int k = 0; k < 3 && !d->host; k++)
        placed &= fl_mem_device_current(tags[k]) - before[k] == want[tags[k]];
    t_check(placed, "%s: the optimizer, its master, gradient sum and state are the device's",
            d->name);
    for (int s = 0; s < DEV_STEPS; s++) {
        for (int micro = 0; micro < cfg->grad_accum; micro++) {
            fl_optimizer_zero_grad(&o);
            t_fill(f, n, 70 + 10 * (unsigned)s + (unsigned)micro, 0.05f);
            if (s == overflow) f[n / 3] = 1e4f;
            for (size_t i = 0; i < n; i++) f[i] *= fl_optimizer_loss_scale(&o);
            fl_dev_download(d, host, grads, n * ds);
            fl_accumulate_f32(dt, host, f, n);
            fl_dev_upload(d, grads, host, n * ds);
            if (!by_rows) fl_optimizer_micro_done(&o);
        }
        if (by_rows)
            out->r[s] = rows_step(&o, d, grads, 1e-2f * (float)(s + 1));
        else
            out->r[s] = fl_optimizer_step(&o, 1e-2f * (float)(s + 1));
    }
    out->n = n;
    out->bytes = n * ds;
    out->params = malloc(n * ds);
    fl_dev_download(d, out->params, params, n * ds);
    if (o.master) {
        out->master = malloc(n * sizeof(float));
        fl_dev_download(d, out->master, o.master, n * sizeof(float));
    }
    out->nstate = fl_optim_state_count(o.rule);
    out->state_n = n;
    if (cfg->kind == FL_OPT_ADALOMO) { // one buffer of per-row statistics
        out->nstate = 1;
        out->state_n = o.adalomo.numel;
        out->state[0] = malloc(o.adalomo.numel * sizeof(float));
        fl_dev_download(d, out->state[0], o.adalomo.state, o.adalomo.numel * sizeof(float));
    }
    for (int k = 0; k < out->nstate && cfg->kind != FL_OPT_ADALOMO; k++) {
        out->state[k] = malloc(n * sizeof(float));
        fl_dev_download(d, out->state[k], fl_optim_state_ptr(o.rule, k, 0), n * sizeof(float));
    }
    fl_optimizer_free(&o);
    d->free(d, params);
    d->free(d, grads);
    free(f);
    free(host);
    fl_params_free(&t);
}

static void dev_outcome_free(dev_outcome *x) {
    free(x->params);
    free(x->master);
    for (int k = 0; k < x->nstate; k++) free(x->state[k]);
}

// The optimizer on the test device (buffers the host cannot touch, the
// cpu's kernels) gives the cpu's weights, master, state, norms, skips and
// loss scales bitwise. clip: the norm must exceed max_grad_norm at every
// step that is not skipped.
static void check_device_step_as(const char *name, fl_dtype dt, const fl_optimizer_config *cfg,
                                 int overflow, int by_rows) {
    dev_outcome a = {0}, b = {0};
    dev_run(fl_device_cpu(), dt, cfg, overflow, by_rows, &a);
    dev_run(fl_device_get("test"), dt, cfg, overflow, by_rows, &b);
    size_t n = a.n;
    int same = !memcmp(a.params, b.params, a.bytes) && !a.master == !b.master &&
               (!a.master || !memcmp(a.master, b.master, n * sizeof(float))) &&
               a.nstate == b.nstate && a.state_n == b.state_n;
    for (int k = 0; same && k < a.nstate; k++)
        same &= !memcmp(a.state[k], b.state[k], a.state_n * sizeof(float));
    int results = 1, clipped = 1, skips = 1,
        halved = overflow < 0 || overflow + 1 >= DEV_STEPS ||
                 b.r[overflow + 1].loss_scale * 2.0f == b.r[overflow].loss_scale;
    for (int s = 0; s < DEV_STEPS; s++) {
        const fl_step_result *x = &a.r[s], *y = &b.r[s];
        results &= !memcmp(&x->grad_norm, &y->grad_norm, sizeof(float)) &&
                   x->skipped == y->skipped && x->loss_scale == y->loss_scale;
        skips &= y->skipped == (s == overflow);
        if (!y->skipped) clipped &= y->grad_norm > cfg->max_grad_norm;
    }
    t_check(same && results,
            "%s: the test device's weights, master, state and step results are the cpu's "
            "bitwise",
            name);
    t_check(skips && halved, "%s: only the overflowing step (if any) is skipped, halving the scale",
            name);
    t_check(clipped, "%s: clipping is active", name);
    dev_outcome_free(&a);
    dev_outcome_free(&b);
}

static void check_device_step(const char *name, fl_dtype dt, const fl_optimizer_config *cfg,
                              int overflow) {
    check_device_step_as(name, dt, cfg, overflow, 0);
}

static void test_device_steps(void) {
    fl_optimizer_config adamw = adamw_config(2); // accumulates 2 micro-batches
    adamw.max_grad_norm = 0.5f;
    fl_optimizer_config sgd = adamw;
    sgd.kind = FL_OPT_SGD;
    sgd.momentum = 0.9f;
    sgd.weight_decay = 0.01f;
    sgd.grad_accum = 1;
    check_device_step("fp32 AdamW, 2 micro-batches", FL_F32, &adamw, -1);
    check_device_step("bf16 AdamW with master weights, 2 micro-batches", FL_BF16, &adamw, -1);
    check_device_step("fp32 SGD with momentum", FL_F32, &sgd, -1);
    check_device_step("bf16 SGD with momentum", FL_BF16, &sgd, -1);
    fl_optimizer_config fp16 = adamw;
    fp16.hysteresis = 1; // the overflow halves the scale
    check_device_step("fp16 AdamW, loss scaling, 2 micro-batches", FL_F16, &fp16, 2);

    // the fused kinds: no master, 16-bit weights stored back by stochastic
    // rounding, LOMO's clip by value, AdaLomo's per-row state; whole steps
    // and the fused step's row-by-row updates
    fl_optimizer_config lomo = adamw_config(1);
    lomo.kind = FL_OPT_LOMO;
    lomo.max_grad_norm = 0.5f;
    lomo.clip_value = 0.02f;
    lomo.weight_decay = 0.01f;
    lomo.stochastic_rounding = 1;
    lomo.seed = 1234;
    fl_optimizer_config adalomo = lomo;
    adalomo.kind = FL_OPT_ADALOMO;
    adalomo.clip_value = 0.0f;
    for (int by_rows = 0; by_rows < 2; by_rows++) {
        char name[96];
        const char *how = by_rows ? "row by row" : "whole step";
        const fl_dtype dts[] = {FL_F32, FL_BF16};
        for (int k = 0; k < 2; k++) {
            snprintf(name, sizeof name, "%s LOMO, clipped, %s", fl_dtype_name(dts[k]), how);
            check_device_step_as(name, dts[k], &lomo, -1, by_rows);
            snprintf(name, sizeof name, "%s AdaLomo, clipped, %s", fl_dtype_name(dts[k]), how);
            check_device_step_as(name, dts[k], &adalomo, -1, by_rows);
        }
        fl_optimizer_config lomo16 = lomo;
        lomo16.hysteresis = 1;
        snprintf(name, sizeof name, "fp16 LOMO, loss scaling, an overflow, %s", how);
        check_device_step_as(name, FL_F16, &lomo16, 2, by_rows);
    }
    // AdamW and SGD updated row by row from the backward pass
    fl_optimizer_config in_bwd = adamw_config(1);
    in_bwd.max_grad_norm = 0.5f;
    in_bwd.in_backward = 1;
    check_device_step_as("bf16 AdamW in backward", FL_BF16, &in_bwd, -1, 1);
    in_bwd.kind = FL_OPT_SGD;
    in_bwd.momentum = 0.9f;
    check_device_step_as("fp32 SGD in backward", FL_F32, &in_bwd, -1, 1);
}

// The step's norm asks the device once a step for all its rows' sums
// (sumsq_rows; cuda: one copy back and one wait), never row by row (sumsq,
// a wait each): counted on a copy of the test device's table, whose steps
// stay the cpu's bitwise.
static int n_sumsq, n_sumsq_rows;

static double counted_sumsq(fl_dtype dt, const void *x, size_t n) {
    n_sumsq++;
    return fl_device_get("test")->sumsq(dt, x, n);
}

static void counted_sumsq_rows(fl_dtype dt, const void *x, int n, const size_t *offsets,
                               const size_t *counts, double *out) {
    n_sumsq_rows++;
    fl_device_get("test")->sumsq_rows(dt, x, n, offsets, counts, out);
}

static void test_norm_round_trips(void) {
    fl_device counted = *fl_device_get("test");
    counted.sumsq = counted_sumsq;
    counted.sumsq_rows = counted_sumsq_rows;
    fl_optimizer_config adamw = adamw_config(2);
    adamw.max_grad_norm = 0.5f;
    dev_outcome a = {0}, b = {0};
    dev_run(fl_device_cpu(), FL_BF16, &adamw, -1, 0, &a);
    n_sumsq = n_sumsq_rows = 0;
    dev_run(&counted, FL_BF16, &adamw, -1, 0, &b);
    int same = !memcmp(a.params, b.params, a.bytes) && !memcmp(a.master, b.master, a.n * 4);
    for (int s = 0; s < DEV_STEPS; s++)
        same &= !memcmp(&a.r[s].grad_norm, &b.r[s].grad_norm, sizeof(float));
    t_check(same, "bf16 AdamW through sumsq_rows: the cpu's weights, master and norms bitwise");
    t_check(n_sumsq == 0 && n_sumsq_rows == DEV_STEPS,
            "%d steps' norms: %d calls of sumsq_rows (one a step), %d of sumsq (none)", DEV_STEPS,
            n_sumsq_rows, n_sumsq);
    dev_outcome_free(&a);
    dev_outcome_free(&b);
}

// ----------------------------------------------------------------------------
// the ISA paths

// weights of 4 rules, AdamW's m and v, SGD's momentum; then for two
// mixed-precision AdamW runs, master, m, v and the 16-bit weights
#define PATH_OUTS 15
#define PATH_SUMS 6
#define SUMSQ_N   100003 // several chunks, a ragged end

// What every path must compute bitwise alike: three steps of each rule with
// an elementwise kernel (AdamW, SGD with and without momentum, LOMO) over
// make_big_table's rows (several update blocks, ends no multiple of a vector),
// and of AdamW under mixed precision (fp32 master, 16-bit weights refreshed,
// 16-bit or fp32 gradients), into out (PATH_OUTS arrays of the table's size),
// and sums of squares of ragged lengths in fp32 and bf16 into sums.
static void path_results(float *out, double *sums) {
    fl_param_table t = {0};
    make_big_table(&t);
    size_t n = t.numel;
    float *g = malloc(n * sizeof *g), *p[4];
    for (int k = 0; k < 4; k++) t_fill(p[k] = out + k * n, n, 30 + k, 1.0f);
    fl_adamw adamw;
    fl_sgd sgd, plain;
    fl_lomo lomo;
    fl_adamw_init(&adamw, n, 0.9f, 0.95f, 1e-8f, 0.1f);
    fl_sgd_init(&sgd, n, 0.9f, 0.01f);
    fl_sgd_init(&plain, n, 0.0f, 0.01f);
    fl_lomo_init_range(&lomo, 0, n, 0.1f, 0.3f);
    for (int step = 1; step <= 3; step++) {
        t_fill(g, n, 40 + step, 0.5f);
        rule_step(&adamw.rule, &t, p[0], g, 0.75f, 1e-2f);
        rule_step(&sgd.rule, &t, p[1], g, 0.75f, 0.05f);
        rule_step(&plain.rule, &t, p[2], g, 0.75f, 0.05f);
        rule_step_clip(&lomo.rule, &t, p[3], g, 0.75f, 0.5f, 0.05f);
    }
    float *state[3] = {fl_optim_state_ptr(&adamw.rule, 0, 0), fl_optim_state_ptr(&adamw.rule, 1, 0),
                       fl_optim_state_ptr(&sgd.rule, 0, 0)};
    for (int k = 0; k < 3; k++) memcpy(out + (4 + k) * n, state[k], n * sizeof(float));
    fl_optim_free(&adamw.rule), fl_optim_free(&sgd.rule), fl_optim_free(&plain.rule);
    fl_optim_free(&lomo.rule);
    // mixed precision: bf16 weights with bf16 gradients, fp16 weights with
    // fp32 gradients (an accumulation buffer's)
    for (int run = 0; run < 2; run++) {
        fl_dtype dt = run ? FL_F16 : FL_BF16, gdt = run ? FL_F32 : FL_BF16;
        float *o = out + (7 + 4 * run) * n;
        void *p16 = malloc(n * 2), *g16 = malloc(n * 2);
        t_fill(o, n, 60 + run, 1.0f);
        fl_convert(dt, p16, FL_F32, o, n);
        fl_adamw_init(&adamw, n, 0.9f, 0.95f, 1e-8f, 0.1f);
        for (int step = 1; step <= 3; step++) {
            t_fill(g, n, 70 + step, 0.5f);
            fl_convert(FL_BF16, g16, FL_F32, g, n);
            fl_optim_begin_step(&adamw.rule, 1e-2f);
            for (int k = 0; k < t.count; k++) {
                const fl_param_view *v = &t.views[k];
                fl_update_args a = {.params = o + v->offset,
                                    .params_lowp = fl_at(dt, p16, v->offset),
                                    .lowp_dtype = dt,
                                    .grads = gdt == FL_F32 ? (const void *)(g + v->offset)
                                                           : fl_at(gdt, g16, v->offset),
                                    .grads_dtype = gdt,
                                    .grad_scale = 0.75f};
                fl_optim_update(&adamw.rule, v, v->offset, v->numel, &a);
            }
            fl_optim_end_step(&adamw.rule);
        }
        memcpy(o + n, fl_optim_state_ptr(&adamw.rule, 0, 0), n * sizeof(float));
        memcpy(o + 2 * n, fl_optim_state_ptr(&adamw.rule, 1, 0), n * sizeof(float));
        fl_convert(FL_F32, o + 3 * n, dt, p16, n);
        fl_optim_free(&adamw.rule);
        free(p16), free(g16);
    }
    fl_params_free(&t);

    float *x = malloc(SUMSQ_N * sizeof *x);
    uint16_t *h = malloc(SUMSQ_N * sizeof *h);
    t_fill(x, SUMSQ_N, 50, 1.0f);
    size_t lens[PATH_SUMS - 1] = {1, 15, 16, 17, SUMSQ_N};
    for (int k = 0; k < PATH_SUMS - 1; k++) sums[k] = fl_grad_sumsq(FL_F32, x, lens[k]);
    fl_convert(FL_BF16, h, FL_F32, x, SUMSQ_N);
    sums[PATH_SUMS - 1] = fl_grad_sumsq(FL_BF16, h, SUMSQ_N);
    free(g), free(x), free(h);
}

// path_results on every ISA the CPU has, each in a child forked before any
// OpenMP thread exists (fl_cpu() reads FITLM_ISA once per process), which
// leaves its results in shared memory: AVX2 and AVX-512 must give the
// portable path's bits.
static void test_isa_paths_bitwise(int avx2, int avx512) {
    printf("isa paths\n");
    const char *caps[] = {"portable", "avx2", "avx512"};
    int have[] = {1, avx2, avx512};
    fl_param_table t = {0};
    make_big_table(&t);
    size_t n = t.numel, nout = PATH_OUTS * n;
    fl_params_free(&t);
    float *outs = mmap(NULL, 3 * nout * sizeof *outs, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    double *sums = mmap(NULL, 3 * PATH_SUMS * sizeof *sums, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    t_check(outs != MAP_FAILED && sums != MAP_FAILED, "mmap failed");
    if (outs == MAP_FAILED || sums == MAP_FAILED) return;
    for (int k = 0; k < 3; k++) {
        if (!have[k]) continue;
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            setenv("FITLM_ISA", caps[k], 1);
            path_results(outs + k * nout, sums + k * PATH_SUMS);
            _exit(strcmp(fl_isa_name(fl_cpu_isa()), caps[k]) != 0); // the cap held
        }
        int status = 0;
        if (pid > 0) waitpid(pid, &status, 0);
        t_check(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "%s-path child failed or ran another path", caps[k]);
    }
    const char *out_names[PATH_OUTS] = {"adamw weights",
                                        "sgd+momentum weights",
                                        "sgd weights",
                                        "lomo weights",
                                        "adamw m",
                                        "adamw v",
                                        "sgd momentum",
                                        "bf16 adamw master",
                                        "bf16 adamw m",
                                        "bf16 adamw v",
                                        "bf16 adamw bf16 weights",
                                        "fp16 adamw master (fp32 gradients)",
                                        "fp16 adamw m",
                                        "fp16 adamw v",
                                        "fp16 adamw fp16 weights"};
    const char *sum_names[PATH_SUMS] = {"fp32 n=1",  "fp32 n=15",     "fp32 n=16",
                                        "fp32 n=17", "fp32 n=100003", "bf16 n=100003"};
    for (int k = 1; k < 3; k++) {
        if (!have[k]) continue;
        for (int j = 0; j < PATH_OUTS; j++)
            t_check(!memcmp(outs + k * nout + j * n, outs + j * n, n * sizeof *outs),
                    "%s: the %s path gives the portable path's bits", out_names[j], caps[k]);
        for (int j = 0; j < PATH_SUMS; j++)
            t_check(!memcmp(sums + k * PATH_SUMS + j, sums + j, sizeof *sums),
                    "sum of squares %s: the %s path gives the portable path's bits", sum_names[j],
                    caps[k]);
    }
    munmap(outs, 3 * nout * sizeof *outs);
    munmap(sums, 3 * PATH_SUMS * sizeof *sums);
}

static int run_all(const char *path) {
    printf("%s paths: vector ISA %s\n", path, fl_isa_name(fl_cpu_isa()));
    if (!strcmp(path, "portable") || !strcmp(path, "avx2"))
        t_check(!strcmp(fl_isa_name(fl_cpu_isa()), path), "FITLM_ISA=%s caps the paths at %s", path,
                fl_isa_name(fl_cpu_isa()));
    // first: a forked child cannot use OpenMP once the parent has (libgomp)
    t_dies("fp16 scale stuck at the minimum", stuck_scaler, NULL,
           "loss scale already at its minimum");
    test_adamw_matches_torch_rule();
    test_sgd_momentum_matches_torch_rule();
    test_norm_and_clipping();
    test_loss_scaler();
    test_mixed_precision_step();
    test_fp16_overflow_skips_the_step();
    test_ranges_match_whole_step();
    test_optimizer_pieces();
    test_shards_match_whole();
    test_thread_counts();
    test_frozen_rows();
    test_state_listing();
    test_scale();
    test_lomo_rule();
    test_adalomo_matches_reference();
    test_fused_lowp();
    test_device_steps();
    test_norm_round_trips();

    test_schedules();
    test_deepspeed_schedules();
    return t_report();
}

int main(void) {
    return t_main_under_isa_caps(run_all, test_isa_paths_bitwise);
}
