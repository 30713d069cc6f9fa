// test_failures.c: a data-parallel run (mpirun -np 2 fitlm train) whose rank
// is killed, hangs or fails ends at once, non-zero, with a message naming
// the rank, as does a pipeline of 4 stages one of which is killed or
// stopped, and a point-to-point message never matched, at its deadline;
// ranks started with different settings or builds stop before their first
// collective, naming the first differing key and the ranks; two ranks over
// TCP train exactly as over shared memory; and a tensor-parallel run
// reports the traffic Megatron's layout predicts.
//
// Each case starts mpirun in the background with its output on pipes, finds
// a rank's process (a child of mpirun whose environment says its rank),
// waits for training to run, does the damage and times the job's end from
// that moment. Every job has a deadline after which the test ends it
// itself, so the test never hangs.
#include <ctype.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testlib.h"

// Seconds any one job may take before the test ends it (ASan included).
#define JOB_DEADLINE 90.0

// One training run, with the words that make it quick and endless: it is
// ended by the test, or by --steps when given again later on the line.
#define TRAIN                                                                                      \
    "train --model tiny --data data/brown_byte --tokenizer byte --seq-len 32 --threads 1 "         \
    "--sample-tokens 0 --val-data none --out '' --steps 100000"

typedef struct {
    pid_t pid; // mpirun
    int out, err;
    char *text[2]; // stdout, stderr so far (NUL-terminated)
    size_t len[2], cap[2];
    int status, done;
    double started, ended;
} job;

static job *running; // for the alarm's last resort

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Starts `mpirun.openmpi --bind-to none MPIRUN_ARGS` through the shell
// in the source tree (the data paths are relative), with `env` (NAME=VALUE
// strings, NULL-terminated, may be NULL) added.
static void job_start(job *j, const char *mpirun_args, const char *const *env) {
    *j = (job){.pid = -1, .out = -1, .err = -1};
    for (int k = 0; k < 2; k++) {
        j->cap[k] = 1 << 16;
        j->text[k] = calloc(1, j->cap[k]);
    }
    int po[2], pe[2];
    if (pipe(po) || pipe(pe)) {
        j->done = 1, j->status = 127 << 8; // as if it had exited with 127
        return;
    }
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "exec mpirun.openmpi --bind-to none %s", mpirun_args);
    fflush(stdout);
    fflush(stderr);
    j->started = now();
    j->pid = fork();
    if (j->pid == 0) {
        dup2(po[1], 1);
        dup2(pe[1], 2);
        close(po[0]), close(po[1]), close(pe[0]), close(pe[1]);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        if (chdir(t_source_path("")) != 0) _exit(126);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(po[1]), close(pe[1]);
    j->out = po[0], j->err = pe[0];
    if (j->pid < 0) {
        close(j->out), close(j->err);
        j->out = j->err = -1;
        j->done = 1, j->status = 127 << 8;
    }
    running = j;
}

// Appends what fd has to text k. stdout, rank 0's progress, is endless: past
// 1 MiB only its second half is kept.
static int job_read(job *j, int k) {
    int fd = k ? j->err : j->out;
    if (j->len[k] + 4096 + 1 > j->cap[k]) {
        if (j->cap[k] < (1u << 20)) {
            j->cap[k] *= 2;
            j->text[k] = realloc(j->text[k], j->cap[k]);
        } else {
            size_t half = j->len[k] / 2;
            memmove(j->text[k], j->text[k] + half, j->len[k] - half);
            j->len[k] -= half;
        }
    }
    ssize_t n = read(fd, j->text[k] + j->len[k], 4096);
    if (n > 0) j->len[k] += (size_t)n;
    j->text[k][j->len[k]] = 0;
    return (int)n;
}

// Reads output for up to `seconds`, or until stdout holds `until` (when not
// NULL) or the job has ended with its output closed. Returns whether the
// job has ended.
static int job_pump(job *j, double seconds, const char *until) {
    double end = now() + seconds;
    while (!j->done || j->out >= 0 || j->err >= 0) {
        if (until && strstr(j->text[0], until)) break;
        double left = end - now();
        if (left <= 0) break;
        struct pollfd p[2] = {{.fd = j->out, .events = POLLIN}, {.fd = j->err, .events = POLLIN}};
        poll(p, 2, left < 0.02 ? 1 : 20);
        for (int k = 0; k < 2; k++)
            if (p[k].fd >= 0 && (p[k].revents & (POLLIN | POLLHUP)) && job_read(j, k) <= 0) {
                close(p[k].fd);
                *(k ? &j->err : &j->out) = -1;
            }
        if (!j->done && waitpid(j->pid, &j->status, WNOHANG) == j->pid) {
            j->done = 1;
            j->ended = now();
        }
    }
    return j->done;
}

