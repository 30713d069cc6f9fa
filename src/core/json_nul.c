// json_nul.c: finding a NUL in a JSON text. cJSON decodes "\u0000" into
// its NUL-terminated strings, so "ok\u0000SECRET" would read as "ok"; a raw
// NUL byte would cut a C string the same way. Readers refuse both, naming
// where, rather than keep a silently shortened string.
#include <string.h>

#include "fitlm/core.h"

// Whether the string that goes on at text[i] is an object's key.
static int is_key(const char *text, size_t n, size_t i) {
    while (i < n && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
    for (i++; i < n && strchr(" \t\r\n", text[i]) && text[i]; i++) continue;
    return i < n && text[i] == ':';
}

size_t fl_json_nul_at(const char *text, size_t n, char *key, size_t key_size) {
    size_t start = 0, end = 0; // the last string read
    int in_string = 0;
    if (key_size) key[0] = 0;
    for (size_t i = 0; i < n; i++) {
        char c = text[i];
        int nul = !c || (in_string && c == '\\' && i + 6 <= n && !memcmp(text + i + 1, "u0000", 5));
        if (nul) {
            if (in_string && key_size && is_key(text, n, i)) key[0] = 0;
            return i;
        }
        if (in_string && c == '\\') {
            i++; // the escaped character cannot end the string
        } else if (c == '"') {
            in_string = !in_string;
            if (in_string)
                start = i + 1;
            else
                end = i;
        } else if (!in_string && c == ':' && key_size) { // that string was a key
            size_t len = end - start < key_size - 1 ? end - start : key_size - 1;
            memcpy(key, text + start, len);
            key[len] = 0;
        }
    }
    return n;
}

int fl_json_nul_error(const char *text, size_t n, char *err, size_t errlen) {
    char key[64];
    size_t at = fl_json_nul_at(text, n, key, sizeof key);
    if (at == n) return 0;
    int line = 1;
    for (size_t i = 0; i < at; i++) line += text[i] == '\n';
    return fl_errorf(err, errlen,
                     "%s at line %d (byte %zu)%s%s%s is not allowed: it would cut the "
                     "text short",
                     text[at] ? "\\u0000 (a NUL character)" : "a NUL byte", line, at,
                     *key ? ", in the value of \"" : "", key, *key ? "\"," : "");
}

void fl_json_check_nul(const char *text, size_t n, const char *where) {
    char err[256];
    if (fl_json_nul_error(text, n, err, sizeof err)) fl_die("%s: %s", where, err);
}
