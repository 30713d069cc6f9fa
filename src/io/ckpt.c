// ckpt.c: checkpoint files (layout in io.h). What goes into a checkpoint is
// the caller's business (src/io/train_state.c for training); this file makes
// it durable, findable and verifiable.
//
// A sharded checkpoint is a manifest (a checkpoint file with no tensors and
// a "sharding" list of files) and one file per rank holding pieces of
// tensors (name, first element, count; a tensor-parallel slice: runs of
// elements a stride apart). A reader sees one set of whole tensors either
// way: a read gathers the pieces from whichever files hold them, so any
// number of ranks (or one process) can read any range or slice.
#include "fitlm/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <cJSON.h>

#include "fitlm/comm.h"

#define CKPT_MAGIC        "FITLMCKP"
#define CKPT_VERSION      3 // 3: "files"; version 2 (none) is read too
#define CKPT_VERSION_RUNS 4 // a file holding a strided piece ("run", "stride")
#define CKPT_PREFIX       28
#define CKPT_MAX_HEADER   (64u << 20)
#define CKPT_MAX_TENSORS  4096
#define CKPT_MAX_SHARDS   65536
#define CKPT_MAX_FILES    16
#define CKPT_NAME_MAX     64
#define SHARD_NAME_MAX    64

int fl_is_checkpoint_dir(const char *path) {
    char latest[FL_FILE_PATH_MAX];
    struct stat st;
    snprintf(latest, sizeof latest, "%s/latest", path);
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode) && access(latest, F_OK) == 0;
}

int fl_is_checkpoint(const char *path) {
    struct stat st;
    int fd = fl_try_open_regular(path, &st);
    if (fd < 0) return fl_is_checkpoint_dir(path);
    char magic[8];
    int found = pread(fd, magic, sizeof magic, 0) == (ssize_t)sizeof magic &&
                !memcmp(magic, CKPT_MAGIC, sizeof magic);
    close(fd);
    return found || fl_is_checkpoint_dir(path);
}

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
// file names: DIR/ckpt_<step>.fitlm (a checkpoint or a manifest) and
// DIR/ckpt_<step>.<tag>.rank<r>-of-<world>.fitlm (rank r's shard). The tag
// is new for every save, so a save never replaces a shard file that an
// existing manifest names: until the new manifest is renamed into place the
// old checkpoint of the same step stays whole.

static void ckpt_name(char *out, size_t size, int step) {
    snprintf(out, size, "ckpt_%08d.fitlm", step);
}

static int is_ckpt_name(const char *name, int *step) {
    int n = 0;
    return sscanf(name, "ckpt_%8d.fitlm%n", step, &n) == 1 && n == (int)strlen(name) &&
           strlen(name) == 19;
}

static void shard_name(char *out, size_t size, int step, const char *tag, int rank, int world) {
    snprintf(out, size, "ckpt_%08d.%s.rank%d-of-%d.fitlm", step, tag, rank, world);
}

static int is_shard_name(const char *name, int *step) {
    char tag[9], again[SHARD_NAME_MAX];
    int rank, world, n = 0;
    if (strlen(name) >= SHARD_NAME_MAX ||
        sscanf(name, "ckpt_%8d.%8[0-9a-f].rank%d-of-%d.fitlm%n", step, tag, &rank, &world, &n) !=
            4 ||
        n != (int)strlen(name) || strlen(tag) != 8 || rank < 0 || world < 1 || rank >= world)
        return 0;
    shard_name(again, sizeof again, *step, tag, rank, world); // canonical: no sign, no zeros
    return !strcmp(again, name);
}

// ----------------------------------------------------------------------------
// parsing: everything is checked before anything is trusted

typedef struct {
    char name[CKPT_NAME_MAX];
    fl_dtype dtype;
    uint64_t numel, offset, bytes;
    uint64_t first, total; // a piece: elements [first, first + numel) of a tensor of total
    uint64_t run, stride;  // 0: contiguous; else numel / run runs, run k at first + k * stride
    uint32_t crc;
} tensor_entry;

// A manifest's record of one shard file.
typedef struct {
    char file[SHARD_NAME_MAX];
    uint64_t bytes;
    uint32_t header_crc;
} shard_ref;

typedef struct parsed_ {
    uint32_t version, header_len;
    uint64_t data_len;
    int step;
    char run[64]; // the writing run's id, "" when absent
    cJSON *root;  // owns meta
    char *meta_json;
    tensor_entry *tensors;
    int n_tensors;
    // the files stored whole after the tensors (a tensor entry's fields;
    // dtype unused)
    tensor_entry *files;
    int n_files;
    // a manifest: its shard files, rank by rank (none otherwise)
    shard_ref *shards;
    int n_shards;
    // a shard file: rank of world, of manifest `shard_of` ("" otherwise)
    char shard_of[32];
    int shard_rank, shard_world;
} parsed;

static void parsed_free(parsed *p) {
    cJSON_Delete(p->root);
    cJSON_free(p->meta_json);
    fl_free(p->tensors);
    fl_free(p->files);
    fl_free(p->shards);
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
    if (version < 2 || version > CKPT_VERSION_RUNS)
        return fl_errorf(err, errlen, "format version %u; this fitlm reads versions 2 to %d",
                         version, CKPT_VERSION_RUNS);
    p->version = version;
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

static int json_crc(const cJSON *item, uint32_t *out) {
    if (!cJSON_IsString(item) || strlen(item->valuestring) != 8 ||
        strspn(item->valuestring, "0123456789abcdef") != 8)
        return -1;
    *out = (uint32_t)strtoul(item->valuestring, NULL, 16);
    return 0;
}

// A manifest's "sharding": {"world": W, "shards": [{"file", "bytes",
// "header_crc32"}, ...]}, one per rank.
static int parse_sharding(const cJSON *s, parsed *p, char *err, size_t errlen) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(s, "shards");
    uint64_t world;
    if (!cJSON_IsObject(s) ||
        json_u64(cJSON_GetObjectItemCaseSensitive(s, "world"), CKPT_MAX_SHARDS, &world) != 0 ||
        world < 1 || !cJSON_IsArray(list) || cJSON_GetArraySize(list) != (int)world)
        return fl_errorf(err, errlen, "the manifest's sharding (world, shards) is malformed");
    p->shards = fl_alloc(FL_MEM_OTHER, (size_t)world * sizeof(shard_ref));
    for (const cJSON *item = list->child; item; item = item->next) {
        shard_ref *r = &p->shards[p->n_shards];
        const cJSON *file = cJSON_GetObjectItemCaseSensitive(item, "file");
        int step;
        if (!cJSON_IsString(file) || !is_shard_name(file->valuestring, &step) || step != p->step ||
            json_u64(cJSON_GetObjectItemCaseSensitive(item, "bytes"), 1ull << 62, &r->bytes) != 0 ||
            json_crc(cJSON_GetObjectItemCaseSensitive(item, "header_crc32"), &r->header_crc) != 0)
            return fl_errorf(err, errlen, "the manifest's shard entry %d is malformed",
                             p->n_shards);
        strcpy(r->file, file->valuestring);
        p->n_shards++;
    }
    return 0;
}

// A shard file's "shard": {"of": manifest, "rank", "world"}.
static int parse_shard_of(const cJSON *s, parsed *p, char *err, size_t errlen) {
    const cJSON *of = cJSON_GetObjectItemCaseSensitive(s, "of");
    uint64_t rank, world;
    int step;
    if (!cJSON_IsObject(s) || !cJSON_IsString(of) || !is_ckpt_name(of->valuestring, &step) ||
        json_u64(cJSON_GetObjectItemCaseSensitive(s, "world"), CKPT_MAX_SHARDS, &world) != 0 ||
        json_u64(cJSON_GetObjectItemCaseSensitive(s, "rank"), world - 1, &rank) != 0 || !world)
        return fl_errorf(err, errlen, "the shard description (of, rank, world) is malformed");
    strcpy(p->shard_of, of->valuestring);
    p->shard_rank = (int)rank;
    p->shard_world = (int)world;
    return 0;
}

