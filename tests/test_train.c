// test_train.c: the training step as a whole: determinism, gradient
// accumulation equals the big batch, the hooks, ignored targets, batches
// smaller than the allocated activations, LOMO fused into the backward, the
// training forward that writes the logits' gradient, and the LM head in
// chunks of positions (logits_chunk).
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "testlib.h"

static const fl_model_config tiny = {
    .max_seq_len = 16, .vocab_size = 50, .n_layer = 2, .n_head = 4, .n_embd = 32};
enum { B = 4, T = 16 };

static void random_batch(int *tokens, int *targets, int n, unsigned seed) {
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) {
        tokens[i] = (int)fl_rng_below(&rng, 50);
        targets[i] = (int)fl_rng_below(&rng, 50);
    }
}

// Trains `steps` AdamW steps on random batches; returns the losses and
// leaves the final weights in *weights (caller frees).
static void train(int steps, int threads, float *losses, float **weights) {
    omp_set_num_threads(threads);
    fl_model m;
    fl_model_init(&m, &tiny, FL_F32, 11);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 0);
    fl_adamw opt;
    fl_adamw_init(&opt, m.table.numel, 0.9f, 0.95f, 1e-8f, 0.1f);
    int tokens[B * T], targets[B * T];
    for (int s = 0; s < steps; s++) {
        random_batch(tokens, targets, B * T, 100 + s % 2); // two batches, so it can learn
        fl_model_zero_grad(&m);
        losses[s] = fl_model_forward(&m, tokens, targets, B, T);
        fl_model_backward(&m, 1.0f / m.n_targets);
        t_adamw_step_fp32(&opt, &m.table, m.params, m.grads, 3e-3f, 1.0f);
    }
    *weights = malloc(m.table.numel * sizeof(float));
    memcpy(*weights, m.params, m.table.numel * sizeof(float));
    fl_adamw_free(&opt);
    fl_model_free(&m);
    omp_set_num_threads(2);
}

static void test_deterministic(void) {
    float l1[6], l2[6], *w1, *w2;
    train(6, 2, l1, &w1);
    train(6, 2, l2, &w2);
    size_t n = fl_model_num_params(&tiny);
    t_check(memcmp(l1, l2, sizeof l1) == 0, "same seed and threads: bitwise identical losses");
    t_check(memcmp(w1, w2, n * sizeof(float)) == 0, "... and bitwise identical weights");
    t_check(l1[5] < l1[0], "the loss falls (%.4f -> %.4f)", l1[0], l1[5]);
    float l3[6], *w3;
    train(6, 1, l3, &w3);
    // other thread counts change float summation order only
    t_close("losses on 1 thread vs 2", l3, l1, 6, 1e-5, 1e-5);
    free(w1);
    free(w2);
    free(w3);
}

// Two micro-batches holding different numbers of target tokens (some are
// masked) accumulate to the gradient of the one big batch: token weighting.
static void test_accumulation_equals_big_batch(void) {
    fl_model m;
    fl_model_init(&m, &tiny, FL_F32, 5);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 0);
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 9);
    for (int i = 0; i < B * T / 2; i++)
        if (i % 3 == 0) targets[i] = -1; // the first half holds fewer targets
    size_t n = m.table.numel;
    fl_model_zero_grad(&m);
    float big = fl_model_forward(&m, tokens, targets, B, T);
    int total = m.n_targets;
    fl_model_backward(&m, 1.0f / total);
    float *want = malloc(n * sizeof(float));
    memcpy(want, m.grads, n * sizeof(float));
    fl_model_zero_grad(&m);
    float half1 = fl_model_forward(&m, tokens, targets, B / 2, T);
    int n1 = m.n_targets;
    fl_model_backward(&m, 1.0f / total);
    float half2 = fl_model_forward(&m, tokens + B / 2 * T, targets + B / 2 * T, B / 2, T);
    int n2 = m.n_targets;
    fl_model_backward(&m, 1.0f / total);
    t_check(n1 < n2 && n1 + n2 == total, "the halves hold %d and %d targets", n1, n2);
    t_check(fabsf((half1 * n1 + half2 * n2) / total - big) < 1e-5f,
            "token-weighted mean of micro-batch losses = batch loss");
    t_check(fabsf((half1 + half2) / 2 - big) > 1e-4f,
            "... which the mean of the micro-batch means is not (%g vs %g)", (half1 + half2) / 2,
            big);
    // same sums in another grouping: float rounding only
    t_close("accumulated grads vs big batch", m.grads, want, n, 1e-7, 1e-4);
    free(want);
    fl_model_free(&m);
}

