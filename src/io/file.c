// file.c: crash-safe writing. A file is written under a temporary name in its
// own directory, fsynced, renamed over the final name and the directory
// fsynced: a reader sees the old file or the complete new one, never a torn
// mix, whenever the process or the machine dies.
#include "fitlm/io.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

// CRC-32 (IEEE, as zlib), eight bytes at a time ("slicing-by-8"): checkpoints
// and shards are checksummed whole, so this runs at a few GB/s, not ~400 MB/s.
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

uint32_t fl_crc32(uint32_t crc, const void *data, size_t n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, crc_init);
    const uint8_t *p = data;
    crc = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo =
            crc ^ (p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
              crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^
              crc_table[2][(hi >> 8) & 0xff] ^ crc_table[1][(hi >> 16) & 0xff] ^
              crc_table[0][hi >> 24];
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

void fl_file_begin(fl_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    if ((size_t)snprintf(f->path, sizeof f->path, "%s", path) >= sizeof f->path ||
        (size_t)snprintf(f->tmp, sizeof f->tmp, "%s.tmp", path) >= sizeof f->tmp)
        fl_die("file name is too long: %s", path);
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) fl_die("cannot create %s: %s", f->tmp, strerror(errno));
}

void fl_file_write(fl_file *f, const void *data, size_t n) {
    f->crc = fl_crc32(f->crc, data, n);
    const char *p = data;
    while (n) {
        ssize_t w = write(f->fd, p, n < (1u << 30) ? n : (1u << 30));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int err = errno;
            close(f->fd);
            unlink(f->tmp); // the previous file, if any, is untouched
            fl_die("writing %s failed: %s", f->tmp, w < 0 ? strerror(err) : "no space written");
        }
        p += w;
        n -= (size_t)w;
        f->bytes += (uint64_t)w;
    }
}

void fl_fsync_dir_of(const char *path) {
    char copy[FL_FILE_PATH_MAX];
    snprintf(copy, sizeof copy, "%s", path);
    int dfd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) { // makes the rename itself durable
        fsync(dfd);
        close(dfd);
    }
}

void fl_file_commit(fl_file *f) {
    if (fsync(f->fd) != 0 || close(f->fd) != 0) {
        int err = errno;
        unlink(f->tmp);
        fl_die("cannot flush %s: %s", f->tmp, strerror(err));
    }
    if (rename(f->tmp, f->path) != 0)
        fl_die("cannot rename %s to %s: %s", f->tmp, f->path, strerror(errno));
    fl_fsync_dir_of(f->path);
}

void fl_file_write_all(const char *path, const void *data, size_t n) {
    fl_file f;
    fl_file_begin(&f, path);
    fl_file_write(&f, data, n);
    fl_file_commit(&f);
}
