// comm.c: the communicator (comm.h) on MPI. The only file that includes
// mpi.h. One world (a duplicate of MPI_COMM_WORLD); requests live in a small
// table; every wait polls with a deadline so a dead or hung rank ends the job
// (MPI_Abort) instead of hanging it. Started only under mpirun: a plain run
// is one rank and never calls MPI.
//
// A wait that lasts also watches the other ranks on this machine (their
// processes in /proc): one that has ended ends the job at once, with a
// message naming it, rather than when mpirun gets round to it (about 2 s,
// silently under `mpirun -q`). Ranks on other machines are mpirun's to
// watch; a hung rank anywhere is caught by the deadline.
#include "fitlm/comm.h"

#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <mpi.h>

#include "fitlm/core.h"

enum { MAX_REQS = 64 };

typedef struct {
    MPI_Request req;
    int busy;
    const char *what;
    char says[48];        // what, when it names a rank ("a send to rank 3")
    int peer;             // that rank (world), or -1
    int *counts, *displs; // kept until completion, as MPI requires
} slot;

// A process, as /proc sees it: its pid and start time (in clock ticks since
// boot) tell it apart from a later process that reuses the pid.
typedef struct {
    int rank, pid;
    unsigned long long start, pidns; // pidns: this machine's pid namespace
} peer;

// A group: its communicator, and the world ranks of its ranks (for messages).
struct fl_comm_group {
    MPI_Comm comm;
    int rank, size;
    int *world_ranks; // NULL: the world itself
};

static struct {
    int started, mpi, rank, size;
    fl_comm_group world;
    peer *peers; // the other ranks whose processes this one can see
    int n_peers;
    MPI_Comm comm;
    MPI_Datatype bf16; // two bytes, for 16-bit gathers
    double timeout;
    slot reqs[MAX_REQS];
    fl_comm_stats stats;
} w = {.size = 1, .world = {.size = 1}, .timeout = 600.0};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void on_die(int code) {
    MPI_Abort(MPI_COMM_WORLD, code);
}

// State letter and start time of process pid from /proc/PID/stat; 0 when it
// is gone (no entry, or unreadable).
static char proc_state(int pid, unsigned long long *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    // "pid (comm) S ppid ...": comm may hold anything, so parse after the
    // last ')'; the start time is field 22, 19 after the state
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || !p[2]) return 0;
    char state = p[2];
    p += 3;
    for (int field = 0; field < 18 && p; field++) p = strchr(p + 1, ' ');
    *start = p ? strtoull(p + 1, NULL, 10) : 0;
    return state;
}

static unsigned long long pid_namespace(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

// Learns the processes of the other ranks on this machine (those sharing
// memory with it and its pid namespace). A machine without /proc watches
// none and relies on mpirun and the deadline.
static void find_peers(void) {
    MPI_Comm node;
    MPI_Comm_split_type(w.comm, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &node);
    int n;
    MPI_Comm_size(node, &n);
    peer me = {.rank = w.rank, .pid = (int)getpid(), .pidns = pid_namespace()};
    if (!proc_state(me.pid, &me.start)) me.pidns = 0;
    peer *all = calloc((size_t)n, sizeof *all);
    if (!all) fl_die("out of memory");
    MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE, node);
    MPI_Comm_free(&node);
    // a peer this process cannot see now, while all are alive (/proc
    // mounted with hidepid, say), is not watched: it would look dead
    w.n_peers = 0;
    for (int i = 0; i < n; i++) {
        unsigned long long start = 0;
        if (me.pidns && all[i].pidns == me.pidns && all[i].rank != w.rank &&
            proc_state(all[i].pid, &start) && start == all[i].start)
            all[w.n_peers++] = all[i];
    }
    w.peers = all;
}

static int peer_dead(const peer *p) {
    unsigned long long start = 0;
    char s = proc_state(p->pid, &start);
    return !s || s == 'Z' || s == 'X' || start != p->start;
}