// fl_train_step with 2 micro-batches of B/2 equals 1 of B (SGD, so the
// weights show the gradient directly), masked targets included.
static void test_train_step_accumulation(void) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 4);
    for (int i = 0; i < B * T / 2; i++)
        if (i % 2) targets[i] = -1;
    float *w[2];
    float loss[2];
    for (int k = 0; k < 2; k++) {
        fl_model m;
        fl_model_init(&m, &tiny, FL_F32, 5);
        int micro = k + 1;
        fl_model_alloc_acts(&m, B / micro, T, FL_RECOMPUTE_NONE, 0);
        fl_optimizer_config oc = {.kind = FL_OPT_SGD, .grad_accum = micro};
        fl_optimizer o;
        fl_optimizer_init(&o, &oc, &m.table, FL_F32, m.params, m.grads);
        fl_train_result r = fl_train_step(&m, &o, tokens, targets, micro, B / micro, T, 0.5f);
        loss[k] = r.loss;
        t_check(r.n_targets == B * T - B * T / 4, "%d micro-batch(es): %ld targets", micro,
                r.n_targets);
        w[k] = malloc(m.table.numel * sizeof(float));
        memcpy(w[k], m.params, m.table.numel * sizeof(float));
        fl_optimizer_free(&o);
        fl_model_free(&m);
    }
    t_close("loss of 2 accumulated micro-batches vs 1 batch", &loss[1], &loss[0], 1, 1e-6, 1e-6);
    t_close("weights after the step", w[1], w[0], fl_model_num_params(&tiny), 1e-7, 1e-4);
    free(w[0]);
    free(w[1]);
}

typedef struct {
    fl_model *model;
    int pre[2][8], npre[2]; // units in the order pre_unit saw them, per pass
    int first[8], count[8], n;
    float *snapshot; // each unit's gradient as grad_ready saw it
    void *scratch;   // non-NULL: every block's gradients live here
} hook_log;

static void on_pre_unit(void *ctx, fl_model *m, int unit, int pass) {
    hook_log *h = ctx;
    h->pre[pass][h->npre[pass]++] = unit;
    // a block's gradients are bound to scratch before its backward
    if (h->scratch && pass == FL_PASS_BWD && unit >= 0 && unit < m->config.n_layer) {
        int first, count;
        fl_model_unit_rows(m, unit, &first, &count);
        const fl_param_view *v = &m->table.views[first];
        size_t n = m->table.views[first + count - 1].offset +
                   m->table.views[first + count - 1].numel - v->offset;
        memset(h->scratch, 0, n * sizeof(float));
        fl_model_bind_grads(m, unit, h->scratch);
    }
}

static void on_grad_ready(void *ctx, fl_model *m, int first, int count) {
    hook_log *h = ctx;
    h->first[h->n] = first;
    h->count[h->n++] = count;
    const fl_param_view *a = &m->table.views[first], *z = &m->table.views[first + count - 1];
    size_t n = z->offset + z->numel - a->offset;
    // where the unit's gradients are now: the model's buffer or the scratch
    memcpy(h->snapshot + a->offset, m->gp[first], n * sizeof(float));
}

// The hooks' order and completeness; with logits_chunk the head's
// backward runs in its forward, chunk by chunk, and the hooks see the same
static void test_hooks(void) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 9);
    float *whole = NULL; // the unchunked gradients
    for (int chunk = 0; chunk <= 24; chunk += 24) {
        fl_model_config cfg = tiny;
        cfg.logits_chunk = chunk; // 24, 24 and 16 positions
        float *grads = NULL;
        for (int use_scratch = 0; use_scratch < 2; use_scratch++) {
            fl_model m;
            fl_model_init(&m, &cfg, FL_F32, 5);
            fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 0);
            hook_log h = {.model = &m};
            h.snapshot = calloc(m.table.numel, sizeof(float));
            if (use_scratch) h.scratch = calloc(m.table.numel, sizeof(float));
            m.hooks = (fl_model_hooks){on_pre_unit, on_grad_ready, &h};
            fl_model_zero_grad(&m);
            fl_model_forward_train(&m, tokens, targets, B, T, 1.0f / (B * T));
            fl_model_backward(&m, 1.0f / (B * T));
            int L = tiny.n_layer,
                in_order = h.npre[0] == L + 2 && h.npre[1] == L + 2 && h.n == L + 2;
            for (int u = -1; u <= L; u++) {
                in_order &= h.pre[FL_PASS_FWD][u + 1] == u && h.pre[FL_PASS_BWD][L - u] == u;
                int first, count;
                fl_model_unit_rows(&m, u, &first, &count);
                in_order &= h.first[L - u] == first && h.count[L - u] == count;
            }
            t_check(in_order,
                    "logits_chunk %d, %s: pre_unit runs embedding, blocks, head forward and back; "
                    "grad_ready once per unit, head first",
                    chunk, use_scratch ? "grads in scratch" : "grads in place");
            if (!use_scratch) {
                t_check(memcmp(h.snapshot, m.grads, m.table.numel * sizeof(float)) == 0,
                        "logits_chunk %d: every gradient was complete when its unit's grad_ready "
                        "fired",
                        chunk);
                grads = h.snapshot;
            } else {
                t_check(memcmp(h.snapshot, grads, m.table.numel * sizeof(float)) == 0,
                        "logits_chunk %d: block gradients bound to scratch equal the in-place ones "
                        "bitwise",
                        chunk);
                free(h.snapshot);
                free(h.scratch);
            }
            if (chunk && !use_scratch) // the head's weight gradient summed chunk by chunk
                t_close("logits_chunk 24: the gradients of the whole head's", grads, whole,
                        m.table.numel, 1e-7, 1e-6);
            fl_model_free(&m);
        }
        if (chunk)
            free(grads);
        else
            whole = grads;
    }
    free(whole);
}