// The header's "files": [{"name", "offset", "bytes", "crc32"}, ...], stored
// back to back after the tensors (from *offset, which it advances).
static int parse_files(const cJSON *list, parsed *p, uint64_t *offset, char *err, size_t errlen) {
    if (!list) return 0;
    int n = cJSON_GetArraySize(list);
    if (!cJSON_IsArray(list) || n > CKPT_MAX_FILES)
        return fl_errorf(err, errlen, "the header's files are not a list of at most %d",
                         CKPT_MAX_FILES);
    p->files = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(tensor_entry));
    for (const cJSON *item = list->child; item; item = item->next) {
        tensor_entry *f = &p->files[p->n_files];
        memset(f, 0, sizeof *f);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(item, "name");
        if (!cJSON_IsString(name) || !*name->valuestring ||
            strlen(name->valuestring) >= CKPT_NAME_MAX ||
            json_u64(cJSON_GetObjectItemCaseSensitive(item, "offset"), 1ull << 62, &f->offset) !=
                0 ||
            json_u64(cJSON_GetObjectItemCaseSensitive(item, "bytes"), 1ull << 62, &f->bytes) != 0 ||
            json_crc(cJSON_GetObjectItemCaseSensitive(item, "crc32"), &f->crc) != 0)
            return fl_errorf(err, errlen, "file entry %d is malformed", p->n_files);
        strcpy(f->name, name->valuestring);
        f->numel = f->total = f->bytes;
        if (f->offset != *offset || f->bytes > p->data_len - f->offset)
            return fl_errorf(err, errlen,
                             "file '%s' spans bytes %llu..%llu, outside the data or not where "
                             "the previous entry ended",
                             f->name, (unsigned long long)f->offset,
                             (unsigned long long)(f->offset + f->bytes));
        for (int k = 0; k < p->n_files; k++)
            if (!strcmp(p->files[k].name, f->name))
                return fl_errorf(err, errlen, "file '%s' appears twice", f->name);
        *offset += f->bytes;
        p->n_files++;
    }
    return 0;
}

// A strided piece's "run" and "stride" (a version-4 shard file's, with
// first and total): whole runs, a stride no shorter than a run, the last
// element inside the tensor. Contiguous (run 0) without them.
static int parse_runs(const cJSON *item, const parsed *p, tensor_entry *t, int has_first, char *err,
                      size_t errlen) {
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(item, "run");
    const cJSON *stride = cJSON_GetObjectItemCaseSensitive(item, "stride");
    t->run = t->stride = 0;
    if (!run && !stride) return 0;
    if (p->version < CKPT_VERSION_RUNS || !has_first)
        return fl_errorf(err, errlen,
                         "tensor '%s': run/stride in a version-%u file or a piece without "
                         "first/total (a strided piece is version %d, in a shard file)",
                         t->name, p->version, CKPT_VERSION_RUNS);
    if (json_u64(run, 1ull << 50, &t->run) != 0 || json_u64(stride, 1ull << 50, &t->stride) != 0 ||
        t->run == 0)
        return fl_errorf(err, errlen, "tensor '%s': run/stride are malformed (a run of 1 or more)",
                         t->name);
    if (t->numel % t->run)
        return fl_errorf(err, errlen, "tensor '%s': its %llu elements are not whole runs of %llu",
                         t->name, (unsigned long long)t->numel, (unsigned long long)t->run);
    if (t->stride < t->run)
        return fl_errorf(err, errlen, "tensor '%s': stride %llu is shorter than its run %llu",
                         t->name, (unsigned long long)t->stride, (unsigned long long)t->run);
    uint64_t runs = t->numel / t->run; // the last run ends by total, without overflowing
    if (t->first > t->total || (runs && (t->run > t->total - t->first ||
                                         runs - 1 > (t->total - t->first - t->run) / t->stride)))
        return fl_errorf(err, errlen,
                         "tensor '%s': %llu runs of %llu every %llu from element %llu end past "
                         "its %llu elements",
                         t->name, (unsigned long long)runs, (unsigned long long)t->run,
                         (unsigned long long)t->stride, (unsigned long long)t->first,
                         (unsigned long long)t->total);
    return 0;
}

// The header JSON (after its CRC was checked) against data_len.
static int parse_header(const uint8_t *header, parsed *p, char *err, size_t errlen) {
    const char *why;
    size_t at;
    p->root = fl_json_parse((const char *)header, p->header_len, &why, &at);
    if (!p->root)
        return fl_errorf(err, errlen, "the header is not a JSON object (%s at byte %zu)", why, at);
    if (!cJSON_IsObject(p->root)) return fl_errorf(err, errlen, "the header is not a JSON object");
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
    const cJSON *sharding = cJSON_GetObjectItemCaseSensitive(p->root, "sharding");
    const cJSON *shard = cJSON_GetObjectItemCaseSensitive(p->root, "shard");
    if (sharding && shard) return fl_errorf(err, errlen, "a manifest and a shard at once");
    if (sharding && parse_sharding(sharding, p, err, errlen) != 0) return -1;
    if (shard && parse_shard_of(shard, p, err, errlen) != 0) return -1;
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
        const cJSON *first = cJSON_GetObjectItemCaseSensitive(item, "first");
        const cJSON *total = cJSON_GetObjectItemCaseSensitive(item, "total");
        if (!cJSON_IsString(name) || strlen(name->valuestring) >= CKPT_NAME_MAX ||
            !cJSON_IsString(dtype) || dtype_from_name(dtype->valuestring, &t->dtype) != 0 ||
            !cJSON_IsArray(shape) || cJSON_GetArraySize(shape) != 1 ||
            json_u64(shape->child, 1ull << 50, &t->numel) != 0 ||
            json_u64(offset, 1ull << 62, &t->offset) != 0 || json_crc(crc, &t->crc) != 0)
            return fl_errorf(err, errlen, "tensor entry %d is malformed", p->n_tensors);
        strcpy(t->name, name->valuestring);
        t->bytes = t->numel * fl_dtype_size(t->dtype);
        // a piece (shard files): where it lies in the whole tensor
        t->first = 0;
        t->total = t->numel;
        if ((first || total) && (!p->shard_world || json_u64(first, 1ull << 50, &t->first) != 0 ||
                                 json_u64(total, 1ull << 50, &t->total) != 0))
            return fl_errorf(err, errlen,
                             "tensor entry %d: first/total are malformed or outside a shard",
                             p->n_tensors);
        if (parse_runs(item, p, t, first != NULL, err, errlen) != 0) return -1;
        if (!t->run && t->first + t->numel > t->total)
            return fl_errorf(err, errlen,
                             "tensor entry %d: first/total are malformed or outside a shard",
                             p->n_tensors);
        // back to back, in order: no gaps, no overlaps, nothing past the end
        if (t->offset != expect_offset || t->bytes > p->data_len - t->offset)
            return fl_errorf(err, errlen,
                             "tensor '%s' spans bytes %llu..%llu, outside the data or "
                             "not where the previous one ended",
                             t->name, (unsigned long long)t->offset,
                             (unsigned long long)(t->offset + t->bytes));
        // a shard file may hold several pieces of a tensor (a rank's ZeRO
        // range of its tensor-parallel slice); the reader checks they cover
        // it once
        for (int k = 0; k < p->n_tensors && !p->shard_world; k++)
            if (!strcmp(p->tensors[k].name, t->name))
                return fl_errorf(err, errlen, "tensor '%s' appears twice", t->name);
        expect_offset += t->bytes;
        p->n_tensors++;
    }
    if (parse_files(cJSON_GetObjectItemCaseSensitive(p->root, "files"), p, &expect_offset, err,
                    errlen) != 0)
        return -1;
    if (expect_offset != p->data_len)
        return fl_errorf(err, errlen, "the tensors and files cover %llu of %llu data bytes",
                         (unsigned long long)expect_offset, (unsigned long long)p->data_len);
    if (p->shards && p->n_tensors)
        return fl_errorf(err, errlen, "a manifest holds no tensors, this one %d", p->n_tensors);
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

// Reads and checks the header of the open file fd (size bytes): 0, or -1
// with a message. *header_crc: the prefix's CRC-32, which covers the
// header and so (through the tensors' CRC-32s) names the file's content.
static int read_header(int fd, uint64_t size, parsed *p, uint32_t *header_crc, char *err,
                       size_t errlen) {
    memset(p, 0, sizeof *p);
    uint8_t prefix[CKPT_PREFIX] = {0};
    ssize_t r = pread(fd, prefix, CKPT_PREFIX, 0);
    if (r < 0) return fl_errorf(err, errlen, "cannot read it: %s", strerror(errno));
    if (parse_prefix(prefix, (size_t)r < CKPT_PREFIX ? (uint64_t)r : size, p, err, errlen) != 0)
        return -1;
    uint8_t *header = fl_alloc(FL_MEM_OTHER, p->header_len);
    int rc = 0;
    if (pread(fd, header, p->header_len, CKPT_PREFIX) != (ssize_t)p->header_len)
        rc = fl_errorf(err, errlen, "cannot read its header");
    else if (fl_crc32(fl_crc32(0, prefix, 24), header, p->header_len) != fl_get_u32(prefix + 24))
        rc = fl_errorf(err, errlen, "the header is corrupt (CRC-32 mismatch)");
    else
        rc = parse_header(header, p, err, errlen);
    fl_free(header);
    if (header_crc) *header_crc = fl_get_u32(prefix + 24);
    return rc;
}

