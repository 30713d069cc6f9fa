// ckpt.c: checkpoint files (layout in io.h). What goes into a checkpoint is
// the caller's business (src/io/train_state.c for training); this file makes
// it durable, findable and verifiable.
#include "fitlm/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cJSON.h>

#define CKPT_MAGIC       "FITLMCKP"
#define CKPT_VERSION     2
#define CKPT_PREFIX      28
#define CKPT_MAX_HEADER  (64u << 20)
#define CKPT_MAX_TENSORS 4096
#define CKPT_NAME_MAX    64

static const char *dtype_name(fl_dtype dt) {
    return dt == FL_F32 ? "F32" : dt == FL_BF16 ? "BF16" : "F16";
}
static int dtype_from_name(const char *s, fl_dtype *dt) {
    if (!strcmp(s, "F32"))
        *dt = FL_F32;
    else if (!strcmp(s, "BF16"))
        *dt = FL_BF16;
    else if (!strcmp(s, "F16"))
        *dt = FL_F16;
    else
        return -1;
    return 0;
}

// ----------------------------------------------------------------------------
// writing

static void ckpt_name(char *out, size_t size, int step) {
    snprintf(out, size, "ckpt_%08d.fitlm", step);
}

static int is_ckpt_name(const char *name, int *step) {
    int n = 0;
    return sscanf(name, "ckpt_%8d.fitlm%n", step, &n) == 1 && n == (int)strlen(name) &&
           strlen(name) == 19;
}

typedef struct {
    char name[32];
    struct timespec mtime;
} ckpt_file;

static int older_first(const void *a, const void *b) {
    const struct timespec *x = &((const ckpt_file *)a)->mtime, *y = &((const ckpt_file *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? -1 : 1;
    return (x->tv_nsec > y->tv_nsec) - (x->tv_nsec < y->tv_nsec);
}

// A killed writer's temporary file: NAME.tmp or NAME.tmp.<pid>, of a
// checkpoint, of `latest` or of the log.
static int is_tmp_name(const char *name) {
    const char *t = strstr(name, ".tmp");
    if (!t || (t[4] && t[4] != '.')) return 0;
    return !strncmp(name, "ckpt_", 5) || !strncmp(name, "latest.", 7) ||
           !strncmp(name, "log.txt.", 8);
}

void fl_ckpt_clean_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char path[FL_FILE_PATH_MAX];
    for (struct dirent *e; (e = readdir(d));)
        if (is_tmp_name(e->d_name) &&
            (size_t)snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < sizeof path)
            unlink(path);
    closedir(d);
}

struct parsed_;
static int parse_header(const uint8_t *header, struct parsed_ *p, char *err, size_t errlen);
static int parse_prefix(const uint8_t *prefix, uint64_t file_size, struct parsed_ *p, char *err,
                        size_t errlen);
static void parsed_free(struct parsed_ *p);

// The run id in a checkpoint file's header ("" when it has none); -1 when
// the file cannot be read or parsed: such a file is never pruned.
static int run_of(const char *path, char *out, size_t size);

// Deletes every checkpoint but the `keep` most recently written, and any
// temporary file a killed writer left behind. With a run id, only the
// checkpoints of that run are candidates: a run never deletes another's.
// Without one, all are (so those of an earlier run go first, whatever
// their step). Runs only after `latest` points at the newest.
static void prune(const char *dir, int keep, int newest, const char *run) {
    DIR *d = opendir(dir);
    if (!d) return;
    ckpt_file files[1024] = {{"", {0, 0}}};
    int n = 0;
    struct dirent *e;
    char path[FL_FILE_PATH_MAX], id[64];
    while ((e = readdir(d))) {
        int step;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (is_tmp_name(e->d_name)) {
            unlink(path);
        } else if (is_ckpt_name(e->d_name, &step) && step != newest && n < 1024 &&
                   stat(path, &st) == 0 && keep > 0 &&
                   (!run || (run_of(path, id, sizeof id) == 0 && !strcmp(id, run)))) {
            snprintf(files[n].name, sizeof files[n].name, "%s", e->d_name);
            files[n++].mtime = st.st_mtim;
        }
    }
    closedir(d);
    if (keep <= 0) return;
    qsort(files, (size_t)n, sizeof files[0], older_first);
    for (int i = 0; i < n - (keep - 1); i++)
        if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, files[i].name) < sizeof path)
            unlink(path);
}