// mpirun's exit status the way a shell reports it (128 + a signal).
static int job_rc(const job *j) {
    if (!j->done) return -1;
    return WIFEXITED(j->status) ? WEXITSTATUS(j->status) : 128 + WTERMSIG(j->status);
}

// A /proc file, read to its end (its size reads as 0), NUL-terminated
// (free() it); NULL when it cannot be opened.
static char *read_proc(const char *path, size_t *n) {
    int fd = open(path, O_RDONLY);
    *n = 0;
    if (fd < 0) return NULL;
    size_t cap = 4096;
    char *b = malloc(cap);
    ssize_t r;
    while (b && (r = read(fd, b + *n, cap - 1 - *n)) > 0) {
        *n += (size_t)r;
        if (*n + 1 < cap) continue;
        char *more = realloc(b, cap *= 2);
        if (!more) free(b);
        b = more;
    }
    close(fd);
    if (b) b[*n] = 0;
    return b;
}

// The process of rank `rank`: a child of mpirun whose environment holds
// OMPI_COMM_WORLD_RANK=rank. 0 when there is none (yet).
static pid_t rank_pid(pid_t mpirun, int rank) {
    DIR *d = opendir("/proc");
    if (!d) return 0;
    char want[64];
    int wlen = snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", rank);
    pid_t found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        if (!isdigit((unsigned char)e->d_name[0])) continue;
        char path[300];
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        size_t n;
        char *stat = read_proc(path, &n);
        char *paren = stat ? strrchr(stat, ')') : NULL;
        int ppid = 0;
        if (paren) sscanf(paren + 1, " %*c %d", &ppid);
        free(stat);
        if (ppid != mpirun) continue;
        snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
        char *env = read_proc(path, &n);
        if (!env) continue;
        for (size_t i = 0; i < n; i += strlen(env + i) + 1)
            if (strncmp(env + i, want, (size_t)wlen) == 0 && env[i + (size_t)wlen] == 0)
                found = (pid_t)atoi(e->d_name);
        free(env);
    }
    closedir(d);
    return found;
}

// Whether process pid is gone: no entry, a zombie waiting for its parent,
// or another program by now (its pid reused), which is never to be killed.
static int process_gone(pid_t pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    size_t n;
    char *stat = read_proc(path, &n);
    char *paren = stat ? strrchr(stat, ')') : NULL;
    int gone = !paren || paren[2] == 'Z' || paren[2] == 'X' || !strstr(stat, " (fitlm) ");
    free(stat);
    return gone;
}

// Ends a job that outlived its deadline: mpirun ends its ranks on SIGTERM;
// a rank still there after that (stopped, say) is killed by its pid (the
// n pids in ranks, 0 where unknown).
static void job_end(job *j, const pid_t *ranks, int n) {
    if (j->pid > 0 && !j->done) {
        kill(j->pid, SIGTERM);
        if (!job_pump(j, 10.0, NULL)) {
            kill(j->pid, SIGKILL);
            job_pump(j, 5.0, NULL);
        }
    }
    for (int i = 0; i < n; i++)
        if (ranks[i] > 0 && !process_gone(ranks[i])) {
            kill(ranks[i], SIGKILL);
            kill(ranks[i], SIGCONT);
        }
}

static void job_free(job *j) {
    if (j->out >= 0) close(j->out);
    if (j->err >= 0) close(j->err);
    free(j->text[0]), free(j->text[1]);
    running = NULL;
}

// The alarm's last resort, should a case's own deadline fail: end mpirun.
static void on_alarm(int sig) {
    (void)sig;
    if (running && running->pid > 0) kill(running->pid, SIGKILL);
    static const char msg[] = "FAIL: test_failures ran out of time\n";
    if (write(2, msg, sizeof msg - 1) < 0) _exit(2);
    _exit(1);
}

// Starts an np-rank run (mpirun -q unless loud) with `extra` train flags,
// waits for step `step` and fills pids with the ranks' processes (0 on
// failure, checked for rank `rank`, which it returns).
static pid_t start_training(job *j, const char *what, int np, const char *extra, int loud, int step,
                            int rank, pid_t *pids) {
    char args[4096], at[64];
    snprintf(args, sizeof args, "%s-np %d %s %s %s", loud ? "" : "-q ", np, getenv("FITLM_BINARY"),
             TRAIN, extra);
    snprintf(at, sizeof at, "step %d/100000", step);
    job_start(j, args, NULL);
    job_pump(j, JOB_DEADLINE, at);
    for (int r = 0; r < np; r++) pids[r] = j->done ? 0 : rank_pid(j->pid, r);
    t_check(pids[rank] > 0 && strstr(j->text[0], at),
            "%s: training runs to %s, rank %d is process %d (mpirun status %d): %.300s", what, at,
            rank, (int)pids[rank], job_rc(j), j->text[1]);
    return pids[rank];
}

