// text.c: byte-level text data. The byte tokenizer needs no files: a token is
// a byte, so decoding is exact for any input, including invalid UTF-8.
#include "fitlm/io.h"

#include <errno.h>
#include <math.h>
#include <string.h>

// Returns the offset of the first invalid UTF-8 sequence, or n.
static size_t utf8_invalid_at(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n) return i;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return i;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        // overlong forms, surrogates and code points past U+10FFFF
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return i;
        i += len;
    }
    return n;
}

void fl_text_load(fl_text *text, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        fl_die("cannot open data file %s: %s%s", path, strerror(errno),
               errno == ENOENT ? " (the default data is made by scripts/setup.sh)" : "");
    if (fseek(f, 0, SEEK_END) != 0) fl_die("data file %s: cannot seek", path);
    long size = ftell(f);
    if (size < 0) fl_die("data file %s: cannot tell its size", path);
    if (size == 0) fl_die("data file %s is empty", path);
    fseek(f, 0, SEEK_SET);
    text->n = (size_t)size;
    text->bytes = fl_alloc(FL_MEM_OTHER, text->n);
    if (fread(text->bytes, 1, text->n, f) != text->n) fl_die("cannot read data file %s", path);
    fclose(f);
    size_t bad = utf8_invalid_at(text->bytes, text->n);
    if (bad != text->n)
        fl_die("data file %s is not valid UTF-8: bad byte 0x%02x at offset %zu", path,
               text->bytes[bad], bad);
}

void fl_text_free(fl_text *text) {
    fl_free(text->bytes);
    text->bytes = NULL;
    text->n = 0;
}

static void window(const fl_text *text, size_t start, int *inputs, int *targets, int T) {
    for (int t = 0; t < T; t++) {
        inputs[t] = text->bytes[start + t];
        targets[t] = text->bytes[start + t + 1];
    }
}

void fl_text_random_batch(const fl_text *text, fl_rng *rng, int *inputs, int *targets, int B,
                          int T) {
    if (text->n < (size_t)T + 1)
        fl_die("the training text (%zu bytes) is shorter than one sequence of %d+1 tokens", text->n,
               T);
    size_t starts = text->n - (size_t)T; // valid start offsets
    for (int b = 0; b < B; b++)
        window(text, (size_t)fl_rng_below(rng, starts), inputs + (size_t)b * T,
               targets + (size_t)b * T, T);
}

void fl_text_eval_batch(const fl_text *text, int index, int count, int *inputs, int *targets, int B,
                        int T) {
    if (text->n < (size_t)T + 1)
        fl_die("the validation text (%zu bytes) is shorter than one sequence of %d+1 tokens",
               text->n, T);
    size_t windows = (size_t)B * count, span = text->n - (size_t)T - 1;
    for (int b = 0; b < B; b++) {
        size_t w = (size_t)index * B + b;
        size_t start = windows > 1 ? span * w / (windows - 1) : 0;
        window(text, start, inputs + (size_t)b * T, targets + (size_t)b * T, T);
    }
}

double fl_text_unigram_xent(const fl_text *train, const fl_text *eval) {
    double counts[256];
    for (int i = 0; i < 256; i++) counts[i] = 1.0;
    for (size_t i = 0; i < train->n; i++) counts[train->bytes[i]] += 1.0;
    double total = train->n + 256.0, nll = 0.0;
    for (size_t i = 0; i < eval->n; i++) nll -= log(counts[eval->bytes[i]] / total);
    return nll / (double)eval->n;
}
