// update.h: what the update rules share. Each rule fills an fl_optim_ops
// table; fl_optim_* (update.c) check the arguments and dispatch through it.
// fl_update_range is the loop every elementwise rule runs: it walks a range
// in blocks, in parallel, hands each block's fp32 weights and fp32 gradients
// (converted from their storage dtype, scale still to apply) to the rule's
// elementwise function, then refreshes the 16-bit weights; or, under mixed
// precision with AVX2 or AVX-512, hands each block to the rule's one-pass
// function where it has one (AdamW), which converts in registers.
#ifndef FITLM_OPTIM_UPDATE_H
#define FITLM_OPTIM_UPDATE_H

#include "fitlm/optim.h"

struct fl_optim_ops {
    fl_optim_kind kind;             // which rule: a device's update kernel picks its own by it
    const char *const *state_names; // of the rule's elementwise state tensors
    void (*begin_step)(fl_optim_rule *r, float lr); // t++, the step's constants
    // [offset, offset+count) lies in row and in the state range; row is not frozen
    void (*update)(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                   const fl_update_args *a);
    void (*end_step)(fl_optim_rule *r); // NULL: nothing to do
    // elementwise rules: where tensor k's pointer (to element window_begin) is kept
    float **(*state_slot)(fl_optim_rule *r, int k);
    // the other rules (per-row state): tensor k's value for element offset
    float *(*state_ptr)(fl_optim_rule *r, int k, size_t offset);
    // state tensor k of row as a row of its own (its floats: numel; how it
    // splits under tensor parallelism); NULL: elementwise (the row itself)
    fl_param_view (*state_view)(const fl_optim_rule *r, int k, const fl_param_view *row);
    int *(*step_count)(fl_optim_rule *r);
    void (*free)(fl_optim_rule *r);
    // 1: update goes through fl_update_range alone (no parallel region of
    // its own), so the rows of a step can share one team (fl_update_args.team)
    int team_rows;
};

// p and g point at element i of the range; gscale multiplies g.
typedef void (*fl_update_block_fn)(void *ctx, float *p, const float *g, size_t i, size_t n,
                                   float gscale);

// A rule's one-pass block under mixed precision: elements [i, i+n) of the
// range, the gradients read in a->grads_dtype and the 16-bit weights
// refreshed by the rule itself (converted in registers), with fn's bits.
typedef void (*fl_update_lowp_fn)(void *ctx, const fl_update_args *a, size_t i, size_t n);

// The n elements a points at. lowp (NULL: none) takes the blocks instead of
// fn where there is a master copy and 16-bit gradients or weights, on AVX2
// or AVX-512. The blocks are shared among the threads of a parallel region
// of its own, or with a->team among those of the caller's, every one of
// which makes the same call (no barrier: the rows of a step follow on).
void fl_update_range(const fl_update_args *a, size_t n, fl_update_block_fn fn,
                     fl_update_lowp_fn lowp, void *ctx);

// For rules that walk a range themselves (AdaLomo): the fp32 weights of the
// range's elements [i, i+n) (a->params + i, or without a master the 16-bit
// weights converted into scratch), and, once updated in place, their store
// back (the 16-bit copy refreshed by nearest even, or without a master the
// 16-bit weights by nearest even or stochastic rounding).
float *fl_update_load_params(const fl_update_args *a, size_t i, size_t n, float *scratch);
void fl_update_store_params(const fl_update_args *a, size_t i, size_t n, const float *p);

// An elementwise rule's state in memory from flat element `begin` on:
// tensor k at state[k] (a paged chunk, or the whole range).
void fl_optim_set_window(fl_optim_rule *r, size_t begin, float *const *state);

// The rules' set-up without their state allocated (alloc 0: a pager brings it).
void fl_adamw_setup(fl_adamw *opt, size_t begin, size_t end, float beta1, float beta2, float eps,
                    float weight_decay, int alloc);
void fl_sgd_setup(fl_sgd *opt, size_t begin, size_t end, float momentum, float weight_decay,
                  int alloc);

// AdaLomo's block (its fp32 copies live on the stack). Its sums are taken per
// block, so a change of size changes its bits; fl_update_range has its own.
#define FL_UPDATE_BLOCK 4096

#endif
