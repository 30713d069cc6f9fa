// sample.c: turning logits into tokens, and autoregressive generation.
#include <math.h>
#include <stdlib.h>

#include "arch.h"

typedef struct {
    float logit;
    int id;
} scored;

static int by_logit_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id - y->id; // ties broken by id: deterministic
}

int fl_sample_logits(const float *logits, int V, float temperature, int top_k, fl_rng *rng) {
    FL_ASSERT(V > 0);
    if (temperature <= 0.0f) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        return best;
    }
    scored *s = fl_alloc(FL_MEM_WORKSPACE, (size_t)V * sizeof(scored));
    for (int i = 0; i < V; i++) s[i] = (scored){logits[i], i};
    qsort(s, (size_t)V, sizeof(scored), by_logit_desc);
    int k = top_k > 0 && top_k < V ? top_k : V;
    double total = 0.0;
    for (int i = 0; i < k; i++) total += exp((s[i].logit - s[0].logit) / temperature);
    double r = fl_rng_uniform(rng) * total, acc = 0.0;
    int token = s[k - 1].id;
    for (int i = 0; i < k; i++) {
        acc += exp((s[i].logit - s[0].logit) / temperature);
        if (r < acc) {
            token = s[i].id;
            break;
        }
    }
    fl_free(s);
    return token;
}

// The last position's logits over the whole vocabulary as fp32: the
// model's own row, or under tensor parallelism every rank's columns
// gathered (the same on every rank, so every rank draws the same token).
const float *fl_model_last_logits(fl_model *m, int T, float *row, float *mine) {
    const fl_model_config *c = &m->config;
    fl_dtype dt = m->dtype;
    if (m->tp.size == 1) {
        // (under logits_chunk the last chunk's alone: from position logits_first)
        FL_ASSERT((size_t)(T - 1) >= m->logits_first);
        const void *last =
            fl_at(dt, m->logits, ((size_t)(T - 1) - m->logits_first) * c->padded_vocab_size);
        if (m->dev->host) return fl_load_f32(dt, last, c->vocab_size, row); // row, or fp32's own
        fl_model_download_f32(m, row, last, (size_t)c->vocab_size);
        return row;
    }
    size_t cols = fl_params_vocab_rows((size_t)c->vocab_size, m->tp.size);
    fl_model_download_f32(m, mine, fl_at(dt, m->logits, (size_t)(T - 1) * cols), cols);
    m->tp.ops->all_gather(m->tp.ops->ctx, FL_F32, mine, row, cols);
    return row;
}

// One process's model: its forward, then its last logits.
static const float *model_next(void *ctx, const int *context, int T, int last, float *row,
                               float *mine) {
    fl_model *m = ctx;
    fl_model_forward(m, context, NULL, 1, T);
    return fl_model_last_logits(m, last, row, mine);
}

void fl_model_generate(fl_model *model, int *tokens, int n_prompt, int n_new, float temperature,
                       int top_k, fl_rng *rng, void (*on_token)(int token, void *ctx), void *ctx) {
    fl_model_generate_with(model, model_next, model, tokens, n_prompt, n_new, temperature, top_k,
                           rng, on_token, ctx);
}

void fl_model_generate_with(fl_model *model, fl_next_logits next, void *next_ctx, int *tokens,
                            int n_prompt, int n_new, float temperature, int top_k, fl_rng *rng,
                            void (*on_token)(int token, void *ctx), void *ctx) {
    FL_ASSERT(n_prompt >= 1 && model->max_B >= 1);
    int V = model->config.vocab_size, t = model->tp.size;
    size_t cols = t > 1 ? fl_params_vocab_rows((size_t)V, t) : 0;
    float *row = fl_alloc(FL_MEM_WORKSPACE, (t > 1 ? t * cols : (size_t)V) * sizeof(float));
    float *mine = t > 1 ? fl_alloc(FL_MEM_WORKSPACE, cols * sizeof(float)) : NULL;
    // sequence parallelism splits the positions t ways: the context is
    // padded to a multiple of t at its end, which the causal attention of
    // the positions before never sees
    int sp = model->config.sequence_parallel && t > 1;
    int *padded = sp ? fl_alloc(FL_MEM_WORKSPACE, (size_t)model->max_T * sizeof(int)) : NULL;
    for (int n = n_prompt; n < n_prompt + n_new; n++) {
        int T = n < model->max_T ? n : model->max_T; // the most recent context that fits
        const int *context = tokens + n - T;
        int Tp = T;
        if (sp) {
            if ((T + t - 1) / t * t > model->max_T) T = model->max_T / t * t;
            context = tokens + n - T;
            Tp = (T + t - 1) / t * t;
            for (int i = 0; i < Tp; i++) padded[i] = i < T ? context[i] : 0;
            context = padded;
        }
        const float *logits = next(next_ctx, context, Tp, T, row, mine);
        for (int i = 0; i < V; i++) // a NaN would make every draw garbage
            if (!isfinite(logits[i]))
                fl_die("the model's logits for generated token %d are not finite (%g for id %d): "
                       "the weights overflow them (a huge weight?); nothing can be sampled",
                       n - n_prompt + 1, logits[i], i);
        tokens[n] = fl_sample_logits(logits, V, temperature, top_k, rng);
        if (on_token) on_token(tokens[n], ctx);
    }
    fl_free(row);
    fl_free(mine);
    fl_free(padded);
}
