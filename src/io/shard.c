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

#define SHARD_MAGIC "FITLMTOK"

// The two header parts; bytes 0-63 are the same in both versions.
static void put_header(uint8_t *h, uint32_t version, uint32_t vocab_size, uint32_t width,
                       uint32_t data_crc, uint64_t n_tokens, uint64_t source_bytes,
                       const char *tokenizer) {
    memcpy(h, SHARD_MAGIC, 8);
    fl_put_u32(h + 8, version);
    fl_put_u32(h + 12, vocab_size);
    fl_put_u32(h + 16, width);
    fl_put_u32(h + 20, data_crc);
    fl_put_u64(h + 24, n_tokens);
    fl_put_u64(h + 32, source_bytes);
    memcpy(h + 40, tokenizer, strlen(tokenizer));
    fl_put_u32(h + 60, fl_crc32(0, h, 60));
}

static void put_layout(uint8_t *h, const fl_shard_layout *l, uint64_t n_targets) {
    fl_put_u32(h + 64, l->seq_len);
    fl_put_u32(h + 68, l->policy);
    fl_put_u32(h + 72, l->packed ? 1u : 0u);
    fl_put_u64(h + 76, l->n_examples);
    fl_put_u64(h + 84, n_targets);
    fl_put_u32(h + 124, fl_crc32(0, h + 64, 60));
}

