// test_train.c: the training step as a whole: determinism, gradient
// accumulation equals the big batch, the gradient-ready hook, ignored
// targets, and batches smaller than the allocated activations.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/optim.h"
#include "testlib.h"

static const fl_gpt2_config tiny = {
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
    fl_gpt2 m;
    fl_gpt2_init(&m, &tiny, FL_F32, 11);
    fl_gpt2_alloc_acts(&m, B, T);
    fl_adamw opt;
    fl_adamw_init(&opt, m.table.numel, 0.9f, 0.95f, 1e-8f, 0.1f);
    int tokens[B * T], targets[B * T];
    for (int s = 0; s < steps; s++) {
        random_batch(tokens, targets, B * T, 100 + s % 2); // two batches, so it can learn
        fl_gpt2_zero_grad(&m);
        losses[s] = fl_gpt2_forward(&m, tokens, targets, B, T);
        fl_gpt2_backward(&m, 1.0f);
        t_adamw_step_fp32(&opt, &m.table, m.params, m.grads, 3e-3f, 1.0f);
    }
    *weights = malloc(m.table.numel * sizeof(float));
    memcpy(*weights, m.params, m.table.numel * sizeof(float));
    fl_adamw_free(&opt);
    fl_gpt2_free(&m);
    omp_set_num_threads(2);
}

static void test_deterministic(void) {
    float l1[6], l2[6], *w1, *w2;
    train(6, 2, l1, &w1);
    train(6, 2, l2, &w2);
    size_t n = fl_gpt2_num_params(&tiny);
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

static void test_accumulation_equals_big_batch(void) {
    fl_gpt2 m;
    fl_gpt2_init(&m, &tiny, FL_F32, 5);
    fl_gpt2_alloc_acts(&m, B, T);
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 9);
    size_t n = m.table.numel;
    fl_gpt2_zero_grad(&m);
    float big = fl_gpt2_forward(&m, tokens, targets, B, T);
    fl_gpt2_backward(&m, 1.0f);
    float *want = malloc(n * sizeof(float));
    memcpy(want, m.grads, n * sizeof(float));
    fl_gpt2_zero_grad(&m);
    float half1 = fl_gpt2_forward(&m, tokens, targets, B / 2, T);
    fl_gpt2_backward(&m, 0.5f);
    float half2 = fl_gpt2_forward(&m, tokens + B / 2 * T, targets + B / 2 * T, B / 2, T);
    fl_gpt2_backward(&m, 0.5f);
    t_check(fabsf((half1 + half2) / 2 - big) < 1e-5f, "mean of micro-batch losses = batch loss");
    // same sums in another grouping: float rounding only
    t_close("accumulated grads vs big batch", m.grads, want, n, 1e-7, 1e-4);
    free(want);
    fl_gpt2_free(&m);
}

typedef struct {
    fl_gpt2 *model;
    int calls[64], order[64], n;
    float *snapshot; // each view's gradient as the hook saw it
} hook_log;

static void record(void *ctx, int view) {
    hook_log *h = ctx;
    const fl_param_view *v = &h->model->table.views[view];
    h->calls[view]++;
    h->order[h->n++] = view;
    memcpy(h->snapshot + v->offset, (const float *)h->model->grads + v->offset,
           v->numel * sizeof(float));
}

static void test_grad_hook(void) {
    fl_gpt2 m;
    fl_gpt2_init(&m, &tiny, FL_F32, 5);
    fl_gpt2_alloc_acts(&m, B, T);
    hook_log h = {.model = &m};
    h.snapshot = calloc(m.table.numel, sizeof(float));
    m.grad_hook = record;
    m.grad_hook_ctx = &h;
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, 9);
    fl_gpt2_zero_grad(&m);
    fl_gpt2_forward(&m, tokens, targets, B, T);
    fl_gpt2_backward(&m, 1.0f);
    int once = h.n == m.table.count;
    for (int i = 0; i < m.table.count; i++) once &= h.calls[i] == 1;
    t_check(once, "the hook fires once per parameter (%d calls, %d views)", h.n, m.table.count);
    t_check(h.order[0] == m.table.count - 1 && h.order[h.n - 1] == 0,
            "hooks run from the last parameter back to wte");
    t_check(memcmp(h.snapshot, m.grads, m.table.numel * sizeof(float)) == 0,
            "every gradient was complete when its hook fired");
    free(h.snapshot);
    fl_gpt2_free(&m);
}

static void test_ignored_targets_and_short_batches(void) {
    fl_gpt2 m, small;
    fl_gpt2_init(&m, &tiny, FL_F32, 5);
    fl_gpt2_alloc_acts(&m, B, T);
    fl_gpt2_init(&small, &tiny, FL_F32, 5);
    fl_gpt2_alloc_acts(&small, 1, 8);
    int tokens[B * T], targets[B * T], masked[B * T];
    random_batch(tokens, targets, B * T, 3);
    float full = fl_gpt2_forward(&m, tokens, targets, B, T);
    double sum = 0;
    for (int i = 0; i < B * T; i++) {
        masked[i] = i % 3 ? targets[i] : -1;
        if (i % 3) sum += m.acts.losses[i];
    }
    float partial = fl_gpt2_forward(&m, tokens, masked, B, T);
    int kept = m.n_targets;
    t_check(kept == B * T - (B * T + 2) / 3, "ignored positions are not counted (%d)", kept);
    t_check(fabsf(partial - (float)(sum / kept)) < 1e-5f && partial != full,
            "the loss is the mean over the other positions");
    fl_gpt2_zero_grad(&m);
    fl_gpt2_backward(&m, 1.0f);
    t_check(fl_grad_norm(FL_F32, m.grads, m.table.numel) > 0, "the gradient is not empty");

    // A batch smaller than the activations gives the same numbers as a
    // model allocated for exactly that batch (generation relies on it).
    float a = fl_gpt2_forward(&m, tokens, targets, 1, 8);
    float b = fl_gpt2_forward(&small, tokens, targets, 1, 8);
    t_check(a == b, "1x8 batch on 4x16 activations: same loss (%g vs %g)", a, b);
    fl_gpt2_free(&m);
    fl_gpt2_free(&small);
}

int main(void) {
    omp_set_num_threads(2);
    test_deterministic();
    test_accumulation_equals_big_batch();
    test_grad_hook();
    test_ignored_targets_and_short_batches();
    return t_report();
}
