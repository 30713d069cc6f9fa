// text.c: text files, the input of `fitlm tokenize`, checked to be UTF-8,
// and their documents.
#define _GNU_SOURCE // memmem
#include "fitlm/io.h"

#include <errno.h>
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
    text->bytes = fl_file_read_all(path, SIZE_MAX / 2, &text->n, "data file");
    if (text->n == 0) fl_die("data file %s is empty", path);
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

int fl_line_is_blank(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!s[i] || !strchr(" \t\r\f\v", s[i])) return 0;
    return 1;
}

// Blank-line documents: a line (its end: the "\n", or the text's end) that
// is not blank opens a document or extends the open one; a blank line
// closes it at the end of its last line, before that line's "\r\n" or "\n".
static size_t paragraphs(const uint8_t *t, size_t n,
                         void (*doc)(void *ctx, const uint8_t *bytes, size_t n), void *ctx) {
    size_t count = 0, start = 0, end = 0;
    int open = 0;
    for (size_t i = 0; i < n;) {
        const uint8_t *nl = memchr(t + i, '\n', n - i);
        size_t line_end = nl ? (size_t)(nl - t) : n;
        if (!fl_line_is_blank(t + i, line_end - i)) {
            if (!open) start = i;
            open = 1;
            end = line_end - (nl && line_end > i && t[line_end - 1] == '\r');
        } else if (open) {
            doc(ctx, t + start, end - start);
            count++;
            open = 0;
        }
        i = line_end + 1;
    }
    if (open) { // up to the end: a last line's break stays, as without blank lines
        doc(ctx, t + start, n - start);
        count++;
    }
    return count;
}

size_t fl_text_documents(const uint8_t *text, size_t n, const char *separator,
                         void (*doc)(void *ctx, const uint8_t *bytes, size_t n), void *ctx) {
    if (!separator) return paragraphs(text, n, doc, ctx);
    size_t count = 0, sep_len = strlen(separator);
    for (size_t start = 0; start < n;) {
        const uint8_t *hit = memmem(text + start, n - start, separator, sep_len);
        size_t end = hit ? (size_t)(hit - text) : n;
        if (end > start) {
            doc(ctx, text + start, end - start);
            count++;
        }
        start = end + (hit ? sep_len : 0);
    }
    return count;
}
