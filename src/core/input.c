// input.c: opening the files the user names for reading. Every reader of a
// user-named input (weights, shards, checkpoints, tokenizer and config files,
// data, metrics) opens it here, so none can hang on a FIFO, open a device or
// read a directory: the path (links followed) must be a regular file.
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/core.h"

// What a file that is not a regular one is, for messages.
static const char *kind_of(mode_t mode) {
    return S_ISDIR(mode)    ? "a directory"
           : S_ISFIFO(mode) ? "a FIFO"
           : S_ISSOCK(mode) ? "a socket"
           : S_ISCHR(mode)  ? "a character device"
           : S_ISBLK(mode)  ? "a block device"
                            : "not a regular file";
}

void fl_check_regular(const struct stat *st, const char *path, const char *what) {
    if (S_ISDIR(st->st_mode)) fl_die("%s %s is a directory", what, path);
    if (!S_ISREG(st->st_mode))
        fl_die("%s %s is not a regular file (it is %s)", what, path, kind_of(st->st_mode));
}

void fl_require_regular_file(const char *path, const char *what) {
    struct stat st;
    if (stat(path, &st) != 0) fl_die("cannot open %s %s: %s", what, path, strerror(errno));
    fl_check_regular(&st, path, what);
}

int fl_try_open_regular(const char *path, struct stat *st) {
    // stat first, so a device is never opened (an open can have side
    // effects); O_NONBLOCK and fstat, for a FIFO swapped in after the stat
    if (stat(path, st) != 0) return -1;
    if (!S_ISREG(st->st_mode)) {
        errno = S_ISDIR(st->st_mode) ? EISDIR : EINVAL;
        return -1;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return -1;
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) ||
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
        int e = S_ISREG(st->st_mode) ? errno : EINVAL;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

int fl_open_regular(const char *path, const char *what) {
    struct stat st;
    int fd = fl_try_open_regular(path, &st);
    if (fd < 0) {
        int e = errno;
        if (stat(path, &st) == 0) fl_check_regular(&st, path, what); // names what it is
        fl_die("cannot open %s %s: %s", what, path, strerror(e));
    }
    return fd;
}

uint8_t *fl_file_read_all(const char *path, size_t max_bytes, size_t *size, const char *what) {
    int fd = fl_open_regular(path, what);
    struct stat st;
    if (fstat(fd, &st) != 0) fl_die("cannot stat %s %s: %s", what, path, strerror(errno));
    if ((uint64_t)st.st_size > max_bytes)
        fl_die("%s %s is %lld bytes, more than the %zu this reader accepts", what, path,
               (long long)st.st_size, max_bytes);
    size_t n = (size_t)st.st_size;
    uint8_t *buf = fl_alloc(FL_MEM_OTHER, n + 1); // +1: room for a terminating NUL
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fl_die("cannot read %s %s: %s", what, path, r ? strerror(errno) : "it shrank");
        got += (size_t)r;
    }
    close(fd);
    *size = n;
    return buf;
}
