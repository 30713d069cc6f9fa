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
#include "fitlm/tp.h"

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

// Every collective runs over a group (fl_comm_world() for all ranks; never
// NULL) and every rank of the group calls it; ranks, roots and counts
// arrays are the group's (counts[i] for group rank i).
typedef struct fl_comm_group fl_comm_group;

// Blocking collectives, small: sums or maxima of doubles (in place), a
// barrier, a broadcast of bytes from group rank `root`.
void fl_comm_sum(const fl_comm_group *g, double *v, int n);
void fl_comm_max(const fl_comm_group *g, double *v, int n);
void fl_comm_barrier(const fl_comm_group *g);
void fl_comm_bcast(const fl_comm_group *g, void *buf, size_t bytes, int root);

// Non-blocking collectives on fp32 sums and maxima, on gathers and
// exchanges of any dtype, and point-to-point messages. A request is an
// index; fl_comm_wait completes it (with the deadline).
typedef int fl_comm_req;
// buf[0, n) summed over the group's ranks, in place.
fl_comm_req fl_comm_iallreduce(const fl_comm_group *g, float *buf, size_t n);
// buf[0, n): the element-wise maximum over the group's ranks, in place.
fl_comm_req fl_comm_iallreduce_max(const fl_comm_group *g, float *buf, size_t n);
// send[0, sum of counts) summed over ranks; rank r receives its part
// (counts[r] elements, starting at the sum of counts[0..r)) in recv.
// counts has fl_comm_group_size(g) entries; a count may be 0.
fl_comm_req fl_comm_ireduce_scatter(const fl_comm_group *g, const float *send, float *recv,
                                    const size_t *counts);
// Rank r contributes counts[r] elements from send; every rank receives all
// of them, rank after rank, in recv (displs[r] elements in). send may be
// recv + displs[rank] (in place).
fl_comm_req fl_comm_iallgather(const fl_comm_group *g, fl_dtype dt, const void *send, void *recv,
                               const size_t *counts, const size_t *displs);
// All to all, n elements a pair: send[r*n, (r+1)*n) goes to group rank r,
// which receives it in its recv[q*n, (q+1)*n) (q this rank). Counted as
// a reduce-scatter of the t*n elements (n(t-1) per rank).
fl_comm_req fl_comm_ialltoall(const fl_comm_group *g, fl_dtype dt, const void *send, void *recv,
                              size_t n);
// Point to point: `bytes` bytes to or from group rank `peer` (not this
// rank), matched by `tag` (0 or more); a send counts its bytes in the
// traffic. buf must stay as it is until the wait. A wait past the deadline
// names "a send to rank N" or "a receive from rank N" (world ranks).
fl_comm_req fl_comm_isend(const fl_comm_group *g, int peer, const void *buf, size_t bytes, int tag);
fl_comm_req fl_comm_irecv(const fl_comm_group *g, int peer, void *buf, size_t bytes, int tag);
void fl_comm_wait(fl_comm_req req);
// Whether it has completed; lets MPI progress. A completed request is still
// waited on (fl_comm_wait returns at once), which frees its slot.
int fl_comm_test(fl_comm_req req);

// A group of ranks that a collective runs over: the world, or a part of it
// (the groups of a tensor- or pipeline-parallel layout). Ranks are numbered
// 0..size-1 within a group, in the world's order.
const fl_comm_group *fl_comm_world(void);
// The groups of g's ranks that pass the same color (a collective over g):
// this rank's; fl_comm_group_free it.
fl_comm_group *fl_comm_split(const fl_comm_group *g, int color);
void fl_comm_group_free(fl_comm_group *g);
int fl_comm_group_rank(const fl_comm_group *g);
int fl_comm_group_size(const fl_comm_group *g);
// The world rank of g's rank `rank` (for messages).
int fl_comm_group_world_rank(const fl_comm_group *g, int rank);

// A tensor x pipeline x data parallel layout of the world in Megatron's
// order (TP varies fastest, then DP, then PP): rank = tp + t*dp + t*d*pp.
typedef struct {
    int world, rank, tp, pp, dp; // sizes: t, p, d = world / (t*p)
    int tp_rank, pp_rank, dp_rank;
    fl_comm_group *tp_group, *dp_group, *pp_group; // this rank's groups
    fl_comm_group *mp_group; // the t*p ranks sharing dp_rank (grad norm, overflow)
} fl_layout;
// Dies naming the numbers when world % (t*p) != 0 or t, p < 1. A
// collective over the world (src/parallel/layout.c).
void fl_layout_init(fl_layout *l, int t, int p);
void fl_layout_free(fl_layout *l);
// The coordinates of `rank` in that layout of `world` ranks (dies as
// fl_layout_init does).
void fl_layout_coords(int world, int t, int p, int rank, int *tp_rank, int *dp_rank, int *pp_rank);

// Tensor parallelism's collectives over g (tp.h's fl_tp_ops, in
// src/parallel/tensor_parallel.c): blocking, with the deadline. all_reduce
// and reduce_scatter exchange the parts all to all and sum them in fp32 in
// group-rank order, each rank its part, which all_reduce then all-gathers:
// the same bits on every rank, and the same for a given group size, by
// construction; 16-bit sums are rounded once. The table is made on first
// use and lives as long as g. Its scratch buffer, grown to the largest call
// so far, is counted under FL_MEM_COMM: for a reduce_scatter to n values of
// a dtype of D bytes, t*n*D bytes rounded up to 16 plus n floats; for an
// all_reduce of n, that of a reduce_scatter to ceil(n/t), plus t*ceil(n/t)*D
// bytes when t does not divide n (the padded copy it sends).
const fl_tp_ops *fl_tp_ops_group(const fl_comm_group *g);
// That scratch for one call of a group of t ranks: an all_reduce of n
// values of dt, or a reduce_scatter to n values (all_gather, the maximum
// and the sums take none); the buffer's size is the largest of a run's
// calls (the planner's).
typedef enum { FL_TP_ALL_REDUCE, FL_TP_REDUCE_SCATTER } fl_tp_call;
size_t fl_tp_scratch_bytes(int t, fl_tp_call call, fl_dtype dt, size_t n);
// The bytes a group's table of t ranks keeps under FL_MEM_OTHER.
size_t fl_tp_ops_bytes(int t);
// Frees g's table, if it has one (fl_comm_group_free calls it).
void fl_tp_ops_drop(const fl_comm_group *g);

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
