// out_dir.c: the output directory: one run at a time, never another run's files.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fitlm/config.h"
#include "fitlm/io.h"
#include "out_dir.h"

// Takes DIR/.lock (flock, held until the process exits: the kernel releases
// it however the process ends) and writes the pid into it. A second run into
// DIR fails at once naming the first's pid.
static void lock_dir(const char *dir) {
    char path[FL_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/.lock", dir);
    // never a link, FIFO, device or a file with another name: the pid is
    // written into it (O_NONBLOCK: a FIFO must not block the open)
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    struct stat st;
    if (fd < 0 && errno == ELOOP)
        fl_die("the lock file %s is a symbolic link: fitlm does not write through one; remove it",
               path);
    if (fd < 0 || fstat(fd, &st) != 0)
        fl_die("cannot create the lock file %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
        fl_die("the lock file %s is not a regular file of one link (a FIFO, a device or a hard "
               "link to another name): fitlm does not write into it; remove it",
               path);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char pid[32] = "";
        ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        pid[n > 0 ? n : 0] = 0;
        pid[strcspn(pid, "\n")] = 0;
        if (pid[strspn(pid, "0123456789")]) *pid = 0; // only a pid is ever quoted
        fl_die("%s is in use by another fitlm run (process %s): one run per directory; wait for "
               "it to finish, stop it, or choose another --out",
               dir, *pid ? pid : "unknown");
    }
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n)
        fl_die("cannot write the lock file %s: %s", path, strerror(errno));
    // fd stays open: the lock lives as long as the process
}

// Whether DIR holds a run: `latest`, a checkpoint file or a log.
static int holds_run(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int found = 0;
    for (struct dirent *e; !found && (e = readdir(d));) {
        int step, n = 0;
        found =
            !strcmp(e->d_name, "latest") || !strcmp(e->d_name, "log.txt") ||
            !strcmp(e->d_name, "metrics.jsonl") ||
            (sscanf(e->d_name, "ckpt_%d.fitlm%n", &step, &n) == 1 && n == (int)strlen(e->d_name));
    }
    closedir(d);
    return found;
}

static int same_dir(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

void run_prepare_out_dir(const char *out_dir, const char *resume_dir, int overwrite) {
    fl_mkdir_parents(out_dir);
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        fl_die("cannot create output directory %s: %s", out_dir, strerror(errno));
    if (access(out_dir, W_OK) != 0)
        fl_die("cannot write into output directory %s: %s", out_dir, strerror(errno));
    lock_dir(out_dir);
    fl_tmp_clean(out_dir); // a killed writer's temporaries (only marked ones)
    if (resume_dir && same_dir(resume_dir, out_dir)) return;
    if (!overwrite && holds_run(out_dir))
        fl_die("%s already holds a run (checkpoints, latest, log.txt or metrics.jsonl): continue "
               "it with --resume %s, or start over in it with --overwrite (its checkpoints are not "
               "deleted first, only replaced where this run saves the same step), or choose "
               "another --out",
               out_dir, out_dir);
}

// Time and pid: unique among the runs of a directory.
void run_new_id(char *out, size_t size) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x =
        ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 40);
    snprintf(out, size, "%016llx", (unsigned long long)x);
}
