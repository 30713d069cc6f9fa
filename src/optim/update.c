// update.c: see update.h.
#include "update.h"

#define UPDATE_BLOCK 4096 // elements per work item; fits the fp32 gradient copy on the stack

void fl_update_range(const fl_update_args *a, size_t offset, size_t n, fl_update_block_fn fn,
                     void *ctx) {
    size_t nblocks = (n + UPDATE_BLOCK - 1) / UPDATE_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nblocks; b++) {
        size_t i = offset + b * UPDATE_BLOCK, len = n - b * UPDATE_BLOCK;
        if (len > UPDATE_BLOCK) len = UPDATE_BLOCK;
        float scratch[UPDATE_BLOCK];
        const float *g =
            fl_load_f32(a->grads_dtype, fl_at_const(a->grads_dtype, a->grads, i), len, scratch);
        fn(ctx, a->params + i, g, i, len, a->grad_scale);
        if (a->params_lowp)
            fl_store_f32(a->lowp_dtype, fl_at(a->lowp_dtype, a->params_lowp, i), a->params + i,
                         len);
    }
}
