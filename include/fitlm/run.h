// run.h: a training run, assembled in the one order that works (src/run):
// the config finished, the data and tokenizer, the memory plan, the model,
// its activations, the optimizer(s) over this rank's range, NVMe offload,
// a checkpoint's state, then the parallel strategy; and its step, which
// picks LoRA + LOMO, the fused step or the plain one. `fitlm train`, the
// tests and the benchmarks open runs through it.
#ifndef FITLM_RUN_H
#define FITLM_RUN_H

#include "fitlm/comm.h"
#include "fitlm/config.h"
#include "fitlm/data.h"
#include "fitlm/device.h"
#include "fitlm/dist.h"
#include "fitlm/io.h"
#include "fitlm/offload.h"
#include "fitlm/optim.h"
#include "fitlm/pipeline.h"
#include "fitlm/plan.h"
#include "fitlm/tokenizer.h"
#include "fitlm/train.h"

// A resume's first half, before the flags are read: the checkpoint and its
// config, the run's first layer of settings.
typedef struct {
    fl_ckpt *ck;           // open until fl_run_open restores from it
    const char *path;      // as given (--resume)
    char dir[FL_PATH_MAX]; // the directory it is in: the run continues there
    char run_id[64];       // the run it belongs to ("" for an old checkpoint)
    fl_train_config saved; // its config, for what a resume changes
} fl_run_resume;

// Opens the checkpoint at `path` (a file or a run's directory) and loads
// its config into cfg (defaults first): the flags then go over it.
void fl_run_resume_open(fl_run_resume *res, const char *path, fl_train_config *cfg);

typedef struct {
    fl_run_resume *resume;    // a checkpoint to continue (fl_run_resume_open), or NULL
    int out_given;            // --out was given: a resume writes there, not beside its checkpoint
    int init_from_given;      // --init-from was given (an error with a resume)
    int tokenizer_path_given; // --tokenizer-path was given: a resume reads it, not its copy
    int own_batches;          // no data is opened: the caller steps its own batches
                              // (fl_run_step_batch)
    int alone;                // this process trains by itself whatever the world (no
                              // strategy, zero stage 0): a test's one-process reference
} fl_run_options;

typedef struct {
    fl_train_config cfg;  // finished
    const fl_device *dev; // cfg.device's: the model's and the optimizer's (fl_device_use)
    fl_model model;
    fl_optimizer optim;            // the model's, or under LoRA the adapters'
    fl_optimizer base_optim;       // LoRA + LOMO: the base's fused optimizer (base points here)
    fl_optimizer *base;            // NULL unless lora.train_base
    float base_lr;                 // the base's learning rate (lora.base_lr, else lr)
    fl_dist *strategy;             // data parallelism / ZeRO, or NULL
    fl_offload *offload;           // NVMe offload of the optimizer, or NULL
    fl_dev_offload *dev_offload;   // the optimizer in a device's pinned host memory, or NULL
    fl_dev_weights *dev_weights;   // weight offload: the device's ring of units, or NULL
    fl_dev_adapters *dev_adapters; // LoRA's adapters' optimizer in pinned host memory, or NULL
    void *base_host;      // LoRA under weight offload: the frozen base's pinned copy, or NULL
    fl_loader train, val; // val only when has_val; neither under own_batches
    int has_train, has_val;
    double baseline;              // the unigram cross-entropy of val (nats/token)
    double bytes_per_token;       // of val's targets: for nats/byte
    fl_tokenizer_files tok_files; // the run's tokenizer, read once; in every checkpoint
    int tok_vocab;                // its vocabulary (fl_tokenizer_files_vocab)
    fl_tokenizer *tok;            // for the final sample (sample_tokens > 0), else NULL
    fl_plan plan;
    fl_schedule schedule;
    int *inputs, *targets; // a step's micro-batches, (grad_accum, B, T)
    // this process among the run's data-parallel ranks (alone: 0 of 1): the
    // world, or under tensor parallelism its TP groups (which read the same data)
    int rank, world;
    int lead;          // writes the shared files: world rank 0 (or alone)
    fl_layout layout;  // the TP x PP x DP groups (tensor or pipeline parallelism), else
                       // layout.tp 0
    fl_tp tp;          // this rank's place in its TP group (size 1: none)
    fl_pp_stage stage; // this rank's pipeline stage (size 1: the whole model)
    fl_pipeline *pipe; // the pipeline executor, or NULL
    int dist, lora, train_base;
    // a resume: its step, and what it was saved with (for the notices)
    int resumed, start, ck_world, ck_threads;
    fl_train_config saved;
    char shape_from[FL_PATH_MAX]; // the checkpoint or pretrained weights the shape came from
    fl_weight_source weights;     // opened for the shape, closed once the model is made
    char run_id[64];
    char *config_json; // the run as given, for its checkpoints
} fl_run;

// Opens a run of cfg (copied, then finished into r->cfg). Dies with a clear
// message on anything that cannot run: a contradiction, data that does not
// match, a plan that does not fit memory. A non-empty out_dir is made ready
// (created, locked, checked not to hold another run). Under mpirun every
// rank calls it.
void fl_run_open(fl_run *r, const fl_train_config *cfg, const fl_run_options *opt);
// One step (0-based `step`): loads its micro-batches, takes the schedule's
// learning rate, and steps them.
fl_train_result fl_run_step(fl_run *r, int step);
// The learning rate of step `step` (0-based), before it runs: the
// schedule's at the step, or for DeepSpeed's schedules at the updates
// applied so far.
float fl_run_lr(fl_run *r, int step);
// One step on the caller's batch ((grad_accum, B, T) inputs and targets) at
// learning rate lr: LoRA + LOMO, an optimizer fused into the backward pass,
// or the plain step, whichever the run is. On a device the batch must be in
// pinned memory (fl_train_step): r->inputs and r->targets are.
fl_train_result fl_run_step_batch(fl_run *r, const int *inputs, const int *targets, float lr);
// The weights after every step taken: a delayed update still pending
// (ZeRO-Offload's delayed_update) runs now. Evaluating and saving do it
// first; the caller, before it uses the model otherwise (sampling).
void fl_run_flush(fl_run *r);
// The mean validation loss over cfg.eval_iters fixed batches (every rank's)
// after `step`; dies naming the step and the batch when it is not finite.
float fl_run_evaluate(fl_run *r, int step);
// A checkpoint after `step` in cfg.out_dir (sharded under a strategy),
// unless the weights are not finite: a diverged model never replaces a good one.
void fl_run_save(fl_run *r, int step);
void fl_run_close(fl_run *r);

#endif
