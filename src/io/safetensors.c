// safetensors.c: reading and writing the safetensors format.
//
// The validation follows the reference implementation (huggingface/
// safetensors): the header must be a JSON object starting with '{' and at
// most FL_ST_MAX_HEADER bytes, and the tensors' byte ranges, sorted, must
// tile the data section from 0 to its end with no overlap and no hole.
#include "fitlm/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cJSON.h>

#include "fitlm/io.h"

static const struct {
    const char *name;
    fl_dtype dt;
} st_dtypes[] = {{"F32", FL_F32}, {"F16", FL_F16}, {"BF16", FL_BF16}};

static const char *st_dtype_name(fl_dtype dt) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (st_dtypes[i].dt == dt) return st_dtypes[i].name;
    return "?";
}

// A JSON number that is an exact non-negative integer (doubles hold
// integers exactly up to 2^53, far beyond any real tensor).
static int json_uint(const cJSON *item, uint64_t *out) {
    if (!cJSON_IsNumber(item)) return 0;
    double d = item->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

static int parse_tensor(const cJSON *item, fl_st_tensor *t, size_t data_size, char *err,
                        size_t errlen) {
    const char *name = item->string;
    if (!cJSON_IsObject(item)) return fl_errorf(err, errlen, "entry '%s' is not an object", name);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsString(dtype) || !cJSON_IsArray(shape) || !cJSON_IsArray(offsets))
        return fl_errorf(err, errlen, "tensor '%s' lacks dtype, shape or data_offsets", name);
    size_t k = 0, nk = sizeof st_dtypes / sizeof st_dtypes[0];
    while (k < nk && strcmp(st_dtypes[k].name, dtype->valuestring) != 0) k++;
    if (k == nk)
        return fl_errorf(err, errlen,
                         "tensor '%s' has dtype '%.32s'; only F32, F16 and BF16 are read", name,
                         dtype->valuestring);
    t->dtype = st_dtypes[k].dt;
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > FL_ST_MAX_DIMS)
        return fl_errorf(err, errlen, "tensor '%s' has %d dimensions (at most %d)", name, ndim,
                         FL_ST_MAX_DIMS);
    t->ndim = 0;
    t->numel = 1;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape) {
        uint64_t v;
        if (!json_uint(d, &v))
            return fl_errorf(err, errlen,
                             "tensor '%s': shape entries must be non-negative integers", name);
        if (v && t->numel > SIZE_MAX / v)
            return fl_errorf(err, errlen, "tensor '%s': the shape's element count overflows", name);
        t->shape[t->ndim++] = v;
        t->numel *= (size_t)v;
    }
    uint64_t begin, end;
    if (cJSON_GetArraySize(offsets) != 2 || !json_uint(offsets->child, &begin) ||
        !json_uint(offsets->child->next, &end) || begin > end)
        return fl_errorf(err, errlen, "tensor '%s': data_offsets must be two integers begin <= end",
                         name);
    if (end > data_size)
        return fl_errorf(
            err, errlen,
            "tensor '%s': data_offsets [%llu, %llu] run past the data section (%zu bytes)", name,
            (unsigned long long)begin, (unsigned long long)end, data_size);
    size_t esize = fl_dtype_size(t->dtype);
    if (t->numel > SIZE_MAX / esize || t->numel * esize != end - begin)
        return fl_errorf(
            err, errlen,
            "tensor '%s': %llu bytes in data_offsets, but its shape and dtype take %zu", name,
            (unsigned long long)(end - begin), t->numel * esize);
    t->begin = (size_t)begin;
    t->end = (size_t)end;
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const fl_st_tensor *const *)a)->name, (*(const fl_st_tensor *const *)b)->name);
}

