// agree.c: what fl_comm_agree (comm.h) compares, without MPI: the digest of
// a canonical text and, when two differ, their first differing key in words.
#include <stdio.h>
#include <string.h>

#include "fitlm/comm.h"

// FNV-1a, 64 bits: a mismatch between two texts of settings goes unseen
// with probability 2^-64.
uint64_t fl_agree_hash(const char *text) {
    uint64_t h = 14695981039346656037ull;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        h ^= *p;
        h *= 1099511628211ull;
    }
    return h;
}

// One "key=value" line of a canonical text: its key and value (lengths
// clipped for a message); *text moves past it. Returns 0 at the end.
typedef struct {
    const char *key, *value;
    int key_len, value_len;
} line;

static int next_line(const char **text, line *l) {
    const char *p = *text;
    if (!*p) return 0;
    size_t n = strcspn(p, "\n"), k = strcspn(p, "=\n");
    l->key = p;
    l->key_len = (int)k;
    l->value = k < n ? p + k + 1 : p + n;
    l->value_len = k < n ? (int)(n - k - 1) : 0;
    if (l->value_len > 200) l->value_len = 200; // a path's worth, in a message
    *text = p + n + (p[n] == '\n');
    return 1;
}

int fl_agree_describe(const char *a, int rank_a, const char *b, int rank_b, char *out,
                      size_t size) {
    line x, y;
    for (;;) {
        int more_a = next_line(&a, &x), more_b = next_line(&b, &y);
        if (!more_a && !more_b) {
            snprintf(out, size, "ranks %d and %d agree", rank_a, rank_b);
            return 0;
        }
        int same_key =
            more_a && more_b && x.key_len == y.key_len && !memcmp(x.key, y.key, (size_t)x.key_len);
        if (same_key && x.value_len == y.value_len &&
            !memcmp(x.value, y.value, (size_t)x.value_len))
            continue;
        if (same_key)
            snprintf(out, size,
                     "ranks %d and %d differ at key %.*s: %.*s (rank %d) vs %.*s (rank %d)", rank_a,
                     rank_b, x.key_len, x.key, x.value_len, x.value, rank_a, y.value_len, y.value,
                     rank_b);
        else if (!more_b)
            snprintf(out, size,
                     "ranks %d and %d differ at key %.*s: rank %d has it (%.*s), rank %d not",
                     rank_a, rank_b, x.key_len, x.key, rank_a, x.value_len, x.value, rank_b);
        else if (!more_a)
            snprintf(out, size,
                     "ranks %d and %d differ at key %.*s: rank %d has it (%.*s), rank %d not",
                     rank_a, rank_b, y.key_len, y.key, rank_b, y.value_len, y.value, rank_a);
        else
            snprintf(
                out, size,
                "ranks %d and %d differ at key %.*s: rank %d has %.*s = %.*s where rank %d has "
                "%.*s = %.*s",
                rank_a, rank_b, x.key_len, x.key, rank_a, x.key_len, x.key, x.value_len, x.value,
                rank_b, y.key_len, y.key, y.value_len, y.value);
        return 1;
    }
}
