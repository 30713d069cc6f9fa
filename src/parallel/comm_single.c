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

void fl_comm_sum(double *v, int n) {
    (void)v;
    (void)n;
}

void fl_comm_max(double *v, int n) {
    (void)v;
    (void)n;
}

void fl_comm_barrier(void) {}

void fl_comm_bcast(void *buf, size_t bytes, int root) {
    (void)buf;
    (void)bytes;
    (void)root;
}

fl_comm_req fl_comm_iallreduce(float *buf, size_t n) {
    (void)buf;
    (void)n;
    return 0;
}

fl_comm_req fl_comm_ireduce_scatter(const float *send, float *recv, const size_t *counts) {
    if (counts[0] && recv != send) memmove(recv, send, counts[0] * sizeof(float));
    return 0;
}

fl_comm_req fl_comm_iallgather(fl_dtype dt, const void *send, void *recv, const size_t *counts,
                               const size_t *displs) {
    size_t D = fl_dtype_size(dt);
    char *at = (char *)recv + displs[0] * D;
    if (counts[0] && at != send) memmove(at, send, counts[0] * D);
    return 0;
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
    free(g);
}

int fl_comm_group_rank(const fl_comm_group *g) {
    return g->rank;
}

int fl_comm_group_size(const fl_comm_group *g) {
    return g->size;
}

void fl_comm_agree(const fl_comm_group *g, const char *what, const char *text) {
    (void)g;
    (void)what;
    (void)text;
}
