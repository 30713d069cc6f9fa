// file.c: crash-safe writing. A file is written under a temporary name in its
// own directory, fsynced, renamed over the final name and the directory
// fsynced: a reader sees the old file or the complete new one, never a torn
// mix, whenever the process or the machine dies. The temporary is
// PATH.tmp.<pid>/<name>, in a marked directory of its own (tmp.c): two
// processes writing the same file never write into one temporary, a link
// planted at PATH is replaced by the rename (its target never written), and a
// killed writer's leftover is provably fitlm's; the next run into its
// directory (fl_tmp_clean) deletes it.
#include "fitlm/io.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
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
    if ((size_t)snprintf(f->path, sizeof f->path, "%s", path) >= sizeof f->path)
        fl_die("file name is too long: %s", path);
    fl_tmp_name(f->tmp, sizeof f->tmp, path);
    f->fd = fl_tmp_open(f->tmp);
    if (f->fd < 0) fl_die_not_new(f->tmp);
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
            fl_tmp_discard(f->tmp); // the previous file, if any, is untouched
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
        fl_tmp_discard(f->tmp);
        fl_die("cannot flush %s: %s", f->tmp, strerror(err));
    }
    if (fl_tmp_commit(f->tmp, f->path) != 0)
        fl_die("cannot rename %s to %s: %s", f->tmp, f->path, strerror(errno));
}

void fl_file_write_all(const char *path, const void *data, size_t n) {
    fl_file f;
    fl_file_begin(&f, path);
    fl_file_write(&f, data, n);
    fl_file_commit(&f);
}

// ----------------------------------------------------------------------------
// crash-safe directories (io.h): a set of files written beside DIR and
// swapped in whole. Kept apart from the file functions above.

#include <dirent.h>
#include <stdlib.h>
#include <sys/syscall.h>

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1) // linux/fs.h
#endif

// Splits "a/b/c/" into parent "a/b" and name "c"; 0 when there is no name
// that a sibling could be made for ("", ".", "..", "/").
static int split_path(const char *dir, char *parent, char *name) {
    char copy[FL_FILE_PATH_MAX];
    if ((size_t)snprintf(copy, sizeof copy, "%s", dir) >= sizeof copy)
        fl_die("directory name is too long: %s", dir);
    size_t n = strlen(copy);
    while (n > 1 && copy[n - 1] == '/') copy[--n] = 0;
    char *slash = strrchr(copy, '/');
    const char *base = slash ? slash + 1 : copy;
    if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) return 0;
    strcpy(name, base);
    if (!slash)
        strcpy(parent, ".");
    else if (slash == copy)
        strcpy(parent, "/");
    else
        *slash = 0, strcpy(parent, copy);
    return 1;
}

void fl_mkdir_parents(const char *path) {
    char parent[FL_FILE_PATH_MAX], name[FL_FILE_PATH_MAX];
    if (!split_path(path, parent, name)) return;
    for (char *p = parent + 1;; p++) { // each ancestor, the shortest first
        int end = !*p;
        if (*p != '/' && !end) continue;
        *p = 0;
        struct stat st;
        if (mkdir(parent, 0755) != 0 && errno != EEXIST)
            fl_die("cannot create directory %s: %s", parent, strerror(errno));
        if (stat(parent, &st) != 0 || !S_ISDIR(st.st_mode))
            fl_die("cannot create %s: %s is not a directory", path, parent);
        if (end) return;
        *p = '/';
    }
}

// name is "<base>.<kind>.<pid>"; returns the pid, or 0.
static long leftover_pid(const char *name, const char *base, const char *kind) {
    size_t nb = strlen(base), nk = strlen(kind);
    if (strncmp(name, base, nb) || name[nb] != '.' || strncmp(name + nb + 1, kind, nk) ||
        name[nb + 1 + nk] != '.')
        return 0;
    const char *digits = name + nb + nk + 2;
    char *end;
    long pid = strtol(digits, &end, 10);
    return *digits >= '0' && *digits <= '9' && !*end && pid > 0 ? pid : 0;
}

void fl_dir_recover(const char *dir) {
    char parent[FL_FILE_PATH_MAX], base[FL_FILE_PATH_MAX], path[2 * FL_FILE_PATH_MAX];
    if (!split_path(dir, parent, base)) return;
    // the old set first: with DIR missing it is the only complete one
    for (int pass = 0; pass < 2; pass++) {
        DIR *d = opendir(parent);
        if (!d) return;
        const struct dirent *e;
        while ((e = readdir(d))) {
            long pid = leftover_pid(e->d_name, base, pass ? "tmp" : "old");
            snprintf(path, sizeof path, "%s/%s", parent, e->d_name);
            if (!pid || !fl_tmp_is_leftover(path, pid)) continue; // not fitlm's, or still writing
            struct stat st;
            if (!pass && lstat(dir, &st) != 0 && errno == ENOENT) {
                if (rename(path, dir) != 0)
                    fl_die("cannot restore %s from %s: %s", dir, path, strerror(errno));
                fl_fsync_dir_of(path);
                fl_tmp_unmark(dir);
                fl_warn("restored %s from %s (a writer was killed while swapping it)", dir, path);
                continue;
            }
            fl_tmp_remove_tree(path);
        }
        closedir(d);
    }
    // a marker a killed writer left in DIR itself (after its swap)
    if (fl_tmp_dead_writer(dir)) fl_tmp_unmark(dir);
}

