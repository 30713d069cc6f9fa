// update.h: what the update rules share. Each rule fills an fl_optim_ops
// table; fl_optim_* (update.c) check the arguments and dispatch through it.
// fl_update_range is the loop every elementwise rule runs: it walks a range
// in blocks, in parallel, hands each block's fp32 weights and fp32 gradients
// (converted from their storage dtype, scale still to apply) to the rule's
// elementwise function, then refreshes the 16-bit weights.
#ifndef FITLM_OPTIM_UPDATE_H
#define FITLM_OPTIM_UPDATE_H

#include "fitlm/optim.h"

struct fl_optim_ops {
    const char *const *state_names;                 // of the rule's elementwise state tensors
    void (*begin_step)(fl_optim_rule *r, float lr); // t++, the step's constants
    // [offset, offset+count) lies in row and in the state range; row is not frozen
    void (*update)(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                   const fl_update_args *a);
    void (*end_step)(fl_optim_rule *r); // NULL: nothing to do
    float *(*state_ptr)(fl_optim_rule *r, int k, size_t offset);
    int *(*step_count)(fl_optim_rule *r);
    void (*free)(fl_optim_rule *r);
};

// p and g point at element i of the range; gscale multiplies g.
typedef void (*fl_update_block_fn)(void *ctx, float *p, const float *g, size_t i, size_t n,
                                   float gscale);

// The n elements a points at.
void fl_update_range(const fl_update_args *a, size_t n, fl_update_block_fn fn, void *ctx);

#endif