// The header of the file at path, never dying (for pruning): 0 or -1.
static int header_of(const char *path, parsed *p) {
    memset(p, 0, sizeof *p);
    struct stat st;
    int fd = fl_try_open_regular(path, &st);
    if (fd < 0) return -1;
    char err[256];
    int rc = read_header(fd, (uint64_t)st.st_size, p, NULL, err, sizeof err);
    close(fd);
    if (rc != 0) parsed_free(p);
    return rc;
}

// The run id in a checkpoint file's header ("" when it has none); -1 when
// the file cannot be read or parsed: such a file is never pruned.
static int run_of(const char *path, char *out, size_t size) {
    parsed p;
    if (header_of(path, &p) != 0) return -1;
    snprintf(out, size, "%s", p.run);
    parsed_free(&p);
    return 0;
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
        for (int i = 0; i < p.n_files && rc == 0; i++)
            if (fl_crc32(0, data + p.files[i].offset, p.files[i].bytes) != p.files[i].crc)
                rc = fl_errorf(err, errlen, "file '%s' is corrupt (CRC-32 mismatch)",
                               p.files[i].name);
    }
    parsed_free(&p);
    return rc;
}

// ----------------------------------------------------------------------------
// writing

typedef struct {
    char name[SHARD_NAME_MAX];
    struct timespec mtime;
} dir_file;

static int older_first(const void *a, const void *b) {
    const struct timespec *x = &((const dir_file *)a)->mtime, *y = &((const dir_file *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? -1 : 1;
    return (x->tv_nsec > y->tv_nsec) - (x->tv_nsec < y->tv_nsec);
}

// Whether path's header names run (any run when run is NULL).
static int of_run(const char *path, const char *run) {
    char id[64];
    return !run || (run_of(path, id, sizeof id) == 0 && !strcmp(id, run));
}

// Deletes a checkpoint file and, when it is a manifest, its shard files
// (after it: a manifest never names a shard that is gone).
static void remove_ckpt(const char *dir, const char *name) {
    char path[FL_FILE_PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) return;
    parsed p;
    int manifest = header_of(path, &p) == 0;
    unlink(path);
    if (!manifest) return;
    for (int i = 0; i < p.n_shards; i++)
        if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, p.shards[i].file) < sizeof path)
            unlink(path);
    parsed_free(&p);
}

// Shard files found in a directory, by name (so a step's are together).
typedef struct {
    char (*names)[SHARD_NAME_MAX];
    int n, cap;
} name_list;

static void name_add(name_list *l, const char *name) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        char(*grown)[SHARD_NAME_MAX] = fl_alloc(FL_MEM_OTHER, (size_t)l->cap * SHARD_NAME_MAX);
        if (l->n) memcpy(grown, l->names, (size_t)l->n * SHARD_NAME_MAX);
        fl_free(l->names);
        l->names = grown;
    }
    size_t len = strlen(name); // shard names are checked short by the caller's parse
    FL_ASSERT(len < SHARD_NAME_MAX);
    memcpy(l->names[l->n++], name, len + 1);
}

static int by_name(const void *a, const void *b) {
    return strcmp(a, b);
}

// Deletes the shard files of `run` (any, when NULL) that the manifest of
// their step does not list: what a failed or killed save left, or a set
// whose manifest a later save of the same step replaced. Each manifest is
// read once.
static void remove_orphans(const char *dir, name_list *l, const char *run) {
    if (!l->n) return;
    qsort(l->names, (size_t)l->n, SHARD_NAME_MAX, by_name);
    parsed m;
    memset(&m, 0, sizeof m);
    int m_step = -1, have = 0;
    char path[FL_FILE_PATH_MAX];
    for (int i = 0; i < l->n; i++) {
        int step;
        is_shard_name(l->names[i], &step);
        if (step != m_step) { // the next step's manifest
            char manifest[32];
            if (have) parsed_free(&m);
            ckpt_name(manifest, sizeof manifest, step);
            snprintf(path, sizeof path, "%s/%s", dir, manifest);
            have = header_of(path, &m) == 0;
            m_step = step;
        }
        int listed = 0;
        for (int k = 0; have && k < m.n_shards && !listed; k++)
            listed = !strcmp(m.shards[k].file, l->names[i]);
        if (!listed &&
            (size_t)snprintf(path, sizeof path, "%s/%s", dir, l->names[i]) < sizeof path &&
            of_run(path, run))
            unlink(path);
    }
    if (have) parsed_free(&m);
    fl_free(l->names);
}

// Deletes every checkpoint but the `keep` most recently written, and any
// temporary file a killed writer left behind. With a run id, only the
// checkpoints of that run are candidates: a run never deletes another's.
// Without one, all are (so those of an earlier run go first, whatever
// their step). Shard files of the run that no manifest lists (a save that
// failed or was killed before its manifest) go too. Runs only after
// `latest` points at the newest.
static void prune(const char *dir, int keep, int newest, const char *run) {
    fl_tmp_clean(dir);
    DIR *d = opendir(dir);
    if (!d) return;
    enum { MAX_FILES = 1024 };
    dir_file files[MAX_FILES] = {{"", {0, 0}}};
    int n = 0;
    name_list shards = {NULL, 0, 0};
    struct dirent *e;
    char path[FL_FILE_PATH_MAX];
    while ((e = readdir(d))) {
        int step;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (is_ckpt_name(e->d_name, &step) && step != newest && n < MAX_FILES &&
            stat(path, &st) == 0 && keep > 0 && of_run(path, run)) {
            memcpy(files[n].name, e->d_name, 20); // 19 characters (is_ckpt_name) and the NUL
            files[n++].mtime = st.st_mtim;
        } else if (is_shard_name(e->d_name, &step)) {
            name_add(&shards, e->d_name);
        }
    }
    closedir(d);
    if (keep > 0) {
        qsort(files, (size_t)n, sizeof files[0], older_first);
        for (int i = 0; i < n - (keep - 1); i++) remove_ckpt(dir, files[i].name);
    }
    remove_orphans(dir, &shards, run); // after the manifests: theirs are orphans now
}

// A device's tensors pass to and from the host in blocks of this, through
// one staging buffer (tag other); host memory is read in place.
#define STAGE_BYTES ((size_t)1 << 20)

static int on_device(const fl_device *dev) {
    return dev && !dev->host;
}

static void *stage_for(const fl_ckpt_piece *tensors, int n_tensors) {
    for (int i = 0; i < n_tensors; i++)
        if (on_device(tensors[i].dev)) return fl_alloc(FL_MEM_OTHER, STAGE_BYTES);
    return NULL;
}

// Bytes [at, at + n) of piece t (n <= STAGE_BYTES) where the host can read
// them: its own memory, or their copy in stage.
static const void *piece_block(const fl_ckpt_piece *t, size_t at, size_t n, void *stage) {
    const uint8_t *src = (const uint8_t *)t->data + at;
    if (!on_device(t->dev)) return src;
    fl_dev_download(t->dev, stage, src, n);
    return stage;
}

static size_t block_of(size_t bytes, size_t at) {
    return bytes - at < STAGE_BYTES ? bytes - at : STAGE_BYTES;
}

static uint32_t piece_crc(const fl_ckpt_piece *t, void *stage) {
    size_t bytes = t->numel * fl_dtype_size(t->dtype);
    if (!on_device(t->dev)) return fl_crc32(0, t->data, bytes);
    uint32_t crc = 0;
    for (size_t at = 0; at < bytes; at += STAGE_BYTES)
        crc = fl_crc32(crc, piece_block(t, at, block_of(bytes, at), stage), block_of(bytes, at));
    return crc;
}

