// update.cu: fl_optim_update on device memory for AdamW and SGD (LOMO and
// AdaLomo are refused on devices in this issue: no master copy). The rule's
// struct stays on the host (its step constants, set by begin_step); its
// state (m, v, the momentum) and the weights, master and gradients are on
// the device. One thread per element, the arithmetic of src/optim/adamw.c
// and sgd.c operation for operation (their FMAs written out, no other
// contraction), so the fp32 weights, the state and the 16-bit copy
// (rounded to nearest even) come out as the cpu's bits.
#include "common.cuh"

extern "C" {
#include "../optim/update.h"
}

__global__ void adamw_kernel(float *p, fl_dtype gdt, const void *g, float *m, float *v,
                             fl_dtype pdt, void *p16, size_t n, float gscale, float b1, float b2,
                             float eps, float bc1, float bc2, float lr, float keep) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = fl_d_load(gdt, g, i) * gscale;
        float mi = fmaf(b1, m[i], (1.0f - b1) * gi);
        float vi = fmaf(b2, v[i], (1.0f - b2) * gi * gi);
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        float pi = fmaf(p[i], keep, -(lr * mhat / (sqrtf(vhat) + eps)));
        p[i] = pi;
        if (p16) fl_d_store(pdt, p16, i, pi);
    }
}

// buf NULL: no momentum; first: the step that starts the buffer
__global__ void sgd_kernel(float *p, fl_dtype gdt, const void *g, float *buf, fl_dtype pdt,
                           void *p16, size_t n, float gscale, float lr, float wd, float mu,
                           int first) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float d = fl_d_load(gdt, g, i) * gscale + wd * p[i];
        if (buf) {
            d = first ? d : mu * buf[i] + d;
            buf[i] = d;
        }
        float pi = p[i] - lr * d;
        p[i] = pi;
        if (p16) fl_d_store(pdt, p16, i, pi);
    }
}

extern "C" void fl_cuda_update(fl_optim_rule *r, const fl_param_view *row, size_t offset,
                               size_t count, const fl_update_args *a) {
    FL_ASSERT(*fl_optim_step_count(r) >= 1); // inside a step
    FL_ASSERT(offset >= row->offset && offset + count <= row->offset + row->numel);
    FL_ASSERT(offset >= r->state_begin && offset + count <= r->state_end);
    if ((row->flags & FL_PARAM_FROZEN) || !count) return;
    if (r->ops->kind != FL_OPT_ADAMW && r->ops->kind != FL_OPT_SGD)
        fl_die("cuda: the optimizer's update runs AdamW and SGD on the GPU; LOMO and AdaLomo "
               "are not supported on a device yet (use --device cpu)");
    if (!a->params)
        fl_die(
            "cuda: an update without fp32 weights (no master copy) is not supported on a device");
    void *p16 = a->params_lowp;
    size_t s = offset - r->window_begin; // the state's element
    unsigned blocks = fl_cuda_blocks(count, 256);
    if (r->ops->kind == FL_OPT_ADAMW) {
        const fl_adamw *o = (const fl_adamw *)r;
        float keep = (row->flags & FL_PARAM_DECAY) ? o->keep : 1.0f;
        adamw_kernel<<<blocks, 256, 0, fl_cuda_stream()>>>(
            a->params, a->grads_dtype, a->grads, o->m + s, o->v + s, a->lowp_dtype, p16, count,
            a->grad_scale, o->beta1, o->beta2, o->eps, o->bc1, o->bc2, o->lr, keep);
        FL_CUDA_LAUNCHED("adamw_kernel");
        return;
    }
    const fl_sgd *o = (const fl_sgd *)r;
    float wd = (row->flags & FL_PARAM_DECAY) ? o->weight_decay : 0.0f;
    sgd_kernel<<<blocks, 256, 0, fl_cuda_stream()>>>(
        a->params, a->grads_dtype, a->grads, o->buf ? o->buf + s : NULL, a->lowp_dtype, p16, count,
        a->grad_scale, o->lr, wd, o->momentum, o->t == 1);
    FL_CUDA_LAUNCHED("sgd_kernel");
}
