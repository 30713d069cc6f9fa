// bpe.h: the tokenizer's tables, shared by its loader (tokenizer.c), its
// encoder (encode.c) and the merging (bpe.c). Read-only once loaded.
#ifndef FITLM_BPE_H
#define FITLM_BPE_H

#include <stdint.h>
#include <string.h>

#include "fitlm/tokenizer.h"

// One merge rule: the pair (left, right) of token ids becomes token `id`;
// lower rank merges first. key is bpe_pair_key(left, right), 0 when empty.
typedef struct {
    uint64_t key;
    int32_t rank, id;
} fl_bpe_merge;

struct fl_tokenizer {
    char name[8];
    int vocab, eot, bos; // bos -1: none
    uint8_t *bytes;       // token i is bytes[offs[i] .. offs[i+1])
    uint32_t *offs;       // vocab + 1 offsets
    int32_t byte_id[256]; // the token of each single byte
    fl_bpe_merge *merges; // open addressing, linear probing; NULL: byte tokenizer
    int merge_shift;      // 64 - log2(table size)
    uint64_t merge_mask;
    // Every merge ranks below all merges that use its result (true of any
    // learned BPE, GPT-2's included): lets long pieces merge through a heap.
    int ordered;
};

// Scratch memory for fl_bpe, grown as needed; one per thread.
typedef struct {
    void *buf;
    size_t cap;
} fl_bpe_scratch;

// The tokens of one piece p[0..len) (*n of them, in the scratch memory).
const int32_t *fl_bpe(const fl_tokenizer *tok, const uint8_t *p, size_t len, fl_bpe_scratch *s,
                      size_t *n);

static inline uint64_t bpe_pair_key(int32_t left, int32_t right) {
    return (uint64_t)(uint32_t)(left + 1) << 32 | (uint32_t)right;
}

// Multiplicative hashing: the top bits of the product index the table.
static inline uint64_t bpe_mix(uint64_t x) {
    x *= 0x9e3779b97f4a7c15ull;
    return x ^ (x >> 29);
}

// A fast hash of a short byte string, 8 bytes at a time.
static inline uint64_t bpe_hash(const uint8_t *s, size_t n) {
    uint64_t h = 0x243f6a8885a308d3ull ^ n, w;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, s + i, 8);
        h = bpe_mix(h ^ w);
    }
    w = 0;
    memcpy(&w, s + i, n - i);
    return bpe_mix(bpe_mix(h ^ w));
}

// The merge table's slot for a pair key: its rule, or the empty slot where it
// would go.
static inline fl_bpe_merge *bpe_merge_slot(const fl_tokenizer *tok, uint64_t key) {
    uint64_t i = bpe_mix(key) >> tok->merge_shift;
    while (tok->merges[i].key && tok->merges[i].key != key) i = (i + 1) & tok->merge_mask;
    return &tok->merges[i];
}

#endif
