// eval.c: the loss of a model over whole token data (the rule: eval.h).
// Forward passes only; the loss of each target comes from m->losses, summed
// in data order so that batching and threads cannot change the result.
#include <math.h>

#include "fitlm/eval.h"

// Tokens from one window's start to the next: a stream's windows share a
// token; a version 2 shard's are laid out back to back.
static uint64_t stride(const fl_shard *s, int T) {
    return s->version == 2 ? (uint64_t)T + 1 : (uint64_t)T;
}

// Windows of a shard: a stream of n tokens takes ceil((n - 1) / T), the last
// one partial; a version 2 shard holds n / (T + 1) whole ones.
static uint64_t shard_windows(const fl_shard *s, int T) {
    if (s->version == 2) return s->n_tokens / stride(s, T);
    return s->n_tokens < 2 ? 0 : (s->n_tokens - 2) / (uint64_t)T + 1;
}

uint64_t fl_eval_windows(const fl_shard *shards, int n_shards, int T) {
    uint64_t w = 0;
    for (int i = 0; i < n_shards; i++) w += shard_windows(&shards[i], T);
    return w;
}

// Window k of shard s into inputs/targets (T each). Positions past the
// shard's end are padding (input 0, a valid id; target -1), a masked target
// is -1.
static void read_window(const fl_shard *s, uint64_t k, int T, int *inputs, int *targets) {
    uint64_t start = k * stride(s, T);
    for (int t = 0; t < T; t++) {
        uint64_t i = start + (uint64_t)t;
        int in = i + 1 < s->n_tokens;
        inputs[t] = in ? (int)fl_shard_token(s, i) : 0;
        targets[t] = in && fl_shard_is_target(s, i + 1) ? (int)fl_shard_token(s, i + 1) : -1;
    }
}

// Dies naming the shard and window of the data's window number `w`, whose
// target at position t has the non-finite loss `loss`.
static void nonfinite_loss(const fl_shard *shards, int n_shards, int T, uint64_t w, int t,
                           float loss) {
    int i = 0;
    for (; i < n_shards - 1 && w >= shard_windows(&shards[i], T); i++)
        w -= shard_windows(&shards[i], T);
    fl_die("the model's loss is %g (not finite) at position %d of window %llu of %s: the "
           "weights overflow the logits (a huge weight?); no loss is reported from it",
           loss, t, (unsigned long long)w, shards[i].path);
}

// One forward over `rows` windows; adds the losses of their counted
// targets, in order (downloaded into losses, rows x T). Every loss must be
// finite.
static void run_batch(fl_model *m, const int *inputs, const int *targets, float *losses, int rows,
                      int T, fl_eval_sum *out, const fl_shard *shards, int n_shards) {
    fl_model_forward(m, inputs, targets, rows, T);
    size_t n = (size_t)rows * (size_t)T;
    fl_dev_download(m->dev, losses, m->losses, n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        if (targets[i] == -1) continue;
        if (!isfinite(losses[i]))
            nonfinite_loss(shards, n_shards, T, out->windows + i / (size_t)T, (int)(i % (size_t)T),
                           losses[i]);
        out->nats += (double)losses[i];
        out->tokens++;
    }
    out->windows += (uint64_t)rows;
}

void fl_eval_shards(fl_model *m, const fl_shard *shards, int n_shards, int B, int T,
                    fl_eval_sum *out, void (*progress)(void *ctx, uint64_t done, uint64_t total),
                    void *ctx) {
    FL_ASSERT(B > 0 && T > 0 && B <= m->max_B && T <= m->max_T);
    for (int i = 0; i < n_shards; i++)
        FL_ASSERT(shards[i].version != 2 || shards[i].layout.seq_len == (uint32_t)T);
    *out = (fl_eval_sum){0};
    uint64_t total = fl_eval_windows(shards, n_shards, T);
    size_t BT = (size_t)B * (size_t)T;
    // host buffers (the model's own are its device's)
    int *inputs = fl_alloc(FL_MEM_OTHER, BT * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, BT * sizeof(int));
    float *losses = fl_alloc(FL_MEM_OTHER, BT * sizeof(float));
    int rows = 0;
    for (int i = 0; i < n_shards; i++) {
        uint64_t n = shard_windows(&shards[i], T);
        for (uint64_t k = 0; k < n; k++) {
            read_window(&shards[i], k, T, inputs + (size_t)rows * T, targets + (size_t)rows * T);
            if (++rows < B) continue;
            run_batch(m, inputs, targets, losses, rows, T, out, shards, n_shards);
            rows = 0;
            if (progress) progress(ctx, out->windows, total);
        }
    }
    if (rows) { // the last batch, smaller
        run_batch(m, inputs, targets, losses, rows, T, out, shards, n_shards);
        if (progress) progress(ctx, out->windows, total);
    }
    fl_free(losses);
    fl_free(targets);
    fl_free(inputs);
}