// Whether DIR may be replaced whole (see io.h); *run: it holds a run's
// checkpoints, which a run may be writing.
static int swappable(const char *dir, int *run) {
    DIR *d = opendir(dir);
    if (!d) fl_die("cannot list %s: %s", dir, strerror(errno));
    int ok = 1;
    *run = 0;
    const struct dirent *e;
    char path[2 * FL_FILE_PATH_MAX];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        *run |= !strcmp(e->d_name, "latest") || !strncmp(e->d_name, "ckpt_", 5);
        ok &= lstat(path, &st) == 0 && S_ISREG(st.st_mode);
    }
    closedir(d);
    return ok && !*run;
}

const char *fl_dir_begin(fl_dir_txn *t, const char *dir, int (*in_set)(const char *name)) {
    memset(t, 0, sizeof *t);
    char parent[FL_FILE_PATH_MAX], base[FL_FILE_PATH_MAX];
    if ((size_t)snprintf(t->dir, sizeof t->dir, "%s", dir) >= sizeof t->dir)
        fl_die("directory name is too long: %s", dir);
    fl_mkdir_parents(dir);
    fl_dir_recover(dir);
    struct stat st;
    int exists = lstat(dir, &st) == 0;
    if (exists && !S_ISDIR(st.st_mode) && !S_ISLNK(st.st_mode))
        fl_die("%s exists and is not a directory", dir);
    int run = 1, whole = exists && S_ISDIR(st.st_mode) && swappable(dir, &run);
    if (exists && S_ISDIR(st.st_mode) && !run) { // a killed in-place writer's temporaries
        fl_tmp_clean(dir);
        whole = swappable(dir, &run);
    }
    t->whole = split_path(dir, parent, base) && (!exists || whole);
    if (!t->whole) { // in place
        if (mkdir(dir, 0755) != 0 && errno != EEXIST)
            fl_die("cannot create directory %s: %s", dir, strerror(errno));
        return t->dir;
    }
    if ((size_t)snprintf(t->tmp, sizeof t->tmp, "%s/%s.tmp.%ld", parent, base, (long)getpid()) >=
            sizeof t->tmp ||
        (size_t)snprintf(t->old, sizeof t->old, "%s/%s.old.%ld", parent, base, (long)getpid()) >=
            sizeof t->old)
        fl_die("directory name is too long: %s", dir);
    if (mkdir(t->tmp, exists ? st.st_mode & 07777 : 0755) != 0)
        fl_die("cannot create directory %s: %s%s", t->tmp, strerror(errno),
               errno == EEXIST ? " (it is not fitlm's: move it away)" : "");
    fl_tmp_mark(t->tmp); // first: from now on it is provably ours
    if (!exists) return t->tmp;
    // the files that are not the set's stay (a tokenizer beside an export)
    DIR *d = opendir(dir);
    if (!d) fl_die("cannot list %s: %s", dir, strerror(errno));
    const struct dirent *e;
    char from[2 * FL_FILE_PATH_MAX], to[2 * FL_FILE_PATH_MAX];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || fl_tmp_is_mark(e->d_name) ||
            !in_set || in_set(e->d_name))
            continue;
        snprintf(from, sizeof from, "%s/%s", dir, e->d_name);
        snprintf(to, sizeof to, "%s/%s", t->tmp, e->d_name);
        if (link(from, to) != 0)
            fl_die("cannot keep %s in the new %s (hard link to %s): %s", from, dir, to,
                   strerror(errno));
    }
    closedir(d);
    return t->tmp;
}

void fl_dir_commit(fl_dir_txn *t) {
    if (!t->whole) return;
    // the new files' data and names are durable before the swap
    int dfd = open(t->tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0) fl_die("cannot flush %s: %s", t->tmp, strerror(errno));
    close(dfd);
    struct stat st;
    if (lstat(t->dir, &st) != 0) { // nothing to replace
        if (rename(t->tmp, t->dir) != 0)
            fl_die("cannot rename %s to %s: %s", t->tmp, t->dir, strerror(errno));
        fl_fsync_dir_of(t->dir);
        fl_tmp_unmark(t->dir);
        return;
    }
    // the old set is marked too: once swapped out it is a temporary of ours
    fl_tmp_mark(t->dir);
    int swapped = 0;
#ifdef SYS_renameat2
    // one step: DIR is never missing; tmp then holds the old set (the
    // variable lets the tests kill writers on the two-step path too)
    if (!getenv("FITLM_TEST_NO_EXCHANGE"))
        swapped = syscall(SYS_renameat2, AT_FDCWD, t->tmp, AT_FDCWD, t->dir, RENAME_EXCHANGE) == 0;
#endif
    if (swapped) {
        fl_fsync_dir_of(t->dir);
        fl_tmp_unmark(t->dir);
        fl_tmp_remove_tree(t->tmp);
        return;
    }
    // two steps: a kill between them leaves DIR.old.<pid>, which the next
    // fl_dir_recover renames back
    if (rename(t->dir, t->old) != 0)
        fl_die("cannot move %s aside to %s: %s", t->dir, t->old, strerror(errno));
    if (rename(t->tmp, t->dir) != 0)
        fl_die("cannot rename %s to %s: %s", t->tmp, t->dir, strerror(errno));
    fl_fsync_dir_of(t->dir);
    fl_tmp_unmark(t->dir); // a crash may bring it back: a dead writer's, removed next time
    fl_tmp_remove_tree(t->old);
}