static int by_range(const void *a, const void *b) {
    const fl_st_tensor *x = *(const fl_st_tensor *const *)a, *y = *(const fl_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

// Unique names, and ranges that tile [0, data_size) exactly.
static int check_layout(const fl_safetensors *st, char *err, size_t errlen) {
    if (st->count == 0)
        return st->data_size
                   ? fl_errorf(err, errlen, "%zu data bytes but no tensors", st->data_size)
                   : 0;
    const fl_st_tensor **order = fl_alloc(FL_MEM_OTHER, (size_t)st->count * sizeof *order);
    for (int i = 0; i < st->count; i++) order[i] = &st->tensors[i];
    int rc = 0;
    qsort(order, (size_t)st->count, sizeof *order, by_name);
    for (int i = 1; i < st->count && !rc; i++)
        if (strcmp(order[i - 1]->name, order[i]->name) == 0)
            rc = fl_errorf(err, errlen, "tensor '%s' appears twice", order[i]->name);
    qsort(order, (size_t)st->count, sizeof *order, by_range);
    size_t expected = 0;
    for (int i = 0; i < st->count && !rc; i++) {
        if (order[i]->begin < expected)
            rc = fl_errorf(err, errlen, "tensors '%s' and '%s' overlap", order[i - 1]->name,
                           order[i]->name);
        else if (order[i]->begin > expected)
            rc = fl_errorf(err, errlen, "%zu unused bytes before tensor '%s'",
                           order[i]->begin - expected, order[i]->name);
        expected = order[i]->end;
    }
    if (!rc && expected != st->data_size)
        rc = fl_errorf(err, errlen, "%zu unused bytes after the last tensor",
                       st->data_size - expected);
    fl_free(order);
    return rc;
}

static int parse_header(const cJSON *root, fl_safetensors *out, char *err, size_t errlen) {
    if (!cJSON_IsObject(root)) return fl_errorf(err, errlen, "the header is not a JSON object");
    int count = 0;
    size_t name_bytes = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, root) {
        if (strcmp(item->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(item))
                return fl_errorf(err, errlen, "__metadata__ is not an object");
            const cJSON *kv;
            cJSON_ArrayForEach(kv, item) {
                if (!cJSON_IsString(kv))
                    return fl_errorf(err, errlen, "__metadata__ value '%s' is not a string",
                                     kv->string);
            }
            continue;
        }
        count++;
        name_bytes += strlen(item->string) + 1;
    }
    out->tensors = fl_alloc(FL_MEM_OTHER, (size_t)count * sizeof(fl_st_tensor));
    out->names = fl_alloc(FL_MEM_OTHER, name_bytes);
    char *names = out->names;
    cJSON_ArrayForEach(item, root) {
        if (strcmp(item->string, "__metadata__") == 0) continue;
        fl_st_tensor *t = &out->tensors[out->count];
        size_t len = strlen(item->string) + 1;
        memcpy(names, item->string, len);
        t->name = names;
        names += len;
        if (parse_tensor(item, t, out->data_size, err, errlen) != 0) return -1;
        out->count++;
    }
    return check_layout(out, err, errlen);
}

int fl_safetensors_parse(const uint8_t *buf, size_t n, fl_safetensors *out, char *err,
                         size_t errlen) {
    memset(out, 0, sizeof *out);
    if (n < 8) return fl_errorf(err, errlen, "%zu bytes: too short for the header length", n);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)buf[i] << (8 * i);
    if (hlen > FL_ST_MAX_HEADER)
        return fl_errorf(err, errlen, "header length %llu exceeds the limit of %d bytes",
                         (unsigned long long)hlen, FL_ST_MAX_HEADER);
    if (hlen > n - 8)
        return fl_errorf(err, errlen,
                         "header length %llu runs past the end of the file (%zu bytes)",
                         (unsigned long long)hlen, n);
    const char *header = (const char *)buf + 8;
    if (hlen < 2 || header[0] != '{')
        return fl_errorf(err, errlen, "the header does not start with '{' (header length %llu)",
                         (unsigned long long)hlen);
    out->data = buf + 8 + hlen;
    out->data_size = n - 8 - (size_t)hlen;
    const char *why;
    size_t at;
    cJSON *root = fl_json_parse(header, (size_t)hlen, &why, &at);
    if (!root)
        return fl_errorf(err, errlen, "the header is not valid JSON: %s at byte %zu of %llu", why,
                         at, (unsigned long long)hlen);
    if (fl_json_nul_error(header, (size_t)hlen, err, errlen)) {
        cJSON_Delete(root);
        return -1; // a tensor name cut short
    }
    int rc = parse_header(root, out, err, errlen);
    cJSON_Delete(root);
    return rc;
}

void fl_safetensors_open(fl_safetensors *st, const char *path) {
    int fd = fl_open_regular(path, "safetensors file");
    struct stat s;
    if (fstat(fd, &s) != 0) fl_die("cannot stat safetensors file %s: %s", path, strerror(errno));
    size_t size = (size_t)s.st_size;
    void *map = NULL;
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) fl_die("cannot map %s: %s", path, strerror(errno));
    }
    close(fd);
    char err[512];
    if (fl_safetensors_parse(map, size, st, err, sizeof err) != 0)
        fl_die("safetensors file %s: %s", path, err);
    st->map = map;
    st->map_size = size;
}

const fl_st_tensor *fl_safetensors_find(const fl_safetensors *st, const char *name) {
    for (int i = 0; i < st->count; i++)
        if (strcmp(st->tensors[i].name, name) == 0) return &st->tensors[i];
    return NULL;
}

void fl_safetensors_free(fl_safetensors *st) {
    fl_free(st->tensors);
    fl_free(st->names);
    if (st->map) munmap(st->map, st->map_size);
    memset(st, 0, sizeof *st);
}

void fl_safetensors_write(const char *path, const fl_st_tensor *tensors, int n, fl_st_fill fill,
                          void *ctx) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(cJSON_AddObjectToObject(root, "__metadata__"), "format", "pt");
    size_t offset = 0, largest = 0;
    for (int i = 0; i < n; i++) {
        const fl_st_tensor *t = &tensors[i];
        size_t bytes = t->numel * fl_dtype_size(t->dtype);
        cJSON *o = cJSON_AddObjectToObject(root, t->name);
        cJSON_AddStringToObject(o, "dtype", st_dtype_name(t->dtype));
        cJSON *shape = cJSON_AddArrayToObject(o, "shape");
        for (int d = 0; d < t->ndim; d++)
            cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->shape[d]));
        cJSON *offs = cJSON_AddArrayToObject(o, "data_offsets");
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)offset));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(offset + bytes)));
        offset += bytes;
        if (bytes > largest) largest = bytes;
    }
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!json) fl_die("out of memory writing %s", path);
    // Pad with spaces so the data section starts 8-byte aligned, as HF does.
    size_t len = strlen(json), padded = (len + 7) / 8 * 8;
    uint8_t *head = fl_alloc(FL_MEM_OTHER, 8 + padded);
    for (int i = 0; i < 8; i++) head[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(head + 8, json, len);
    memset(head + 8 + len, ' ', padded - len);
    cJSON_free(json);

    fl_file w;
    fl_file_begin(&w, path);
    fl_file_write(&w, head, 8 + padded);
    fl_free(head);
    void *buf = fl_alloc(FL_MEM_WORKSPACE, largest ? largest : 1);
    for (int i = 0; i < n; i++) {
        fill(ctx, i, buf);
        fl_file_write(&w, buf, tensors[i].numel * fl_dtype_size(tensors[i].dtype));
    }
    fl_free(buf);
    fl_file_commit(&w);
}
