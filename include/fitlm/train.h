// train.h: one training step, as a library call: forward and backward over
// the micro-batches of an accumulated batch, loss scaling, clipping and the
// optimizer update (src/run/step.c); and a run's config made whole for it
// (src/run/config_finish.c). A run (run.h) steps through it.
#ifndef FITLM_TRAIN_H
#define FITLM_TRAIN_H

#include "fitlm/config.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"

typedef struct {
    float loss;      // mean loss over every target token of the accumulated batch
    long n_targets;  // target tokens (targets != -1) in the accumulated batch
    float grad_norm; // of the unscaled gradient, before clipping
    int skipped;     // nothing was updated: an fp16 overflow, or (another precision)
                     // a non-finite gradient found before the update
    float loss_scale;
    fl_spike_verdict spike; // the spike guard's; an outlier was not applied (skipped 0)
    int spikes_in_row;      // consecutive outliers up to this step
    long spikes_skipped;    // outliers in all (a resumed run's too)
} fl_train_result;

// The target tokens (targets != -1) of targets[0, n), summed over every rank
// under data parallelism (o->sync): the count each token's loss is weighed by.
long fl_batch_targets(const fl_optimizer *o, const int *targets, size_t n);

// One optimizer step over `micro` micro-batches of B x T tokens: inputs and
// targets are (micro, B, T). Gradients are token-weighted: each target
// token's loss has weight 1 / (targets in the whole accumulated batch), so k
// micro-batches give the gradient of one batch of k*B sequences even when
// they hold different numbers of targets (DeepSpeed/HF's mean of per-micro-
// batch means does not). micro must equal the optimizer's grad_accum. On a
// device other than the cpu the tokens go up asynchronously: they must lie
// in its pinned memory (host_alloc; a run's inputs and targets do).
fl_train_result fl_train_step(fl_model *m, fl_optimizer *o, const int *inputs, const int *targets,
                              int micro, int B, int T, float lr);

// The step of an optimizer fused into the backward pass (LOMO, AdaLomo) on a
// model made by fl_model_init_unit_grads, one micro-batch:
// each unit is updated as soon as its gradients are complete. With gradient
// clipping (max_grad_norm > 0) or fp16, a first forward and backward gather
// the global norm and look for overflow without changing a weight, then a
// second forward and backward update. fl_train_step calls it for those
// optimizers; the result's grad_norm is that of the unscaled gradient.
// A step's forward and backward passes over its one micro-batch: one
// process's model (fl_fused_step), or a pipeline's stages (pipeline.h).
// forward runs the whole forward, or with head_only the head again (what
// the first backward overwrote), and leaves the loss and its target count
// in m->loss and m->n_targets on every rank.
typedef struct {
    void *ctx;
    void (*forward)(void *ctx, const int *inputs, const int *targets, int B, int T, float dloss,
                    int head_only);
    void (*backward)(void *ctx, float dloss);
} fl_step_passes;
// fl_fused_step over other passes.
fl_train_result fl_fused_step_passes(fl_model *m, fl_optimizer *o, const fl_step_passes *passes,
                                     const int *inputs, const int *targets, int B, int T, float lr);
fl_train_result fl_fused_step(fl_model *m, fl_optimizer *o, const int *inputs, const int *targets,
                              int B, int T, float lr);
// LoRA + LOMO (lora.train_base): one micro-batch, the base updated in the
// backward by `base` (LOMO or AdaLomo, at base_lr) as fl_fused_step does, the
// adapters' gradients gathered in the same backward and stepped by
// `adapters` (at lr) after it. bf16 or fp32. The result's grad_norm is the
// base's.
fl_train_result fl_lora_lomo_step(fl_model *m, fl_optimizer *adapters, fl_optimizer *base,
                                  const int *inputs, const int *targets, int B, int T, float lr,
                                  float base_lr);

// ----------------------------------------------------------------------------
// the config finished (src/run/config_finish.c)

// A run's config made whole: the model shape from its
// preset and the model.* options (the preset names the architecture unless
// it is tiny or demo), the vocabulary from the tokenizer's (tokenizer_vocab,
// which the caller took from the run's tokenizer files), then
// fl_config_check. Dies naming the option on a contradiction.
void fl_config_finish(fl_train_config *cfg, int tokenizer_vocab);
// The checks of a config that need no model, section by section in the
// order their derived values are read: DeepSpeed's keys mapped or refused,
// the common options, the batch over the ranks, LoRA, NF4, the optimizer,
// ZeRO and its offload. Dies naming the option.
void fl_config_check(fl_train_config *cfg);
// Takes the model shape of pretrained weights or a checkpoint (`source`);
// a model.* option that contradicts it is an error.
void fl_config_set_shape(fl_train_config *cfg, const fl_model_config *shape, const char *source);
// Takes the LoRA config of a PEFT adapter (`source`): a lora.* option that
// contradicts it is an error; the base's training (lora.base_optimizer)
// stays the run's.
void fl_config_set_lora(fl_train_config *cfg, const fl_lora_config *adapter, const char *source);
// The optimizer settings of a finished config (under LoRA: the adapters').
fl_optimizer_config fl_config_optimizer(const fl_train_config *cfg);
// LoRA + LOMO (lora.base_optimizer): the base's fused optimizer, with the
// run's clipping, loss scaling and LOMO/AdaLomo options, no weight decay.
fl_optimizer_config fl_config_base_optimizer(const fl_train_config *cfg);
// Whether a run with these settings keeps one unit's gradients at a time
// (fl_model_alloc_acts' unit_grads): an optimizer updating from the backward
// pass (LOMO, AdaLomo, optimizer_in_backward) without accumulation; with
// accumulation it needs the whole gradient.
static inline int fl_optimizer_unit_grads(const fl_optimizer_config *o) {
    return fl_optim_in_backward(o) && o->grad_accum == 1;
}

#endif