static void test_ignored_targets_and_short_batches(void) {
    fl_model m, small;
    fl_model_init(&m, &tiny, FL_F32, 5);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 0);
    fl_model_init(&small, &tiny, FL_F32, 5);
    fl_model_alloc_acts(&small, 1, 8, FL_RECOMPUTE_NONE, 0);
    int tokens[B * T], targets[B * T], masked[B * T];
    random_batch(tokens, targets, B * T, 3);
    float full = fl_model_forward(&m, tokens, targets, B, T);
    double sum = 0;
    for (int i = 0; i < B * T; i++) {
        masked[i] = i % 3 ? targets[i] : -1;
        if (i % 3) sum += m.losses[i];
    }
    float partial = fl_model_forward(&m, tokens, masked, B, T);
    int kept = m.n_targets;
    t_check(kept == B * T - (B * T + 2) / 3, "ignored positions are not counted (%d)", kept);
    t_check(fabsf(partial - (float)(sum / kept)) < 1e-5f && partial != full,
            "the loss is the mean over the other positions");
    fl_model_zero_grad(&m);
    fl_model_backward(&m, 1.0f / m.n_targets);
    t_check(fl_grad_norm(FL_F32, m.grads, m.table.numel) > 0, "the gradient is not empty");

    // A batch smaller than the activations gives the same numbers as a
    // model allocated for exactly that batch (generation relies on it).
    float a = fl_model_forward(&m, tokens, targets, 1, 8);
    float b = fl_model_forward(&small, tokens, targets, 1, 8);
    t_check(a == b, "1x8 batch on 4x16 activations: same loss (%g vs %g)", a, b);
    fl_model_free(&m);
    fl_model_free(&small);
}

// ----------------------------------------------------------------------------
// LOMO: the update fused into the backward pass

static const fl_model_config tiny_llama = {.arch = FL_ARCH_LLAMA,
                                           .max_seq_len = 16,
                                           .vocab_size = 50,
                                           .n_layer = 2,
                                           .n_head = 4,
                                           .n_kv_head = 2,
                                           .n_embd = 32,
                                           .intermediate_size = 48};

// The global norm of the whole gradient, gathered row by row in table
// order, as the fused step gathers it unit by unit.
static float row_norm(const fl_model *m) {
    double total = 0.0;
    for (int r = 0; r < m->table.count; r++)
        total += fl_grad_sumsq(FL_F32, (const float *)m->grads + m->table.views[r].offset,
                               m->table.views[r].numel);
    return (float)sqrt(total);
}

