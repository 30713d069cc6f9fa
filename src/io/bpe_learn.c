// bpe_learn.c: learning a byte-level BPE from text, as GPT-2's tokenizer was
// learnt (Sennrich et al. 2016; GPT-2's pre-tokenizer and byte alphabet).
// The text is cut into pieces by GPT-2's regex, identical pieces are counted
// once with their number of occurrences, and each step merges the adjacent
// pair of tokens that occurs most often (ties: the pair of lower ids), as
// Hugging Face's BpeTrainer does. The result is GPT-2's two files, so the
// "gpt2" tokenizer loads it: encoder.json (ids: the 256 bytes, the merged
// tokens in the order they were made, <|endoftext|> last) and vocab.bpe.
#include "bpe.h"

#include <cJSON.h>

#include "fitlm/core.h"
#include "fitlm/io.h"

// Open addressing over 64-bit keys (0: empty) with a count each: the pieces
// (by hash, with the piece's first occurrence) and the pairs.
typedef struct {
    uint64_t *keys;
    int64_t *counts;
    const uint8_t **text; // pieces only: where the piece was first seen
    uint32_t *len;
    size_t mask, used;
} table;

static void table_init(table *t, size_t n, int pieces) { // n: a power of two
    t->keys = fl_alloc(FL_MEM_OTHER, n * sizeof *t->keys);
    t->counts = fl_alloc(FL_MEM_OTHER, n * sizeof *t->counts);
    t->text = pieces ? fl_alloc(FL_MEM_OTHER, n * sizeof *t->text) : NULL;
    t->len = pieces ? fl_alloc(FL_MEM_OTHER, n * sizeof *t->len) : NULL;
    t->mask = n - 1;
    t->used = 0;
}

static void table_free(table *t) {
    fl_free(t->keys);
    fl_free(t->counts);
    fl_free(t->text);
    fl_free(t->len);
}

// The slot of key in a table of pairs, or the empty slot where it goes.
static size_t key_slot(const table *t, uint64_t key) {
    for (size_t i = bpe_mix(key) & t->mask;; i = (i + 1) & t->mask)
        if (!t->keys[i] || t->keys[i] == key) return i;
}

// The slot of key (a table of byte strings: of the bytes s[0..n) with that
// hash), or the empty slot where it goes.
static size_t table_slot(const table *t, uint64_t key, const uint8_t *s, size_t n) {
    if (!t->text) return key_slot(t, key);
    for (size_t i = bpe_mix(key) & t->mask;; i = (i + 1) & t->mask)
        if (!t->keys[i] || (t->keys[i] == key && t->len[i] == n && !memcmp(t->text[i], s, n)))
            return i;
}

// Twice the slots; each key moves to the first empty one from its hash
// (the keys are distinct entries already).
static void table_grow(table *t) {
    table old = *t;
    table_init(t, 2 * (old.mask + 1), old.text != NULL);
    for (size_t i = 0; i <= old.mask; i++) {
        if (!old.keys[i]) continue;
        size_t j = bpe_mix(old.keys[i]) & t->mask;
        while (t->keys[j]) j = (j + 1) & t->mask;
        t->keys[j] = old.keys[i];
        t->counts[j] = old.counts[i];
        if (t->text) t->text[j] = old.text[i], t->len[j] = old.len[i];
    }
    t->used = old.used;
    table_free(&old);
}

// The key of a byte string (never 0, which marks an empty slot).
static uint64_t bytes_key(const uint8_t *s, size_t n) {
    uint64_t h = bpe_hash(s, n);
    return h | !h;
}

static void table_add(table *t, uint64_t key, const uint8_t *s, size_t n, int64_t count) {
    size_t i = table_slot(t, key, s, n);
    if (!t->keys[i]) {
        if (2 * (t->used + 1) > t->mask + 1) {
            table_grow(t);
            i = table_slot(t, key, s, n);
        }
        t->keys[i] = key;
        if (t->text) t->text[i] = s, t->len[i] = (uint32_t)n;
        t->used++;
    }
    t->counts[i] += count;
}

// A max-heap of (count, pair key): the most frequent pair first, the lower
// key on ties. Entries may be stale (a count that has fallen since): the
// top is checked against the pair table before it is used.
typedef struct {
    int64_t count;
    uint64_t key;
} entry;

typedef struct {
    entry *e;
    size_t n, cap;
} heap;

static int before(entry a, entry b) {
    return a.count > b.count || (a.count == b.count && a.key < b.key);
}

static void heap_push(heap *h, entry x) {
    h->e = fl_reserve(FL_MEM_OTHER, h->e, &h->cap, h->n, h->n + 1, sizeof *h->e);
    size_t i = h->n++;
    for (; i && before(x, h->e[(i - 1) / 2]); i = (i - 1) / 2) h->e[i] = h->e[(i - 1) / 2];
    h->e[i] = x;
}

static entry heap_pop(heap *h) {
    entry top = h->e[0], last = h->e[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && before(h->e[c + 1], h->e[c])) c++;
        if (!before(h->e[c], last)) break;
        h->e[i] = h->e[c];
        i = c;
    }
    if (h->n) h->e[i] = last;
    return top;
}