// Prints what the job said on stderr, indented: what a user would see.
static void show_stderr(const job *j) {
    for (const char *p = j->text[1]; *p;) {
        size_t n = strcspn(p, "\n");
        printf("    | %.*s\n", (int)n, p);
        p += n + (p[n] == '\n');
    }
}

static int ranks_gone(const pid_t *ranks, int n) {
    for (int i = 0; i < n; i++)
        if (ranks[i] > 0 && !process_gone(ranks[i])) return 0;
    return 1;
}

// The ranks' processes are gone once mpirun has ended (none is orphaned).
static void check_no_rank_left(const char *what, const pid_t *ranks, int n) {
    double end = now() + 2.0;
    while (now() < end && !ranks_gone(ranks, n)) usleep(20000);
    t_check(ranks_gone(ranks, n), "%s: no rank process outlives mpirun", what);
}

// kill -9 of one rank mid-training: the job ends within 5 s, non-zero, and
// the rank that waited for it says which rank ended. Under mpirun -q that
// is the only message naming it; without -q, mpirun names it too.
static void test_kill(int rank, const char *extra, int loud) {
    char what[128];
    snprintf(what, sizeof what, "kill -9 of rank %d (%s%s)", rank, extra,
             loud ? ", mpirun without -q" : "");
    job j;
    pid_t pids[2];
    pid_t victim = start_training(&j, what, 2, extra, loud, 3, rank, pids);
    double t_kill = now();
    if (victim > 0) kill(victim, SIGKILL);
    int ended = victim > 0 && job_pump(&j, JOB_DEADLINE, NULL);
    double took = (ended ? j.ended : now()) - t_kill;
    printf("  %-50s ended %.2f s after the kill, status %d\n", what, took, job_rc(&j));
    show_stderr(&j);
    t_check(ended && took < 5.0 && job_rc(&j) == 128 + SIGKILL,
            "%s: the job ends within 5 s of the kill, status 137 (%.2f s, status %d)", what, took,
            job_rc(&j));
    char says[160];
    snprintf(says, sizeof says, "fitlm: rank %d: error: rank %d (process %d) has ended", 1 - rank,
             rank, (int)victim);
    t_check(strstr(j.text[1], says) != NULL, "%s: stderr says \"%s\"; got: %.600s", what, says,
            j.text[1]);
    if (loud) {
        snprintf(says, sizeof says, "noticed that process rank %d with PID", rank);
        t_check(strstr(j.text[1], says) && strstr(j.text[1], "exited on signal 9"),
                "%s: mpirun says \"%s ... exited on signal 9\"; got: %.600s", what, says,
                j.text[1]);
    } else {
        t_check(!strstr(j.text[1], "noticed that process"),
                "%s: mpirun -q prints no notice of its own (our message is the one naming the "
                "rank): %.600s",
                what, j.text[1]);
    }
    job_end(&j, pids, 2);
    check_no_rank_left(what, pids, 2);
    job_free(&j);
}

// SIGSTOP of one rank (a hang): the other rank's collective times out after
// --comm-timeout 3 s and ends the job, naming itself, the operation and the
// stopped rank; the job is over soon after the timeout.
static void test_hang(void) {
    const char *what = "SIGSTOP of rank 1 (--comm-timeout 3)";
    const double timeout = 3.0;
    job j;
    pid_t pids[2];
    pid_t victim = start_training(&j, what, 2, "--comm-timeout 3", 0, 3, 1, pids);
    double t_stop = now();
    if (victim > 0) kill(victim, SIGSTOP);
    int ended = victim > 0 && job_pump(&j, JOB_DEADLINE, NULL);
    double took = (ended ? j.ended : now()) - t_stop;
    printf("  %-50s ended %.2f s after the stop, status %d\n", what, took, job_rc(&j));
    show_stderr(&j);
    // the deadline counts from the start of the wait, at most a step after
    // the stop; after it, MPI_Abort takes well under a second
    t_check(ended && took > timeout - 0.1 && took < timeout + 4.0 && job_rc(&j) != 0,
            "%s: the job ends a little after the timeout, non-zero (%.2f s, status %d)", what, took,
            job_rc(&j));
    char stopped[96];
    snprintf(stopped, sizeof stopped, "fitlm: rank 0: rank 1 (process %d) is stopped", (int)victim);
    t_check(strstr(j.text[1], "fitlm: rank 0: error: ") &&
                strstr(j.text[1], "did not complete within 3 s (--comm-timeout)") &&
                strstr(j.text[1], stopped),
            "%s: rank 0 names itself, the operation, the timeout and the stopped rank; got: %.600s",
            what, j.text[1]);
    job_end(&j, pids, 2);
    check_no_rank_left(what, pids, 2);
    job_free(&j);
}

