// json.c: the one strict parse of JSON read from outside (files, headers,
// lines of a log). cJSON stops after the first value and at a NUL byte; a
// reader that took its answer as the file's would accept "{...} junk",
// "{...}{...}" or a file cut at a NUL. Here the value must be the whole text.
#include <cjson/cJSON.h>
#include <string.h>

#include "fitlm/core.h"

int fl_text_line_of(const char *text, size_t off) {
    int line = 1;
    for (size_t i = 0; i < off; i++) line += text[i] == '\n';
    return line;
}

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

cJSON *fl_json_parse(const char *text, size_t n, const char **why, size_t *at) {
    const char *z = memchr(text, 0, n);
    if (z) {
        *why = "a NUL byte";
        *at = (size_t)(z - text);
        return NULL;
    }
    size_t i = 0;
    while (i < n && is_space(text[i])) i++;
    if (i == n) {
        *why = "no JSON value";
        *at = n;
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    if (!root) {
        *why = "invalid JSON";
        *at = end && end >= text && (size_t)(end - text) <= n ? (size_t)(end - text) : 0;
        return NULL;
    }
    for (i = (size_t)(end - text); i < n && is_space(text[i]);) i++;
    if (i < n) {
        cJSON_Delete(root);
        *why = "unexpected text after the top-level JSON value";
        *at = i;
        return NULL;
    }
    return root;
}

cJSON *fl_json_read(const char *text, size_t n, char *err, size_t errlen) {
    const char *why;
    size_t at;
    cJSON *root = fl_json_parse(text, n, &why, &at);
    if (!root) {
        fl_errorf(err, errlen, "not valid JSON: %s at line %d (byte %zu)", why,
                  fl_text_line_of(text, at), at);
        return NULL;
    }
    if (fl_json_nul_error(text, n, err, errlen)) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

cJSON *fl_json_load(const char *text, size_t n, const char *what) {
    const char *why;
    size_t at;
    cJSON *root = fl_json_parse(text, n, &why, &at);
    if (!root)
        fl_die("%s is not valid JSON: %s at line %d (byte %zu)", what, why,
               fl_text_line_of(text, at), at);
    fl_json_check_nul(text, n, what);
    return root;
}
