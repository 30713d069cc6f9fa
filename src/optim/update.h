// update.h: the loop every optimizer update shares. It walks a parameter
// range in blocks, in parallel, hands each block's fp32 weights and fp32
// gradients (converted from their storage dtype, scale still to apply) to
// the optimizer's elementwise rule, then refreshes the 16-bit weights.
#ifndef FITLM_OPTIM_UPDATE_H
#define FITLM_OPTIM_UPDATE_H

#include "fitlm/optim.h"

// p and g point at element `offset` of the range; gscale multiplies g.
typedef void (*fl_update_block_fn)(void *ctx, float *p, const float *g, size_t offset, size_t n,
                                   float gscale);

void fl_update_range(const fl_update_args *a, size_t offset, size_t n, fl_update_block_fn fn,
                     void *ctx);

#endif