// A pipeline of 4 stages (ranks 0-3 in order, the tied head's data sent
// from the last to the first), run long enough to have reused its request
// slots many times over.
#define PIPELINE      "--n-layer 4 --pipeline-parallel 4 --grad-accum 4"
#define PIPELINE_STEP 12

// The first line of text that holds `key` (NUL-terminated, in line).
static void line_with(const char *text, const char *key, char *line, size_t size) {
    const char *at = strstr(text, key);
    line[0] = 0;
    if (!at) return;
    while (at > text && at[-1] != '\n') at--;
    snprintf(line, size, "%.*s", (int)strcspn(at, "\n"), at);
}

// kill -9 of a middle stage (rank 1) mid-step: the job ends within 5 s,
// non-zero (mpirun reports 137 or the status of a rank that left on
// noticing, whichever it sees first), and the ranks that notice name it;
// a rank that waited on rank 1 itself names rank 1, not another rank that
// has left on noticing first.
static void test_pipeline_kill(void) {
    const char *what = "kill -9 of stage 1 of 4 (--pipeline-parallel 4)";
    job j;
    pid_t pids[4];
    pid_t victim = start_training(&j, what, 4, PIPELINE, 0, PIPELINE_STEP, 1, pids);
    double t_kill = now();
    if (victim > 0) kill(victim, SIGKILL);
    int ended = victim > 0 && job_pump(&j, JOB_DEADLINE, NULL);
    double took = (ended ? j.ended : now()) - t_kill;
    printf("  %-50s ended %.2f s after the kill, status %d\n", what, took, job_rc(&j));
    show_stderr(&j);
    t_check(ended && took < 5.0 && (job_rc(&j) == 128 + SIGKILL || job_rc(&j) == 1),
            "%s: the job ends within 5 s of the kill, status 137 or 1 (%.2f s, status %d)", what,
            took, job_rc(&j));
    char says[96];
    snprintf(says, sizeof says, "error: rank 1 (process %d) has ended (killed or exited)",
             (int)victim);
    t_check(strstr(j.text[1], says) != NULL, "%s: stderr says \"%s\"; got: %.600s", what, says,
            j.text[1]);
    for (const char *p = j.text[1]; *p;) {
        size_t n = strcspn(p, "\n");
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)n, p);
        if (strstr(line, "waited in a send to rank 1;") ||
            strstr(line, "waited in a receive from rank 1;"))
            t_check(strstr(line, says) != NULL, "%s: a wait on rank 1 names it: %s", what, line);
        p += n + (p[n] == '\n');
    }
    job_end(&j, pids, 4);
    check_no_rank_left(what, pids, 4);
    job_free(&j);
}

// SIGSTOP of a middle stage (rank 1): its neighbours wait on its sends and
// receives, the others on theirs. The first wait to pass --comm-timeout 3
// ends the job a little after it, naming the message and its peer by world
// rank, and the stopped rank.
static void test_pipeline_hang(void) {
    const char *what = "SIGSTOP of stage 1 of 4 (--comm-timeout 3)";
    const double timeout = 3.0;
    job j;
    pid_t pids[4];
    pid_t victim =
        start_training(&j, what, 4, PIPELINE " --comm-timeout 3", 0, PIPELINE_STEP, 1, pids);
    double t_stop = now();
    if (victim > 0) kill(victim, SIGSTOP);
    int ended = victim > 0 && job_pump(&j, JOB_DEADLINE, NULL);
    double took = (ended ? j.ended : now()) - t_stop;
    printf("  %-50s ended %.2f s after the stop, status %d\n", what, took, job_rc(&j));
    show_stderr(&j);
    t_check(ended && took > timeout - 0.1 && took < timeout + 4.0 && job_rc(&j) != 0,
            "%s: the job ends a little after the timeout, non-zero (%.2f s, status %d)", what, took,
            job_rc(&j));
    // the first to time out: a neighbour waiting on rank 1 as a rule, but
    // a rank further down the chain may have begun its wait first, and
    // ranks past the step's last message wait in its collectives
    char first[512], stopped[128], op[256] = "";
    line_with(j.text[1], " did not complete within ", first, sizeof first);
    int rank = -1, peer = -1;
    sscanf(first, "fitlm: rank %d: error: %255[^\n]", &rank, op);
    char *end = strstr(op, " did not complete within 3 s (--comm-timeout)");
    if (end) *end = 0;
    if (sscanf(op, "a send to rank %d", &peer) != 1) sscanf(op, "a receive from rank %d", &peer);
    int d = rank - peer;
    int next = peer < 0 || d == 1 || d == -1 || d == 3 || d == -3; // the tied head: 3 and 0
    t_check(end && rank >= 0 && rank != 1 && next,
            "%s: the first error is a deadline of rank 0, 2 or 3, a message naming a neighbour "
            "(world rank) or a collective: %s",
            what, first);
    snprintf(stopped, sizeof stopped, ": rank 1 (process %d) is stopped (by a signal)",
             (int)victim);
    t_check(strstr(j.text[1], stopped) != NULL, "%s: a rank that timed out says \"%s\"", what,
            stopped);
    job_end(&j, pids, 4);
    check_no_rank_left(what, pids, 4);
    job_free(&j);
}

