// comm_single.c: the communicator (comm.h) of a build without MPI: one rank.
// Collectives are copies; the traffic counters stay at zero.
#include "fitlm/comm.h"

#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"

void fl_comm_init(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    if (getenv("OMPI_COMM_WORLD_SIZE") && atoi(getenv("OMPI_COMM_WORLD_SIZE")) > 1)
        fl_die("this fitlm was built without MPI (libopenmpi-dev was missing when it was "
               "configured): it cannot run several ranks; run scripts/setup.sh and rebuild");
}

int fl_comm_finalize(int rc) {
    return rc;
}

int fl_comm_rank(void) {
    return 0;
}

int fl_comm_size(void) {
    return 1;
}

int fl_comm_built_with_mpi(void) {
    return 0;
}

void fl_comm_set_timeout(double seconds) {
    (void)seconds;
}

void fl_comm_abort(int code) {
    fflush(stdout);
    exit(code);
}

void fl_comm_sum(const fl_comm_group *g, double *v, int n) {
    (void)g;
    (void)v;
    (void)n;
}

void fl_comm_max(const fl_comm_group *g, double *v, int n) {
    (void)g;
    (void)v;
    (void)n;
}

void fl_comm_barrier(const fl_comm_group *g) {
    (void)g;
}

void fl_comm_bcast(const fl_comm_group *g, void *buf, size_t bytes, int root) {
    (void)g;
    (void)buf;
    (void)bytes;
    (void)root;
}

fl_comm_req fl_comm_iallreduce(const fl_comm_group *g, float *buf, size_t n) {
    (void)g;
    (void)buf;
    (void)n;
    return 0;
}

fl_comm_req fl_comm_iallreduce_max(const fl_comm_group *g, float *buf, size_t n) {
    (void)g;
    (void)buf;
    (void)n;
    return 0;
}

fl_comm_req fl_comm_ireduce_scatter(const fl_comm_group *g, const float *send, float *recv,
                                    const size_t *counts) {
    (void)g;
    if (counts[0] && recv != send) memmove(recv, send, counts[0] * sizeof(float));
    return 0;
}

fl_comm_req fl_comm_iallgather(const fl_comm_group *g, fl_dtype dt, const void *send, void *recv,
                               const size_t *counts, const size_t *displs) {
    (void)g;
    size_t D = fl_dtype_size(dt);
    char *at = (char *)recv + displs[0] * D;
    if (counts[0] && at != send) memmove(at, send, counts[0] * D);
    return 0;
}

fl_comm_req fl_comm_ialltoall(const fl_comm_group *g, fl_dtype dt, const void *send, void *recv,
                              size_t n) {
    (void)g;
    if (n && recv != send) memmove(recv, send, n * fl_dtype_size(dt));
    return 0;
}

// A group of one has no other rank to send to or receive from.
fl_comm_req fl_comm_isend(const fl_comm_group *g, int peer, const void *buf, size_t bytes,
                          int tag) {
    (void)g;
    (void)buf;
    fl_die("internal: a send of %zu bytes to rank %d (tag %d) in a group of one rank", bytes, peer,
           tag);
}

fl_comm_req fl_comm_irecv(const fl_comm_group *g, int peer, void *buf, size_t bytes, int tag) {
    (void)g;
    (void)buf;
    fl_die("internal: a receive of %zu bytes from rank %d (tag %d) in a group of one rank", bytes,
           peer, tag);
}

void fl_comm_wait(fl_comm_req req) {
    (void)req;
}

int fl_comm_test(fl_comm_req req) {
    (void)req;
    return 1;
}

fl_comm_stats fl_comm_get_stats(void) {
    return (fl_comm_stats){0};
}

// One rank: the world is a group of one, and so is any split of it.
struct fl_comm_group {
    int rank, size;
};

const fl_comm_group *fl_comm_world(void) {
    static const fl_comm_group world = {0, 1};
    return &world;
}

fl_comm_group *fl_comm_split(const fl_comm_group *g, int color) {
    (void)g;
    (void)color;
    fl_comm_group *s = malloc(sizeof *s);
    if (!s) fl_die("out of memory");
    *s = (fl_comm_group){0, 1};
    return s;
}

void fl_comm_group_free(fl_comm_group *g) {
    if (!g) return;
    fl_tp_ops_drop(g);
    free(g);
}

int fl_comm_group_rank(const fl_comm_group *g) {
    return g->rank;
}

int fl_comm_group_size(const fl_comm_group *g) {
    return g->size;
}

int fl_comm_group_world_rank(const fl_comm_group *g, int rank) {
    (void)g;
    return rank;
}

void fl_comm_agree(const fl_comm_group *g, const char *what, const char *text) {
    (void)g;
    (void)what;
    (void)text;
}