void fl_ckpt_write(const char *dir, int step, const char *meta_json, const fl_ckpt_tensor *tensors,
                   int n_tensors, int keep) {
    fl_ckpt_write_run(dir, step, meta_json, tensors, n_tensors, keep, NULL);
}

void fl_ckpt_write_run(const char *dir, int step, const char *meta_json,
                       const fl_ckpt_tensor *tensors, int n_tensors, int keep, const char *run) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        fl_die("cannot create checkpoint directory %s: %s", dir, strerror(errno));
    cJSON *meta = cJSON_Parse(meta_json);
    FL_ASSERT(meta && cJSON_IsObject(meta));
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "meta", meta);
    cJSON_AddNumberToObject(root, "step", step);
    if (run) cJSON_AddStringToObject(root, "run", run);
    cJSON *list = cJSON_AddArrayToObject(root, "tensors");
    uint64_t offset = 0;
    for (int i = 0; i < n_tensors; i++) {
        const fl_ckpt_tensor *t = &tensors[i];
        size_t bytes = t->numel * fl_dtype_size(t->dtype);
        cJSON *item = cJSON_CreateObject();
        cJSON_AddStringToObject(item, "name", t->name);
        cJSON_AddStringToObject(item, "dtype", dtype_name(t->dtype));
        cJSON *shape = cJSON_AddArrayToObject(item, "shape");
        cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->numel));
        cJSON_AddNumberToObject(item, "offset", (double)offset);
        char crc[16];
        snprintf(crc, sizeof crc, "%08x", fl_crc32(0, t->data, bytes));
        cJSON_AddStringToObject(item, "crc32", crc);
        cJSON_AddItemToArray(list, item);
        offset += bytes;
    }
    char *header = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    FL_ASSERT(header);

    uint8_t prefix[CKPT_PREFIX];
    memcpy(prefix, CKPT_MAGIC, 8);
    fl_put_u32(prefix + 8, CKPT_VERSION);
    fl_put_u32(prefix + 12, (uint32_t)strlen(header));
    fl_put_u64(prefix + 16, offset);
    fl_put_u32(prefix + 24, fl_crc32(fl_crc32(0, prefix, 24), header, strlen(header)));

    char name[32], path[FL_FILE_PATH_MAX];
    ckpt_name(name, sizeof name, step);
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        fl_die("checkpoint directory name is too long: %s", dir);
    fl_file f;
    fl_file_begin(&f, path);
    fl_file_write(&f, prefix, sizeof prefix);
    fl_file_write(&f, header, strlen(header));
    cJSON_free(header);
    for (int i = 0; i < n_tensors; i++)
        fl_file_write(&f, tensors[i].data, tensors[i].numel * fl_dtype_size(tensors[i].dtype));
    fl_file_commit(&f);

    // Only now does `latest` move: it always names a complete checkpoint.
    snprintf(path, sizeof path, "%s/latest", dir);
    fl_file_begin(&f, path);
    fl_file_write(&f, name, strlen(name));
    fl_file_write(&f, "\n", 1);
    fl_file_commit(&f);
    prune(dir, keep, step, run);
}

// ----------------------------------------------------------------------------
// parsing: everything is checked before anything is trusted

typedef struct {
    char name[CKPT_NAME_MAX];
    fl_dtype dtype;
    uint64_t numel, offset, bytes;
    uint32_t crc;
} tensor_entry;

