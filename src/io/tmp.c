// tmp.c: what fitlm may write, replace or delete (io.h). Outputs are created
// as new files (O_EXCL|O_NOFOLLOW) and renamed into place, so a link, FIFO or
// hard link planted at a name is replaced or refused, never written through.
// Every temporary is a directory NAME.tmp.<pid> whose first entry is a
// marker file naming its writer (pid, boot id, start time): a leftover is
// deleted only with that proof and only once its writer is gone, so a
// user's file or directory that merely looks like one (results.old.2024) is
// never touched.
#include "fitlm/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MARK_NAME  ".fitlm-dir"
#define MARK_MAGIC "fitlm temporary directory\n"

// A new file to write: never an existing one, never through a link.
static int open_new(const char *path) {
    return open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
}

void fl_die_not_new(const char *path) {
    if (errno == EEXIST)
        fl_die("cannot create %s: something of that name is already there (fitlm writes only "
               "files it creates; remove it if it is a leftover)",
               path);
    fl_die("cannot create %s: %s", path, strerror(errno));
}

FILE *fl_fopen_append(const char *path, const char *what) {
    // O_NONBLOCK: opening a FIFO to write must fail, not wait for a reader
    int fd = open(path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 && errno == ELOOP)
        fl_die("%s %s is a symbolic link: fitlm does not write through one", what, path);
    if (fd < 0 || fstat(fd, &st) != 0)
        fl_die("cannot open %s %s for writing: %s", what, path, strerror(errno));
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
        fl_die("%s %s is not a regular file of one link (a FIFO, a device or a hard link to "
               "another name): fitlm does not write into it",
               what, path);
    FILE *f = fdopen(fd, "a");
    if (!f) fl_die("cannot open %s %s for writing: %s", what, path, strerror(errno));
    return f;
}

void fl_name_excerpt(char *out, size_t size, const char *bytes, size_t n, uint64_t total,
                     const char *prefix) {
    int named = n > 0 && n <= 40 && !strncmp(bytes, prefix, strlen(prefix));
    for (size_t i = 0; named && i < n; i++)
        named = (bytes[i] >= 'a' && bytes[i] <= 'z') || (bytes[i] >= 'A' && bytes[i] <= 'Z') ||
                (bytes[i] >= '0' && bytes[i] <= '9') || (bytes[i] && strchr("._-", bytes[i]));
    if (named)
        snprintf(out, size, "'%.*s'", (int)n, bytes);
    else
        snprintf(out, size, "%llu bytes that are not a name", (unsigned long long)total);
}

// ----------------------------------------------------------------------------
// markers

// The machine's boot id and a process's start time (clock ticks since boot,
// /proc/PID/stat field 22): with the pid they name one process, so a pid
// reused by another program after a writer died is not taken for it.
static void boot_id(char *out, size_t size) {
    snprintf(out, size, "unknown");
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f && fgets(out, (int)size, f)) out[strcspn(out, "\n")] = 0;
    if (f) fclose(f);
}

// /proc/<pid>/stat after the process's name (which may hold spaces): " S
// ppid ...", the state first; NULL when there is no such process.
static const char *proc_stat(long pid, char *buf, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, size - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] && p[2] ? p + 1 : NULL;
}

static unsigned long long start_time(long pid) {
    char buf[1024];
    const char *p = proc_stat(pid, buf, sizeof buf);
    unsigned long long t = 0;
    if (p && sscanf(p,
                    " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d "
                    "%llu",
                    &t) != 1)
        t = 0;
    return t;
}

// Whether process pid started more than 2 s after dir was last changed: it
// cannot have made it (its pid is a dead writer's, reused; pid_max may be
// as low as 32768, so pids wrap in a busy minute). Seconds since the epoch
// from the boot time (/proc/stat's btime) and the start in clock ticks.
static int started_after(long pid, const char *dir) {
    struct stat st;
    unsigned long long ticks = start_time(pid), btime = 0;
    char line[256];
    FILE *f = fopen("/proc/stat", "r");
    while (f && fgets(line, sizeof line, f) && sscanf(line, "btime %llu", &btime) != 1) continue;
    if (f) fclose(f);
    long hz = sysconf(_SC_CLK_TCK);
    if (!ticks || !btime || hz <= 0 || lstat(dir, &st) != 0) return 0;
    return (double)btime + (double)ticks / (double)hz > (double)st.st_mtime + 2.0;
}

// A process that can still write: a zombie (killed, not yet reaped: its
// parent, mpirun say, may have exited first and left it to init) cannot.
static int running(long pid) {
    if (pid == (long)getpid()) return 1;
    if (kill((pid_t)pid, 0) != 0 && errno != EPERM) return 0;
    char buf[1024];
    const char *p = proc_stat(pid, buf, sizeof buf);
    return !(p && (p[1] == 'Z' || p[1] == 'X'));
}

void fl_tmp_mark(const char *dir) {
    char path[FL_FILE_PATH_MAX + 16], boot[64], text[256];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, MARK_NAME) >= sizeof path)
        fl_die("directory name is too long: %s", dir);
    boot_id(boot, sizeof boot);
    int n = snprintf(text, sizeof text, "%spid %ld\nboot %s\nstart %llu\n", MARK_MAGIC,
                     (long)getpid(), boot, start_time((long)getpid()));
    int fd = open_new(path);
    if (fd < 0) fl_die_not_new(path);
    if (write(fd, text, (size_t)n) != n || close(fd) != 0)
        fl_die("cannot write %s: %s", path, strerror(errno));
}