// The header JSON of a file: meta (NULL: {}), step, run, `extra` (owned)
// under extra_key, the tensor table (pieces: with first and total), then the
// files stored after the tensors. *data_len receives the bytes of both.
static char *make_header(const char *meta_json, int step, const char *run, const char *extra_key,
                         cJSON *extra, const fl_ckpt_piece *tensors, int n_tensors,
                         const fl_ckpt_file *files, int n_files, uint64_t *data_len) {
    cJSON *meta = meta_json ? cJSON_Parse(meta_json) : cJSON_CreateObject();
    FL_ASSERT(meta && cJSON_IsObject(meta));
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "meta", meta);
    cJSON_AddNumberToObject(root, "step", step);
    if (run) cJSON_AddStringToObject(root, "run", run);
    if (extra) cJSON_AddItemToObject(root, extra_key, extra);
    cJSON *list = cJSON_AddArrayToObject(root, "tensors");
    uint64_t offset = 0;
    void *stage = stage_for(tensors, n_tensors);
    for (int i = 0; i < n_tensors; i++) {
        const fl_ckpt_piece *t = &tensors[i];
        size_t bytes = t->numel * fl_dtype_size(t->dtype);
        cJSON *item = cJSON_CreateObject();
        cJSON_AddStringToObject(item, "name", t->name);
        cJSON_AddStringToObject(item, "dtype", dtype_name(t->dtype));
        cJSON *shape = cJSON_AddArrayToObject(item, "shape");
        cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->numel));
        cJSON_AddNumberToObject(item, "offset", (double)offset);
        if (t->total) {
            cJSON_AddNumberToObject(item, "first", (double)t->first);
            cJSON_AddNumberToObject(item, "total", (double)t->total);
        }
        if (t->run) { // strided: whole runs, the last inside the tensor
            FL_ASSERT(t->total && t->numel % t->run == 0 && t->stride >= t->run);
            FL_ASSERT(!t->numel ||
                      t->first + (t->numel / t->run - 1) * t->stride + t->run <= t->total);
            cJSON_AddNumberToObject(item, "run", (double)t->run);
            cJSON_AddNumberToObject(item, "stride", (double)t->stride);
        }
        char crc[16];
        snprintf(crc, sizeof crc, "%08x", piece_crc(t, stage));
        cJSON_AddStringToObject(item, "crc32", crc);
        cJSON_AddItemToArray(list, item);
        offset += bytes;
    }
    fl_free(stage);
    FL_ASSERT(n_files <= CKPT_MAX_FILES);
    cJSON *flist = n_files ? cJSON_AddArrayToObject(root, "files") : NULL;
    for (int i = 0; i < n_files; i++) {
        cJSON *item = cJSON_CreateObject();
        char crc[16];
        snprintf(crc, sizeof crc, "%08x", fl_crc32(0, files[i].data, files[i].size));
        cJSON_AddStringToObject(item, "name", files[i].name);
        cJSON_AddNumberToObject(item, "offset", (double)offset);
        cJSON_AddNumberToObject(item, "bytes", (double)files[i].size);
        cJSON_AddStringToObject(item, "crc32", crc);
        cJSON_AddItemToArray(flist, item);
        offset += files[i].size;
    }
    char *header = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    FL_ASSERT(header);
    *data_len = offset;
    return header;
}

// Fault injection for tests: FITLM_CKPT_FAULT=<rank> (or <rank>:<step>)
// makes that rank's checkpoint write fail as on a full disk (ENOSPC) after
// its first bytes, at every save (or at that step's).
static int fault_injected(int step) {
    const char *v = getenv("FITLM_CKPT_FAULT");
    int rank, at = -1;
    if (!v || sscanf(v, "%d:%d", &rank, &at) < 1) return 0;
    return rank == fl_comm_rank() && (at < 0 || at == step);
}

static int write_full(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n < (1u << 30) ? n : (1u << 30));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            if (w == 0) errno = ENOSPC;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int write_piece(int fd, const fl_ckpt_piece *t, void *stage) {
    size_t bytes = t->numel * fl_dtype_size(t->dtype);
    if (!on_device(t->dev)) return write_full(fd, t->data, bytes);
    for (size_t at = 0; at < bytes; at += STAGE_BYTES)
        if (write_full(fd, piece_block(t, at, block_of(bytes, at), stage), block_of(bytes, at)))
            return -1;
    return 0;
}

// The format version of a file of these tensors: 4 only when one is strided,
// so a checkpoint of contiguous pieces stays what earlier versions wrote.
static uint32_t version_of(const fl_ckpt_piece *tensors, int n_tensors) {
    for (int i = 0; i < n_tensors; i++)
        if (tensors[i].run) return CKPT_VERSION_RUNS;
    return CKPT_VERSION;
}

// Writes a checkpoint file (prefix, header, tensors, files) to tmp and makes
// it durable. 0, or -1 with errno set and tmp removed. *header_crc and *size:
// the file's identity as a manifest records it.
static int write_file(const char *tmp, const char *header, const fl_ckpt_piece *tensors,
                      int n_tensors, const fl_ckpt_file *files, int n_files, uint64_t data_len,
                      int fault, uint32_t *header_crc, uint64_t *size) {
    uint8_t prefix[CKPT_PREFIX];
    size_t hlen = strlen(header);
    memcpy(prefix, CKPT_MAGIC, 8);
    fl_put_u32(prefix + 8, version_of(tensors, n_tensors));
    fl_put_u32(prefix + 12, (uint32_t)hlen);
    fl_put_u64(prefix + 16, data_len);
    fl_put_u32(prefix + 24, fl_crc32(fl_crc32(0, prefix, 24), header, hlen));
    if (header_crc) *header_crc = fl_get_u32(prefix + 24);
    if (size) *size = CKPT_PREFIX + hlen + data_len;
    int fd = fl_tmp_open(tmp);
    if (fd < 0) return -1;
    int rc = write_full(fd, prefix, sizeof prefix);
    if (rc == 0 && fault) {
        errno = ENOSPC;
        rc = -1;
    }
    if (rc == 0) rc = write_full(fd, header, hlen);
    void *stage = stage_for(tensors, n_tensors);
    for (int i = 0; i < n_tensors && rc == 0; i++) rc = write_piece(fd, &tensors[i], stage);
    fl_free(stage);
    for (int i = 0; i < n_files && rc == 0; i++) rc = write_full(fd, files[i].data, files[i].size);
    if (rc == 0) rc = fsync(fd);
    int err = errno;
    if (close(fd) != 0 && rc == 0) {
        rc = -1;
        err = errno;
    }
    if (rc != 0) {
        fl_tmp_discard(tmp); // the previous file, if any, is untouched
        errno = err;
    }
    return rc;
}

// DIR/latest := name, crash-safely. 0 or -1 (errno).
static int write_latest(const char *dir, const char *name) {
    char path[FL_FILE_PATH_MAX], tmp[FL_FILE_PATH_MAX + 128], line[64];
    snprintf(path, sizeof path, "%s/latest", dir);
    fl_tmp_name(tmp, sizeof tmp, path);
    int n = snprintf(line, sizeof line, "%s\n", name);
    int fd = fl_tmp_open(tmp);
    if (fd < 0) return -1;
    int rc = write_full(fd, line, (size_t)n);
    if (rc == 0) rc = fsync(fd);
    int err = errno;
    if (close(fd) != 0 && rc == 0) rc = -1, err = errno;
    if (rc != 0) {
        fl_tmp_discard(tmp);
        errno = err;
        return -1;
    }
    return fl_tmp_commit(tmp, path);
}

static void make_dir(const char *dir) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        fl_die("cannot create checkpoint directory %s: %s", dir, strerror(errno));
}

static void join(char *out, size_t size, const char *dir, const char *name) {
    if ((size_t)snprintf(out, size, "%s/%s", dir, name) >= size)
        fl_die("checkpoint directory name is too long: %s", dir);
}

void fl_ckpt_write(const char *dir, int step, const char *meta_json, const fl_ckpt_tensor *tensors,
                   int n_tensors, int keep) {
    fl_ckpt_write_run(dir, step, meta_json, tensors, n_tensors, keep, NULL, NULL, 0);
}

void fl_ckpt_write_run(const char *dir, int step, const char *meta_json,
                       const fl_ckpt_tensor *tensors, int n_tensors, int keep, const char *run,
                       const fl_ckpt_file *files, int n_files) {
    fl_ckpt_piece *whole =
        fl_alloc(FL_MEM_OTHER, (size_t)(n_tensors ? n_tensors : 1) * sizeof *whole);
    for (int i = 0; i < n_tensors; i++)
        whole[i] = (fl_ckpt_piece){.name = tensors[i].name,
                                   .dtype = tensors[i].dtype,
                                   .data = tensors[i].data,
                                   .numel = tensors[i].numel};
    fl_ckpt_write_whole(dir, step, meta_json, whole, n_tensors, keep, run, files, n_files);
    fl_free(whole);
}

