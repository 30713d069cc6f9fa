// bpe.c: merging one piece into tokens, as encoder.py's bpe() does: take
// the lowest-ranked pair present, merge it at each of its occurrences left
// to right, repeat until no pair has a rank. Short pieces run exactly that;
// long ones (a run of thousands of letters is one piece) use a heap of
// (rank, position), which merges in the same order when the merges are
// ordered (see fl_tokenizer.ordered) and takes O(n log n), not O(n^2).
// Hugging Face's order (tokenizer.json) is the heap's at any length: the
// leftmost lowest-ranked pair, one occurrence at a time, which differs from
// encoder.py's when a merge makes a pair of lower rank than its own (merges
// not ordered, as LLaMA's are not); short pieces run that one at a time.
#include "bpe.h"

#include "fitlm/core.h"

enum { SHORT_PIECE = 64 };

static inline int32_t pair_rank(const fl_tokenizer *tok, int32_t left, int32_t right) {
    const fl_bpe_merge *m = bpe_merge_slot(tok, bpe_pair_key(left, right));
    return m->key ? m->rank : INT32_MAX;
}

// sym[0..len) in place; rank[i] is the rank of the pair (sym[i], sym[i+1]).
static size_t merge_short(const fl_tokenizer *tok, int32_t *sym, int32_t *rank, size_t len) {
    for (size_t i = 0; i + 1 < len; i++) rank[i] = pair_rank(tok, sym[i], sym[i + 1]);
    size_t m = len;
    while (m > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < m; i++)
            if (rank[i] < rank[best]) best = i;
        if (rank[best] == INT32_MAX) break;
        int32_t a = sym[best], b = sym[best + 1];
        int32_t merged = bpe_merge_slot(tok, bpe_pair_key(a, b))->id;
        // compact in place; a pair's rank changes only next to a merged symbol
        size_t i = best, j = best;
        int prev_merged = 0;
        while (i < m) {
            // Hugging Face merges one occurrence (the leftmost) at a time
            int merge = i + 1 < m && sym[i] == a && sym[i + 1] == b && (!tok->hf || i == best);
            sym[j] = merge ? merged : sym[i];
            if (j > 0)
                rank[j - 1] =
                    merge || prev_merged ? pair_rank(tok, sym[j - 1], sym[j]) : rank[i - 1];
            i += merge ? 2 : 1;
            j++;
            prev_merged = merge;
        }
        m = j;
    }
    return m;
}

// A binary min-heap of (rank << 32 | position).
static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    for (; i > 0 && h[(i - 1) / 2] > v; i = (i - 1) / 2) h[i] = h[(i - 1) / 2];
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--*n];
    size_t i = 0;
    for (size_t c = 1; c < *n; i = c, c = 2 * c + 1) {
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
    }
    h[i] = v;
    return top;
}

static void push_pair(const fl_tokenizer *tok, uint64_t *heap, size_t *n, const int32_t *sym,
                      uint32_t left, uint32_t right) {
    int32_t rank = pair_rank(tok, sym[left], sym[right]);
    if (rank != INT32_MAX) heap_push(heap, n, (uint64_t)rank << 32 | left);
}

// sym[0..len) as a linked list over the original positions. Under the
// ordering property, the merges a rank makes never form a pair of lower
// rank, so popping (rank, position) runs through the ranks in the same order
// and each rank's occurrences left to right, like merge_short. A popped entry
// whose pair has changed since it was pushed is skipped.
static size_t merge_long(const fl_tokenizer *tok, int32_t *sym, uint32_t *next, uint32_t *prev,
                         uint64_t *heap, uint32_t len) {
    size_t n = 0;
    for (uint32_t i = 0; i < len; i++) {
        next[i] = i + 1; // len: the end
        prev[i] = i - 1; // UINT32_MAX before the first
    }
    for (uint32_t i = 0; i + 1 < len; i++) push_pair(tok, heap, &n, sym, i, i + 1);
    while (n) {
        uint64_t top = heap_pop(heap, &n);
        uint32_t l = (uint32_t)top, r = next[l];
        if (sym[l] < 0 || r >= len) continue;
        const fl_bpe_merge *m = bpe_merge_slot(tok, bpe_pair_key(sym[l], sym[r]));
        if (!m->key || m->rank != (int32_t)(top >> 32)) continue;
        sym[l] = m->id;
        sym[r] = -1;
        next[l] = next[r];
        if (next[r] < len) prev[next[r]] = l;
        if (prev[l] != UINT32_MAX) push_pair(tok, heap, &n, sym, prev[l], l);
        if (next[l] < len) push_pair(tok, heap, &n, sym, l, next[l]);
    }
    size_t m = 0;
    for (uint32_t i = 0; i < len; i = next[i]) sym[m++] = sym[i];
    return m;
}

// The symbols the merging starts from: a character each, or, for one the
// vocabulary lacks, its <0xNN> byte tokens (all of them or none), else unk.
static size_t char_symbols(const fl_tokenizer *tok, const uint8_t *p, size_t len, int32_t *sym) {
    size_t m = 0;
    for (size_t i = 0, n; i < len; i += n) {
        n = p[i] < 0xc0 ? 1 : p[i] < 0xe0 ? 2 : p[i] < 0xf0 ? 3 : 4; // the input is valid UTF-8
        int32_t id = n == 1 ? tok->ascii_id[p[i]] : fl_tok_find(tok, p + i, n);
        int bytes = id < 0 && tok->byte_fallback;
        for (size_t k = 0; bytes && k < n; k++) bytes = tok->byte_id[p[i + k]] >= 0;
        if (id >= 0) {
            sym[m++] = id;
        } else if (bytes) {
            for (size_t k = 0; k < n; k++) sym[m++] = tok->byte_id[p[i + k]];
        } else if (tok->unk >= 0 && !(tok->fuse_unk && m && sym[m - 1] == tok->unk)) {
            sym[m++] = tok->unk; // (no unk: the character is dropped, as Hugging Face does)
        }
    }
    return m;
}

const int32_t *fl_bpe(const fl_tokenizer *tok, const uint8_t *p, size_t len, fl_bpe_scratch *s,
                      size_t *n_out) {
    if (len >= UINT32_MAX / 4)
        fl_die("the text has a piece of %zu bytes without a break (the %s tokenizer's limit "
               "is 1 GiB)",
               len, tok->name);
    // the heap holds at most len - 1 initial pairs plus 2 per merge
    size_t need = len * (3 * sizeof(uint64_t) + 3 * sizeof(int32_t));
    if (need > s->cap) {
        fl_free(s->buf);
        s->cap = 2 * need;
        s->buf = fl_alloc(FL_MEM_OTHER, s->cap);
    }
    uint64_t *heap = (uint64_t *)s->buf;
    int32_t *sym = (int32_t *)(heap + 3 * len), *other = sym + len;
    if (tok->start == FL_BPE_CHARS) {
        len = char_symbols(tok, p, len, sym);
    } else {
        for (size_t i = 0; i < len; i++) sym[i] = tok->byte_id[p[i]];
    }
    if (len <= SHORT_PIECE || !(tok->ordered || tok->hf))
        *n_out = merge_short(tok, sym, other, len);
    else
        *n_out =
            merge_long(tok, sym, (uint32_t *)other, (uint32_t *)other + len, heap, (uint32_t)len);
    return sym;
}