// The pieces that were counted, each as its tokens (sym[start .. start+len)).
typedef struct {
    int32_t *sym;
    size_t *start;
    uint32_t *len;
    int64_t *count;
    size_t n;
} words;

typedef struct {
    table pairs;
    heap queue;
    uint64_t *raised; // pairs whose count rose in this merge (re-queued after it)
    size_t n_raised, cap_raised;
} pair_counts;

static void pair_add(pair_counts *p, int32_t a, int32_t b, int64_t count) {
    uint64_t key = bpe_pair_key(a, b);
    table_add(&p->pairs, key, NULL, 0, count);
    if (count > 0) {
        p->raised = fl_reserve(FL_MEM_OTHER, p->raised, &p->cap_raised, p->n_raised,
                               p->n_raised + 1, sizeof(uint64_t));
        p->raised[p->n_raised++] = key;
    }
}

static int64_t pair_count(const pair_counts *p, uint64_t key) {
    size_t i = key_slot(&p->pairs, key);
    return p->pairs.keys[i] ? p->pairs.counts[i] : 0;
}

static void queue_raised(pair_counts *p) {
    for (size_t i = 0; i < p->n_raised; i++) {
        int64_t c = pair_count(p, p->raised[i]);
        if (c > 0) heap_push(&p->queue, (entry){c, p->raised[i]});
    }
    p->n_raised = 0;
}

// Replaces every (a, b) in the words by t, keeping the pair counts exact.
static void merge_pair(words *w, pair_counts *p, int32_t a, int32_t b, int32_t t) {
    for (size_t k = 0; k < w->n; k++) {
        int32_t *s = w->sym + w->start[k];
        uint32_t len = w->len[k], r = 0, o = 0;
        int64_t c = w->count[k];
        if (len < 2) continue;
        while (r < len) {
            if (r + 1 < len && s[r] == a && s[r + 1] == b) {
                if (o) pair_add(p, s[o - 1], a, -c), pair_add(p, s[o - 1], t, c);
                if (r + 2 < len) pair_add(p, b, s[r + 2], -c), pair_add(p, t, s[r + 2], c);
                pair_add(p, a, b, -c);
                s[o++] = t;
                r += 2;
            } else {
                s[o++] = s[r++];
            }
        }
        w->len[k] = o;
    }
}

// Counts the pieces of the texts under GPT-2's pre-tokenizer.
static void count_pieces(const uint8_t *const *texts, const size_t *lens, size_t n_texts,
                         words *w) {
    table pieces;
    table_init(&pieces, (size_t)1 << 16, 1);
    for (size_t d = 0; d < n_texts; d++)
        for (size_t i = 0; i < lens[d];) {
            size_t end = fl_pretok_end(FL_PRE_GPT2, texts[d], lens[d], i);
            table_add(&pieces, bytes_key(texts[d] + i, end - i), texts[d] + i, end - i, 1);
            i = end;
        }
    size_t n = pieces.used, bytes = 0;
    for (size_t i = 0; i <= pieces.mask; i++) bytes += pieces.keys[i] ? pieces.len[i] : 0;
    w->sym = fl_alloc(FL_MEM_OTHER, (bytes ? bytes : 1) * sizeof *w->sym);
    w->start = fl_alloc(FL_MEM_OTHER, (n ? n : 1) * sizeof *w->start);
    w->len = fl_alloc(FL_MEM_OTHER, (n ? n : 1) * sizeof *w->len);
    w->count = fl_alloc(FL_MEM_OTHER, (n ? n : 1) * sizeof *w->count);
    w->n = 0;
    size_t at = 0;
    for (size_t i = 0; i <= pieces.mask; i++) {
        if (!pieces.keys[i]) continue;
        w->start[w->n] = at;
        w->len[w->n] = pieces.len[i];
        w->count[w->n++] = pieces.counts[i];
        for (uint32_t j = 0; j < pieces.len[i]; j++) w->sym[at++] = pieces.text[i][j];
    }
    table_free(&pieces);
}

// GPT-2's byte alphabet: each byte as a printable code point, UTF-8.
static size_t put_token(char *out, const uint8_t *bytes, size_t n, const int *cp_of) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int cp = cp_of[bytes[i]];
        if (cp < 0x80) {
            out[o++] = (char)cp;
        } else {
            out[o++] = (char)(0xc0 | cp >> 6);
            out[o++] = (char)(0x80 | (cp & 0x3f));
        }
    }
    out[o] = 0;
    return o;
}

typedef struct {
    uint8_t *bytes; // token i is bytes[offs[i] .. offs[i + 1])
    uint32_t *offs;
    size_t cap;
    int n;
} vocabulary;