// One fused LOMO step (one unit's gradients at a time, two passes for the
// clipping norm) against the same update applied after a whole backward.
static void lomo_matches_unfused(const char *name, const fl_model_config *cfg, float clip,
                                 fl_recompute policy) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 21);
    fl_optimizer_config oc = {.kind = FL_OPT_LOMO,
                              .grad_accum = 1,
                              .weight_decay = 0.1f,
                              .max_grad_norm = clip,
                              .clip_value = 0.05f};
    fl_model fused, whole;
    fl_model_init(&fused, cfg, FL_F32, 5);
    fl_model_init(&whole, cfg, FL_F32, 5);
    size_t grads0 = fl_mem_current(FL_MEM_GRADS);
    fl_model_alloc_acts(&fused, B, T, policy, 1);
    size_t fused_grads = fl_mem_current(FL_MEM_GRADS) - grads0;
    fl_model_alloc_acts(&whole, B, T, FL_RECOMPUTE_NONE, 0);
    fl_optimizer of, ow;
    fl_optimizer_init(&of, &oc, &fused.table, FL_F32, fused.params, NULL);
    fl_optimizer_init(&ow, &oc, &whole.table, FL_F32, whole.params, whole.grads);
    size_t full = fused.table.numel * sizeof(float);
    t_check(fused.grads == NULL && fused_grads < full,
            "%s: no whole-model gradient buffer (%zu bytes of gradients for %zu)", name,
            fused_grads, full);
    fl_train_result r = fl_train_step(&fused, &of, tokens, targets, 1, B, T, 0.05f);

    fl_model_zero_grad(&whole);
    fl_model_forward(&whole, tokens, targets, B, T);
    fl_model_backward(&whole, 1.0f / whole.n_targets);
    float norm = row_norm(&whole);
    fl_optimizer_begin_step(&ow, 0.05f);
    fl_optimizer_update_rows_clip(&ow, 0, whole.table.count, whole.grads, FL_F32, 1.0f,
                                  fl_clip_coef(norm, clip));
    fl_optimizer_end_step(&ow);
    t_check(r.grad_norm == norm && (clip == 0.0f || norm > clip),
            "%s: the fused step's norm is the whole gradient's (%g vs %g)%s", name, r.grad_norm,
            norm, clip > 0 ? ", clipping" : "");
    t_check(!memcmp(fused.params, whole.params, full),
            "%s: fused LOMO = the update after a whole backward, bitwise", name);
    fl_optimizer_free(&of);
    fl_optimizer_free(&ow);
    fl_model_free(&fused);
    fl_model_free(&whole);
}

// Without weight decay and clipping, LOMO's step is plain SGD's.
static void lomo_is_sgd(const char *name, const fl_model_config *cfg) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 22);
    fl_model a, b;
    fl_model_init(&a, cfg, FL_F32, 6);
    fl_model_init(&b, cfg, FL_F32, 6);
    fl_model_alloc_acts(&a, B, T, FL_RECOMPUTE_BLOCK, 1); // composes with checkpointing
    fl_model_alloc_acts(&b, B, T, FL_RECOMPUTE_NONE, 0);
    fl_optimizer_config lomo = {.kind = FL_OPT_LOMO, .grad_accum = 1};
    fl_optimizer_config sgd = {.kind = FL_OPT_SGD, .grad_accum = 1};
    fl_optimizer oa, ob;
    fl_optimizer_init(&oa, &lomo, &a.table, FL_F32, a.params, NULL);
    fl_optimizer_init(&ob, &sgd, &b.table, FL_F32, b.params, b.grads);
    fl_train_result ra = fl_train_step(&a, &oa, tokens, targets, 1, B, T, 0.1f);
    fl_train_result rb = fl_train_step(&b, &ob, tokens, targets, 1, B, T, 0.1f);
    t_check(ra.loss == rb.loss && !memcmp(a.params, b.params, a.table.numel * sizeof(float)),
            "%s: a LOMO step (block recomputation) = an SGD step, bitwise", name);
    fl_optimizer_free(&oa);
    fl_optimizer_free(&ob);
    fl_model_free(&a);
    fl_model_free(&b);
}

// fp16: an overflow is found in the norm pass, before any weight changes.
static void test_lomo_fp16_overflow(void) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 23);
    fl_model m;
    fl_model_init(&m, &tiny_llama, FL_F16, 7);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 1);
    // a static scale of 2^30 overflows fp16 gradients
    fl_optimizer_config oc = {.kind = FL_OPT_LOMO,
                              .grad_accum = 1,
                              .loss_scale = 1073741824.0f,
                              .min_loss_scale = 1.0f,
                              .loss_scale_window = 1000,
                              .hysteresis = 1,
                              .stochastic_rounding = 1};
    fl_optimizer o;
    fl_optimizer_init(&o, &oc, &m.table, FL_F16, m.params, NULL);
    size_t bytes = m.table.numel * 2;
    void *before = malloc(bytes);
    memcpy(before, m.params, bytes);
    fl_train_result r = fl_train_step(&m, &o, tokens, targets, 1, B, T, 0.1f);
    t_check(r.skipped && !memcmp(before, m.params, bytes),
            "fp16 LOMO: an overflowing step is skipped with every weight bitwise unchanged");
    // dynamic scaling grows after loss_scale_window clean steps (DeepSpeed's
    // semantics; LOMO's reference implementation never grows it)
    fl_optimizer_config dyn = oc;
    dyn.loss_scale = 0.0f;
    dyn.initial_scale_power = 4;
    dyn.loss_scale_window = 2;
    fl_optimizer od;
    fl_optimizer_init(&od, &dyn, &m.table, FL_F16, m.params, NULL);
    float scales[3];
    for (int i = 0; i < 3; i++) {
        fl_train_step(&m, &od, tokens, targets, 1, B, T, 1e-3f);
        scales[i] = od.scaler.scale;
    }
    t_check(scales[0] == 16.0f && scales[1] == 32.0f && scales[2] == 32.0f,
            "fp16 LOMO: the scale doubles after 2 clean steps (%g %g %g)", scales[0], scales[1],
            scales[2]);
    fl_optimizer_free(&od);
    free(before);
    fl_optimizer_free(&o);
    fl_model_free(&m);
}