void fl_ckpt_write_whole(const char *dir, int step, const char *meta_json,
                         const fl_ckpt_piece *whole, int n_tensors, int keep, const char *run,
                         const fl_ckpt_file *files, int n_files) {
    make_dir(dir);
    uint64_t data_len;
    char *header =
        make_header(meta_json, step, run, NULL, NULL, whole, n_tensors, files, n_files, &data_len);
    char name[32], path[FL_FILE_PATH_MAX], tmp[FL_FILE_PATH_MAX + 128];
    ckpt_name(name, sizeof name, step);
    join(path, sizeof path, dir, name);
    fl_tmp_name(tmp, sizeof tmp, path);
    if (write_file(tmp, header, whole, n_tensors, files, n_files, data_len, 0, NULL, NULL) != 0)
        fl_die("writing %s failed: %s", tmp, strerror(errno));
    cJSON_free(header);
    if (fl_tmp_commit(tmp, path) != 0)
        fl_die("cannot rename %s to %s: %s", tmp, path, strerror(errno));
    // Only now does `latest` move: it always names a complete checkpoint.
    if (write_latest(dir, name) != 0) fl_die("cannot update %s/latest: %s", dir, strerror(errno));
    prune(dir, keep, step, run);
}

// ----------------------------------------------------------------------------
// collective saving (fl_ckpt_write_dist): every rank writes its file to a
// temporary name; the ranks agree that all succeeded before any file takes
// its final name, and again before the manifest (rank 0) is written, and
// `latest` moves last. A failure anywhere stops every rank with the same
// message, and `latest` still names the previous checkpoint.

enum { PHASE_WRITE = 1, PHASE_RENAME, PHASE_MANIFEST, PHASE_LATEST };

// Each rank's code (phase * 100000 + errno, 0: fine), agreed by a max over
// ranks. Returns the first failing rank, or -1.
static int agree(int code, int *codes) {
    int world = fl_comm_size();
    double *v = fl_alloc(FL_MEM_OTHER, (size_t)world * sizeof(double));
    for (int r = 0; r < world; r++) v[r] = r == fl_comm_rank() ? code : 0.0;
    fl_comm_max(fl_comm_world(), v, world);
    int first = -1;
    for (int r = world - 1; r >= 0; r--)
        if (v[r] != 0.0) first = r, *codes = (int)v[r];
    fl_free(v);
    return first;
}

typedef struct {
    const char *dir;
    int step, sharded, world;
    char tag[12];
} dist_save;

// The file rank r writes: its shard, or rank 0's single checkpoint.
static void file_of(const dist_save *s, int r, char *out, size_t size) {
    char name[SHARD_NAME_MAX];
    if (s->sharded)
        shard_name(name, sizeof name, s->step, s->tag, r, s->world);
    else
        ckpt_name(name, sizeof name, s->step);
    join(out, size, s->dir, name);
}

// Every rank stops with the failing rank's reason (rank 0 says it; the
// others wait for the job to end).
static void fail_all(const dist_save *s, int rank, int code) {
    char path[FL_FILE_PATH_MAX], manifest[32];
    int phase = code / 100000, err = code % 100000;
    ckpt_name(manifest, sizeof manifest, s->step);
    if (phase == PHASE_MANIFEST || phase == PHASE_LATEST)
        join(path, sizeof path, s->dir, phase == PHASE_MANIFEST ? manifest : "latest");
    else
        file_of(s, rank, path, sizeof path);
    const char *what = phase == PHASE_WRITE    ? "write"
                       : phase == PHASE_RENAME ? "rename into place"
                                               : "write";
    if (fl_comm_rank() == 0)
        fl_die("checkpoint of step %d not saved: rank %d could not %s %s: %s. %s/latest still "
               "names the previous checkpoint, if any; stopping every rank",
               s->step, rank, what, path, strerror(err), s->dir);
    // rank 0's fl_die ends the job (signals included): one message, not one per rank
    for (unsigned left = 30; left;) left = sleep(left);
    fl_die("checkpoint of step %d not saved: rank %d failed", s->step, rank);
}

// A tag new for this save, the same on every rank.
static void new_tag(char *tag, size_t size) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint32_t x = fl_crc32((uint32_t)getpid(), &ts, sizeof ts);
    char t[12];
    snprintf(t, sizeof t, "%08x", x);
    fl_comm_bcast(fl_comm_world(), t, sizeof t, 0);
    snprintf(tag, size, "%s", t);
}

// The manifest's sharding entry: every rank's file name, size and header CRC.
static cJSON *sharding_json(const dist_save *s, const double *bytes, const double *crcs) {
    cJSON *sh = cJSON_CreateObject();
    cJSON_AddNumberToObject(sh, "world", s->world);
    cJSON *list = cJSON_AddArrayToObject(sh, "shards");
    for (int r = 0; r < s->world; r++) {
        char name[SHARD_NAME_MAX], crc[16];
        shard_name(name, sizeof name, s->step, s->tag, r, s->world);
        snprintf(crc, sizeof crc, "%08x", (uint32_t)crcs[r]);
        cJSON *item = cJSON_CreateObject();
        cJSON_AddStringToObject(item, "file", name);
        cJSON_AddNumberToObject(item, "bytes", bytes[r]);
        cJSON_AddStringToObject(item, "header_crc32", crc);
        cJSON_AddItemToArray(list, item);
    }
    return sh;
}

void fl_ckpt_write_dist(const char *dir, int step, const char *meta_json,
                        const char *shard_meta_json, const fl_ckpt_piece *tensors, int n_tensors,
                        int sharded, int keep, const char *run, const fl_ckpt_file *files,
                        int n_files) {
    int rank = fl_comm_rank(), world = fl_comm_size(), code = 0, bad;
    dist_save s = {dir, step, sharded, world, ""};
    char run0[64] = ""; // rank 0's id names the run in every file
    if (run) snprintf(run0, sizeof run0, "%s", run);
    fl_comm_bcast(fl_comm_world(), run0, sizeof run0, 0);
    run = run ? run0 : NULL;
    if (rank == 0) make_dir(dir);
    fl_comm_barrier(fl_comm_world());
    if (sharded) new_tag(s.tag, sizeof s.tag);
    char path[FL_FILE_PATH_MAX], tmp[FL_FILE_PATH_MAX + 128], manifest[32];
    ckpt_name(manifest, sizeof manifest, step);
    file_of(&s, rank, path, sizeof path);
    fl_tmp_name(tmp, sizeof tmp, path);
    int writes = sharded || rank == 0;
    uint32_t crc = 0;
    uint64_t size = 0;
    if (writes) {
        cJSON *shard = NULL;
        if (sharded) {
            shard = cJSON_CreateObject();
            cJSON_AddStringToObject(shard, "of", manifest);
            cJSON_AddNumberToObject(shard, "rank", rank);
            cJSON_AddNumberToObject(shard, "world", world);
        }
        // the files go with the meta: in rank 0's single file, else the manifest
        int nf = sharded ? 0 : n_files;
        uint64_t data_len;
        char *header = make_header(sharded ? shard_meta_json : meta_json, step, run, "shard", shard,
                                   tensors, n_tensors, files, nf, &data_len);
        if (write_file(tmp, header, tensors, n_tensors, files, nf, data_len, fault_injected(step),
                       &crc, &size) != 0)
            code = PHASE_WRITE * 100000 + errno;
        cJSON_free(header);
    }
    // nothing has its final name until every rank's file is durable
    if ((bad = agree(code, &code)) >= 0) {
        if (writes) fl_tmp_discard(tmp);
        fail_all(&s, bad, code);
    }
    if (writes && fl_tmp_commit(tmp, path) != 0) code = PHASE_RENAME * 100000 + errno;
    if ((bad = agree(code, &code)) >= 0) {
        if (sharded) unlink(path); // a shard of this save only (its tag): no one needs it
        fail_all(&s, bad, code);
    }
    if (sharded) { // rank 0 needs every shard's identity for the manifest
        double *v = fl_alloc(FL_MEM_OTHER, 2 * (size_t)world * sizeof(double));
        memset(v, 0, 2 * (size_t)world * sizeof(double));
        v[rank] = (double)size;
        v[world + rank] = (double)crc;
        fl_comm_sum(fl_comm_world(), v, 2 * world);
        if (rank == 0) {
            cJSON *sh = sharding_json(&s, v, v + world);
            uint64_t data_len;
            char *header = make_header(meta_json, step, run, "sharding", sh, NULL, 0, files,
                                       n_files, &data_len);
            char mpath[FL_FILE_PATH_MAX], mtmp[FL_FILE_PATH_MAX + 128];
            join(mpath, sizeof mpath, dir, manifest);
            fl_tmp_name(mtmp, sizeof mtmp, mpath);
            if (write_file(mtmp, header, NULL, 0, files, n_files, data_len, 0, NULL, NULL) != 0 ||
                fl_tmp_commit(mtmp, mpath) != 0)
                code = PHASE_MANIFEST * 100000 + errno;
            cJSON_free(header);
        }
        fl_free(v);
    }
    // Only now does `latest` move: it always names a complete checkpoint.
    if (rank == 0 && !code && write_latest(dir, manifest) != 0)
        code = PHASE_LATEST * 100000 + errno;
    if ((bad = agree(code, &code)) >= 0) {
        if (sharded && code / 100000 == PHASE_MANIFEST) unlink(path); // no manifest names it
        fail_all(&s, bad, code);
    }
    if (rank == 0) prune(dir, keep, step, run);
    fl_comm_barrier(fl_comm_world()); // the next save starts once pruning is done
}

