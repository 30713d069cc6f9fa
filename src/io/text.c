// text.c: text files, the input of `fitlm tokenize`, checked to be UTF-8.
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
