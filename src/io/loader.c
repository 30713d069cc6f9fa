// loader.c: batches from token shards. An epoch's window order is a keyed
// bijection on [0, windows) (a small Feistel network with cycle walking), so
// shuffling costs no memory and the position is three integers and a key.
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

#include "fitlm/data.h"

static uint64_t mix64(uint64_t x) { // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// A bijection on [0, n): four Feistel rounds on the smallest even-width
// power of two >= n, re-applied until the value falls inside [0, n) (at
// most 4x the domain, so a few rounds on average).
static uint64_t permute(uint64_t x, uint64_t n, const uint64_t key[2]) {
    int half = 1;
    while (half < 32 && (1ull << (2 * half)) < n) half++;
    uint64_t mask = (1ull << half) - 1;
    do {
        uint64_t left = x >> half, right = x & mask;
        for (int r = 0; r < 4; r++) {
            uint64_t f = mix64(right ^ key[r & 1] ^ ((uint64_t)r << 56)) & mask;
            uint64_t next = left ^ f;
            left = right;
            right = next;
        }
        x = left << half | right;
    } while (x >= n);
    return x;
}

static void new_epoch_key(fl_loader_state *s) {
    s->key[0] = fl_rng_u64(&s->rng);
    s->key[1] = fl_rng_u64(&s->rng);
}

fl_shard *fl_shards_open(const char *pattern, const char *split, int *count) {
    char glob_pattern[1200];
    struct stat st;
    if (stat(pattern, &st) == 0 && S_ISDIR(st.st_mode))
        snprintf(glob_pattern, sizeof glob_pattern, "%s/%s_*.bin", pattern, split);
    else
        snprintf(glob_pattern, sizeof glob_pattern, "%s", pattern);
    glob_t g;
    int rc = glob(glob_pattern, 0, NULL, &g);
    if (rc != 0 || g.gl_pathc == 0) {
        if (rc != GLOB_NOMATCH && rc != 0) fl_die("cannot list %s data %s", split, glob_pattern);
        fl_die("no %s token shards at %s%s", split, glob_pattern,
               stat(pattern, &st) != 0 && errno == ENOENT
                   ? " (make them with 'fitlm tokenize'; the default data comes from "
                     "scripts/demo.sh)"
                   : "");
    }
    int n = (int)g.gl_pathc;
    fl_shard *shards = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof(fl_shard));
    for (int i = 0; i < n; i++) {
        fl_shard *s = &shards[i];
        const fl_shard *first = &shards[0];
        fl_shard_open(s, g.gl_pathv[i]);
        if (strcmp(s->tokenizer, first->tokenizer) || s->vocab_size != first->vocab_size)
            fl_die("token shard %s (tokenizer %s, vocabulary %u) does not match %s (tokenizer %s, "
                   "vocabulary %u)",
                   s->path, s->tokenizer, s->vocab_size, first->path, first->tokenizer,
                   first->vocab_size);
        // a stream and windows of examples cannot share one window numbering
        if (s->version != first->version)
            fl_die("token shard %s (format version %u) does not match %s (version %u): text and "
                   "examples (tokenize --format jsonl) cannot be mixed in one data set",
                   s->path, s->version, first->path, first->version);
        if (s->version == 2 && s->layout.seq_len != first->layout.seq_len)
            fl_die("token shard %s was laid out for sequence length %u, %s for %u: one data set "
                   "has one layout",
                   s->path, s->layout.seq_len, first->path, first->layout.seq_len);
    }
    globfree(&g);
    *count = n;
    return shards;
}

void fl_loader_open(fl_loader *l, const char *pattern, const char *split, int T, uint64_t seed,
                    int shuffle, int rank, int world) {
    memset(l, 0, sizeof *l);
    FL_ASSERT(T > 0 && world > 0 && rank >= 0 && rank < world);
    l->T = T;
    l->rank = rank;
    l->world = world;
    l->shuffle = shuffle;
    int n;
    l->shards = fl_shards_open(pattern, split, &n);
    l->n_shards = n;
    strcpy(l->tokenizer, l->shards[0].tokenizer);
    l->vocab_size = l->shards[0].vocab_size;
    // Examples were laid out in windows of T+1 when tokenized: another T
    // would cut them anywhere and lose their start.
    if (l->shards[0].version == 2 && l->shards[0].layout.seq_len != (uint32_t)T)
        fl_die("token shard %s was laid out for sequence length %u (fitlm tokenize --seq-len), "
               "but this run's is %d: train with --seq-len %u or tokenize again with --seq-len %d",
               l->shards[0].path, l->shards[0].layout.seq_len, T, l->shards[0].layout.seq_len, T);
    l->first_window = fl_alloc(FL_MEM_OTHER, (size_t)(n + 1) * sizeof(uint64_t));
    l->stride = l->shards[0].version == 2 ? (uint64_t)T + 1 : (uint64_t)T;
    for (int i = 0; i < n; i++) {
        const fl_shard *s = &l->shards[i];
        uint64_t w = s->version == 2             ? s->n_tokens / l->stride
                     : s->n_tokens > (uint64_t)T ? (s->n_tokens - 1) / l->stride
                                                 : 0;
        l->first_window[i + 1] = l->first_window[i] + w;
        l->n_tokens += s->n_tokens;
        l->n_targets += s->n_targets;
        l->source_bytes += s->source_bytes;
    }
    l->n_windows = l->first_window[n];
    l->per_rank = l->n_windows / (uint64_t)world;
    if (l->per_rank == 0)
        fl_die("the %s data %s (%llu tokens) holds %llu windows of %d+1 tokens: too few for %d "
               "rank(s)",
               split, pattern, (unsigned long long)l->n_tokens, (unsigned long long)l->n_windows, T,
               world);
    fl_rng_seed(&l->state.rng, seed);
    new_epoch_key(&l->state);
}

