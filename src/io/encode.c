// encode.c: encoding. The text is split into pieces exactly as GPT-2's
// encoder.py splits it with (Python `regex` semantics)
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// and each piece's bytes are merged by rank (bpe.c). A cache private to each
// call maps piece bytes to tokens (prose repeats its words), so calls from
// several threads share nothing mutable.
#include "bpe.h"

#include <utf8proc.h>

#include "fitlm/core.h"

enum { LETTER, NUMBER, SPACE, OTHER };
enum { CACHE_MAX_LEN = 64, CACHE_MAX_SLOTS = 1 << 18 };

// \s in the regex module is Unicode's White_Space property; str.isspace()
// would also take U+001C..U+001F. U+200B and U+FEFF are not White_Space.
static int white_space(int32_t cp) {
    return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
           cp == 0x205f || cp == 0x3000;
}

static int cp_class(int32_t cp) {
    if (white_space(cp)) return SPACE;
    utf8proc_category_t c = utf8proc_category(cp);
    if (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) return LETTER;
    if (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO) return NUMBER;
    return OTHER;
}

// The length of the character at s[i] (i < n) and its class. A byte that
// does not start a valid UTF-8 sequence is a character of its own, OTHER:
// what Python's 'surrogateescape' decoding makes of it.
static inline size_t char_at(const uint8_t *s, size_t n, size_t i, int *cls) {
    uint8_t c = s[i];
    if (c < 0x80) {
        *cls = (uint8_t)((c | 0x20) - 'a') < 26   ? LETTER
               : (uint8_t)(c - '0') < 10          ? NUMBER
               : c == ' ' || (uint8_t)(c - 9) < 5 ? SPACE
                                                  : OTHER;
        return 1;
    }
    size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                 : c >= 0xe0 && c <= 0xef ? 3
                 : c >= 0xf0 && c <= 0xf4 ? 4
                                          : 0;
    *cls = OTHER;
    if (!len || i + len > n) return 1;
    // the second byte's range rules out overlong forms, surrogates and > U+10FFFF
    uint8_t lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
    uint8_t hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
    if (s[i + 1] < lo || s[i + 1] > hi) return 1;
    int32_t cp = c & (0x7f >> len);
    for (size_t k = 1; k < len; k++) {
        if ((s[i + k] & 0xc0) != 0x80) return 1;
        cp = cp << 6 | (s[i + k] & 0x3f);
    }
    *cls = cp_class(cp);
    return len;
}

// The end of the piece that starts at s[i]: the regex's alternatives in order.
static size_t piece_end(const uint8_t *s, size_t n, size_t i) {
    if (s[i] == '\'' && i + 1 < n) {
        uint8_t c = s[i + 1], d = i + 2 < n ? s[i + 2] : 0;
        if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
        if ((c == 'r' && d == 'e') || (c == 'v' && d == 'e') || (c == 'l' && d == 'l'))
            return i + 3;
    }
    int cls, next;
    size_t j = i + char_at(s, n, i, &cls);
    if (s[i] == ' ' && j < n) { // the optional space before a letter, number or other run
        size_t len = char_at(s, n, j, &next);
        if (next != SPACE) {
            cls = next;
            j += len;
        }
    }
    if (cls != SPACE) {
        while (j < n) {
            size_t len = char_at(s, n, j, &next);
            if (next != cls) break;
            j += len;
        }
        return j;
    }
    // \s+(?!\S): a run of spaces before a non-space leaves its last one to
    // the next piece (which then starts " word"); a single one is \s+.
    size_t last = i;
    while (j < n) {
        size_t len = char_at(s, n, j, &next);
        if (next != SPACE) return last > i ? last : j;
        last = j;
        j += len;
    }
    return n;
}

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
    fl_bpe_scratch scratch;
} encoder;

// Grows an array to hold `need` elements (doubling), keeping its first `used`.
static void *reserve(void *p, size_t *cap, size_t used, size_t need, size_t elem) {
    if (need <= *cap) return p;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *q = fl_alloc(FL_MEM_OTHER, cap2 * elem);
    if (used) memcpy(q, p, used * elem);
    fl_free(p);
    *cap = cap2;
    return q;
}

static void append(fl_tokens *out, const int32_t *ids, size_t n) {
    out->ids = reserve(out->ids, &out->cap, out->n, out->n + n, sizeof *ids);
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
    e->keys = reserve(e->keys, &e->cap_keys, e->n_keys, e->n_keys + len, 1);
    e->ids = reserve(e->ids, &e->cap_ids, e->n_ids, e->n_ids + n, sizeof *e->ids);
    memcpy(e->keys + e->n_keys, p, len);
    memcpy(e->ids + e->n_ids, ids, n * sizeof *e->ids);
    *s = (cache_slot){h, (uint32_t)e->n_keys, (uint32_t)len, (uint32_t)e->n_ids, (uint32_t)n};
    e->n_keys += len;
    e->n_ids += n;
    e->used++;
}

static void encode_piece(encoder *e, const uint8_t *p, size_t len, fl_tokens *out) {
    if (len == 1) {
        append(out, &e->tok->byte_id[p[0]], 1);
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
    size_t m;
    const int32_t *ids = fl_bpe(e->tok, p, len, &e->scratch, &m);
    append(out, ids, m);
    if (s) cache_add(e, s, h, p, len, ids, m);
}

void fl_tokenizer_encode(const fl_tokenizer *tok, const uint8_t *text, size_t n, fl_tokens *out) {
    if (!tok->merges) { // the byte tokenizer
        out->ids = reserve(out->ids, &out->cap, out->n, out->n + n, sizeof *out->ids);
        for (size_t i = 0; i < n; i++) out->ids[out->n + i] = text[i];
        out->n += n;
        return;
    }
    // the tokens are built in a copy of *out on this thread's stack: callers'
    // fl_tokens for different threads may share a cache line
    fl_tokens mine = *out;
    mine.ids = reserve(mine.ids, &mine.cap, mine.n, mine.n + n / 4 + 1, sizeof *mine.ids);
    encoder e = {.tok = tok};
    int bits = 8;
    while (bits < 17 && ((size_t)1 << bits) < n / 32) bits++;
    cache_init(&e, bits);
    for (size_t i = 0; i < n;) {
        size_t end = piece_end(text, n, i);
        encode_piece(&e, text + i, end - i, &mine);
        i = end;
    }
    *out = mine;
    fl_free(e.slots);
    fl_free(e.keys);
    fl_free(e.ids);
    fl_free(e.scratch.buf);
}

void fl_tokens_free(fl_tokens *t) {
    fl_free(t->ids);
    *t = (fl_tokens){0};
}