static void write_files(const char *dir, const vocabulary *v, const int32_t (*merges)[2],
                        int n_merges) {
    int16_t byte_of[FL_ALPHABET];
    int cp_of[256];
    fl_tok_byte_decoder(byte_of);
    for (int cp = 0; cp < FL_ALPHABET; cp++)
        if (byte_of[cp] >= 0) cp_of[byte_of[cp]] = cp;
    size_t longest = 0;
    for (int i = 0; i < v->n; i++)
        if (v->offs[i + 1] - v->offs[i] > longest) longest = v->offs[i + 1] - v->offs[i];
    char *a = fl_alloc(FL_MEM_OTHER, 4 * longest + 8), *b = fl_alloc(FL_MEM_OTHER, 4 * longest + 8);
    cJSON *enc = cJSON_CreateObject();
    for (int i = 0; i < v->n; i++) {
        put_token(a, v->bytes + v->offs[i], v->offs[i + 1] - v->offs[i], cp_of);
        cJSON_AddNumberToObject(enc, a, i);
    }
    cJSON_AddNumberToObject(enc, "<|endoftext|>", v->n);
    char *json = cJSON_PrintUnformatted(enc);
    char path[FL_FILE_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/encoder.json", dir);
    fl_file_write_all(path, json, strlen(json));
    cJSON_free(json);
    cJSON_Delete(enc);

    size_t cap = 64 + (size_t)n_merges * (8 * longest + 2), n = 0;
    char *text = fl_alloc(FL_MEM_OTHER, cap);
    n += (size_t)snprintf(text, cap, "#version: 0.2 (learnt by fitlm tokenize)\n");
    for (int m = 0; m < n_merges; m++) {
        const int32_t *p = merges[m];
        put_token(a, v->bytes + v->offs[p[0]], v->offs[p[0] + 1] - v->offs[p[0]], cp_of);
        put_token(b, v->bytes + v->offs[p[1]], v->offs[p[1] + 1] - v->offs[p[1]], cp_of);
        n += (size_t)snprintf(text + n, cap - n, "%s %s\n", a, b);
    }
    snprintf(path, sizeof path, "%s/vocab.bpe", dir);
    fl_file_write_all(path, text, n);
    fl_free(text);
    fl_free(a);
    fl_free(b);
}

int fl_bpe_learn(const uint8_t *const *texts, const size_t *lens, size_t n_texts, int vocab,
                 const char *dir) {
    if (vocab < 257)
        fl_die("a learnt BPE needs a vocabulary of at least 257 (256 bytes and "
               "<|endoftext|>), not %d",
               vocab);
    words w;
    count_pieces(texts, lens, n_texts, &w);
    pair_counts p = {0};
    table_init(&p.pairs, (size_t)1 << 16, 0);
    for (size_t k = 0; k < w.n; k++)
        for (uint32_t j = 0; j + 1 < w.len[k]; j++)
            pair_add(&p, w.sym[w.start[k] + j], w.sym[w.start[k] + j + 1], w.count[k]);
    queue_raised(&p);

    // the bytes, then one token per merge. A merge never makes the bytes of
    // an earlier token: a span between two token boundaries changes only by
    // merges inside it (boundaries never appear), the same ones wherever the
    // span occurs, so a span merged as a + b everywhere at rank r cannot be
    // c + d later. (Were it otherwise, loading the files would say so.)
    vocabulary v = {0};
    v.offs = fl_alloc(FL_MEM_OTHER, (size_t)vocab * sizeof *v.offs);
    v.cap = 4096;
    v.bytes = fl_alloc(FL_MEM_OTHER, v.cap);
    for (int b = 0; b < 256; b++) v.bytes[b] = (uint8_t)b, v.offs[b + 1] = (uint32_t)b + 1;
    v.n = 256;
    int32_t(*merges)[2] = fl_alloc(FL_MEM_OTHER, (size_t)vocab * sizeof *merges);
    int n_merges = 0;
    while (v.n < vocab - 1 && p.queue.n) {
        entry top = heap_pop(&p.queue);
        int64_t now = pair_count(&p, top.key);
        if (now != top.count) { // stale: back with its count
            if (now > 0) heap_push(&p.queue, (entry){now, top.key});
            continue;
        }
        if (now < 2) break; // a pair seen once makes no useful token
        int32_t a = (int32_t)(top.key >> 32) - 1, b = (int32_t)(uint32_t)top.key, t = v.n++;
        size_t la = v.offs[a + 1] - v.offs[a], lb = v.offs[b + 1] - v.offs[b];
        v.bytes = fl_reserve(FL_MEM_OTHER, v.bytes, &v.cap, v.offs[t], v.offs[t] + la + lb, 1);
        memcpy(v.bytes + v.offs[t], v.bytes + v.offs[a], la);
        memcpy(v.bytes + v.offs[t] + la, v.bytes + v.offs[b], lb);
        v.offs[v.n] = v.offs[t] + (uint32_t)(la + lb);
        merges[n_merges][0] = a;
        merges[n_merges++][1] = b;
        merge_pair(&w, &p, a, b, t);
        queue_raised(&p);
    }
    write_files(dir, &v, (const int32_t(*)[2])merges, n_merges);
    int learnt = v.n + 1;
    fl_free(merges);
    fl_free(v.bytes);
    fl_free(v.offs);
    table_free(&p.pairs);
    fl_free(p.queue.e);
    fl_free(p.raised);
    fl_free(w.sym);
    fl_free(w.start);
    fl_free(w.len);
    fl_free(w.count);
    return learnt;
}
