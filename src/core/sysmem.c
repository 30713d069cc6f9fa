// sysmem.c: what core reads from the system: how much memory this process
// may still use (/proc/meminfo and a cgroup limit: the planner's default
// limit), and whole files (config files, tokenizer tables).
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/core.h"

static size_t read_size_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[64] = "";
    size_t v = 0;
    if (fgets(line, sizeof line, f) && isdigit((unsigned char)line[0]))
        v = (size_t)strtoull(line, NULL, 10);
    fclose(f);
    return v; // 0 also for "max" (no limit)
}

size_t fl_mem_available(void) {
    size_t avail = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        size_t kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) {
                avail = kb * 1024;
                break;
            }
        fclose(f);
    }
    // a container's limit, when it is below what the machine has available
    static const char *const limits[][2] = {
        {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory/memory.usage_in_bytes"},
    };
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        size_t max = read_size_file(limits[i][0]), used = read_size_file(limits[i][1]);
        if (!max || max >= ((size_t)1 << 60)) continue; // no limit
        size_t left = max > used ? max - used : 0;
        if (!avail || left < avail) avail = left;
        break;
    }
    return avail;
}

static void check_mode(const struct stat *st, const char *path, const char *what) {
    if (S_ISDIR(st->st_mode)) fl_die("%s %s is a directory", what, path);
    if (!S_ISREG(st->st_mode)) fl_die("%s %s is not a regular file", what, path);
}

void fl_require_regular_file(const char *path, const char *what) {
    struct stat st;
    if (stat(path, &st) != 0) fl_die("cannot open %s %s: %s", what, path, strerror(errno));
    check_mode(&st, path, what);
}

int fl_open_regular(const char *path, const char *what) {
    // stat first, so a device is never opened (an open can have side
    // effects); O_NONBLOCK and fstat, for a FIFO swapped in after the stat
    fl_require_regular_file(path, what);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) fl_die("cannot open %s %s: %s", what, path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) fl_die("cannot stat %s %s: %s", what, path, strerror(errno));
    check_mode(&st, path, what);
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        fl_die("cannot open %s %s: %s", what, path, strerror(errno));
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