// ----------------------------------------------------------------------------
// reading: a checkpoint file, or a manifest and its shard files, seen as
// one set of whole tensors, each made of one piece or several

typedef struct {
    char path[FL_FILE_PATH_MAX];
    int fd;
    parsed p;
} ckpt_part;

typedef struct {
    const char *name;
    int part;              // the file
    const tensor_entry *e; // its table entry
} piece;

typedef struct {
    const char *name;
    fl_dtype dtype;
    uint64_t total;
    int first_piece, n_pieces; // in fl_ckpt.pieces, ordered by first element
    long order;                // where it first appears: file, then table entry
} vtensor;

struct fl_ckpt {
    char path[FL_FILE_PATH_MAX]; // the checkpoint file or manifest
    int fd;
    parsed p;
    ckpt_part *parts; // the tensors' files: the checkpoint itself, or the shards
    int n_parts;
    piece *pieces;
    vtensor *vt;
    int n_vt;
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
    // fitlm writes `latest` as a regular file: a link is not followed (it
    // could name any file), a FIFO would block the read
    int fd = open(latest, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat lst;
    if (fd < 0 && errno == ELOOP)
        fl_die("%s holds no checkpoint: %s is a symbolic link (fitlm writes it as a regular "
               "file and does not follow a link there)",
               path, latest);
    if (fd < 0) fl_die("%s holds no checkpoint: cannot open %s: %s", path, latest, strerror(errno));
    if (fstat(fd, &lst) != 0)
        fl_die("%s holds no checkpoint: cannot read %s: %s", path, latest, strerror(errno));
    fl_check_regular(&lst, latest, "checkpoint pointer file");
    char name[64] = {0};
    ssize_t got = read(fd, name, sizeof name - 1);
    close(fd);
    size_t n = got > 0 ? (size_t)got : 0;
    name[n] = 0;
    while (n && (name[n - 1] == '\n' || name[n - 1] == '\r')) name[--n] = 0;
    int step;
    // only a name's shape is ever quoted: the file's bytes are not echoed
    if (!is_ckpt_name(name, &step) || strlen(name) != n || (uint64_t)lst.st_size > n + 2) {
        char shown[48];
        fl_name_excerpt(shown, sizeof shown, name, n, (uint64_t)lst.st_size, "ckpt_");
        fl_die("%s does not name a checkpoint file (ckpt_<step>.fitlm): it holds %s", latest,
               shown);
    }
    if ((size_t)snprintf(out, size, "%s/%s", path, name) >= size)
        fl_die("checkpoint path too long: %s", path);
}

// Opens and checks one file; dies naming it (what: "checkpoint" or "shard").
static void open_part(ckpt_part *c, const char *path, const char *what) {
    snprintf(c->path, sizeof c->path, "%s", path);
    c->fd = fl_open_regular(c->path, what); // a FIFO or device: refused, never read
    struct stat st;
    if (fstat(c->fd, &st) != 0) fl_die("cannot stat %s %s", what, c->path);
    char err[256];
    if (read_header(c->fd, (uint64_t)st.st_size, &c->p, NULL, err, sizeof err) != 0)
        fl_die("%s %s: %s", what, c->path, err);
}

// The manifest's shard files, each checked to be the one it recorded.
static void open_shards(fl_ckpt *ck) {
    char dir[FL_FILE_PATH_MAX], manifest[32];
    snprintf(dir, sizeof dir, "%s", ck->path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = 0;
    else
        snprintf(dir, sizeof dir, ".");
    ckpt_name(manifest, sizeof manifest, ck->p.step);
    ck->n_parts = ck->p.n_shards;
    ck->parts = fl_alloc(FL_MEM_OTHER, (size_t)ck->n_parts * sizeof(ckpt_part));
    for (int r = 0; r < ck->n_parts; r++) {
        const shard_ref *ref = &ck->p.shards[r];
        char path[FL_FILE_PATH_MAX];
        join(path, sizeof path, dir, ref->file);
        struct stat st;
        if (stat(path, &st) != 0)
            fl_die("checkpoint %s: its shard file %s (rank %d of %d) is missing: %s", ck->path,
                   path, r, ck->n_parts, strerror(errno));
        ckpt_part *c = &ck->parts[r];
        c->fd = fl_open_regular(path, "checkpoint shard");
        snprintf(c->path, sizeof c->path, "%s", path);
        char err[256];
        uint32_t crc;
        if (fstat(c->fd, &st) != 0 ||
            read_header(c->fd, (uint64_t)st.st_size, &c->p, &crc, err, sizeof err) != 0)
            fl_die("checkpoint shard %s (of %s): %s", path, ck->path, err);
        const parsed *p = &c->p;
        if (!p->shard_world) fl_die("checkpoint %s: %s is not a shard file", ck->path, path);
        if (p->step != ck->p.step || strcmp(p->run, ck->p.run))
            fl_die("checkpoint %s: shard file %s belongs to step %d of run '%s', not to this "
                   "checkpoint (step %d of run '%s')",
                   ck->path, path, p->step, p->run, ck->p.step, ck->p.run);
        if (p->shard_rank != r || p->shard_world != ck->n_parts || strcmp(p->shard_of, manifest))
            fl_die("checkpoint %s: shard file %s is rank %d of %d of %s, not rank %d of %d of "
                   "this checkpoint",
                   ck->path, path, p->shard_rank, p->shard_world, p->shard_of, r, ck->n_parts);
        if (crc != ref->header_crc || (uint64_t)st.st_size != ref->bytes)
            fl_die("checkpoint %s: shard file %s is not the one it recorded (%llu bytes, header "
                   "CRC-32 %08x; recorded %llu bytes, %08x): a shard of another save",
                   ck->path, path, (unsigned long long)st.st_size, crc,
                   (unsigned long long)ref->bytes, ref->header_crc);
    }
}

static int piece_order(const void *a, const void *b) {
    const piece *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return (x->e->first > y->e->first) - (x->e->first < y->e->first);
}

static int vt_order(const void *a, const void *b) {
    const vtensor *x = a, *y = b;
    return (x->order > y->order) - (x->order < y->order);
}

// A set of elements of a tensor: count elements in runs of `run`, run k from
// element first + k * stride. A contiguous range is one run; a strided
// piece, or a rank's slice of a tensor, one run per row.
typedef struct {
    uint64_t first, run, stride, count;
} span;

static span span_of(const tensor_entry *e) {
    uint64_t run = e->run ? e->run : e->numel ? e->numel : 1;
    return (span){e->first, run, e->run ? e->stride : run, e->numel};
}

// One past the last element (first when empty).
static uint64_t span_end(const span *s) {
    return s->count ? s->first + (s->count / s->run - 1) * s->stride + s->run : s->first;
}

// Whether [a, b) holds an element of s.
static int span_hits(const span *s, uint64_t a, uint64_t b) {
    uint64_t end = span_end(s);
    if (a < s->first) a = s->first;
    if (b > end) b = end;
    if (a >= b) return 0;
    uint64_t k = (a - s->first) / s->stride;
    return (a - s->first) % s->stride < s->run || s->first + (k + 1) * s->stride < b;
}

// Sets bits [a, b) of map; the first of them that was set already, else b.
static uint64_t mark(uint64_t *map, uint64_t a, uint64_t b) {
    while (a < b) {
        uint64_t lo = a % 64, n = b - a < 64 - lo ? b - a : 64 - lo;
        uint64_t bits = (n == 64 ? ~0ull : (1ull << n) - 1) << lo, *w = &map[a / 64];
        if (*w & bits) return a - lo + (uint64_t)__builtin_ctzll(*w & bits);
        *w |= bits;
        a += n;
    }
    return b;
}

// Coverage of a tensor with a strided piece: a bitmap of its elements, each
// piece's runs marked in turn. It spans the elements up to the first one no
// piece can reach: the pieces' element count, plus one, when that is short
// of the tensor (a gap lies there; a header's total never sizes it alone).
static void check_strided(const fl_ckpt *ck, const vtensor *v) {
    uint64_t held = 0;
    for (int i = 0; i < v->n_pieces && held < v->total; i++)
        held += ck->pieces[v->first_piece + i].e->numel;
    uint64_t limit = held < v->total ? held + 1 : v->total, words = (limit + 63) / 64;
    uint64_t *map = fl_alloc(FL_MEM_WORKSPACE, (words ? words : 1) * sizeof *map);
    memset(map, 0, (words ? words : 1) * sizeof *map);
    for (int i = 0; i < v->n_pieces; i++) {
        const piece *q = &ck->pieces[v->first_piece + i];
        span s = span_of(q->e);
        for (uint64_t k = 0; k < s.count / s.run; k++) {
            uint64_t a = s.first + k * s.stride, b = a + s.run < limit ? a + s.run : limit;
            if (a >= limit) break;
            uint64_t twice = mark(map, a, b);
            if (twice < b)
                fl_die("checkpoint %s: tensor '%s' has element %llu twice (%s)", ck->path, v->name,
                       (unsigned long long)twice, ck->parts[q->part].path);
        }
    }
    for (uint64_t w = 0; w < words; w++) {
        uint64_t valid = w + 1 < words || limit % 64 == 0 ? ~0ull : (1ull << (limit % 64)) - 1;
        if (~map[w] & valid)
            fl_die("checkpoint %s: tensor '%s' has element %llu in no file", ck->path, v->name,
                   (unsigned long long)(w * 64 + (uint64_t)__builtin_ctzll(~map[w] & valid)));
    }
    fl_free(map);
}

// The whole tensors from their pieces: each covered exactly once, listed
// in file order (a single file's own order; shard 0's tensors first).
// Contiguous pieces, sorted by first element, must follow one another; a
// tensor with a strided piece is checked element by element.
static void build_tensors(fl_ckpt *ck) {
    int n = 0;
    for (int f = 0; f < ck->n_parts; f++) n += ck->parts[f].p.n_tensors;
    ck->pieces = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(piece));
    ck->vt = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(vtensor));
    int k = 0;
    for (int f = 0; f < ck->n_parts; f++)
        for (int i = 0; i < ck->parts[f].p.n_tensors; i++) {
            const tensor_entry *e = &ck->parts[f].p.tensors[i];
            ck->pieces[k++] = (piece){e->name, f, e};
        }
    qsort(ck->pieces, (size_t)n, sizeof(piece), piece_order);
    for (int i = 0; i < n;) {
        const piece *p = &ck->pieces[i];
        vtensor *v = &ck->vt[ck->n_vt++];
        *v = (vtensor){p->name, p->e->dtype, p->e->total, i, 0, -1};
        int strided = 0;
        for (; i < n && !strcmp(ck->pieces[i].name, v->name); i++, v->n_pieces++) {
            const piece *q = &ck->pieces[i];
            long order =
                (long)q->part * CKPT_MAX_TENSORS + (long)(q->e - ck->parts[q->part].p.tensors);
            if (v->order < 0 || order < v->order) v->order = order;
            if (q->e->total != v->total || q->e->dtype != v->dtype)
                fl_die("checkpoint %s: the pieces of tensor '%s' disagree on its size or dtype "
                       "(%s)",
                       ck->path, v->name, ck->parts[q->part].path);
            strided |= q->e->run != 0;
        }
        if (strided) {
            check_strided(ck, v);
            continue;
        }
        uint64_t next = 0;
        for (int j = 0; j < v->n_pieces; j++) {
            const piece *q = &ck->pieces[v->first_piece + j];
            if (q->e->first != next)
                fl_die("checkpoint %s: tensor '%s' has elements [%llu, %llu) %s (%s)", ck->path,
                       v->name, (unsigned long long)next, (unsigned long long)q->e->first,
                       q->e->first > next ? "in no file" : "twice", ck->parts[q->part].path);
            next = q->e->first + q->e->numel;
        }
        if (next != v->total)
            fl_die("checkpoint %s: tensor '%s' has elements [%llu, %llu) in no file", ck->path,
                   v->name, (unsigned long long)next, (unsigned long long)v->total);
    }
    qsort(ck->vt, (size_t)ck->n_vt, sizeof(vtensor), vt_order);
}

