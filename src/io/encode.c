// encode.c: encoding. Hugging Face tokenizers first make the text valid
// UTF-8 (U+FFFD per maximal invalid subpart, as Python's and JavaScript's
// decoders do) and cut out the added tokens; each text between them is
// normalised (SentencePiece: the leading "▁", spaces as "▁"), cut into
// pieces (pretokenize.c; SentencePiece: where the vocabulary allows, at word
// starts and around characters only byte tokens stand for) and each piece
// merged by rank (bpe.c). A cache private to each
// call maps piece bytes to tokens (prose repeats its words), so calls from
// several threads share nothing mutable.
#include "bpe.h"

#include <stdlib.h>
#include <utf8proc.h>

#include "fitlm/core.h"

enum { CACHE_MAX_LEN = 64, CACHE_MAX_SLOTS = 1 << 18 };

typedef struct {
    uint64_t hash;                 // 0: empty
    uint32_t key, len, ids, n_ids; // the piece is keys[key..+len), its tokens ids[ids..+n_ids)
} cache_slot;

typedef struct {
    const fl_tokenizer *tok;
    cache_slot *slots;
    size_t mask, used;
    int shift;
    uint8_t *keys;
    int32_t *ids;
    size_t n_keys, cap_keys, n_ids, cap_ids;
    uint8_t *norm; // a SentencePiece text, normalised
    size_t cap_norm;
    fl_bpe_scratch scratch;
} encoder;

static void append(fl_tokens *out, const int32_t *ids, size_t n) {
    out->ids = fl_reserve(FL_MEM_OTHER, out->ids, &out->cap, out->n, out->n + n, sizeof *ids);
    memcpy(out->ids + out->n, ids, n * sizeof *ids);
    out->n += n;
}

static cache_slot *cache_find(const encoder *e, uint64_t h, const uint8_t *p, size_t len) {
    for (size_t i = h >> e->shift;; i = (i + 1) & e->mask) {
        cache_slot *s = &e->slots[i];
        if (!s->hash || (s->hash == h && s->len == len && !memcmp(e->keys + s->key, p, len)))
            return s;
    }
}

static void cache_init(encoder *e, int bits) {
    e->slots = fl_alloc(FL_MEM_OTHER, ((size_t)1 << bits) * sizeof *e->slots);
    e->mask = ((size_t)1 << bits) - 1;
    e->shift = 64 - bits;
    e->used = 0;
}

static void cache_add(encoder *e, cache_slot *s, uint64_t h, const uint8_t *p, size_t len,
                      const int32_t *ids, size_t n) {
    if (2 * (e->used + 1) > e->mask + 1) {
        cache_slot *old = e->slots;
        size_t n_old = e->mask + 1, used = e->used;
        if (n_old < CACHE_MAX_SLOTS) { // rehash into a table twice the size
            cache_init(e, 64 - e->shift + 1);
            for (size_t k = 0; k < n_old; k++)
                if (old[k].hash) {
                    size_t i = old[k].hash >> e->shift;
                    while (e->slots[i].hash) i = (i + 1) & e->mask;
                    e->slots[i] = old[k];
                }
            e->used = used;
        } else { // full at its largest: start afresh, bounding the memory
            cache_init(e, 64 - e->shift);
            e->n_keys = e->n_ids = 0;
        }
        fl_free(old);
        s = cache_find(e, h, p, len);
    }
    e->keys = fl_reserve(FL_MEM_OTHER, e->keys, &e->cap_keys, e->n_keys, e->n_keys + len, 1);
    e->ids = fl_reserve(FL_MEM_OTHER, e->ids, &e->cap_ids, e->n_ids, e->n_ids + n, sizeof *e->ids);
    memcpy(e->keys + e->n_keys, p, len);
    memcpy(e->ids + e->n_ids, ids, n * sizeof *e->ids);
    *s = (cache_slot){h, (uint32_t)e->n_keys, (uint32_t)len, (uint32_t)e->n_ids, (uint32_t)n};
    e->n_keys += len;
    e->n_ids += n;
    e->used++;
}

