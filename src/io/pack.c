// pack.c: examples into windows of T+1 tokens (data.h). Packing keeps
// examples whole: one cut at a window boundary would leave an answer
// without its question. Open windows are kept in lists by their room, and a
// bitmap over the rooms finds the tightest one that fits in T/64 word tests.
#include <string.h>

#include "fitlm/data.h"

void fl_packer_init(fl_packer *p, int T, fl_seq_policy policy, int packed, int32_t pad) {
    memset(p, 0, sizeof *p);
    FL_ASSERT(T > 0 && (policy == FL_SEQ_TRUNCATE || policy == FL_SEQ_SPLIT));
    p->T = T;
    p->policy = policy;
    p->packed = packed;
    p->pad = pad;
    size_t rooms = (size_t)T + 2;
    p->room_head = fl_alloc(FL_MEM_OTHER, rooms * sizeof *p->room_head);
    for (size_t r = 0; r < rooms; r++) p->room_head[r] = -1;
    p->room_bits = fl_alloc(FL_MEM_OTHER, (rooms + 63) / 64 * sizeof *p->room_bits);
}

static void *grown(void *old, size_t n, size_t cap, size_t elem) {
    void *q = fl_alloc(FL_MEM_OTHER, cap * elem);
    if (n) memcpy(q, old, n * elem);
    fl_free(old);
    return q;
}

static size_t new_window(fl_packer *p) {
    size_t W = (size_t)p->T + 1, w = p->n_windows++;
    if (w == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 64;
        p->tokens = grown(p->tokens, w * W, cap * W, sizeof *p->tokens);
        p->mask = grown(p->mask, w * W, cap * W, 1);
        p->examples = grown(p->examples, w, cap, sizeof *p->examples);
        p->bytes = grown(p->bytes, w, cap, sizeof *p->bytes);
        p->used = grown(p->used, w, cap, sizeof *p->used);
        p->room_next = grown(p->room_next, w, cap, sizeof *p->room_next);
        p->cap = cap;
    }
    for (size_t i = 0; i < W; i++) p->tokens[w * W + i] = p->pad;
    return w;
}

static void room_push(fl_packer *p, size_t w, size_t room) {
    p->room_next[w] = p->room_head[room];
    p->room_head[room] = (int64_t)w;
    p->room_bits[room / 64] |= 1ull << (room % 64);
}

// The open window with the least room >= need (taken off its list), or -1.
static int64_t room_pop(fl_packer *p, size_t need) {
    size_t rooms = (size_t)p->T + 2;
    for (size_t k = need / 64; k < (rooms + 63) / 64; k++) {
        uint64_t bits = p->room_bits[k];
        if (k == need / 64) bits &= ~0ull << (need % 64);
        if (!bits) continue;
        size_t room = k * 64 + (size_t)__builtin_ctzll(bits);
        int64_t w = p->room_head[room];
        p->room_head[room] = p->room_next[w];
        if (p->room_head[room] < 0) p->room_bits[k] &= ~(1ull << (room % 64));
        return w;
    }
    return -1;
}

// Tokens from `from` of ex: n <= T+1 of them, a piece, into a window; its
// first token is an input only (what comes before it in the window belongs
// to another piece). The window's bytes are those of the piece's targets:
// what a cut leaves out is not counted. Returns 0 when the piece holds no
// target and is left out.
static int place(fl_packer *p, const fl_example *ex, size_t from, size_t n, int first) {
    const int32_t *ids = ex->tokens.ids + from;
    const uint8_t *mask = ex->mask + from;
    size_t targets = 0, W = (size_t)p->T + 1;
    uint64_t bytes = 0;
    for (size_t i = 1; i < n; i++) {
        targets += mask[i] != 0;
        bytes += mask[i] ? ex->text_bytes[from + i] : 0;
    }
    if (!targets) return 0;
    int64_t w = p->packed ? room_pop(p, n) : -1;
    if (w < 0) w = (int64_t)new_window(p);
    size_t at = (size_t)w * W + p->used[w];
    memcpy(p->tokens + at, ids, n * sizeof *ids);
    memcpy(p->mask + at, mask, n);
    p->mask[at] = 0;
    p->used[w] += (uint32_t)n;
    p->examples[w] += (uint32_t)first;
    p->bytes[w] += bytes;
    p->n_targets += targets;
    // a piece has at least two tokens (an input and a target)
    if (p->packed && W - p->used[w] >= 2) room_push(p, (size_t)w, W - p->used[w]);
    return 1;
}

void fl_packer_add(fl_packer *p, const fl_example *ex) {
    size_t n = ex->tokens.n, W = (size_t)p->T + 1, T = (size_t)p->T;
    int placed = 0;
    p->n_examples++;
    if (n <= W) {
        placed = place(p, ex, 0, n, 1);
    } else if (p->policy == FL_SEQ_TRUNCATE) {
        p->n_truncated++;
        placed = place(p, ex, 0, W, 1);
    } else {
        // windows overlap by one token: the last target of one is the first
        // input of the next, so every target of the example is kept
        p->n_split++;
        for (size_t start = 0; start + 1 < n; start += T)
            placed |= place(p, ex, start, n - start < W ? n - start : W, !placed);
    }
    p->n_dropped += !placed;
}

void fl_packer_free(fl_packer *p) {
    fl_free(p->tokens);
    fl_free(p->mask);
    fl_free(p->examples);
    fl_free(p->bytes);
    fl_free(p->used);
    fl_free(p->room_head);
    fl_free(p->room_next);
    fl_free(p->room_bits);
    memset(p, 0, sizeof *p);
}