int fl_loader_open_val(fl_loader *val, const char *data, const char *val_data, int T) {
    if (!strcmp(val_data, "none")) return 0;
    if (!*val_data) {
        char beside[1200];
        struct stat st;
        snprintf(beside, sizeof beside, "%s/val_000000.bin", data);
        if (stat(beside, &st) != 0) return 0;
        val_data = data;
    }
    fl_loader_open(val, val_data, "val", T, 0, 0, 0, 1);
    return 1;
}

void fl_loader_close(fl_loader *l) {
    for (int i = 0; i < l->n_shards; i++) fl_shard_close(&l->shards[i]);
    fl_free(l->shards);
    fl_free(l->first_window);
    memset(l, 0, sizeof *l);
}

void fl_loader_window(const fl_loader *l, uint64_t w, int *inputs, int *targets) {
    int lo = 0, hi = l->n_shards - 1; // the shard whose windows include w
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (l->first_window[mid] <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    const fl_shard *s = &l->shards[lo];
    uint64_t start = (w - l->first_window[lo]) * l->stride;
    for (int t = 0; t < l->T; t++) {
        uint64_t i = start + (uint64_t)t;
        inputs[t] = (int)fl_shard_token(s, i);
        targets[t] = fl_shard_is_target(s, i + 1) ? (int)fl_shard_token(s, i + 1) : -1;
    }
}

void fl_loader_next(fl_loader *l, int *inputs, int *targets, int B) {
    fl_loader_state *s = &l->state;
    for (int b = 0; b < B; b++) {
        if (s->index == l->per_rank) {
            s->epoch++;
            s->index = 0;
            new_epoch_key(s);
        }
        uint64_t g = (uint64_t)l->rank + (uint64_t)l->world * s->index++;
        uint64_t w = l->shuffle ? permute(g, l->n_windows, s->key) : g;
        fl_loader_window(l, w, inputs + (size_t)b * l->T, targets + (size_t)b * l->T);
    }
}

void fl_loader_eval_batch(const fl_loader *l, int index, int count, int *inputs, int *targets,
                          int B) {
    uint64_t total = (uint64_t)B * (uint64_t)count;
    for (int b = 0; b < B; b++) {
        uint64_t k = (uint64_t)index * (uint64_t)B + (uint64_t)b;
        uint64_t w = (uint64_t)((double)k * (double)l->n_windows / (double)total);
        fl_loader_window(l, w < l->n_windows ? w : l->n_windows - 1, inputs + (size_t)b * l->T,
                         targets + (size_t)b * l->T);
    }
}

double fl_loader_unigram_xent(const fl_loader *train, const fl_loader *eval) {
    FL_ASSERT(train->vocab_size == eval->vocab_size);
    size_t V = train->vocab_size;
    // scratch of this one computation: workspace, which training's peak covers
    double *counts = fl_alloc(FL_MEM_WORKSPACE, V * sizeof(double));
    for (size_t v = 0; v < V; v++) counts[v] = 1.0;
    for (int i = 0; i < train->n_shards; i++) {
        const fl_shard *s = &train->shards[i];
        for (uint64_t k = 0; k < s->n_tokens; k++)
            if (fl_shard_is_target(s, k)) counts[fl_shard_token(s, k)] += 1.0;
    }
    // only targets count: the loss a model reports is over them alone
    double total = (double)train->n_targets + (double)V, nll = 0.0;
    for (int i = 0; i < eval->n_shards; i++) {
        const fl_shard *s = &eval->shards[i];
        for (uint64_t k = 0; k < s->n_tokens; k++)
            if (fl_shard_is_target(s, k)) nll -= log(counts[fl_shard_token(s, k)] / total);
    }
    fl_free(counts);
    return eval->n_targets ? nll / (double)eval->n_targets : 0.0;
}
