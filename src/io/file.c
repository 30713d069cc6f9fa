// file.c: whole-file reads and crash-safe writes shared by the model-file
// writers. A file is written to PATH.tmp, fsynced, renamed over PATH and the
// directory fsynced, so a crash leaves either the old file or the new one.
#include "fitlm/io.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void fl_file_create(fl_file_writer *w, const char *path) {
    if ((size_t)snprintf(w->path, sizeof w->path, "%s", path) >= sizeof w->path ||
        (size_t)snprintf(w->tmp, sizeof w->tmp, "%s.tmp", path) >= sizeof w->tmp)
        fl_die("file name is too long: %s", path);
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (w->fd < 0) fl_die("cannot create %s: %s", w->tmp, strerror(errno));
}

void fl_file_write(fl_file_writer *w, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t r = write(w->fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fl_die("writing %s failed: %s", w->tmp, strerror(errno));
        p += r;
        n -= (size_t)r;
    }
}

void fl_file_commit(fl_file_writer *w) {
    if (fsync(w->fd) != 0 || close(w->fd) != 0)
        fl_die("cannot flush %s: %s", w->tmp, strerror(errno));
    if (rename(w->tmp, w->path) != 0)
        fl_die("cannot rename %s to %s: %s", w->tmp, w->path, strerror(errno));
    char dir[sizeof w->path];
    strcpy(dir, w->path);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        slash[1] = 0;
    else if (slash)
        *slash = 0;
    else
        strcpy(dir, ".");
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) { // make the rename itself durable
        fsync(dfd);
        close(dfd);
    }
}

void fl_file_write_all(const char *path, const void *data, size_t n) {
    fl_file_writer w = {0};
    fl_file_create(&w, path);
    fl_file_write(&w, data, n);
    fl_file_commit(&w);
}

char *fl_file_read(const char *path, size_t max_bytes, size_t *n) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) fl_die("cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) fl_die("%s is not a regular file", path);
    if ((uint64_t)st.st_size > max_bytes)
        fl_die("%s is too large (%lld bytes, at most %zu expected)", path, (long long)st.st_size,
               max_bytes);
    size_t size = (size_t)st.st_size, got = 0;
    char *buf = fl_alloc(FL_MEM_OTHER, size + 1);
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fl_die("cannot read %s: %s", path, r < 0 ? strerror(errno) : "file shrank");
        got += (size_t)r;
    }
    close(fd);
    *n = size;
    return buf;
}