// A point-to-point message whose other side never comes (test_dist
// --p2p-hang, a 1 s deadline): a send that is never received, a receive
// that is never sent, between world ranks 0 and 1 (np 2) or between ranks
// 0 and 1 of the group of world ranks {1, 3} (np 4). The waiting rank ends
// the job soon after the deadline, naming itself, the operation and the
// peer, by their world ranks.
static void test_p2p_hang(const char *kind, int np) {
    char what[96], args[4096];
    snprintf(what, sizeof what, "a %s that never completes (1 s, %s)", kind,
             np == 2 ? "world" : "ranks {1, 3}");
    snprintf(args, sizeof args, "-q -np %d %s --p2p-hang %s", np, getenv("FITLM_TEST_DIST"), kind);
    job j;
    job_start(&j, args, NULL);
    int ended = job_pump(&j, JOB_DEADLINE, NULL);
    double took = (ended ? j.ended : now()) - j.started;
    printf("  %-50s ended after %.2f s, status %d\n", what, took, job_rc(&j));
    show_stderr(&j);
    int sending = !strcmp(kind, "send"), waiter = sending ? 0 : 1, peer = 1 - waiter;
    if (np == 4) waiter = 2 * waiter + 1, peer = 2 * peer + 1; // group rank r is world 2r + 1
    char says[160];
    snprintf(says, sizeof says,
             "fitlm: rank %d: error: a %s rank %d did not complete within 1 s (--comm-timeout)",
             waiter, sending ? "send to" : "receive from", peer);
    t_check(ended && took < 15.0 && job_rc(&j) != 0,
            "%s: the job ends soon after the deadline, non-zero (%.2f s, status %d)", what, took,
            job_rc(&j));
    t_check(strstr(j.text[1], says) && !strstr(j.text[1], "was not stopped"),
            "%s: stderr says \"%s\"; got: %.600s", what, says, j.text[1]);
    if (!ended) job_end(&j, NULL, 0);
    job_free(&j);
}

// One rank fails with an error: the data directory is missing on its
// machine. The ranks run the same command line, but rank 1 in a working
// directory without data/ (mpirun -wdir per application context), as when
// one machine of several lacks the data. Its message names it, and the job
// ends at once, though rank 0 is already waiting for it.
static void test_error_on_one_rank(void) {
    const char *what = "rank 1 cannot find its data";
    char empty[] = "/tmp/fitlm_failures_XXXXXX";
    if (!t_check(mkdtemp(empty) != NULL, "%s: a scratch directory", what)) return;
    const char *bin = getenv("FITLM_BINARY");
    char args[8192];
    snprintf(args, sizeof args, "-q -np 1 -wdir %s %s %s : -np 1 -wdir %s %s %s", t_source_path(""),
             bin, TRAIN, empty, bin, TRAIN);
    job j;
    job_start(&j, args, NULL);
    const char *says = "fitlm: rank 1: error: no train token shards at data/brown_byte";
    // timed from rank 1's message: the time to start up is not the point
    double t_said = 0;
    while (!j.done && now() - j.started < JOB_DEADLINE) {
        job_pump(&j, 0.02, NULL);
        if (!t_said && strstr(j.text[1], says)) t_said = now();
    }
    job_pump(&j, 5.0, NULL); // the rest of the output
    if (!t_said && strstr(j.text[1], says)) t_said = j.ended;
    double took = j.done && t_said ? j.ended - t_said : -1;
    printf("  %-50s ended %.2f s after its message, status %d\n", what, took, job_rc(&j));
    show_stderr(&j);
    t_check(j.done && t_said && took < 5.0 && job_rc(&j) == 1,
            "%s: the job ends with status 1 within 5 s of the message (%.2f s, status %d)", what,
            took, job_rc(&j));
    t_check(t_said && !strstr(j.text[1], "did not complete within"),
            "%s: stderr has rank 1's message, and no timeout; got: %.600s", what, j.text[1]);
    job_end(&j, NULL, 0);
    job_free(&j);
    rmdir(empty);
}

