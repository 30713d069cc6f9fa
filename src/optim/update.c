// update.c: see update.h.
#include "update.h"

#include "fitlm/core.h"

#include "gate.h"

#include <omp.h>

// Elements per work item of fl_update_range. Its fp32 copies (the gradients,
// and the weights read back for the 16-bit store) must still be in L1 when
// read: with 4,096, about 80 KB a block, the 16-bit AdamW step took ~40%
// longer than fp32's though it moves as many bytes. 16-bit gradients or
// weights take smaller blocks still (AdamW on SmolLM-135M's 135 M fp16
// parameters, Zen 4: 115-129 ms at 128 against 137-176 at 512, three
// rounds in turn; in that LLaMA's fp16 training step, median 179 against
// 193 ms over 8 alternated runs), fp32 larger ones (84-108 ms at 512,
// 96-118 at 128).
#define UPDATE_BLOCK      512
#define UPDATE_BLOCK_LOWP 128
_Static_assert(UPDATE_BLOCK_LOWP <= UPDATE_BLOCK, "the stack copies are UPDATE_BLOCK long");

void fl_optim_begin_step(fl_optim_rule *r, float lr) {
    r->ops->begin_step(r, lr);
}

void fl_optim_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                     const fl_update_args *a) {
    FL_ASSERT(*fl_optim_step_count(r) >= 1); // inside a step
    FL_ASSERT(offset >= row->offset && offset + count <= row->offset + row->numel);
    FL_ASSERT(offset >= r->state_begin && offset + count <= r->state_end);
    if (row->flags & FL_PARAM_FROZEN) return;
    if (!a->gate) {
        r->ops->update(r, row, offset, count, a);
        return;
    }
    // a gated update (on the host's memory: the cpu and test devices)
    if (a->gate->skip) return;
    fl_update_args b = *a;
    fl_gate_factors(a->gate, fl_optim_kind_fused(r->ops->kind), &b.grad_scale, &b.clip_coef);
    b.gate = NULL;
    r->ops->update(r, row, offset, count, &b);
}

void fl_optim_end_step(fl_optim_rule *r) {
    if (r->ops->end_step) r->ops->end_step(r);
}

void fl_optim_free(fl_optim_rule *r) {
    r->ops->free(r);
}

int fl_optim_state_count(const fl_optim_rule *r) {
    return r->nstate;
}

const char *fl_optim_state_name(const fl_optim_rule *r, int k) {
    FL_ASSERT(k >= 0 && k < r->nstate);
    return r->ops->state_names[k];
}

float *fl_optim_state_ptr(fl_optim_rule *r, int k, size_t offset) {
    FL_ASSERT(k >= 0 && k < r->nstate);
    FL_ASSERT(offset >= r->state_begin && offset < r->state_end);
    if (r->ops->state_slot) return *r->ops->state_slot(r, k) + (offset - r->window_begin);
    return r->ops->state_ptr(r, k, offset);
}

void fl_optim_set_window(fl_optim_rule *r, size_t begin, float *const *state) {
    FL_ASSERT(r->ops->state_slot && begin >= r->state_begin);
    r->window_begin = begin;
    for (int k = 0; k < r->nstate; k++) *r->ops->state_slot(r, k) = state[k];
}

fl_param_view fl_optim_state_view(const fl_optim_rule *r, int k, const fl_param_view *row) {
    FL_ASSERT(k >= 0 && k < r->nstate);
    return r->ops->state_view ? r->ops->state_view(r, k, row) : *row;
}

size_t fl_optim_state_numel(const fl_optim_rule *r, int k, const fl_param_view *row) {
    return fl_optim_state_view(r, k, row).numel;
}

int *fl_optim_step_count(fl_optim_rule *r) {
    return r->ops->step_count(r);
}

float *fl_update_load_params(const fl_update_args *a, size_t i, size_t n, float *scratch) {
    if (a->params) return a->params + i;
    FL_ASSERT(a->params_lowp);
    fl_convert(FL_F32, scratch, a->lowp_dtype, fl_at(a->lowp_dtype, a->params_lowp, i), n);
    return scratch;
}

void fl_update_store_params(const fl_update_args *a, size_t i, size_t n, const float *p) {
    if (!a->params_lowp) return;
    void *dst = fl_at(a->lowp_dtype, a->params_lowp, i);
    if (!a->params && a->stochastic)
        fl_store_f32_stochastic(a->lowp_dtype, dst, p, n, a->sr_seed, a->first_index + i);
    else
        fl_store_f32(a->lowp_dtype, dst, p, n);
}

// elements per work item of a rule's one-pass blocks (no copies to keep in L1)
#define UPDATE_BLOCK_ONE_PASS 4096

// The calling thread's share of the range's blocks: a contiguous run of
// them, as schedule(static) would give it (the bits do not depend on it:
// each block's elements are updated on their own).
static void range_share(const fl_update_args *a, size_t n, fl_update_block_fn fn,
                        fl_update_lowp_fn lowp, void *ctx) {
    int lowp_data = a->params_lowp || a->grads_dtype != FL_F32;
    int one_pass = lowp && lowp_data && a->params && fl_cpu_isa() >= FL_ISA_AVX2;
    size_t block = one_pass                                      ? UPDATE_BLOCK_ONE_PASS
                   : a->grads_dtype == FL_F32 && !a->params_lowp ? UPDATE_BLOCK
                                                                 : UPDATE_BLOCK_LOWP;
    size_t nblocks = (n + block - 1) / block;
    size_t threads = (size_t)omp_get_num_threads(), t = (size_t)omp_get_thread_num();
    for (size_t b = nblocks * t / threads; b < nblocks * (t + 1) / threads; b++) {
        size_t i = b * block, len = n - i < block ? n - i : block;
        if (one_pass) {
            lowp(ctx, a, i, len);
            continue;
        }
        float scratch[UPDATE_BLOCK], pbuf[UPDATE_BLOCK];
        const float *g =
            fl_load_f32(a->grads_dtype, fl_at_const(a->grads_dtype, a->grads, i), len, scratch);
        float *p = fl_update_load_params(a, i, len, pbuf);
        fn(ctx, p, g, i, len, a->grad_scale);
        fl_update_store_params(a, i, len, p);
    }
}

void fl_update_range(const fl_update_args *a, size_t n, fl_update_block_fn fn,
                     fl_update_lowp_fn lowp, void *ctx) {
    if (a->team) {
        range_share(a, n, fn, lowp, ctx);
        return;
    }
#pragma omp parallel
    range_share(a, n, fn, lowp, ctx);
}