// bf16 weights without a master copy: an update of lr 1e-5 is far below half
// an ulp of weights near 0.02-1, so rounding to nearest loses it and the
// loss never moves; stochastic rounding keeps it on average.
static void test_lomo_stochastic_rounding(void) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 24);
    float first[2] = {0}, last[2] = {0};
    for (int sr = 0; sr < 2; sr++) {
        fl_model m;
        fl_model_init(&m, &tiny_llama, FL_BF16, 8);
        fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 1);
        fl_optimizer_config oc = {
            .kind = FL_OPT_LOMO, .grad_accum = 1, .stochastic_rounding = sr, .seed = 99};
        fl_optimizer o;
        fl_optimizer_init(&o, &oc, &m.table, FL_BF16, m.params, NULL);
        for (int s = 0; s < 20; s++) {
            float loss = fl_train_step(&m, &o, tokens, targets, 1, B, T, 1e-5f).loss;
            if (s == 0) first[sr] = loss;
            last[sr] = loss;
        }
        fl_optimizer_free(&o);
        fl_model_free(&m);
    }
    float moved_rne = first[0] - last[0], moved_sr = first[1] - last[1];
    printf("  bf16 LOMO, lr 1e-5, 20 steps: the loss falls by %.3g rounding to nearest, by %.3g "
           "stochastically\n",
           moved_rne, moved_sr);
    t_check(moved_sr > 0 && moved_sr > 10 * fabsf(moved_rne),
            "bf16 LOMO at lr 1e-5: the loss moves with stochastic rounding (%.3g), hardly without "
            "(%.3g: only weights near 0 have ulps that small)",
            moved_sr, moved_rne);
}

// LOMO with accumulation keeps the whole gradient: 2 micro-batches of B/2
// give the step of one batch of B.
static void test_lomo_accumulation(void) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 25);
    float *w[2];
    for (int k = 0; k < 2; k++) {
        int micro = k + 1;
        fl_model m;
        fl_model_init(&m, &tiny_llama, FL_F32, 9);
        fl_optimizer_config oc = {.kind = FL_OPT_LOMO, .grad_accum = micro, .max_grad_norm = 1.0f};
        fl_model_alloc_acts(&m, B / micro, T, FL_RECOMPUTE_NONE, fl_optimizer_unit_grads(&oc));
        fl_optimizer o;
        fl_optimizer_init(&o, &oc, &m.table, FL_F32, m.params, m.grads);
        fl_train_step(&m, &o, tokens, targets, micro, B / micro, T, 0.05f);
        w[k] = malloc(m.table.numel * sizeof(float));
        memcpy(w[k], m.params, m.table.numel * sizeof(float));
        fl_optimizer_free(&o);
        fl_model_free(&m);
    }
    t_close("LOMO, 2 accumulated micro-batches vs 1 fused batch", w[1], w[0],
            fl_model_num_params(&tiny_llama), 1e-7, 1e-4);
    free(w[0]);
    free(w[1]);
}

static void test_lomo(void) {
    // the second pass re-runs only the head: the activations the first
    // backward left (and what a policy recomputes) serve the second
    lomo_matches_unfused("GPT-2", &tiny, 0.5f, FL_RECOMPUTE_NONE);
    lomo_matches_unfused("GPT-2 selective", &tiny, 0.5f, FL_RECOMPUTE_SELECTIVE);
    lomo_matches_unfused("LLaMA", &tiny_llama, 0.5f, FL_RECOMPUTE_NONE);
    lomo_matches_unfused("LLaMA block", &tiny_llama, 0.5f, FL_RECOMPUTE_BLOCK);
    lomo_is_sgd("GPT-2", &tiny);
    lomo_is_sgd("LLaMA", &tiny_llama);
    test_lomo_fp16_overflow();
    test_lomo_stochastic_rounding();
    test_lomo_accumulation();
}