// What the data-parallel engine cannot run over several ranks is refused
// at the start, status 1, naming it: LoRA and QLoRA adapters (one rank
// trains them at any ZeRO stage, which partitions nothing there).
static void test_refused_over_ranks(void) {
    static const char *const cases[][2] = {
        {"--lora --zero-stage 2", "lora.enabled (LoRA) with zero_optimization.stage 2"},
        {"--lora --quantize nf4 --precision bf16",
         "quantization_config.bnb_4bit_quant_type nf4 with 2 ranks (data parallelism)"},
    };
    const char *bin = getenv("FITLM_BINARY");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[4096];
        snprintf(args, sizeof args, "-q -np 2 -wdir %s %s %s %s", t_source_path(""), bin, TRAIN,
                 cases[i][0]);
        job j;
        job_start(&j, args, NULL);
        while (!j.done && now() - j.started < JOB_DEADLINE) job_pump(&j, 0.02, NULL);
        job_pump(&j, 1.0, NULL); // the rest of the output
        t_check(j.done && job_rc(&j) == 1 && strstr(j.text[1], cases[i][1]),
                "%s over 2 ranks: refused, status 1 (%d), naming it; got: %.600s", cases[i][0],
                job_rc(&j), j.text[1]);
        job_end(&j, NULL, 0);
        job_free(&j);
    }
}

// Ranks that differ: MPMD jobs (mpirun's "A : B") whose last rank runs
// other settings, another config file at the same path or another ISA
// path. Each stops at the start, status 1, within seconds, rank 0 naming
// the key, both values and both ranks; no sanitizer report and no error of
// MPI's own (before the check, a different shape overflowed a buffer inside
// MPI and most other settings trained apart silently).
typedef struct {
    const char *what;
    int ranks;      // in all: the first ranks run `first`, the last one `last`
    char *first;    // mpirun's words for an application context: [-wdir D] program args
    char *last;     //
    char says[256]; // rank 0's words after "error: the ranks' <of> differ: "
    const char *of; // NULL: "builds and settings"
} differ_case;

static void test_ranks_differ_case(const differ_case *c) {
    char args[8192];
    snprintf(args, sizeof args, "-q -np %d %s : -np 1 %s", c->ranks - 1, c->first, c->last);
    job j;
    job_start(&j, args, NULL);
    int ended = job_pump(&j, JOB_DEADLINE / 3, NULL);
    double took = (ended ? j.ended : now()) - j.started;
    printf("  %-50s ended after %.2f s, status %d\n", c->what, took, job_rc(&j));
    show_stderr(&j);
    char says[512];
    snprintf(says, sizeof says, "fitlm: rank 0: error: the ranks' %s differ: %s",
             c->of ? c->of : "builds and settings", c->says);
    t_check(ended && took < 15.0 && job_rc(&j) == 1,
            "%s: the job ends at the start with status 1 (%.2f s, status %d)", c->what, took,
            job_rc(&j));
    t_check(strstr(j.text[1], says) && !strstr(j.text[0], "step 1/"),
            "%s: rank 0 says \"%s\" before any step; got: %.600s", c->what, says, j.text[1]);
    t_check(!strstr(j.text[1], "Sanitizer") && !strstr(j.text[1], "runtime error") &&
                !strstr(j.text[1], "MPI_ERR") && !strstr(j.text[1], "did not complete within"),
            "%s: no sanitizer report, MPI error or timeout: %.600s", c->what, j.text[1]);
    if (!ended) job_end(&j, NULL, 0);
    job_free(&j);
}

// An application context of the usual run with `extra` words (free() it).
static char *context(const char *wdir, const char *prefix, const char *extra) {
    char *out = malloc(8192);
    snprintf(out, 8192, "%s%s %s%s %s %s", wdir ? "-wdir " : "", wdir ? wdir : "", prefix,
             getenv("FITLM_BINARY"), TRAIN, extra);
    return out;
}