// mask NULL: version 1. Tokens (and the mask's bits) are packed and
// checksummed in blocks, so the file is written in one pass without a
// second copy of the shard in memory.
static void write_shard(const char *path, const char *tokenizer, uint32_t vocab_size,
                        const int32_t *tokens, const uint8_t *mask, uint64_t n_tokens,
                        uint64_t source_bytes, const fl_shard_layout *layout) {
    FL_ASSERT(strlen(tokenizer) <= FL_SHARD_NAME_SIZE);
    FL_ASSERT(!mask || (layout && layout->seq_len > 0 && n_tokens % (layout->seq_len + 1) == 0));
    uint32_t width = vocab_size <= 65536 ? 2 : 4;
    enum { BLOCK = 1 << 16 }; // a multiple of 8: mask bytes never straddle blocks
    uint8_t *block = fl_alloc(FL_MEM_WORKSPACE, (size_t)BLOCK * 4);
    uint32_t data_crc = 0;
    uint64_t n_targets = 0;
    for (int pass = 0; pass < 2; pass++) {
        fl_file f;
        if (pass == 1) {
            uint8_t h[FL_SHARD_HEADER_V2] = {0};
            put_header(h, mask ? 2 : 1, vocab_size, width, data_crc, n_tokens, source_bytes,
                       tokenizer);
            if (mask) put_layout(h, layout, n_targets);
            fl_file_begin(&f, path);
            fl_file_write(&f, h, mask ? FL_SHARD_HEADER_V2 : FL_SHARD_HEADER);
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
        for (uint64_t i = 0; mask && i < n_tokens; i += BLOCK) {
            size_t n = n_tokens - i < BLOCK ? (size_t)(n_tokens - i) : BLOCK, bytes = (n + 7) / 8;
            memset(block, 0, bytes);
            for (size_t k = 0; k < n; k++)
                if (mask[i + k]) block[k / 8] |= (uint8_t)(1u << (k % 8));
            if (pass == 0) {
                for (size_t k = 0; k < n; k++) n_targets += mask[i + k] != 0;
                data_crc = fl_crc32(data_crc, block, bytes);
            } else {
                fl_file_write(&f, block, bytes);
            }
        }
        if (pass == 1) fl_file_commit(&f);
    }
    fl_free(block);
}

void fl_shard_write(const char *path, const char *tokenizer, uint32_t vocab_size,
                    const int32_t *tokens, uint64_t n_tokens, uint64_t source_bytes) {
    write_shard(path, tokenizer, vocab_size, tokens, NULL, n_tokens, source_bytes, NULL);
}

void fl_shard_write_masked(const char *path, const char *tokenizer, uint32_t vocab_size,
                           const int32_t *tokens, const uint8_t *mask, uint64_t n_tokens,
                           uint64_t source_bytes, const fl_shard_layout *layout) {
    FL_ASSERT(mask);
    write_shard(path, tokenizer, vocab_size, tokens, mask, n_tokens, source_bytes, layout);
}

// Version 2's layout fields (bytes 64-127), checked.
static void read_layout(fl_shard *s) {
    const uint8_t *h = s->map;
    const char *path = s->path;
    if (s->map_size < FL_SHARD_HEADER_V2)
        fl_die("token shard %s is truncated: %zu bytes, shorter than its %d-byte header", path,
               s->map_size, FL_SHARD_HEADER_V2);
    if (fl_get_u32(h + 124) != fl_crc32(0, h + 64, 60))
        fl_die("token shard %s: the header (bytes 64-123) is corrupt (CRC-32 mismatch at byte "
               "offset 124)",
               path);
    fl_shard_layout *l = &s->layout;
    l->seq_len = fl_get_u32(h + 64);
    l->policy = fl_get_u32(h + 68);
    l->packed = fl_get_u32(h + 72);
    l->n_examples = fl_get_u64(h + 76);
    s->n_targets = fl_get_u64(h + 84);
    if (l->seq_len == 0 || l->seq_len > (1u << 24))
        fl_die("token shard %s: sequence length %u (byte offset 64) is out of range", path,
               l->seq_len);
    if (l->policy != FL_SEQ_TRUNCATE && l->policy != FL_SEQ_SPLIT)
        fl_die("token shard %s: unknown sequence policy %u (byte offset 68)", path, l->policy);
    if (l->packed > 1) fl_die("token shard %s: unknown flags %u (byte offset 72)", path, l->packed);
    for (int i = 92; i < 124; i++)
        if (h[i]) fl_die("token shard %s: reserved byte offset %d is not zero", path, i);
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
    s->version = fl_get_u32(h + 8);
    if (s->version != 1 && s->version != 2)
        fl_die("token shard %s has format version %u (byte offset 8); this fitlm reads versions 1 "
               "and 2",
               path, s->version);
    size_t header = s->version == 2 ? FL_SHARD_HEADER_V2 : FL_SHARD_HEADER;
    if (s->version == 2) read_layout(s);
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
    // the size is checked one term at a time: a huge count must not wrap
    size_t body = s->map_size - header;
    uint64_t mask_bytes = s->version == 2 ? s->n_tokens / 8 + (s->n_tokens % 8 != 0) : 0;
    if (s->n_tokens > body / s->width || mask_bytes > body - s->n_tokens * s->width ||
        s->n_tokens * s->width + mask_bytes != body)
        fl_die(
            "token shard %s is truncated or too long: the header says %llu tokens of %u bytes%s, "
            "the file holds %zu bytes after the header",
            path, (unsigned long long)s->n_tokens, s->width,
            s->version == 2 ? " and their mask" : "", body);
    s->tokens = h + header;
    if (fl_crc32(0, s->tokens, body) != fl_get_u32(h + 20))
        fl_die("token shard %s: the token data (byte offset %zu on) is corrupt (CRC-32 mismatch)",
               path, header);
    if (s->version == 2) {
        uint64_t window = (uint64_t)s->layout.seq_len + 1;
        if (s->n_tokens % window)
            fl_die("token shard %s: %llu tokens (byte offset 24) are not whole windows of %llu "
                   "(sequence length %u + 1)",
                   path, (unsigned long long)s->n_tokens, (unsigned long long)window,
                   s->layout.seq_len);
        s->mask = s->tokens + s->n_tokens * s->width;
        uint64_t count = 0;
        for (uint64_t i = 0; i < mask_bytes; i++) count += (uint64_t)__builtin_popcount(s->mask[i]);
        if (s->n_tokens % 8 && s->mask[mask_bytes - 1] >> (s->n_tokens % 8))
            fl_die("token shard %s: mask bits past the last token are set (byte offset %llu)", path,
                   (unsigned long long)(header + s->n_tokens * s->width + mask_bytes - 1));
        // a window's first token is an input only: the header's count is exact
        for (uint64_t i = 0; i < s->n_tokens; i += window)
            if (fl_shard_is_target(s, i))
                fl_die("token shard %s: token %llu starts a window but its mask bit is set (byte "
                       "offset %llu)",
                       path, (unsigned long long)i,
                       (unsigned long long)(header + s->n_tokens * s->width + i / 8));
        if (count != s->n_targets)
            fl_die("token shard %s: the mask holds %llu targets, the header (byte offset 84) says "
                   "%llu",
                   path, (unsigned long long)count, (unsigned long long)s->n_targets);
    } else {
        s->n_targets = s->n_tokens;
    }
    for (uint64_t i = 0; i < s->n_tokens; i++)
        if (fl_shard_token(s, i) >= s->vocab_size)
            fl_die("token shard %s: token %u at byte offset %llu is not below the vocabulary size "
                   "%u",
                   path, fl_shard_token(s, i), (unsigned long long)(header + i * s->width),
                   s->vocab_size);
}

void fl_shard_close(fl_shard *s) {
    if (s->map) munmap(s->map, s->map_size);
    memset(s, 0, sizeof *s);
}