// fl_model_forward_train (the loss pass writes the logits' gradient) gives
// the bits of fl_model_forward and a backward apart: loss and gradients, in
// each dtype, with ignored targets, and again through the head alone.
static void test_forward_train(void) {
    fl_dtype dts[] = {FL_F32, FL_BF16, FL_F16};
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 7);
    for (int i = 0; i < B * T; i += 5) targets[i] = -1;
    for (int chunk = 0; chunk <= 24; chunk += 24) // the head in chunks too
        for (int d = 0; d < 3; d++) {
            fl_model_config cfg = tiny;
            cfg.logits_chunk = chunk;
            fl_model m[2];
            float loss[2][2];
            for (int k = 0; k < 2; k++) {
                fl_model_init(&m[k], &cfg, dts[d], 11);
                fl_model_alloc_acts(&m[k], B, T, FL_RECOMPUTE_NONE, 0);
                fl_model_zero_grad(&m[k]);
                float dloss = 0.37f / (float)(B * T);
                loss[k][0] = k ? fl_model_forward_train(&m[k], tokens, targets, B, T, dloss)
                               : fl_model_forward(&m[k], tokens, targets, B, T);
                fl_model_backward(&m[k], dloss);
                loss[k][1] = k ? fl_model_forward_head_train(&m[k], 2.0f * dloss)
                               : fl_model_forward_head(&m[k]);
                fl_model_backward(&m[k], 2.0f * dloss);
            }
            size_t bytes = m[0].table.numel * fl_dtype_size(dts[d]);
            t_check(!memcmp(loss[0], loss[1], sizeof loss[0]) &&
                        !memcmp(m[0].grads, m[1].grads, bytes),
                    "%s, logits_chunk %d: forward_train + backward = forward + backward, bitwise "
                    "(losses %.6f %.6f)",
                    fl_dtype_name(dts[d]), chunk, loss[1][0], loss[1][1]);
            fl_model_free(&m[0]);
            fl_model_free(&m[1]);
        }
}

// logits_chunk: the LM head and the loss over 24 positions at a time (24,
// 24, 16 of 64) give the whole batch's losses bitwise (each position's are
// its own), GPT-2 (tied) and LLaMA (untied) in fp32 and bf16, evaluated and
// trained; the gradients within the chunked sums' rounding (the head's
// weights' summed chunk by chunk: fp32 1e-6, bf16 a few of its units); a
// sampling forward's last logits bitwise; the logits' buffer a chunk's
static void test_logits_chunk(void) {
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 17);
    for (int i = 3; i < B * T; i += 7) targets[i] = -1;
    fl_dtype dts[] = {FL_F32, FL_BF16};
    for (int arch = 0; arch < 2; arch++)
        for (int d = 0; d < 2; d++) {
            fl_model_config cfg = tiny;
            cfg.arch = arch ? FL_ARCH_LLAMA : FL_ARCH_GPT2;
            const char *name = fl_arch_name(cfg.arch), *dt = fl_dtype_name(dts[d]);
            fl_model m[2];
            float eval[2], train[2], *g[2];
            size_t n = 0;
            for (int k = 0; k < 2; k++) {
                cfg.logits_chunk = k ? 24 : 0;
                fl_model_init(&m[k], &cfg, dts[d], 3);
                fl_model_alloc_acts(&m[k], B, T, FL_RECOMPUTE_NONE, 0);
                eval[k] = fl_model_forward(&m[k], tokens, targets, B, T);
                fl_model_zero_grad(&m[k]);
                float dloss = 1.0f / (float)m[k].n_targets;
                train[k] = fl_model_forward_train(&m[k], tokens, targets, B, T, dloss);
                fl_model_backward(&m[k], dloss);
                n = m[k].table.numel;
                g[k] = malloc(n * sizeof(float));
                fl_convert(FL_F32, g[k], dts[d], m[k].grads, n);
            }
            t_check(eval[0] == eval[1] && train[0] == train[1],
                    "%s %s: the chunked head's losses are the whole one's bitwise (%.7f %.7f)",
                    name, dt, eval[1], train[1]);
            double e = t_rel_diff(g[1], g[0], n), bound = d ? 1e-2 : 1e-6;
            t_check(e <= bound, "%s %s: gradients within %g of the whole head's (relative L2 %.2g)",
                    name, dt, bound, e);
            free(g[0]), free(g[1]);
            fl_model_free(&m[0]);
            fl_model_free(&m[1]);
        }
    // sampling: a batch of 1 over 16 positions in chunks of 5: the last
    // chunk's logits alone, the last position's bitwise the whole head's
    float row[2][64];
    size_t acts[2];
    for (int k = 0; k < 2; k++) {
        fl_model_config cfg = tiny;
        cfg.logits_chunk = k ? 5 : 0;
        fl_model m;
        fl_model_init(&m, &cfg, FL_F32, 3);
        fl_model_alloc_acts(&m, 1, T, FL_RECOMPUTE_NONE, 1);
        fl_model_forward(&m, tokens, NULL, 1, T);
        memcpy(row[k], fl_model_last_logits(&m, T, row[k], NULL), 50 * sizeof(float));
        size_t bytes[FL_MEM_NTAGS];
        fl_model_config_finish(&cfg);
        fl_model_memory(NULL, &cfg, FL_F32, 1, T, 1, FL_RECOMPUTE_NONE, 1, NULL, NULL, NULL, bytes);
        acts[k] = bytes[FL_MEM_ACTS];
        fl_model_free(&m);
    }
    size_t Vp = 128; // 50 padded
    t_check(
        !memcmp(row[0], row[1], 50 * sizeof(float)) &&
            acts[0] - acts[1] == (size_t)(T - 5) * Vp * sizeof(float),
        "sampling in chunks of 5: the last logits bitwise; %zu bytes of logits fewer (want %zu)",
        acts[0] - acts[1], (size_t)(T - 5) * Vp * sizeof(float));
}