static void test_ranks_differ(void) {
    // the same command line and config path, another file on the last
    // rank's machine (mpirun -wdir per application context)
    char dirs[2][32] = {"/tmp/fitlm_agree_XXXXXX", "/tmp/fitlm_agree_XXXXXX"};
    char path[128], words[FL_PATH_MAX + 64], out[64];
    char ck[FL_PATH_MAX + 64], made[2 * FL_PATH_MAX + 256];
    for (int k = 0; k < 2; k++) {
        if (!t_check(mkdtemp(dirs[k]) != NULL, "a scratch directory")) return;
        snprintf(path, sizeof path, "%s/run.json", dirs[k]);
        t_write_text(path, k ? "{\"gradient_clipping\": 0.5}" : "{\"gradient_clipping\": 1.0}");
        // a checkpoint at the same path, of another seed on the last rank's machine
        snprintf(made, sizeof made, "%s %s --data %s --steps 1 --seed %d --out %s/ck >/dev/null",
                 getenv("FITLM_BINARY"), TRAIN, t_source_path("data/brown_byte"), 1 + k, dirs[k]);
        t_check(system(made) == 0, "a checkpoint in %s", dirs[k]);
    }
    snprintf(ck, sizeof ck, "--init-from ck --data %s", t_source_path("data/brown_byte"));
    snprintf(words, sizeof words, "--config run.json --data %s", t_source_path("data/brown_byte"));
    snprintf(out, sizeof out, "--out %s/run", dirs[0]);
    char save_every[128];
    snprintf(save_every, sizeof save_every, "%s --save-every 3", out);
    differ_case cases[] = {
        {"model shape (n_embd)", 2, context(NULL, "", ""), context(NULL, "", "--n-embd 32"),
         "ranks 0 and 1 differ at key model.n_embd: 64 (rank 0) vs 32 (rank 1)", NULL},
        {"save_every", 2, context(NULL, "", out), context(NULL, "", save_every),
         "ranks 0 and 1 differ at key save_every: 0 (rank 0) vs 3 (rank 1)", NULL},
        {"config file at the same path", 2, context(dirs[0], "", words),
         context(dirs[1], "", words),
         "ranks 0 and 1 differ at key gradient_clipping: 1 (rank 0) vs 0.5 (rank 1)", NULL},
        {"lr, the last of 3 ranks", 3, context(NULL, "", ""), context(NULL, "", "--lr 0.002"),
         "ranks 0 and 2 differ at key optimizer.params.lr: 0.003 (rank 0) vs 0.002 (rank 2) (1 "
         "of 3 ranks",
         NULL},
        {"ISA path (the last rank capped to portable)", 2, context(NULL, "", ""),
         context(NULL, "env FITLM_ISA=portable ", ""),
         "ranks 0 and 1 differ at key build.isa: ", NULL},
        {"zero stage", 2, context(NULL, "", ""), context(NULL, "", "--zero-stage 2"),
         "ranks 0 and 1 differ at key zero_optimization.stage: 0 (rank 0) vs 2 (rank 1)", NULL},
        {"seed", 2, context(NULL, "", ""), context(NULL, "", "--seed 7"),
         "ranks 0 and 1 differ at key seed: 1337 (rank 0) vs 7 (rank 1)", NULL},
        {"precision", 2, context(NULL, "", ""), context(NULL, "", "--precision bf16"),
         "ranks 0 and 1 differ at key precision: fp32 (rank 0) vs bf16 (rank 1)", NULL},
        {"gradient accumulation", 2, context(NULL, "", ""), context(NULL, "", "--grad-accum 2"),
         "ranks 0 and 1 differ at key gradient_accumulation_steps: 1 (rank 0) vs 2 (rank 1)", NULL},
        {"weights: --init-from's path holds another checkpoint", 2, context(dirs[0], "", ck),
         context(dirs[1], "", ck), "ranks 0 and 1 differ at key weights.crc32: ",
         "weights (the same settings, but the files they were read from hold other contents on "
         "another machine)"},
    };
    // the sanitizer build: the classes of shape, schedule, file, rank and
    // build (every key's description is test_dist's)
    size_t n = sizeof cases / sizeof cases[0];
    for (size_t i = 0; i < n; i++) {
        // a host without AVX2 has no other path to cap to
        int skip = (t_quick() && i >= 5 && !cases[i].of) ||
                   (strstr(cases[i].says, "build.isa") && !t_cpu_avx2());
        if (!skip) test_ranks_differ_case(&cases[i]);
        free(cases[i].first);
        free(cases[i].last);
    }
    for (int k = 0; k < 2; k++) t_remove_dir(dirs[k]);
}

// The losses printed by rank 0 ("step N/M | loss X"), joined by spaces.
static void losses_of(const char *out, char *into, size_t size) {
    size_t n = 0;
    into[0] = 0;
    for (const char *p = strstr(out, "| loss "); p && n + 32 < size; p = strstr(p + 1, "| loss "))
        n += (size_t)snprintf(into + n, size - n, "%.*s ", (int)strcspn(p + 7, " |\r\n"), p + 7);
}