// A peer that has ended: no /proc entry, a zombie, or another process now.
// World rank `awaited` first, when it is one: in a chain of ranks waiting on
// each other (a pipeline) a rank that ended on seeing the first end is
// likely dead too, and the awaited one is the one to name.
static const peer *dead_peer(int awaited) {
    for (int i = 0; i < w.n_peers; i++)
        if (w.peers[i].rank == awaited && peer_dead(&w.peers[i])) return &w.peers[i];
    for (int i = 0; i < w.n_peers; i++)
        if (peer_dead(&w.peers[i])) return &w.peers[i];
    return NULL;
}

// Appends to a timeout message the peers that are stopped (SIGSTOP, ^Z, a
// debugger): the likely reason, when it is one of them.
static void print_stopped_peers(void) {
    for (int i = 0; i < w.n_peers; i++) {
        unsigned long long start;
        char s = proc_state(w.peers[i].pid, &start);
        if (s == 'T' || s == 't')
            fprintf(stderr, "fitlm: rank %d: rank %d (process %d) is stopped (%s)\n", w.rank,
                    w.peers[i].rank, w.peers[i].pid, s == 'T' ? "by a signal" : "by a debugger");
    }
}

// Launched by mpirun (Open MPI, or a PMI-speaking launcher)?
static int launched(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

void fl_comm_init(int *argc, char ***argv) {
    if (w.started) return;
    w.started = 1;
    if (!launched()) return;
    int provided;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    w.mpi = 1;
    MPI_Comm_dup(MPI_COMM_WORLD, &w.comm);
    MPI_Comm_rank(w.comm, &w.rank);
    MPI_Comm_size(w.comm, &w.size);
    w.world = (fl_comm_group){w.comm, w.rank, w.size, NULL};
    MPI_Type_contiguous(2, MPI_BYTE, &w.bf16);
    MPI_Type_commit(&w.bf16);
    if (w.size > 1) {
        fl_log_set_rank(w.rank, on_die);
        find_peers();
    }
}

// Open MPI and the components it loads keep allocations past MPI_Finalize,
// some made by threads of their own (theirs, not fitlm's). A process that
// started MPI therefore ends with _exit, skipping the exit handlers (and so
// LeakSanitizer's check, which every test without MPI still runs over the
// same code).
int fl_comm_finalize(int rc) {
    if (!w.mpi) return rc;
    fl_comm_barrier(&w.world); // with the deadline: a rank may have died at the very end
    free(w.peers);
    w.peers = NULL;
    w.n_peers = 0;
    MPI_Type_free(&w.bf16);
    MPI_Comm_free(&w.comm);
    w.world.comm = MPI_COMM_NULL;
    MPI_Finalize();
    fflush(NULL);
    _exit(rc);
}

int fl_comm_rank(void) {
    return w.rank;
}

int fl_comm_size(void) {
    return w.size;
}

int fl_comm_built_with_mpi(void) {
    return 1;
}

void fl_comm_set_timeout(double seconds) {
    w.timeout = seconds;
}

void fl_comm_abort(int code) {
    fflush(stdout);
    fflush(stderr);
    if (w.mpi) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

static int count_of(size_t n, const char *what) {
    if (n > INT_MAX)
        fl_die("%s of %zu elements is more than one MPI call takes (%d)", what, n, INT_MAX);
    return (int)n;
}

// elements of elsize bytes each: elements * elsize bytes of traffic
static fl_comm_req new_req(const char *what, double elements, size_t elsize) {
    for (int i = 0; i < MAX_REQS; i++)
        if (!w.reqs[i].busy) {
            w.reqs[i] = (slot){.req = MPI_REQUEST_NULL, .busy = 1, .what = what, .peer = -1};
            w.stats.elements += elements;
            w.stats.bytes += elements * (double)elsize;
            w.stats.collectives++;
            return i;
        }
    fl_die("internal: more than %d collectives in flight", MAX_REQS);
}

static void release(fl_comm_req r) {
    free(w.reqs[r].counts);
    free(w.reqs[r].displs);
    w.reqs[r].counts = w.reqs[r].displs = NULL;
    w.reqs[r].busy = 0;
}

int fl_comm_test(fl_comm_req r) {
    FL_ASSERT(r >= 0 && r < MAX_REQS && w.reqs[r].busy);
    int done = 1;
    if (w.reqs[r].req != MPI_REQUEST_NULL) MPI_Test(&w.reqs[r].req, &done, MPI_STATUS_IGNORE);
    return done;
}

void fl_comm_wait(fl_comm_req r) {
    double t0 = now(), checked = t0;
    long polls = 0;
    while (!fl_comm_test(r)) {
        // yield first (a short collective finishes in microseconds), then
        // sleep a little: ranks oversubscribed on few cores need the CPU
        if (++polls < 1000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
        if ((polls & 255) != 0) continue;
        double t = now();
        if (t - t0 > w.timeout) {
            fprintf(stderr,
                    "fitlm: rank %d: error: %s did not complete within %g s (--comm-timeout): "
                    "another rank is dead or hung; ending the job\n",
                    w.rank, w.reqs[r].what, w.timeout);
            print_stopped_peers();
            fl_comm_abort(1);
        }
        // a wait of over 0.1 s: are the ranks it waits for still there?
        if (t - checked > 0.1) {
            checked = t;
            const peer *dead = dead_peer(w.reqs[r].peer);
            if (dead) {
                fprintf(stderr,
                        "fitlm: rank %d: error: rank %d (process %d) has ended (killed or exited) "
                        "while this rank waited in %s; ending the job\n",
                        w.rank, dead->rank, dead->pid, w.reqs[r].what);
                // leaving is enough: mpirun ends a job when a rank exits
                // before MPI_Finalize, and has likely seen the peer end
                // already; MPI_Abort would wait for its kill sequence (2 s)
                fflush(stdout);
                fflush(stderr);
                _exit(1);
            }
        }
    }
    w.stats.wait_seconds += now() - t0;
    release(r);
}

static void reduce(const fl_comm_group *g, double *v, int n, MPI_Op op, const char *what) {
    if (g->size == 1) return;
    fl_comm_req r = new_req(what, 2.0 * n * (g->size - 1) / g->size, sizeof(double));
    MPI_Iallreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, op, g->comm, &w.reqs[r].req);
    fl_comm_wait(r);
}

void fl_comm_sum(const fl_comm_group *g, double *v, int n) {
    reduce(g, v, n, MPI_SUM, "an all-reduce (sum) of scalars");
}

void fl_comm_max(const fl_comm_group *g, double *v, int n) {
    reduce(g, v, n, MPI_MAX, "an all-reduce (max) of scalars");
}

void fl_comm_barrier(const fl_comm_group *g) {
    if (g->size == 1) return;
    fl_comm_req r = new_req("a barrier", 0.0, 1);
    MPI_Ibarrier(g->comm, &w.reqs[r].req);
    fl_comm_wait(r);
}

void fl_comm_bcast(const fl_comm_group *g, void *buf, size_t bytes, int root) {
    if (g->size == 1) return;
    fl_comm_req r = new_req("a broadcast", (double)bytes, 1);
    MPI_Ibcast(buf, count_of(bytes, "a broadcast"), MPI_BYTE, root, g->comm, &w.reqs[r].req);
    fl_comm_wait(r);
}

static fl_comm_req allreduce(const fl_comm_group *g, float *buf, size_t n, MPI_Op op,
                             const char *what) {
    fl_comm_req r = new_req(what, 2.0 * (double)n * (g->size - 1) / g->size, sizeof(float));
    if (g->size > 1)
        MPI_Iallreduce(MPI_IN_PLACE, buf, count_of(n, what), MPI_FLOAT, op, g->comm,
                       &w.reqs[r].req);
    return r;
}

fl_comm_req fl_comm_iallreduce(const fl_comm_group *g, float *buf, size_t n) {
    return allreduce(g, buf, n, MPI_SUM, "a gradient all-reduce");
}

fl_comm_req fl_comm_iallreduce_max(const fl_comm_group *g, float *buf, size_t n) {
    return allreduce(g, buf, n, MPI_MAX, "an all-reduce (max)");
}

static int *int_copy(const fl_comm_group *g, const size_t *v, const char *what) {
    int *out = malloc((size_t)g->size * sizeof(int));
    if (!out) fl_die("out of memory");
    for (int i = 0; i < g->size; i++) out[i] = count_of(v[i], what);
    return out;
}

fl_comm_req fl_comm_ireduce_scatter(const fl_comm_group *g, const float *send, float *recv,
                                    const size_t *counts) {
    const char *what = "a gradient reduce-scatter";
    size_t total = 0;
    for (int i = 0; i < g->size; i++) total += counts[i];
    fl_comm_req r = new_req(what, (double)total * (g->size - 1) / g->size, sizeof(float));
    if (g->size == 1) {
        if (counts[0] && recv != send) memmove(recv, send, counts[0] * sizeof(float));
        return r;
    }
    slot *s = &w.reqs[r];
    s->counts = int_copy(g, counts, what);
    static float dummy;
    MPI_Ireduce_scatter(send, counts[g->rank] ? recv : &dummy, s->counts, MPI_FLOAT, MPI_SUM,
                        g->comm, &s->req);
    return r;
}

static MPI_Datatype type_of(size_t D) {
    return D == 4 ? MPI_FLOAT : w.bf16;
}

fl_comm_req fl_comm_iallgather(const fl_comm_group *g, fl_dtype dt, const void *send, void *recv,
                               const size_t *counts, const size_t *displs) {
    const char *what = "a parameter all-gather";
    size_t total = 0, D = fl_dtype_size(dt);
    for (int i = 0; i < g->size; i++) total += counts[i];
    fl_comm_req r = new_req(what, (double)total * (g->size - 1) / g->size, D);
    char *at = (char *)recv + displs[g->rank] * D;
    if (g->size == 1) {
        if (counts[0] && at != send) memmove(at, send, counts[0] * D);
        return r;
    }
    slot *s = &w.reqs[r];
    s->counts = int_copy(g, counts, what);
    s->displs = int_copy(g, displs, what);
    MPI_Iallgatherv(at == send ? MPI_IN_PLACE : send, s->counts[g->rank], type_of(D), recv,
                    s->counts, s->displs, type_of(D), g->comm, &s->req);
    return r;
}

fl_comm_req fl_comm_ialltoall(const fl_comm_group *g, fl_dtype dt, const void *send, void *recv,
                              size_t n) {
    const char *what = "an all-to-all";
    size_t D = fl_dtype_size(dt);
    fl_comm_req r = new_req(what, (double)n * (g->size - 1), D);
    if (g->size == 1) {
        if (n && recv != send) memmove(recv, send, n * D);
        return r;
    }
    MPI_Ialltoall(send, count_of(n, what), type_of(D), recv, count_of(n, what), type_of(D), g->comm,
                  &w.reqs[r].req);
    return r;
}

// A message to or from group rank peer, its words naming the world rank.
static fl_comm_req p2p(const fl_comm_group *g, int peer, size_t bytes, int tag, int sending) {
    if (peer < 0 || peer >= g->size || peer == g->rank || tag < 0)
        fl_die("internal: a %s rank %d (tag %d) in a group of %d ranks where this is rank %d",
               sending ? "send to" : "receive from", peer, tag, g->size, g->rank);
    count_of(bytes, sending ? "a send" : "a receive");
    fl_comm_req r = new_req("", 0.0, 1);
    if (sending) w.stats.bytes += (double)bytes; // bytes without a dtype: no elements
    slot *s = &w.reqs[r];
    s->peer = g->world_ranks ? g->world_ranks[peer] : peer;
    snprintf(s->says, sizeof s->says, "a %s rank %d", sending ? "send to" : "receive from",
             s->peer);
    s->what = s->says;
    return r;
}

fl_comm_req fl_comm_isend(const fl_comm_group *g, int peer, const void *buf, size_t bytes,
                          int tag) {
    fl_comm_req r = p2p(g, peer, bytes, tag, 1);
    MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, g->comm, &w.reqs[r].req);
    return r;
}

fl_comm_req fl_comm_irecv(const fl_comm_group *g, int peer, void *buf, size_t bytes, int tag) {
    fl_comm_req r = p2p(g, peer, bytes, tag, 0);
    MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, g->comm, &w.reqs[r].req);
    return r;
}