void fl_tmp_unmark(const char *dir) {
    char path[FL_FILE_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%s", dir, MARK_NAME);
    if (unlink(path) != 0 && errno != ENOENT) fl_die("cannot remove %s: %s", path, strerror(errno));
}

// What dir (not followed if a link) holds: 1, with the marker's pid and
// whether that writer is gone; 0 when nothing, or only an empty marker (a
// writer killed before it wrote one: a write this short is never cut; or
// after it removed it); -1 anything else.
static int inspect(const char *dir, long *pid, int *gone) {
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) return -1;
    char text[256] = "", boot[64] = "", mine[64];
    int fd = openat(dfd, MARK_NAME, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    ssize_t n = fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode)
                    ? read(fd, text, sizeof text - 1)
                    : -1;
    if (fd >= 0) close(fd);
    text[n > 0 ? n : 0] = 0;
    unsigned long long t = 0;
    size_t nm = strlen(MARK_MAGIC);
    *pid = 0;
    if (n > 0) {
        close(dfd);
        if (strncmp(text, MARK_MAGIC, nm) ||
            sscanf(text + nm, "pid %ld\nboot %63s\nstart %llu\n", pid, boot, &t) != 3 || *pid <= 0)
            return -1;
        boot_id(mine, sizeof mine);
        // this process's pid: a dead namesake's, as this process has none under way
        *gone =
            *pid == (long)getpid() || strcmp(boot, mine) || !running(*pid) || start_time(*pid) != t;
        return 1;
    }
    if (n < 0 && fd >= 0) {
        close(dfd);
        return -1; // a marker that is not a regular file
    }
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return -1;
    }
    int others = 0;
    for (const struct dirent *e; (e = readdir(d));)
        others += strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, MARK_NAME);
    closedir(d);
    return others ? -1 : 0;
}

long fl_tmp_dead_writer(const char *dir) {
    long pid;
    int gone = 0;
    return inspect(dir, &pid, &gone) == 1 && gone ? pid : 0;
}

int fl_tmp_is_leftover(const char *dir, long pid) {
    long marked;
    int gone = 0, r = inspect(dir, &marked, &gone);
    if (r == 1) return marked == pid && gone;
    return r == 0 && (pid == (long)getpid() || !running(pid) || started_after(pid, dir));
}

int fl_tmp_is_mark(const char *name) {
    return !strcmp(name, MARK_NAME);
}

// Removes name (in the directory dfd) and, when it is a directory,
// everything in it; never follows a symlink (it is unlinked, not its
// target); a missing name is no error. shown: the path, for messages.
static void remove_at(int dfd, const char *name, const char *shown) {
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
        if (!d) fl_die("cannot list %s: %s", shown, strerror(errno));
        const struct dirent *e;
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, MARK_NAME))
                remove_at(dirfd(d), e->d_name, shown);
        // the marker last: a kill in the middle leaves a leftover still provably ours
        remove_at(dirfd(d), MARK_NAME, shown);
        closedir(d);
    }
    if (unlinkat(dfd, name, S_ISDIR(st.st_mode) ? AT_REMOVEDIR : 0) != 0 && errno != ENOENT)
        fl_die("cannot remove %s (%s): %s", shown, name, strerror(errno));
}

void fl_tmp_remove_tree(const char *path) {
    remove_at(AT_FDCWD, path, path);
}

// ----------------------------------------------------------------------------
// temporary files: PATH.tmp.<pid>/<name>, in a marked directory of their own

void fl_tmp_name(char *out, size_t size, const char *path) {
    const char *slash = strrchr(path, '/');
    if ((size_t)snprintf(out, size, "%s.tmp.%ld/%s", path, (long)getpid(),
                         slash ? slash + 1 : path) >= size)
        fl_die("file name is too long: %s", path);
}

// tmp's directory (tmp up to its last '/').
static void dir_of(char *out, size_t size, const char *tmp) {
    snprintf(out, size, "%s", tmp);
    *strrchr(out, '/') = 0;
}

int fl_tmp_open(const char *tmp) {
    char dir[FL_FILE_PATH_MAX + 64];
    dir_of(dir, sizeof dir, tmp);
    if (fl_tmp_is_leftover(dir, (long)getpid())) fl_tmp_remove_tree(dir); // a dead namesake's
    if (mkdir(dir, 0755) != 0) return -1;                                 // EEXIST: not ours
    fl_tmp_mark(dir); // first: from now on it is provably ours
    int fd = open_new(tmp);
    if (fd < 0) {
        int err = errno;
        fl_tmp_remove_tree(dir);
        errno = err;
    }
    return fd;
}

void fl_tmp_discard(const char *tmp) {
    char dir[FL_FILE_PATH_MAX + 64];
    dir_of(dir, sizeof dir, tmp);
    if (fl_tmp_is_leftover(dir, (long)getpid())) fl_tmp_remove_tree(dir);
}

int fl_tmp_commit(const char *tmp, const char *path) {
    char dir[FL_FILE_PATH_MAX + 64];
    dir_of(dir, sizeof dir, tmp);
    if (rename(tmp, path) != 0) {
        int err = errno;
        fl_tmp_discard(tmp);
        errno = err;
        return -1;
    }
    fl_tmp_unmark(dir);
    rmdir(dir); // fails only if another put something there: then it stays
    fl_fsync_dir_of(path);
    return 0;
}

void fl_tmp_clean(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char path[2 * FL_FILE_PATH_MAX];
    for (const struct dirent *e; (e = readdir(d));) {
        const char *t = strstr(e->d_name, ".tmp.");
        while (t && strstr(t + 1, ".tmp.")) t = strstr(t + 1, ".tmp.");
        char *end = "";
        long pid = t && t[5] >= '0' && t[5] <= '9' ? strtol(t + 5, &end, 10) : 0;
        if (pid > 0 && !*end &&
            (size_t)snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < sizeof path &&
            fl_tmp_is_leftover(path, pid))
            fl_tmp_remove_tree(path);
    }
    closedir(d);
}