// Two ranks over TCP (loopback only) train exactly as over shared memory:
// the same losses, step by step.
static void test_tcp_equals_shared_memory(void) {
    static const char *const tcp[] = {"OMPI_MCA_btl=self,tcp", "OMPI_MCA_btl_tcp_if_include=lo",
                                      "OMPI_MCA_oob_tcp_if_include=lo", NULL};
    static const char *const shm[] = {"OMPI_MCA_btl=self,vader", NULL};
    const char *const *env[2] = {shm, tcp};
    char losses[2][4096];
    int rc[2];
    for (int k = 0; k < 2; k++) {
        char args[4096];
        snprintf(args, sizeof args, "-q -np 2 %s %s --steps 12 --warmup 2", getenv("FITLM_BINARY"),
                 TRAIN);
        job j;
        job_start(&j, args, env[k]);
        if (!job_pump(&j, JOB_DEADLINE, NULL)) job_end(&j, NULL, 0);
        rc[k] = job_rc(&j);
        losses_of(j.text[0], losses[k], sizeof losses[k]);
        if (rc[k] != 0) fprintf(stderr, "%s", j.text[1]);
        job_free(&j);
    }
    printf("  2 ranks, shared memory: losses %s\n  2 ranks, TCP:           losses %s\n", losses[0],
           losses[1]);
    int steps = 0;
    for (const char *p = losses[1]; (p = strchr(p, ' ')); p++) steps++;
    t_check(rc[0] == 0 && rc[1] == 0 && steps == 12 && strcmp(losses[0], losses[1]) == 0,
            "DDP over TCP: status %d, 12 losses equal to shared memory's (status %d, %d losses)",
            rc[1], rc[0], steps);
}

// Two ranks splitting one model (--tensor-parallel 2, one data-parallel
// replica) report their traffic per step and rank as a ring moves it (2n(t -
// 1)/t for an all-reduce of n): Megatron's four all-reduces of B x T x C a
// layer, the embedding's (forward) and the LM head's input gradient
// (backward), the cross-entropy's max, sum of exponentials and target logit
// (3 B x T) and the gradient norm's per-row sums and overflow flag.
static void test_tp_traffic(void) {
    char args[4096];
    snprintf(args, sizeof args, "-q -np 2 %s %s --steps 2 --batch 4 --tensor-parallel 2",
             getenv("FITLM_BINARY"), TRAIN);
    job j;
    job_start(&j, args, NULL);
    if (!job_pump(&j, JOB_DEADLINE, NULL)) job_end(&j, NULL, 0);
    int rc = job_rc(&j);
    const char *key = "communication per step and rank: ", *line = strstr(j.text[0], key);
    double elements = line ? strtod(line + strlen(key), NULL) : 0.0;
    // tiny: L = 2, C = 64, 4 + 12 L parameter rows; B x T = 4 x 32; t = 2
    double L = 2, C = 64, BT = 4 * 32, r = 0.5, rows = 4 + 12 * L;
    double theory = (8 * L + 4) * BT * C * r + 6 * BT * r + 2 * (rows + 1) * r;
    double off = elements > theory ? elements - theory : theory - elements;
    if (rc != 0) fprintf(stderr, "%s", j.text[1]);
    printf("  TP 2: %.6g elements per step and rank (theory %.6g)\n", elements, theory);
    // the line prints 4 digits
    t_check(rc == 0 && off <= 1e-3 * theory,
            "a tensor-parallel run: status %d, %.6g elements per step and rank, theory %.6g", rc,
            elements, theory);
    job_free(&j);
}

int main(void) {
    signal(SIGALRM, on_alarm);
    alarm(300); // CTest would end it at 600 s, leaving mpirun behind
    if (!getenv("FITLM_BINARY") || !getenv("FITLM_TEST_DIST")) {
        fprintf(stderr, "test_failures: FITLM_BINARY or FITLM_TEST_DIST is not set (run it "
                        "through ctest)\n");
        return 1;
    }
    test_tcp_equals_shared_memory();
    // counts and deadlines, checked in the release build (the sanitizer
    // build's quick list leaves them to it; test_dist runs the same code)
    if (!t_quick()) test_tp_traffic();
    test_kill(1, "--zero-stage 0", 0);
    test_kill(0, "--zero-stage 3", 1);
    test_hang();
    test_pipeline_kill();
    if (!t_quick()) {
        test_pipeline_hang();
        test_p2p_hang("send", 2);
        test_p2p_hang("receive", 2);
        test_p2p_hang("receive", 4);
    }
    test_error_on_one_rank();
    test_refused_over_ranks();
    test_ranks_differ();
    return t_report();
}
