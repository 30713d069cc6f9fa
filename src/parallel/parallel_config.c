// parallel_config.c: the data-parallel section of a run's config: DeepSpeed's
// batch rule over the ranks, ZeRO's keys by stage, and what the engine
// cannot run yet. The ranks are the communicator's (a plan's: cfg->ranks).
#include <string.h>

#include "fitlm/comm.h"
#include "fitlm/dist.h"

#define ZERO "zero_optimization."

// DeepSpeed's batch rule (runtime/config.py, _set_batch_related_parameters):
// train_batch_size = micro x accum x ranks, and any two of the three set the
// third; train_batch_size alone means no accumulation. Run after MPI has
// started: the ranks are fl_comm_size's (or cfg->ranks, a plan's).
static int world_of(const fl_train_config *cfg) {
    return cfg->ranks > 0 ? cfg->ranks : fl_comm_size();
}

void fl_parallel_check_batch(fl_train_config *cfg) {
    int world = world_of(cfg), t = cfg->train_batch_size; // t 0: not given
    int has_micro = fl_config_given(cfg, "train_micro_batch_size_per_gpu");
    int has_accum = fl_config_given(cfg, "gradient_accumulation_steps");
    const char *ranks = world == 1 ? "rank" : "ranks";
    if (t && !has_micro) {
        int accum = has_accum ? cfg->grad_accum : 1;
        if (t % ((long long)accum * world))
            fl_die("train_batch_size %d is not a multiple of gradient_accumulation_steps %d x %d "
                   "%s: it cannot set train_micro_batch_size_per_gpu",
                   t, accum, world, ranks);
        cfg->grad_accum = accum;
        cfg->micro_batch = (int)(t / ((long long)accum * world));
    } else if (t && !has_accum) {
        if (t % ((long long)cfg->micro_batch * world))
            fl_die("train_batch_size %d is not a multiple of train_micro_batch_size_per_gpu %d x "
                   "%d %s: it cannot set gradient_accumulation_steps",
                   t, cfg->micro_batch, world, ranks);
        cfg->grad_accum = (int)(t / ((long long)cfg->micro_batch * world));
    }
    long long total = (long long)cfg->micro_batch * cfg->grad_accum * world;
    if (t && total != t)
        fl_die("train_batch_size %d != train_micro_batch_size_per_gpu %d x "
               "gradient_accumulation_steps %d x %d %s",
               t, cfg->micro_batch, cfg->grad_accum, world, ranks);
    if (total > 1 << 30)
        fl_die("train_micro_batch_size_per_gpu %d x gradient_accumulation_steps %d x %d %s is "
               "more than 2^30 sequences per step",
               cfg->micro_batch, cfg->grad_accum, world, ranks);
    cfg->train_batch_size = (int)total;
}

// Keys named stage3_* do nothing below stage 3: an error, as an fp16 key
// without fp16 is (saving gathered weights is the exception: DeepSpeed's
// save_16bit_model reads it at stage 2 too).
static void check_stage3_keys(const fl_train_config *cfg) {
    static const char *const keys[] = {ZERO "stage3_prefetch_bucket_size",
                                       ZERO "stage3_max_live_parameters",
                                       ZERO "stage3_max_reuse_distance",
                                       ZERO "stage3_param_persistence_threshold",
                                       ZERO "stage3_model_persistence_threshold",
                                       ZERO "stage3_module_granularity_threshold",
                                       ZERO "stage3_use_all_reduce_for_fetch_params"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (cfg->zero.stage != 3 && fl_config_given(cfg, keys[i]))
            fl_die("%s applies to ZeRO stage 3; zero_optimization.stage is %d", keys[i],
                   cfg->zero.stage);
}

// What the data-parallel engine (src/parallel) cannot run yet, said before
// anything loads, naming the keys (LOMO and AdaLomo it runs: fused_units).
static void check_unsupported(const fl_train_config *cfg) {
    int world = fl_comm_size(), stage = cfg->zero.stage;
    if (stage == 0 && world == 1) return;
    char with[96];
    if (stage)
        snprintf(with, sizeof with, "zero_optimization.stage %d%s", stage,
                 world > 1 ? "" : " (one rank)");
    else
        snprintf(with, sizeof with, "%d ranks (data parallelism)", world);
    if (cfg->quant.enabled)
        fl_die("quantization_config.bnb_4bit_quant_type nf4 with %s is not supported yet: train "
               "QLoRA on one rank without ZeRO",
               with);
    if (cfg->lora_enabled)
        fl_die("lora.enabled (LoRA%s) with %s is not supported yet: train adapters on one rank "
               "without ZeRO",
               *cfg->adapter ? ", from --adapter" : "", with);
}

void fl_parallel_check_config(fl_train_config *cfg) {
    // DeepSpeed's default depends on the stage (zero/config.py); stage 0 is
    // not ZeRO there, and DDP overlaps its all-reduce with the backward pass
    if (!fl_config_given(cfg, ZERO "overlap_comm"))
        cfg->zero.overlap_comm = cfg->zero.stage == 3 || cfg->zero.stage == 0;
    check_stage3_keys(cfg);
    check_unsupported(cfg);
}