// The spike guard's detector (optim.h): z-scores against the window of
// earlier normal values, judged only from min_count values on, one-sided;
// an outlier never enters the window; the ring wraps; NAN is not judged.
static void test_spike_detector(void) {
    fl_spike_config c = {.loss_z = 4, .grad_z = 4, .window = 4, .min_count = 3, .max_in_row = 2};
    fl_spike_guard g;
    fl_spike_guard_init(&g, &c);
    fl_spike_verdict v = fl_spike_judge(&g, 1.0, 10.0);
    t_check(!v.outlier && isnan(v.loss_z) && g.loss.count == 1, "one value: not judged");
    fl_spike_judge(&g, 2.0, 10.0);
    v = fl_spike_judge(&g, 1000.0, 10.0); // two values < min_count: not judged, kept
    t_check(!v.outlier && isnan(v.loss_z) && g.loss.count == 3, "below min_count: not judged");
    // window {1, 2, 1000}: mean 334.33, sd 470.69
    v = fl_spike_judge(&g, 3.0, 10.0);
    double mean = 1003.0 / 3, sd = sqrt(((1 - mean) * (1 - mean) + (2 - mean) * (2 - mean) +
                                         (1000 - mean) * (1000 - mean)) /
                                        3);
    t_check(!v.outlier && fabs(v.loss_z - (3.0 - mean) / sd) < 1e-6 && g.loss.count == 4,
            "z of 3 against {1, 2, 1000}: %g (want %g); a low value is never an outlier", v.loss_z,
            (3.0 - mean) / sd);
    // equal norms: the deviation's floor is 1% of the mean, so 10.3 is z 3 (normal)
    t_check(!v.outlier && fabs(v.grad_z) < 1e-6, "equal values: z 0 (%g)", v.grad_z);
    v = fl_spike_judge(&g, 4.0, 10.3);
    t_check(!v.outlier && fabs(v.grad_z - 3.0) < 1e-4 && g.loss.count == 4 && g.loss.next == 1,
            "a 3%% rise of equal values is z 3 (%g); the ring wrapped (next %d)", v.grad_z,
            g.loss.next);
    // window {2, 1000, 3, 4} (1 was dropped): 5000 is an outlier and stays out
    v = fl_spike_judge(&g, 5000.0, 10.0);
    t_check(v.outlier && v.loss_z > 4 && g.in_row == 1 && g.skipped == 1 && g.loss.next == 1,
            "5000 after {2, 1000, 3, 4}: an outlier (z %g), not added", v.loss_z);
    v = fl_spike_judge(&g, 5000.0, NAN); // the norm unknown: the loss alone judges
    t_check(v.outlier && isnan(v.grad_z) && g.in_row == 2 && g.skipped == 2,
            "again: two in a row, the norm not judged");
    v = fl_spike_judge(&g, 3.0, 1e6); // the norm's test alone
    t_check(v.outlier && !(v.loss_z > 4) && v.grad_z > 4 && g.in_row == 3,
            "a norm outlier with a normal loss");
    v = fl_spike_judge(&g, 3.0, 10.0);
    t_check(!v.outlier && g.in_row == 0 && g.skipped == 3, "a normal step ends the row");
    // a test set to 0 is off; both off: nothing is judged or kept
    c.grad_z = 0;
    fl_spike_guard_init(&g, &c);
    for (int i = 0; i < 4; i++) fl_spike_judge(&g, 1.0, 1.0);
    v = fl_spike_judge(&g, 1.0, 1e9);
    t_check(!v.outlier && isnan(v.grad_z), "grad_z 0: the norm is not judged");
    c.loss_z = 0;
    fl_spike_guard_init(&g, &c);
    for (int i = 0; i < 4; i++) fl_spike_judge(&g, 1.0, 1.0);
    v = fl_spike_judge(&g, 1e9, 1e9);
    t_check(!fl_spike_guard_on(&g) && !v.outlier && g.loss.count == 0, "both off: nothing");
}