// ----------------------------------------------------------------------------
// groups, and the check that their ranks agree

const fl_comm_group *fl_comm_world(void) {
    return &w.world;
}

int fl_comm_group_rank(const fl_comm_group *g) {
    return g->rank;
}

int fl_comm_group_size(const fl_comm_group *g) {
    return g->size;
}

int fl_comm_group_world_rank(const fl_comm_group *g, int rank) {
    return g->world_ranks ? g->world_ranks[rank] : rank;
}

// One fixed-size element from every rank of g, in rank order.
static void allgather_u64(const fl_comm_group *g, uint64_t mine, uint64_t *all, const char *what) {
    all[g->rank] = mine;
    if (g->size == 1) return;
    fl_comm_req r = new_req(what, (double)(g->size - 1), sizeof mine);
    MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all, 1, MPI_UINT64_T, g->comm,
                   &w.reqs[r].req);
    fl_comm_wait(r);
}

fl_comm_group *fl_comm_split(const fl_comm_group *g, int color) {
    fl_comm_group *s = calloc(1, sizeof *s);
    if (!s) fl_die("out of memory");
    if (g->size == 1) { // without MPI, or a group of one: a group of this rank alone
        *s = (fl_comm_group){MPI_COMM_NULL, 0, 1, malloc(sizeof(int))};
        if (!s->world_ranks) fl_die("out of memory");
        s->world_ranks[0] = fl_comm_group_world_rank(g, g->rank);
        return s;
    }
    MPI_Comm_split(g->comm, color, g->rank, &s->comm);
    MPI_Comm_rank(s->comm, &s->rank);
    MPI_Comm_size(s->comm, &s->size);
    uint64_t *all = malloc((size_t)s->size * sizeof *all);
    s->world_ranks = malloc((size_t)s->size * sizeof(int));
    if (!all || !s->world_ranks) fl_die("out of memory");
    allgather_u64(s, (uint64_t)fl_comm_group_world_rank(g, g->rank), all,
                  "a group's all-gather of its ranks");
    for (int i = 0; i < s->size; i++) s->world_ranks[i] = (int)all[i];
    free(all);
    return s;
}