static void encode_piece(encoder *e, const uint8_t *p, size_t len, fl_tokens *out) {
    const fl_tokenizer *tok = e->tok;
    if (len == 1 && tok->start == FL_BPE_BYTES) {
        append(out, &tok->byte_id[p[0]], 1);
        return;
    }
    uint64_t h = 0;
    cache_slot *s = NULL;
    if (len <= CACHE_MAX_LEN) {
        h = bpe_hash(p, len) | 1;
        s = cache_find(e, h, p, len);
        if (s->hash) {
            append(out, e->ids + s->ids, s->n_ids);
            return;
        }
    }
    int32_t whole = tok->ignore_merges ? fl_tok_find(tok, p, len) : -1;
    size_t m = 1;
    const int32_t *ids = whole >= 0 ? &whole : fl_bpe(tok, p, len, &e->scratch, &m);
    append(out, ids, m);
    if (s) cache_add(e, s, h, p, len, ids, m);
}

// SentencePiece's normalisation of s[0..n) into e->norm, with "▁" written as
// the space it stands for; first: s starts the input.
static size_t normalise(encoder *e, const uint8_t *s, size_t n, int first) {
    int p = e->tok->prepend;
    int meta = p == FL_PREPEND_META_ALWAYS || (p == FL_PREPEND_META_FIRST && first);
    int starts_space = n && (s[0] == ' ' || (n >= 3 && !memcmp(s, "\xe2\x96\x81", 3)));
    e->norm = fl_reserve(FL_MEM_OTHER, e->norm, &e->cap_norm, 0, n + 1, 1);
    size_t m = 0;
    if (n && (p == FL_PREPEND_ALWAYS || (meta && !starts_space))) e->norm[m++] = ' ';
    for (size_t i = 0; i < n; i++) {
        int bar = s[i] == 0xe2 && i + 2 < n && s[i + 1] == 0x96 && s[i + 2] == 0x81;
        e->norm[m++] = bar ? ' ' : s[i];
        i += bar ? 2 : 0;
    }
    return m;
}

// The tokens of s[0..n), a normalised text without added tokens.
static void split_text(encoder *e, const uint8_t *s, size_t n, int first, fl_tokens *out) {
    const fl_tokenizer *tok = e->tok;
    if (tok->start == FL_BPE_BYTES) {
        for (size_t i = 0; i < n;) {
            size_t end = fl_pretok_end(tok->pattern, s, n, i);
            encode_piece(e, s + i, end - i, out);
            i = end;
        }
        return;
    }
    n = normalise(e, s, n, first);
    const uint8_t *p = e->norm;
    size_t start = 0;
    for (size_t i = 1; i < n; i++)
        if ((tok->word_split && p[i] == ' ' && p[i - 1] != ' ') || tok->inert[p[i]] ||
            tok->inert[p[i - 1]]) {
            encode_piece(e, p + start, i - start, out);
            start = i;
        }
    if (n > start) encode_piece(e, p + start, n - start, out);
}

