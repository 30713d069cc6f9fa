// bpe.h: the tokenizer's tables, shared by its loaders (tokenizer.c for
// byte and gpt2, hf_tokenizer.c for tokenizer.json), its encoder (encode.c,
// pretokenize.c) and the merging (bpe.c). Read-only once loaded.
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

// What the merging starts from: a byte each (GPT-2, LLaMA-3) or a Unicode
// character each, bytes only for characters outside the vocabulary (LLaMA-1/2).
enum { FL_BPE_BYTES, FL_BPE_CHARS };
// The pre-tokenizer's pattern: GPT-2's regex, LLaMA-3's, or none (the whole
// text is one piece).
enum { FL_PRE_GPT2, FL_PRE_LLAMA3, FL_PRE_NONE };
// Where the space that starts a SentencePiece text comes from: the Prepend
// normaliser (always), Metaspace (unless the text starts with one; at the
// start of the input only, or of every text between added tokens), or none.
enum { FL_PREPEND_NONE, FL_PREPEND_ALWAYS, FL_PREPEND_META_FIRST, FL_PREPEND_META_ALWAYS };

// Token bytes -> id over the model's vocabulary (not the added tokens, nor
// the <0xNN> byte tokens). ids holds id + 1, 0 when empty.
typedef struct {
    int32_t *ids;
    uint64_t mask;
    int shift;
} fl_vocab_index;

struct fl_tokenizer {
    char name[8];
    int vocab, eot, bos;  // bos -1: none
    uint8_t *bytes;       // token i is bytes[offs[i] .. offs[i+1])
    uint32_t *offs;       // vocab + 1 offsets
    int32_t byte_id[256]; // the token of each byte (FL_BPE_CHARS: its <0xNN>, or -1)
    fl_bpe_merge *merges; // open addressing, linear probing; NULL: byte tokenizer
    int merge_shift;      // 64 - log2(table size)
    uint64_t merge_mask;
    // Every merge ranks below all merges that use its result (true of any
    // learned BPE, GPT-2's included): lets long pieces merge through a heap.
    int ordered;
    int start;   // FL_BPE_*
    int pattern; // FL_PRE_*
    // tokenizer.json: invalid UTF-8 becomes U+FFFD first, added tokens are
    // matched, and merging follows Hugging Face's order even when not ordered
    int hf;
    int ignore_merges;   // a piece that is a token is that token (LLaMA-3)
    int nfc;             // the NFC normaliser
    fl_vocab_index find; // hf only
    // FL_BPE_CHARS: text reaches the merging with "▁" written as the space
    // it stands for (tokens likewise), so a token's bytes are its text
    int prepend;  // FL_PREPEND_*
    int unk;      // a character without a token (and no byte tokens): -1 drops it
    int fuse_unk; // consecutive unknown characters are one unk
    int byte_fallback;
    // No token joins a non-space to a following space (SentencePiece's
    // vocabularies): the text may be cut before every space run that follows
    // a non-space, and the pieces merged apart, with the same tokens.
    int word_split;
    // inert[c]: ASCII c has no token but a byte token, and byte tokens merge
    // with nothing (hf_tokenizer.c refuses such merges): cuts on both sides of
    // it change no token (LLaMA's "\n"), and keep pieces short for the cache
    uint8_t inert[256];
    int32_t ascii_id[128]; // FL_BPE_CHARS: the token of each ASCII character, or -1
    int strip_space;       // decoding drops the one leading space the encoding adds
    // Added tokens, matched in the input before anything else: their ids by
    // first byte (added_at[b] .. added_at[b+1]), longest first.
    int32_t *added;
    int32_t added_at[257];
    uint8_t *special; // per id: 1 for an added token marked special
};

// Scratch memory for fl_bpe, grown as needed; one per thread.
typedef struct {
    void *buf;
    size_t cap;
} fl_bpe_scratch;

// The tokens of one piece p[0..len) (*n of them, in the scratch memory).
const int32_t *fl_bpe(const fl_tokenizer *tok, const uint8_t *p, size_t len, fl_bpe_scratch *s,
                      size_t *n);

// The end of the piece that starts at s[i] (i < n) under tok->pattern.
size_t fl_pretok_end(int pattern, const uint8_t *s, size_t n, size_t i);

// Loader helpers shared by tokenizer.c and hf_tokenizer.c.
char *fl_tok_read_file(const char *path, size_t *size);
// GPT-2's byte alphabet (bytes_to_unicode in encoder.py): byte_of[cp] is the
// byte written as code point cp < FL_ALPHABET, or -1.
enum { FL_ALPHABET = 256 + 68 };
void fl_tok_byte_decoder(int16_t byte_of[FL_ALPHABET]);
// A token written in the alphabet (UTF-8) back to its bytes (room for n in
// out); the length, or -1 for a character outside it.
long fl_tok_unmap(const int16_t *byte_of, const char *str, size_t n, uint8_t *out);
// Builds tok->find over ids [0, count) whose use[id] is set (NULL: all);
// returns the first id that repeats an earlier token's bytes, or -1.
int fl_tok_index(fl_tokenizer *tok, int count, const uint8_t *use);
int32_t fl_tok_find(const fl_tokenizer *tok, const void *s, size_t n);
// Allocates the merge table for this many merges.
void fl_tok_merges_alloc(fl_tokenizer *tok, size_t merges);
// Whether every merge ranks below all merges that use the token it makes.
int fl_tok_merges_ordered(const fl_tokenizer *tok);
// Loads name "hf" from its files (tokenizer.json, tokenizer_config.json).
void fl_hf_tokenizer_load(fl_tokenizer *tok, const fl_tokenizer_files *f);

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