typedef struct parsed_ {
    uint32_t header_len;
    uint64_t data_len;
    int step;
    char run[64]; // the writing run's id, "" when absent
    cJSON *root;  // owns meta
    char *meta_json;
    tensor_entry *tensors;
    int n_tensors;
} parsed;

static void parsed_free(parsed *p) {
    cJSON_Delete(p->root);
    cJSON_free(p->meta_json);
    fl_free(p->tensors);
    memset(p, 0, sizeof *p);
}

// The prefix (CKPT_PREFIX bytes) against the file size.
static int parse_prefix(const uint8_t *prefix, uint64_t file_size, parsed *p, char *err,
                        size_t errlen) {
    if (file_size < CKPT_PREFIX)
        return fl_errorf(err, errlen, "truncated: %llu bytes, shorter than the %d-byte prefix",
                         (unsigned long long)file_size, CKPT_PREFIX);
    if (memcmp(prefix, CKPT_MAGIC, 8) != 0)
        return fl_errorf(err, errlen, "not a fitlm checkpoint (bad magic)");
    uint32_t version = fl_get_u32(prefix + 8);
    if (version != CKPT_VERSION)
        return fl_errorf(err, errlen, "format version %u; this fitlm reads version %d", version,
                         CKPT_VERSION);
    p->header_len = fl_get_u32(prefix + 12);
    p->data_len = fl_get_u64(prefix + 16);
    if (p->header_len == 0 || p->header_len > CKPT_MAX_HEADER)
        return fl_errorf(err, errlen, "header length %u is out of range", p->header_len);
    if (p->data_len > file_size || CKPT_PREFIX + (uint64_t)p->header_len + p->data_len != file_size)
        return fl_errorf(
            err, errlen,
            "truncated or corrupt: the prefix says %u header + %llu data bytes, the file "
            "has %llu",
            p->header_len, (unsigned long long)p->data_len, (unsigned long long)file_size);
    return 0;
}

static int json_u64(const cJSON *item, uint64_t max, uint64_t *out) {
    if (!cJSON_IsNumber(item) || !(item->valuedouble >= 0) || item->valuedouble > (double)max ||
        item->valuedouble != (double)(uint64_t)item->valuedouble)
        return -1;
    *out = (uint64_t)item->valuedouble;
    return 0;
}

