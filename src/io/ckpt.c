// ckpt.c: model checkpoints.
//
// File DIR/model.ckpt, little-endian:
//   bytes 0-7    magic "FITLMCKP"
//   bytes 8-11   uint32 format version (1)
//   bytes 12-15  uint32 header length H
//   bytes 16-23  uint64 data length D
//   H bytes      JSON header: {"model": {n_layer, n_head, n_embd, vocab_size,
//                max_seq_len}, "tokenizer", "step", "dtype": "float32"}
//   D bytes      the flat fp32 parameter buffer, in parameter-table order
//   4 bytes      uint32 CRC-32 of everything before it
// Written to model.ckpt.tmp, fsynced, then renamed over model.ckpt, so the
// previous checkpoint stays intact until the new one is complete.
#include "fitlm/io.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cJSON.h>

#define CKPT_MAGIC   "FITLMCKP"
#define CKPT_VERSION 1
#define CKPT_PREFIX  24

uint32_t fl_crc32(uint32_t crc, const void *data, size_t n) {
    static uint32_t table[256];
    if (!table[1]) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
    }
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_u64(const uint8_t *p) {
    return get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

static void write_all(int fd, const void *data, size_t n, const char *path, uint32_t *crc) {
    const char *p = data;
    *crc = fl_crc32(*crc, data, n);
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) fl_die("writing checkpoint %s failed: %s", path, strerror(errno));
        p += w;
        n -= (size_t)w;
    }
}

static void ckpt_path(char *out, size_t size, const char *dir, const char *suffix) {
    if ((size_t)snprintf(out, size, "%s/model.ckpt%s", dir, suffix) >= size)
        fl_die("checkpoint directory name is too long: %s", dir);
}

void fl_ckpt_save(const char *dir, const fl_gpt2 *model, const float *weights,
                  const char *tokenizer, int step) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        fl_die("cannot create checkpoint directory %s: %s", dir, strerror(errno));
    char path[4096], tmp[4096];
    ckpt_path(path, sizeof path, dir, "");
    ckpt_path(tmp, sizeof tmp, dir, ".tmp");

    const fl_gpt2_config *c = &model->config;
    cJSON *root = cJSON_CreateObject(), *m = cJSON_AddObjectToObject(root, "model");
    cJSON_AddNumberToObject(m, "n_layer", c->n_layer);
    cJSON_AddNumberToObject(m, "n_head", c->n_head);
    cJSON_AddNumberToObject(m, "n_embd", c->n_embd);
    cJSON_AddNumberToObject(m, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(m, "max_seq_len", c->max_seq_len);
    cJSON_AddStringToObject(root, "tokenizer", tokenizer);
    cJSON_AddNumberToObject(root, "step", step);
    cJSON_AddStringToObject(root, "dtype", "float32");
    char *header = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!header) fl_die("out of memory writing checkpoint %s", path);

    size_t data_bytes = model->table.numel * sizeof(float);
    uint8_t prefix[CKPT_PREFIX];
    memcpy(prefix, CKPT_MAGIC, 8);
    put_u32(prefix + 8, CKPT_VERSION);
    put_u32(prefix + 12, (uint32_t)strlen(header));
    put_u64(prefix + 16, data_bytes);

    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) fl_die("cannot create %s: %s", tmp, strerror(errno));
    uint32_t crc = 0;
    write_all(fd, prefix, sizeof prefix, tmp, &crc);
    write_all(fd, header, strlen(header), tmp, &crc);
    write_all(fd, weights, data_bytes, tmp, &crc);
    uint8_t trailer[4];
    put_u32(trailer, crc);
    uint32_t ignored = 0;
    write_all(fd, trailer, 4, tmp, &ignored);
    cJSON_free(header);
    if (fsync(fd) != 0 || close(fd) != 0)
        fl_die("cannot flush checkpoint %s: %s", tmp, strerror(errno));
    if (rename(tmp, path) != 0) fl_die("cannot rename %s to %s: %s", tmp, path, strerror(errno));
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) { // make the rename itself durable
        fsync(dfd);
        close(dfd);
    }
}

static int json_int(const cJSON *obj, const char *key, const char *path, int min, int max) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(item) || item->valuedouble != (int)item->valuedouble ||
        item->valuedouble < min || item->valuedouble > max)
        fl_die("checkpoint %s: header field '%s' is missing or not an integer in [%d, %d]", path,
               key, min, max);
    return (int)item->valuedouble;
}