void fl_comm_group_free(fl_comm_group *g) {
    if (!g) return;
    fl_tp_ops_drop(g);
    if (g->comm != MPI_COMM_NULL) MPI_Comm_free(&g->comm);
    free(g->world_ranks);
    free(g);
}

// The text of g's rank `root` on every rank: its size first (one fixed-size
// element), then exactly that many bytes. free() it.
static char *share_text(const fl_comm_group *g, int root, const char *text) {
    uint64_t n = g->rank == root ? strlen(text) : 0;
    fl_comm_bcast(g, &n, sizeof n, root);
    char *out = malloc(n + 1);
    if (!out) fl_die("out of memory");
    if (g->rank == root) memcpy(out, text, n);
    fl_comm_bcast(g, out, n, root);
    out[n] = 0;
    return out;
}

void fl_comm_agree(const fl_comm_group *g, const char *what, const char *text) {
    if (g->size == 1) return;
    uint64_t *all = malloc((size_t)g->size * sizeof *all);
    if (!all) fl_die("out of memory");
    allgather_u64(g, fl_agree_hash(text), all, "the all-gather of the ranks' digests");
    int first = -1, others = 0;
    for (int r = 1; r < g->size; r++)
        if (all[r] != all[0]) {
            if (first < 0) first = r;
            others++;
        }
    free(all);
    if (first < 0) return;
    // every rank holds the same digests, so every rank comes here
    char *text0 = share_text(g, 0, text), *textd = share_text(g, first, text);
    char says[1024];
    fl_agree_describe(text0, fl_comm_group_world_rank(g, 0), textd,
                      fl_comm_group_world_rank(g, first), says, sizeof says);
    free(text0);
    free(textd);
    if (g->rank == 0)
        fl_die("the ranks' %s differ: %s (%d of %d ranks differ from rank 0); start every rank "
               "with the same build, config file, flags and input files",
               what, says, others, g->size);
    // rank 0's fl_die ends the job (MPI_Abort): one message, not one per rank
    for (unsigned left = 30; left;) left = sleep(left);
    fl_die("the ranks' %s differ (rank 0 says how)", what);
}

fl_comm_stats fl_comm_get_stats(void) {
    return w.stats;
}
