// tp.h: tensor parallelism (Megatron-LM) as the model sees it: this rank's
// place in a t-way split and the collectives over its TP group (Megatron's f
// and g, and their sequence-parallel forms). src/parallel implements the
// collectives over a process group (fl_tp_ops_group, comm.h); src/model calls
// them through this table and includes no MPI.
#ifndef FITLM_TP_H
#define FITLM_TP_H

#include <stddef.h>

#include "fitlm/dtype.h"

typedef struct {
    void *ctx;
    // buf[0, n) of dt summed over the group, in place (16-bit values summed
    // in fp32 and rounded once); the same bits on every rank of the group
    void (*all_reduce)(void *ctx, fl_dtype dt, void *buf, size_t n);
    // buf[0, n) fp32: the element-wise maximum over the group, in place
    void (*all_reduce_max)(void *ctx, float *buf, size_t n);
    // each rank's send[0, n) lands in recv[r*n, (r+1)*n) (r its group rank)
    // on every rank
    void (*all_gather)(void *ctx, fl_dtype dt, const void *send, void *recv, size_t n);
    // send[0, t*n) summed over the group (in fp32); group rank r receives
    // elements [r*n, (r+1)*n) of the sum in recv
    void (*reduce_scatter)(void *ctx, fl_dtype dt, const void *send, void *recv, size_t n);
} fl_tp_ops;

// This rank's place in a t-way tensor-parallel split.
typedef struct {
    int size, rank;        // t (1: no tensor parallelism) and this rank's index in its TP group
    int sequence_parallel; // norms and residual adds on 1/t of the tokens
    const fl_tp_ops *ops;  // NULL when size is 1
} fl_tp;

#endif