void fl_ckpt_load(const char *dir, fl_gpt2 *model, fl_dtype dt, char *tokenizer,
                  size_t tokenizer_size, int *step) {
    char path[4096];
    ckpt_path(path, sizeof path, dir, "");
    FILE *f = fopen(path, "rb");
    if (!f) fl_die("cannot open checkpoint %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long fsize = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t prefix[CKPT_PREFIX];
    if (fsize < CKPT_PREFIX + 4 || fread(prefix, 1, CKPT_PREFIX, f) != CKPT_PREFIX)
        fl_die("checkpoint %s is truncated (%ld bytes)", path, fsize);
    if (memcmp(prefix, CKPT_MAGIC, 8) != 0)
        fl_die("%s is not a fitlm checkpoint (bad magic)", path);
    uint32_t version = get_u32(prefix + 8), hlen = get_u32(prefix + 12);
    uint64_t data_bytes = get_u64(prefix + 16);
    if (version != CKPT_VERSION)
        fl_die("checkpoint %s has format version %u; this fitlm reads version %d", path, version,
               CKPT_VERSION);
    if (hlen > (1u << 20) || data_bytes > (uint64_t)fsize ||
        (uint64_t)CKPT_PREFIX + hlen + data_bytes + 4 != (uint64_t)fsize)
        fl_die("checkpoint %s is truncated or corrupt: header says %u + %llu bytes, file has %ld",
               path, hlen, (unsigned long long)data_bytes, fsize);

    char *header = fl_alloc(FL_MEM_OTHER, hlen + 1);
    if (fread(header, 1, hlen, f) != hlen) fl_die("cannot read checkpoint %s", path);
    uint32_t crc = fl_crc32(fl_crc32(0, prefix, CKPT_PREFIX), header, hlen);
    cJSON *root = cJSON_ParseWithLength(header, hlen);
    if (!root) fl_die("checkpoint %s: the header is not valid JSON", path);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *tok = cJSON_GetObjectItemCaseSensitive(root, "tokenizer");
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(root, "dtype");
    if (!cJSON_IsObject(m) || !cJSON_IsString(tok) || !cJSON_IsString(dtype))
        fl_die("checkpoint %s: the header lacks model, tokenizer or dtype", path);
    if (strcmp(dtype->valuestring, "float32") != 0)
        fl_die("checkpoint %s: unsupported dtype '%s'", path, dtype->valuestring);
    if (strlen(tok->valuestring) >= tokenizer_size)
        fl_die("checkpoint %s: tokenizer name too long", path);
    strcpy(tokenizer, tok->valuestring);
    fl_gpt2_config cfg = {0};
    cfg.n_layer = json_int(m, "n_layer", path, 1, 1024);
    cfg.n_head = json_int(m, "n_head", path, 1, 1 << 16);
    cfg.n_embd = json_int(m, "n_embd", path, 1, 1 << 16);
    cfg.vocab_size = json_int(m, "vocab_size", path, 1, 1 << 30);
    cfg.max_seq_len = json_int(m, "max_seq_len", path, 1, 1 << 20);
    *step = json_int(root, "step", path, 0, 1 << 30);
    cJSON_Delete(root);
    fl_free(header);

    // Check the size before allocating: a corrupt shape must not allocate.
    size_t numel = fl_gpt2_num_params(&cfg);
    if ((uint64_t)numel * sizeof(float) != data_bytes)
        fl_die("checkpoint %s: %llu data bytes do not match the model shape (%zu parameters)", path,
               (unsigned long long)data_bytes, numel);
    fl_gpt2_init(model, &cfg, dt, 0);
    float *weights = fl_alloc(FL_MEM_WORKSPACE, data_bytes);
    if (fread(weights, 1, data_bytes, f) != data_bytes) fl_die("cannot read checkpoint %s", path);
    crc = fl_crc32(crc, weights, data_bytes);
    fl_convert(dt, model->params, FL_F32, weights, numel);
    fl_free(weights);
    uint8_t trailer[4];
    if (fread(trailer, 1, 4, f) != 4) fl_die("cannot read checkpoint %s", path);
    fclose(f);
    if (get_u32(trailer) != crc)
        fl_die("checkpoint %s is corrupt: CRC-32 mismatch (stored %08x, computed %08x)", path,
               get_u32(trailer), crc);
}