// A step the guard flags changes no weight, for the plain step and both
// fused ones (two passes with clipping: the norm and the loss; one pass:
// the loss, before the backward that updates).
static void test_spike_step_kinds(void) {
    const struct {
        const char *name;
        fl_optim_kind kind;
        float clip;
    } kinds[] = {{"adamw", FL_OPT_ADAMW, 1.0f},
                 {"lomo, two passes", FL_OPT_LOMO, 1.0f},
                 {"lomo, one pass", FL_OPT_LOMO, 0.0f}};
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 31);
    for (int k = 0; k < 3; k++) {
        fl_optimizer_config oc = {.kind = kinds[k].kind,
                                  .grad_accum = 1,
                                  .beta1 = 0.9f,
                                  .beta2 = 0.95f,
                                  .eps = 1e-8f,
                                  .max_grad_norm = kinds[k].clip,
                                  .spike = {10, 10, 8, 4, 3}};
        fl_model m;
        fl_model_init(&m, &tiny, FL_F32, 5);
        fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, fl_optimizer_unit_grads(&oc));
        fl_optimizer o;
        fl_optimizer_init(&o, &oc, &m.table, FL_F32, m.params, m.grads);
        // a window of losses and norms far below this batch's
        for (int i = 0; i < 4; i++)
            fl_spike_judge(&o.spike, 0.01 * (1 + i % 2), 0.001 * (1 + i % 2));
        size_t bytes = m.table.numel * sizeof(float);
        float *before = malloc(bytes);
        memcpy(before, m.params, bytes);
        fl_train_result r = fl_train_step(&m, &o, tokens, targets, 1, B, T, 0.05f);
        t_check(r.spike.outlier && !r.skipped && r.spikes_in_row == 1 && r.spikes_skipped == 1 &&
                    !memcmp(before, m.params, bytes) && isfinite(r.loss),
                "%s: the flagged step changes no weight (loss %g, z %g)", kinds[k].name, r.loss,
                r.spike.loss_z);
        // without the guard the same step updates
        o.spike.cfg.loss_z = o.spike.cfg.grad_z = 0;
        r = fl_train_step(&m, &o, tokens, targets, 1, B, T, 0.05f);
        t_check(!r.spike.outlier && memcmp(before, m.params, bytes),
                "%s: the guard off, the step updates", kinds[k].name);
        free(before);
        fl_optimizer_free(&o);
        fl_model_free(&m);
    }
}

// Sampling from logits that are not finite is an error, not a garbage draw.
static void generate_from_nan(void *arg) {
    (void)arg;
    fl_model m;
    fl_model_init(&m, &tiny, FL_F32, 5);
    fl_model_alloc_acts(&m, 1, T, FL_RECOMPUTE_NONE, 1);
    ((float *)m.params)[m.table.views[fl_params_find(&m.table, "ln_f.weight")].offset] = NAN;
    int tokens[4] = {1, 2, 0, 0};
    fl_rng rng;
    fl_rng_seed(&rng, 1);
    fl_model_generate(&m, tokens, 2, 2, 1.0f, 0, &rng, NULL, NULL);
}

int main(void) {
    // first: a forked child cannot use a parent's OpenMP threads
    t_dies("generate from NaN logits", generate_from_nan, NULL,
           "logits for generated token 1 are not finite (nan for id 0)");
    omp_set_num_threads(2);
    test_spike_detector();
    test_spike_step_kinds();
    test_deterministic();
    test_accumulation_equals_big_batch();
    test_train_step_accumulation();
    test_hooks();
    test_ignored_targets_and_short_batches();
    test_lomo();
    test_forward_train();
    test_logits_chunk();
    return t_report();
}