fl_ckpt *fl_ckpt_open(const char *path) {
    fl_ckpt *ck = fl_alloc(FL_MEM_OTHER, sizeof *ck);
    memset(ck, 0, sizeof *ck);
    char file[FL_FILE_PATH_MAX];
    resolve(path, file, sizeof file);
    ckpt_part self = {0};
    open_part(&self, file, "checkpoint");
    snprintf(ck->path, sizeof ck->path, "%s", self.path);
    ck->fd = self.fd;
    ck->p = self.p;
    if (ck->p.shard_world)
        fl_die("%s is rank %d's shard of the sharded checkpoint %s: open that (or its directory)",
               ck->path, ck->p.shard_rank, ck->p.shard_of);
    if (ck->p.n_shards) {
        open_shards(ck);
    } else {
        ck->n_parts = 1;
        ck->parts = fl_alloc(FL_MEM_OTHER, sizeof(ckpt_part));
        ck->parts[0] = self; // shares fd and p with ck: freed once
    }
    build_tensors(ck);
    return ck;
}

void fl_ckpt_close(fl_ckpt *ck) {
    if (!ck) return;
    if (ck->p.n_shards)
        for (int i = 0; i < ck->n_parts; i++) {
            close(ck->parts[i].fd);
            parsed_free(&ck->parts[i].p);
        }
    close(ck->fd);
    parsed_free(&ck->p);
    fl_free(ck->parts);
    fl_free(ck->pieces);
    fl_free(ck->vt);
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
int fl_ckpt_shards(const fl_ckpt *ck) {
    return ck->p.n_shards;
}

static const vtensor *find(const fl_ckpt *ck, const char *name) {
    for (int i = 0; i < ck->n_vt; i++)
        if (!strcmp(ck->vt[i].name, name)) return &ck->vt[i];
    return NULL;
}

int fl_ckpt_has(const fl_ckpt *ck, const char *name) {
    return find(ck, name) != NULL;
}

int fl_ckpt_tensor_count(const fl_ckpt *ck) {
    return ck->n_vt;
}

const char *fl_ckpt_tensor_name(const fl_ckpt *ck, int i) {
    FL_ASSERT(i >= 0 && i < ck->n_vt);
    return ck->vt[i].name;
}

size_t fl_ckpt_numel(const fl_ckpt *ck, const char *name) {
    const vtensor *t = find(ck, name);
    return t ? (size_t)t->total : 0;
}

void fl_ckpt_read(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t numel) {
    const vtensor *t = find(ck, name);
    if (!t) fl_die("checkpoint %s has no tensor '%s'", ck->path, name);
    if (t->total != numel)
        fl_die("checkpoint %s: tensor '%s' has %llu elements, this model needs %zu", ck->path, name,
               (unsigned long long)t->total, numel);
    fl_ckpt_read_range(ck, name, dt, dst, 0, numel);
}

// Where a piece's elements land in dst, when all of them are wanted and
// they land back to back (so a piece of dt is read straight there): its
// index in dst, else -1. Either the piece is one run inside a wanted run,
// or it has the wanted runs' shape, aligned with them.
static int64_t direct_at(const span *have, const span *want) {
    if (!have->count || have->first < want->first) return -1;
    uint64_t at = have->first - want->first, k = at / want->stride, j = at % want->stride;
    uint64_t runs = want->count / want->run, have_runs = have->count / have->run;
    if ((have_runs == 1 || have->stride == have->run) && k < runs && j + have->count <= want->run)
        return (int64_t)(k * want->run + j);
    if (have->run == want->run && have->stride == want->stride && j == 0 && k + have_runs <= runs)
        return (int64_t)(k * want->run);
    return -1;
}

// The wanted elements among a piece's elements [i, i + n) (buf holds
// them, of type st), converted into dst: walked a run of the piece at a
// time, each run's part in each wanted run copied at once.
// n elements of type st (host memory) converted into dst (dt), which is
// dev's: on a device, a staged block at a time.
static void put(const fl_device *dev, fl_dtype dt, void *dst, fl_dtype st, const uint8_t *src,
                size_t n, void *stage) {
    if (!on_device(dev)) {
        fl_convert(dt, dst, st, src, n);
        return;
    }
    size_t per = STAGE_BYTES / fl_dtype_size(dt);
    for (size_t i = 0; i < n; i += per) {
        size_t k = n - i < per ? n - i : per;
        fl_convert(dt, stage, st, src + i * fl_dtype_size(st), k);
        fl_dev_upload(dev, fl_at(dt, dst, i), stage, k * fl_dtype_size(dt));
    }
}

static void scatter(const fl_device *dev, fl_dtype dt, void *dst, const span *want, fl_dtype st,
                    const uint8_t *buf, const span *have, uint64_t i, uint64_t n, void *stage) {
    size_t esize = fl_dtype_size(st);
    uint64_t end = span_end(want);
    for (uint64_t at = i; at < i + n;) { // at: the piece's element
        uint64_t k = at / have->run, j = at % have->run;
        uint64_t len = have->run - j < i + n - at ? have->run - j : i + n - at;
        uint64_t a = have->first + k * have->stride + j, b = a + len; // in the tensor
        uint64_t e = a > want->first ? a : want->first, stop = b < end ? b : end;
        while (e < stop) {
            uint64_t q = (e - want->first) / want->stride, o = (e - want->first) % want->stride;
            if (o >= want->run) { // between wanted runs: on to the next
                e = want->first + (q + 1) * want->stride;
                continue;
            }
            uint64_t hi = want->first + q * want->stride + want->run;
            if (hi > stop) hi = stop;
            put(dev, dt, fl_at(dt, dst, q * want->run + o), st, buf + (at - i + e - a) * esize,
                hi - e, stage);
            e = hi;
        }
        at += len;
    }
}

// The wanted elements of one file's piece into dst. The whole piece is read
// once, in blocks (its CRC-32 covers all of it): a piece of dt whose
// elements land back to back is read straight into dst; otherwise blocks
// pass through a buffer and the wanted elements land in dst, converted
// (dst on a device: through the device's copies, staged).
static void read_entry(const ckpt_part *f, const tensor_entry *t, fl_dtype dt, const fl_device *dev,
                       void *dst, const span *want) {
    size_t esize = fl_dtype_size(t->dtype), numel = t->numel;
    size_t block = numel < ((size_t)1 << 20) ? numel : (size_t)1 << 20;
    span have = span_of(t);
    int64_t at = t->dtype == dt && !on_device(dev) ? direct_at(&have, want) : -1;
    int direct = at >= 0;
    uint8_t *buf = direct || !numel ? NULL : fl_alloc(FL_MEM_WORKSPACE, block * esize);
    void *stage = on_device(dev) && numel ? fl_alloc(FL_MEM_OTHER, STAGE_BYTES) : NULL;
    uint64_t base = CKPT_PREFIX + (uint64_t)f->p.header_len + t->offset;
    uint32_t crc = 0;
    for (size_t i = 0; i < numel; i += block) {
        size_t n = numel - i < block ? numel - i : block;
        uint8_t *into = direct ? (uint8_t *)dst + ((size_t)at + i) * esize : buf;
        size_t want_bytes = n * esize, got = 0;
        while (got < want_bytes) {
            ssize_t r = pread(f->fd, into + got, want_bytes - got, (off_t)(base + i * esize + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0)
                fl_die("cannot read checkpoint %s: %s", f->path,
                       r ? strerror(errno) : "end of file");
            got += (size_t)r;
        }
        crc = fl_crc32(crc, into, want_bytes);
        if (!direct) scatter(dev, dt, dst, want, t->dtype, buf, &have, i, n, stage);
    }
    fl_free(buf);
    fl_free(stage);
    if (crc != t->crc)
        fl_die("checkpoint %s: tensor '%s' is corrupt (CRC-32 mismatch: stored %08x, computed "
               "%08x)",
               f->path, t->name, t->crc, crc);
}

// Whether a piece holds any wanted element: each of its runs asked.
static int piece_hits(const tensor_entry *e, const span *want) {
    span have = span_of(e);
    uint64_t end = span_end(&have);
    if (!have.count || end <= want->first || have.first >= span_end(want)) return 0;
    for (uint64_t k = 0; k < have.count / have.run; k++) {
        uint64_t a = have.first + k * have.stride;
        if (span_hits(want, a, a + have.run)) return 1;
    }
    return 0;
}

void fl_ckpt_read_runs(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t first,
                       size_t run, size_t stride, size_t count) {
    fl_ckpt_read_runs_to(ck, name, dt, NULL, dst, first, run, stride, count);
}

void fl_ckpt_read_runs_to(fl_ckpt *ck, const char *name, fl_dtype dt, const fl_device *dev,
                          void *dst, size_t first, size_t run, size_t stride, size_t count) {
    const vtensor *t = find(ck, name);
    if (!t) fl_die("checkpoint %s has no tensor '%s'", ck->path, name);
    if (!run || stride < run || count % run)
        fl_die("checkpoint %s: %zu elements in runs of %zu every %zu are not a slice of tensor "
               "'%s'",
               ck->path, count, run, stride, name);
    // the last element inside the tensor, without overflowing
    size_t runs = count / run, total = (size_t)t->total;
    if (first > total ||
        (runs && (run > total - first || runs - 1 > (total - first - run) / stride))) {
        if (runs <= 1)
            fl_die("checkpoint %s: elements [%zu, %zu) are outside tensor '%s' of %zu", ck->path,
                   first, first + count, name, total);
        fl_die("checkpoint %s: %zu runs of %zu every %zu from element %zu are outside tensor "
               "'%s' of %zu",
               ck->path, runs, run, stride, first, name, total);
    }
    span want = {first, run, stride, count};
    for (int i = 0; i < t->n_pieces; i++) { // the pieces that hold any of them, once each
        const piece *p = &ck->pieces[t->first_piece + i];
        if (piece_hits(p->e, &want) || (count == 0 && t->n_pieces == 1)) // (an empty read
            read_entry(&ck->parts[p->part], p->e, dt, dev, dst, &want);  // still checks)
    }
}

void fl_ckpt_read_range(fl_ckpt *ck, const char *name, fl_dtype dt, void *dst, size_t first,
                        size_t count) {
    fl_ckpt_read_range_to(ck, name, dt, NULL, dst, first, count);
}

void fl_ckpt_read_range_to(fl_ckpt *ck, const char *name, fl_dtype dt, const fl_device *dev,
                           void *dst, size_t first, size_t count) {
    size_t run = count ? count : 1; // one run
    fl_ckpt_read_runs_to(ck, name, dt, dev, dst, first, run, run, count);
}

uint8_t *fl_ckpt_file_read(const fl_ckpt *ck, const char *name, size_t *size) {
    const tensor_entry *f = NULL;
    for (int i = 0; i < ck->p.n_files && !f; i++)
        if (!strcmp(ck->p.files[i].name, name)) f = &ck->p.files[i];
    if (!f) return NULL;
    uint8_t *data = fl_alloc(FL_MEM_OTHER, f->bytes + 1); // + a NUL: text reads as a string
    uint64_t base = CKPT_PREFIX + (uint64_t)ck->p.header_len + f->offset;
    for (size_t got = 0; got < f->bytes;) {
        ssize_t r = pread(ck->fd, data + got, f->bytes - got, (off_t)(base + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            fl_die("cannot read checkpoint %s: %s", ck->path, r ? strerror(errno) : "end of file");
        got += (size_t)r;
    }
    data[f->bytes] = 0;
    if (fl_crc32(0, data, f->bytes) != f->crc)
        fl_die("checkpoint %s: its file '%s' is corrupt (CRC-32 mismatch)", ck->path, name);
    *size = f->bytes;
    return data;
}
