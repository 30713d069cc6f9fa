// shard.c: token shard files (layout in data.h). Opening a shard checks all
// of it once, so training never meets a bad token halfway through an epoch.
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/data.h"
#include "fitlm/io.h"

#define SHARD_MAGIC   "FITLMTOK"
#define SHARD_VERSION 1

void fl_shard_write(const char *path, const char *tokenizer, uint32_t vocab_size,
                    const int32_t *tokens, uint64_t n_tokens, uint64_t source_bytes) {
    FL_ASSERT(strlen(tokenizer) <= FL_SHARD_NAME_SIZE);
    uint32_t width = vocab_size <= 65536 ? 2 : 4;
    // Tokens are packed and checksummed in blocks, so the file is written in
    // one pass without a second copy of the shard in memory.
    enum { BLOCK = 1 << 16 };
    uint8_t *block = fl_alloc(FL_MEM_WORKSPACE, (size_t)BLOCK * 4);
    uint32_t data_crc = 0;
    for (int pass = 0; pass < 2; pass++) {
        fl_file f;
        if (pass == 1) {
            uint8_t h[FL_SHARD_HEADER] = {0};
            memcpy(h, SHARD_MAGIC, 8);
            fl_put_u32(h + 8, SHARD_VERSION);
            fl_put_u32(h + 12, vocab_size);
            fl_put_u32(h + 16, width);
            fl_put_u32(h + 20, data_crc);
            fl_put_u64(h + 24, n_tokens);
            fl_put_u64(h + 32, source_bytes);
            memcpy(h + 40, tokenizer, strlen(tokenizer));
            fl_put_u32(h + 60, fl_crc32(0, h, 60));
            fl_file_begin(&f, path);
            fl_file_write(&f, h, sizeof h);
        }
        for (uint64_t i = 0; i < n_tokens; i += BLOCK) {
            size_t n = n_tokens - i < BLOCK ? (size_t)(n_tokens - i) : BLOCK;
            for (size_t k = 0; k < n; k++) {
                uint32_t t = (uint32_t)tokens[i + k];
                FL_ASSERT(t < vocab_size);
                if (width == 2) {
                    block[2 * k] = (uint8_t)t;
                    block[2 * k + 1] = (uint8_t)(t >> 8);
                } else {
                    fl_put_u32(block + 4 * k, t);
                }
            }
            if (pass == 0)
                data_crc = fl_crc32(data_crc, block, n * width);
            else
                fl_file_write(&f, block, n * width);
        }
        if (pass == 1) fl_file_commit(&f);
    }
    fl_free(block);
}

void fl_shard_open(fl_shard *s, const char *path) {
    memset(s, 0, sizeof *s);
    if (strlen(path) >= sizeof s->path) fl_die("shard path is too long: %s", path);
    strcpy(s->path, path);
    int fd = fl_open_regular(path, "token shard");
    struct stat st;
    if (fstat(fd, &st) != 0) fl_die("cannot stat token shard %s", path);
    if (st.st_size < FL_SHARD_HEADER)
        fl_die("token shard %s is truncated: %lld bytes, shorter than its %d-byte header", path,
               (long long)st.st_size, FL_SHARD_HEADER);
    s->map_size = (size_t)st.st_size;
    s->map = mmap(NULL, s->map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (s->map == MAP_FAILED) fl_die("cannot map token shard %s: %s", path, strerror(errno));
    const uint8_t *h = s->map;
    if (memcmp(h, SHARD_MAGIC, 8) != 0)
        fl_die("%s is not a fitlm token shard (bad magic at byte offset 0; make shards with "
               "'fitlm tokenize')",
               path);
    if (fl_get_u32(h + 60) != fl_crc32(0, h, 60))
        fl_die("token shard %s: the header (bytes 0-59) is corrupt (CRC-32 mismatch at byte "
               "offset 60)",
               path);
    uint32_t version = fl_get_u32(h + 8);
    if (version != SHARD_VERSION)
        fl_die("token shard %s has format version %u (byte offset 8); this fitlm reads version %d",
               path, version, SHARD_VERSION);
    s->vocab_size = fl_get_u32(h + 12);
    s->width = fl_get_u32(h + 16);
    s->n_tokens = fl_get_u64(h + 24);
    s->source_bytes = fl_get_u64(h + 32);
    memcpy(s->tokenizer, h + 40, FL_SHARD_NAME_SIZE);
    // readers keep vocabularies in an int: a larger one must not wrap
    if (s->vocab_size > (1u << 30))
        fl_die("token shard %s: vocabulary size %u (byte offset 12) is more than 2^30", path,
               s->vocab_size);
    if (s->vocab_size == 0 || (s->width != 2 && s->width != 4) ||
        (s->width == 2 && s->vocab_size > 65536))
        fl_die("token shard %s: bad vocabulary size %u or token width %u (byte offset 12)", path,
               s->vocab_size, s->width);
    if (s->n_tokens > (s->map_size - FL_SHARD_HEADER) / s->width ||
        FL_SHARD_HEADER + s->n_tokens * s->width != s->map_size)
        fl_die("token shard %s is truncated or too long: the header says %llu tokens of %u bytes, "
               "the file holds %zu bytes after the header",
               path, (unsigned long long)s->n_tokens, s->width, s->map_size - FL_SHARD_HEADER);
    s->tokens = h + FL_SHARD_HEADER;
    if (fl_crc32(0, s->tokens, s->n_tokens * s->width) != fl_get_u32(h + 20))
        fl_die("token shard %s: the token data (byte offset %d on) is corrupt (CRC-32 mismatch)",
               path, FL_SHARD_HEADER);
    for (uint64_t i = 0; i < s->n_tokens; i++)
        if (fl_shard_token(s, i) >= s->vocab_size)
            fl_die("token shard %s: token %u at byte offset %llu is not below the vocabulary size "
                   "%u",
                   path, fl_shard_token(s, i), (unsigned long long)(FL_SHARD_HEADER + i * s->width),
                   s->vocab_size);
}

void fl_shard_close(fl_shard *s) {
    if (s->map) munmap(s->map, s->map_size);
    memset(s, 0, sizeof *s);
}