// The tokens of s[0..n), a text without added tokens.
static void encode_text(encoder *e, const uint8_t *s, size_t n, int first, fl_tokens *out) {
    if (!e->tok->nfc || !n) {
        split_text(e, s, n, first, out);
        return;
    }
    uint8_t *nfc; // utf8proc's allocation
    utf8proc_ssize_t m =
        utf8proc_map(s, (utf8proc_ssize_t)n, &nfc, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (m == UTF8PROC_ERROR_NOMEM) fl_die_oom(4 * n, FL_MEM_OTHER); // utf8proc's malloc
    if (m < 0) fl_die("NFC normalisation failed: %s", utf8proc_errmsg(m));
    split_text(e, nfc, (size_t)m, first, out);
    free(nfc);
}

// The length of the valid UTF-8 character at s[i], or 0 when there is none,
// with *bad the length of the maximal subpart that one U+FFFD replaces.
static size_t utf8_char(const uint8_t *s, size_t n, size_t i, size_t *bad) {
    uint8_t c = s[i];
    if (c < 0x80) return 1;
    size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                 : c >= 0xe0 && c <= 0xef ? 3
                 : c >= 0xf0 && c <= 0xf4 ? 4
                                          : 0;
    // the second byte's range rules out overlong forms, surrogates and > U+10FFFF
    uint8_t lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
    uint8_t hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
    *bad = 1;
    for (size_t k = 1; k < len; k++)
        if (i + k >= n || s[i + k] < (k == 1 ? lo : 0x80) || s[i + k] > (k == 1 ? hi : 0xbf)) {
            *bad = k;
            return 0;
        }
    return len;
}

// text with each maximal invalid subpart replaced by U+FFFD (fl_free it),
// or NULL when it is valid UTF-8.
static uint8_t *valid_utf8(const uint8_t *text, size_t *n) {
    size_t i = 0, len, bad;
    while (i < *n && (len = utf8_char(text, *n, i, &bad))) i += len;
    if (i == *n) return NULL;
    uint8_t *out = fl_alloc(FL_MEM_OTHER, 3 * *n);
    memcpy(out, text, i);
    size_t m = i;
    while (i < *n) {
        len = utf8_char(text, *n, i, &bad);
        if (len) {
            memcpy(out + m, text + i, len);
            m += len;
            i += len;
        } else {
            memcpy(out + m, "\xef\xbf\xbd", 3);
            m += 3;
            i += bad;
        }
    }
    *n = m;
    return out;
}

// The first added token at or after s[i] (the longest of those that start
// there): its id, and its position in *at; -1 and n when there is none.
static int32_t next_added(const fl_tokenizer *tok, const uint8_t *s, size_t n, size_t i,
                          size_t *at) {
    for (; i < n; i++)
        for (int32_t k = tok->added_at[s[i]]; k < tok->added_at[s[i] + 1]; k++) {
            int32_t id = tok->added[k];
            size_t len = tok->offs[id + 1] - tok->offs[id];
            if (len <= n - i && !memcmp(s + i, tok->bytes + tok->offs[id], len)) {
                *at = i;
                return id;
            }
        }
    *at = n;
    return -1;
}

void fl_tokenizer_encode(const fl_tokenizer *tok, const uint8_t *text, size_t n, fl_tokens *out) {
    if (!tok->merges) { // the byte tokenizer
        out->ids =
            fl_reserve(FL_MEM_OTHER, out->ids, &out->cap, out->n, out->n + n, sizeof *out->ids);
        for (size_t i = 0; i < n; i++) out->ids[out->n + i] = text[i];
        out->n += n;
        return;
    }
    uint8_t *valid = tok->hf ? valid_utf8(text, &n) : NULL;
    if (valid) text = valid;
    // the tokens are built in a copy of *out on this thread's stack: callers'
    // fl_tokens for different threads may share a cache line
    fl_tokens mine = *out;
    mine.ids =
        fl_reserve(FL_MEM_OTHER, mine.ids, &mine.cap, mine.n, mine.n + n / 4 + 1, sizeof *mine.ids);
    encoder e = {.tok = tok};
    int bits = 8;
    while (bits < 17 && ((size_t)1 << bits) < n / 32) bits++;
    cache_init(&e, bits);
    for (size_t i = 0, at; i < n; i = at) {
        int32_t id = tok->added ? next_added(tok, text, n, i, &at) : -1;
        if (!tok->added) at = n;
        encode_text(&e, text + i, at - i, i == 0, &mine);
        if (id >= 0) {
            append(&mine, &id, 1);
            at += tok->offs[id + 1] - tok->offs[id];
        }
    }
    *out = mine;
    fl_free(e.slots);
    fl_free(e.keys);
    fl_free(e.ids);
    fl_free(e.norm);
    fl_free(e.scratch.buf);
    fl_free(valid);
}

void fl_tokens_free(fl_tokens *t) {
    fl_free(t->ids);
    *t = (fl_tokens){0};
}