// The header JSON (after its CRC was checked) against data_len.
static int parse_header(const uint8_t *header, parsed *p, char *err, size_t errlen) {
    p->root = cJSON_ParseWithLength((const char *)header, p->header_len);
    if (!p->root || !cJSON_IsObject(p->root))
        return fl_errorf(err, errlen, "the header is not a JSON object");
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(p->root, "meta");
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(p->root, "step");
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(p->root, "tensors");
    uint64_t s;
    if (!cJSON_IsObject(meta) || !cJSON_IsArray(list) || json_u64(step, 1u << 30, &s) != 0)
        return fl_errorf(err, errlen, "the header lacks meta, step or tensors");
    p->step = (int)s;
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(p->root, "run");
    if (cJSON_IsString(run) && strlen(run->valuestring) < sizeof p->run)
        strcpy(p->run, run->valuestring);
    p->meta_json = cJSON_PrintUnformatted(meta);
    int n = cJSON_GetArraySize(list);
    if (n > CKPT_MAX_TENSORS) return fl_errorf(err, errlen, "%d tensors is too many", n);
    p->tensors = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(tensor_entry));
    uint64_t expect_offset = 0;
    for (const cJSON *item = list->child; item; item = item->next) {
        tensor_entry *t = &p->tensors[p->n_tensors];
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(item, "name");
        const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(item, "dtype");
        const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
        const cJSON *offset = cJSON_GetObjectItemCaseSensitive(item, "offset");
        const cJSON *crc = cJSON_GetObjectItemCaseSensitive(item, "crc32");
        if (!cJSON_IsString(name) || strlen(name->valuestring) >= CKPT_NAME_MAX ||
            !cJSON_IsString(dtype) || dtype_from_name(dtype->valuestring, &t->dtype) != 0 ||
            !cJSON_IsArray(shape) || cJSON_GetArraySize(shape) != 1 ||
            json_u64(shape->child, 1ull << 50, &t->numel) != 0 ||
            json_u64(offset, 1ull << 62, &t->offset) != 0 || !cJSON_IsString(crc) ||
            strlen(crc->valuestring) != 8 || strspn(crc->valuestring, "0123456789abcdef") != 8)
            return fl_errorf(err, errlen, "tensor entry %d is malformed", p->n_tensors);
        strcpy(t->name, name->valuestring);
        t->crc = (uint32_t)strtoul(crc->valuestring, NULL, 16);
        t->bytes = t->numel * fl_dtype_size(t->dtype);
        // back to back, in order: no gaps, no overlaps, nothing past the end
        if (t->offset != expect_offset || t->bytes > p->data_len - t->offset)
            return fl_errorf(err, errlen,
                             "tensor '%s' spans bytes %llu..%llu, outside the data or "
                             "not where the previous one ended",
                             t->name, (unsigned long long)t->offset,
                             (unsigned long long)(t->offset + t->bytes));
        for (int k = 0; k < p->n_tensors; k++)
            if (!strcmp(p->tensors[k].name, t->name))
                return fl_errorf(err, errlen, "tensor '%s' appears twice", t->name);
        expect_offset += t->bytes;
        p->n_tensors++;
    }
    if (expect_offset != p->data_len)
        return fl_errorf(err, errlen, "the tensors cover %llu of %llu data bytes",
                         (unsigned long long)expect_offset, (unsigned long long)p->data_len);
    return 0;
}

static int parse_image(const uint8_t *file, size_t size, parsed *p, char *err, size_t errlen) {
    memset(p, 0, sizeof *p);
    if (parse_prefix(file, size, p, err, errlen) != 0) return -1;
    const uint8_t *header = file + CKPT_PREFIX;
    if (fl_crc32(fl_crc32(0, file, 24), header, p->header_len) != fl_get_u32(file + 24))
        return fl_errorf(err, errlen, "the header is corrupt (CRC-32 mismatch)");
    return parse_header(header, p, err, errlen);
}

static int run_of(const char *path, char *out, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    parsed p;
    memset(&p, 0, sizeof p);
    struct stat st;
    uint8_t prefix[CKPT_PREFIX];
    char err[256];
    int rc = -1;
    if (fstat(fd, &st) == 0 && pread(fd, prefix, CKPT_PREFIX, 0) == CKPT_PREFIX &&
        parse_prefix(prefix, (uint64_t)st.st_size, &p, err, sizeof err) == 0) {
        uint8_t *header = fl_alloc(FL_MEM_OTHER, p.header_len);
        if (pread(fd, header, p.header_len, CKPT_PREFIX) == (ssize_t)p.header_len &&
            fl_crc32(fl_crc32(0, prefix, 24), header, p.header_len) == fl_get_u32(prefix + 24) &&
            parse_header(header, &p, err, sizeof err) == 0) {
            snprintf(out, size, "%s", p.run);
            rc = 0;
        }
        fl_free(header);
    }
    parsed_free(&p);
    close(fd);
    return rc;
}

int fl_ckpt_parse(const uint8_t *file, size_t size, char *err, size_t errlen) {
    parsed p;
    int rc = parse_image(file, size, &p, err, errlen);
    if (rc == 0) { // the tensors' own checksums, as fl_ckpt_read checks them
        const uint8_t *data = file + CKPT_PREFIX + p.header_len;
        for (int i = 0; i < p.n_tensors && rc == 0; i++)
            if (fl_crc32(0, data + p.tensors[i].offset, p.tensors[i].bytes) != p.tensors[i].crc)
                rc = fl_errorf(err, errlen, "tensor '%s' is corrupt (CRC-32 mismatch)",
                               p.tensors[i].name);
    }
    parsed_free(&p);
    return rc;
}

