// pretokenize.c: splitting text into the pieces that byte-level BPE merges
// apart, by one of two regexes, hand-written (no regex engine) with the
// leftmost-first, backtracking semantics of the engines the references use:
//   GPT-2 (encoder.py, Python `regex`):
//     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   LLaMA-3 (llama3-tokenizer-js, JavaScript with the u flag):
//     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//     ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// \s differs between the two engines: Python's is Unicode's White_Space,
// JavaScript's has U+FEFF and lacks U+0085. Each pattern takes its
// reference's (Hugging Face's Rust tokenizers would use Oniguruma's).
#include "bpe.h"

#include <utf8proc.h>

enum { LETTER, NUMBER, SPACE, OTHER };

// \s: White_Space (str.isspace() would also take U+001C..U+001F; U+200B is
// in neither); js: JavaScript's.
static int white_space(int32_t cp, int js) {
    return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0xa0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
           cp == 0x205f || cp == 0x3000 || cp == (js ? 0xfeff : 0x85);
}

static int cp_class(int32_t cp, int js) {
    if (white_space(cp, js)) return SPACE;
    utf8proc_category_t c = utf8proc_category(cp);
    if (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) return LETTER;
    if (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO) return NUMBER;
    return OTHER;
}

// The length of the character at s[i] (i < n) and its class. A byte that
// does not start a valid UTF-8 sequence is a character of its own, OTHER:
// what Python's 'surrogateescape' decoding makes of it (gpt2 only: hf
// tokenizers see valid UTF-8).
static inline size_t char_at(const uint8_t *s, size_t n, size_t i, int *cls, int js) {
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
    *cls = cp_class(cp, js);
    return len;
}

// The end of the run of class cls that goes on at s[j].
static size_t run_end(const uint8_t *s, size_t n, size_t j, int cls, int js) {
    int next;
    while (j < n) {
        size_t len = char_at(s, n, j, &next, js);
        if (next != cls) break;
        j += len;
    }
    return j;
}

static int crlf(uint8_t c) {
    return c == '\r' || c == '\n';
}

// GPT-2's pattern: the alternatives in order.
static size_t gpt2_end(const uint8_t *s, size_t n, size_t i) {
    if (s[i] == '\'' && i + 1 < n) {
        uint8_t c = s[i + 1], d = i + 2 < n ? s[i + 2] : 0;
        if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
        if ((c == 'r' && d == 'e') || (c == 'v' && d == 'e') || (c == 'l' && d == 'l'))
            return i + 3;
    }
    int cls, next;
    size_t j = i + char_at(s, n, i, &cls, 0);
    if (s[i] == ' ' && j < n) { // the optional space before a letter, number or other run
        size_t len = char_at(s, n, j, &next, 0);
        if (next != SPACE) {
            cls = next;
            j += len;
        }
    }
    if (cls != SPACE) return run_end(s, n, j, cls, 0);
    // \s+(?!\S): a run of spaces before a non-space leaves its last one to
    // the next piece (which then starts " word"); a single one is \s+.
    size_t last = i;
    while (j < n) {
        size_t len = char_at(s, n, j, &next, 0);
        if (next != SPACE) return last > i ? last : j;
        last = j;
        j += len;
    }
    return n;
}

// LLaMA-3's pattern, with JavaScript's \s.
static size_t llama3_end(const uint8_t *s, size_t n, size_t i) {
    if (s[i] == '\'' && i + 1 < n) { // contractions, either case
        uint8_t c = s[i + 1] | 0x20, d = i + 2 < n ? s[i + 2] | 0x20 : 0;
        if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
        if ((c == 'r' && d == 'e') || (c == 'v' && d == 'e') || (c == 'l' && d == 'l'))
            return i + 3;
    }
    int cls, next = -1;
    size_t j = i + char_at(s, n, i, &cls, 1), len = 0;
    if (j < n) len = char_at(s, n, j, &next, 1);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (cls == LETTER) return run_end(s, n, j, LETTER, 1);
    if (cls != NUMBER && !crlf(s[i]) && next == LETTER) return run_end(s, n, j + len, LETTER, 1);
    // \p{N}{1,3}
    if (cls == NUMBER) {
        for (int k = 1; k < 3 && next == NUMBER; k++) {
            j += len;
            if (j < n)
                len = char_at(s, n, j, &next, 1);
            else
                next = -1;
        }
        return j;
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    if (cls == OTHER || (s[i] == ' ' && next == OTHER)) {
        j = run_end(s, n, cls == OTHER ? j : j + len, OTHER, 1);
        while (j < n && crlf(s[j])) j++;
        return j;
    }
    // \s*[\r\n]+ ends after the run's last line break; else \s+(?!\S) leaves
    // a run's last character to the next piece; else \s+ (one character)
    size_t after_break = crlf(s[i]) ? j : 0, last = i;
    while (j < n) {
        size_t l = char_at(s, n, j, &next, 1);
        if (next != SPACE) break;
        if (crlf(s[j])) after_break = j + 1;
        last = j;
        j += l;
    }
    if (after_break) return after_break;
    return j == n || last == i ? j : last;
}

size_t fl_pretok_end(int pattern, const uint8_t *s, size_t n, size_t i) {
    return pattern == FL_PRE_GPT2     ? gpt2_end(s, n, i)
           : pattern == FL_PRE_LLAMA3 ? llama3_end(s, n, i)
                                      : n;
}
