// comm.h: the communicator the engine sees. src/parallel/comm.c implements it
// on MPI (Open MPI); a build without MPI gets src/parallel/comm_single.c, one
// rank. Nothing outside src/parallel includes mpi.h.
//
// One world per process: fl_comm_init starts MPI only when the process was
// launched by mpirun (a plain `fitlm train` is one rank and needs no MPI
// start-up). Every collective waits with a deadline (fl_comm_set_timeout):
// a rank that is dead or hung ends the job with a message naming the
// operation, instead of hanging it. Counts are elements; the traffic
// counters add what a ring algorithm moves per rank in units of elements
// (all-reduce 2n(N-1)/N, reduce-scatter and all-gather n(N-1)/N of the whole
// buffer n), so a step's volume reads directly against ZeRO's 2 and 3 Psi.
#ifndef FITLM_COMM_H
#define FITLM_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/dtype.h"

// Starts the world: MPI when launched by mpirun (and built with it), else
// one rank. Idempotent. argc/argv may be NULL.
void fl_comm_init(int *argc, char ***argv);
// Ends the process's part in the world: without MPI it returns rc; with
// MPI it finalizes (after a barrier) and exits with rc (see comm.c why).
int fl_comm_finalize(int rc);
int fl_comm_rank(void);
int fl_comm_size(void);
// Whether this build has MPI (a build without it runs one rank only).
int fl_comm_built_with_mpi(void);
// Seconds a collective may wait before the job is ended (default 600).
void fl_comm_set_timeout(double seconds);
// Ends every rank of the job with exit code `code` (after the caller has
// printed why): MPI_Abort, or exit with one rank.
void fl_comm_abort(int code);

// Blocking collectives, small: sums or maxima of doubles (in place), a
// barrier, a broadcast of bytes from `root`.
void fl_comm_sum(double *v, int n);
void fl_comm_max(double *v, int n);
void fl_comm_barrier(void);
void fl_comm_bcast(void *buf, size_t bytes, int root);

// Non-blocking collectives on fp32 sums and on gathers of any dtype. A
// request is an index; fl_comm_wait completes it (with the deadline).
typedef int fl_comm_req;
// buf[0, n) summed over ranks, in place.
fl_comm_req fl_comm_iallreduce(float *buf, size_t n);
// send[0, sum of counts) summed over ranks; rank r receives its part
// (counts[r] elements, starting at the sum of counts[0..r)) in recv.
// counts has fl_comm_size() entries; a count may be 0.
fl_comm_req fl_comm_ireduce_scatter(const float *send, float *recv, const size_t *counts);
// Rank r contributes counts[r] elements from send; every rank receives all
// of them, rank after rank, in recv (displs[r] elements in). send may be
// recv + displs[rank] (in place).
fl_comm_req fl_comm_iallgather(fl_dtype dt, const void *send, void *recv, const size_t *counts,
                               const size_t *displs);
void fl_comm_wait(fl_comm_req req);
// Whether it has completed (then it needs no wait); lets MPI progress.
int fl_comm_test(fl_comm_req req);

// A group of ranks that a collective runs over: the world, or a part of it
// (the groups of a tensor- or pipeline-parallel layout). Ranks are numbered
// 0..size-1 within a group, in the world's order.
typedef struct fl_comm_group fl_comm_group;
const fl_comm_group *fl_comm_world(void);
// The groups of g's ranks that pass the same color (a collective over g):
// this rank's; fl_comm_group_free it.
fl_comm_group *fl_comm_split(const fl_comm_group *g, int color);
void fl_comm_group_free(fl_comm_group *g);
int fl_comm_group_rank(const fl_comm_group *g);
int fl_comm_group_size(const fl_comm_group *g);

// The check that a group's ranks run the same thing (a collective over g):
// each rank's `text`, canonical "key=value\n" lines (its settings, its
// parameter table, its build), must equal the group's rank 0's. A 64-bit
// digest of each is all-gathered (one fixed-size element per rank, so the
// check itself cannot overflow); when one differs, rank 0's text and the
// first differing rank's go to every rank by a size, then exactly that many
// bytes, and rank 0 stops the job naming `what`, the first differing key,
// both values and both ranks (world ranks), before any collective whose
// sizes the texts decide. Every rank reaches the same decision: none hangs.
void fl_comm_agree(const fl_comm_group *g, const char *what, const char *text);
// Its parts (src/parallel/agree.c): the digest (FNV-1a, 64 bits) and the
// description of the first line where texts a (of rank_a) and b differ:
// "ranks A and B differ at key K: VA (rank A) vs VB (rank B)". Returns
// whether they differ.
uint64_t fl_agree_hash(const char *text);
int fl_agree_describe(const char *a, int rank_a, const char *b, int rank_b, char *out, size_t size);

// Traffic so far, in elements per rank as a ring moves them (see above),
// and the seconds spent waiting in fl_comm_wait (communication not hidden
// behind computation).
typedef struct {
    double elements, bytes, wait_seconds;
    long collectives;
} fl_comm_stats;
fl_comm_stats fl_comm_get_stats(void);

#endif