// ----------------------------------------------------------------------------
// reading

struct fl_ckpt {
    char path[FL_FILE_PATH_MAX];
    int fd;
    parsed p;
};

// DIR -> DIR/<name in DIR/latest>; a file stays as it is.
static void resolve(const char *path, char *out, size_t size) {
    struct stat st;
    if (stat(path, &st) != 0) fl_die("cannot open checkpoint %s: %s", path, strerror(errno));
    if (!S_ISDIR(st.st_mode)) {
        snprintf(out, size, "%s", path);
        return;
    }
    char latest[FL_FILE_PATH_MAX];
    snprintf(latest, sizeof latest, "%s/latest", path);
    struct stat lst; // a FIFO would block fopen
    if (stat(latest, &lst) == 0 && !S_ISREG(lst.st_mode))
        fl_die("%s holds no checkpoint: %s is not a regular file", path, latest);
    FILE *f = fopen(latest, "rb");
    if (!f) fl_die("%s holds no checkpoint: cannot open %s: %s", path, latest, strerror(errno));
    char name[64] = {0};
    size_t n = fread(name, 1, sizeof name - 1, f);
    fclose(f);
    while (n && (name[n - 1] == '\n' || name[n - 1] == '\r')) name[--n] = 0;
    int step;
    if (!is_ckpt_name(name, &step))
        fl_die("%s does not name a checkpoint file (it says '%s')", latest, name);
    if ((size_t)snprintf(out, size, "%s/%s", path, name) >= size)
        fl_die("checkpoint path too long: %s", path);
}

fl_ckpt *fl_ckpt_open(const char *path) {
    fl_ckpt *ck = fl_alloc(FL_MEM_OTHER, sizeof *ck);
    resolve(path, ck->path, sizeof ck->path);
    ck->fd = fl_open_regular(ck->path, "checkpoint"); // a FIFO or device: refused, never read
    struct stat st;
    if (fstat(ck->fd, &st) != 0) fl_die("cannot stat checkpoint %s", ck->path);
    uint8_t prefix[CKPT_PREFIX] = {0};
    char err[256];
    ssize_t r = pread(ck->fd, prefix, CKPT_PREFIX, 0);
    if (r < 0) fl_die("cannot read checkpoint %s: %s", ck->path, strerror(errno));
    size_t got = (size_t)r;
    if (parse_prefix(prefix, got < CKPT_PREFIX ? got : (uint64_t)st.st_size, &ck->p, err,
                     sizeof err) != 0)
        fl_die("checkpoint %s: %s", ck->path, err);
    uint8_t *image = fl_alloc(FL_MEM_OTHER, CKPT_PREFIX + (size_t)ck->p.header_len);
    memcpy(image, prefix, CKPT_PREFIX);
    if (pread(ck->fd, image + CKPT_PREFIX, ck->p.header_len, CKPT_PREFIX) !=
        (ssize_t)ck->p.header_len)
        fl_die("cannot read checkpoint %s", ck->path);
    uint64_t data_len = ck->p.data_len;
    if (fl_crc32(fl_crc32(0, image, 24), image + CKPT_PREFIX, ck->p.header_len) !=
        fl_get_u32(image + 24))
        fl_die("checkpoint %s: the header is corrupt (CRC-32 mismatch)", ck->path);
    if (parse_header(image + CKPT_PREFIX, &ck->p, err, sizeof err) != 0)
        fl_die("checkpoint %s: %s", ck->path, err);
    FL_ASSERT(ck->p.data_len == data_len);
    fl_free(image);
    return ck;
}

void fl_ckpt_close(fl_ckpt *ck) {
    if (!ck) return;
    close(ck->fd);
    parsed_free(&ck->p);
    fl_free(ck);
}

const char *fl_ckpt_path(const fl_ckpt *ck) {
    return ck->path;
}
int fl_ckpt_step(const fl_ckpt *ck) {
    return ck->p.step;
}
const char *fl_ckpt_meta(const fl_ckpt *ck) {
    return ck->p.meta_json;
}
const char *fl_ckpt_run(const fl_ckpt *ck) {
    return ck->p.run;
}

static const tensor_entry *find(const fl_ckpt *ck, const char *name) {
    for (int i = 0; i < ck->p.n_tensors; i++)
        if (!strcmp(ck->p.tensors[i].name, name)) return &ck->p.tensors[i];
    return NULL;
}

int fl_ckpt_has(const fl_ckpt *ck, const char *name) {
    return find(ck, name) != NULL;
}

int fl_ckpt_tensor_count(const fl_ckpt *ck) {
    return ck->p.n_tensors;
}

const char *fl_ckpt_tensor_name(const fl_ckpt *ck, int i) {
    FL_ASSERT(i >= 0 && i < ck->p.n_tensors);
    return ck->p.tensors[i].name;
}

size_t fl_ckpt_numel(const fl_ckpt *ck, const char *name) {
    const tensor_entry *t = find(ck, name);
    return t ? (size_t)t->numel : 0;
}

void fl_ckpt_read(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t numel) {
    const tensor_entry *t = find(ck, name);
    if (!t) fl_die("checkpoint %s has no tensor '%s'", ck->path, name);
    if (t->numel != numel)
        fl_die("checkpoint %s: tensor '%s' has %llu elements, this model needs %zu", ck->path, name,
               (unsigned long long)t->numel, numel);
    fl_ckpt_read_range(ck, name, dt, dst, 0, numel);
}

void fl_ckpt_read_range(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t first,
                        size_t count) {
    const tensor_entry *t = find(ck, name);
    if (!t) fl_die("checkpoint %s has no tensor '%s'", ck->path, name);
    if (first > t->numel || count > t->numel - first)
        fl_die("checkpoint %s: elements [%zu, %zu) are outside tensor '%s' of %llu", ck->path,
               first, first + count, name, (unsigned long long)t->numel);
    // The whole tensor is read in blocks (its CRC-32 covers all of it). A
    // whole tensor of dt is read straight into dst; otherwise blocks pass
    // through a buffer and the range lands in dst, converted.
    size_t esize = fl_dtype_size(t->dtype), numel = t->numel;
    size_t block = numel < ((size_t)1 << 20) ? numel : (size_t)1 << 20;
    int direct = t->dtype == dt && first == 0 && count == numel;
    uint8_t *buf = direct || !numel ? NULL : fl_alloc(FL_MEM_WORKSPACE, block * esize);
    uint64_t base = CKPT_PREFIX + (uint64_t)ck->p.header_len + t->offset;
    uint32_t crc = 0;
    for (size_t i = 0; i < numel; i += block) {
        size_t n = numel - i < block ? numel - i : block;
        uint8_t *into = direct ? (uint8_t *)dst + i * esize : buf;
        size_t want = n * esize, got = 0;
        while (got < want) {
            ssize_t r = pread(ck->fd, into + got, want - got, (off_t)(base + i * esize + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0)
                fl_die("cannot read checkpoint %s: %s", ck->path,
                       r ? strerror(errno) : "end of file");
            got += (size_t)r;
        }
        crc = fl_crc32(crc, into, want);
        size_t lo = first > i ? first : i, hi = first + count < i + n ? first + count : i + n;
        if (!direct && lo < hi)
            fl_convert(dt, fl_at(dt, dst, lo - first), t->dtype, buf + (lo - i) * esize, hi - lo);
    }
    fl_free(buf);
    if (crc != t->crc)
        fl_die("checkpoint %s: tensor '%s' is corrupt (CRC-32 mismatch: stored %08x, computed "
               "%08x)",
               ck->path, name, t->crc, crc);
}
