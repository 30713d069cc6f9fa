// parallel_config.c: the parallel sections of a run's config: DeepSpeed's
// batch rule over the data-parallel replicas, the tensor-parallel layout
// against the model, ZeRO's keys by stage, and what the engine cannot run
// yet. The ranks are the communicator's (a plan's: cfg->ranks).
#include <string.h>

#include "fitlm/comm.h"
#include "fitlm/dist.h"

#define ZERO "zero_optimization."

static int world_of(const fl_train_config *cfg) {
    return cfg->ranks > 0 ? cfg->ranks : fl_comm_size();
}

// The data-parallel size d = world / t: the model replicas the batch is
// split over, each of t tensor-parallel ranks (rank = tp + t x dp).
static int data_parallel_size(const fl_train_config *cfg) {
    int world = world_of(cfg), t = cfg->tensor_parallel;
    if (world % t)
        fl_die("tensor_parallel.size %d does not divide the world of %d rank%s (%d %% %d = %d): "
               "the ranks form d = world / t data-parallel replicas of %d ranks each; run a "
               "multiple of %d ranks (a checkpoint resumes under any layout: --tensor-parallel "
               "1 for one process)",
               t, world, world == 1 ? "" : "s", world, t, world % t, t, t);
    return world / t;
}

// DeepSpeed's batch rule (runtime/config.py, _set_batch_related_parameters):
// train_batch_size = micro x accum x replicas, and any two of the three set
// the third; train_batch_size alone means no accumulation. The replicas are
// the data-parallel size d = world / t (Megatron: global_batch = micro x m
// x d): a tensor-parallel group of t ranks reads one micro-batch. Run after
// MPI has started: the world is fl_comm_size's (or cfg->ranks, a plan's).
void fl_parallel_check_batch(fl_train_config *cfg) {
    int d = data_parallel_size(cfg), total_given = cfg->train_batch_size; // 0: not given
    int has_micro = fl_config_given(cfg, "train_micro_batch_size_per_gpu");
    int has_accum = fl_config_given(cfg, "gradient_accumulation_steps");
    char ranks[96]; // what d counts
    if (cfg->tensor_parallel == 1)
        snprintf(ranks, sizeof ranks, "%s", d == 1 ? "rank" : "ranks");
    else
        snprintf(ranks, sizeof ranks,
                 "data-parallel replica%s (%d ranks / tensor_parallel.size %d)", d == 1 ? "" : "s",
                 world_of(cfg), cfg->tensor_parallel);
    if (total_given && !has_micro) {
        int accum = has_accum ? cfg->grad_accum : 1;
        if (total_given % ((long long)accum * d))
            fl_die("train_batch_size %d is not a multiple of gradient_accumulation_steps %d x %d "
                   "%s: it cannot set train_micro_batch_size_per_gpu",
                   total_given, accum, d, ranks);
        cfg->grad_accum = accum;
        cfg->micro_batch = (int)(total_given / ((long long)accum * d));
    } else if (total_given && !has_accum) {
        if (total_given % ((long long)cfg->micro_batch * d))
            fl_die("train_batch_size %d is not a multiple of train_micro_batch_size_per_gpu %d x "
                   "%d %s: it cannot set gradient_accumulation_steps",
                   total_given, cfg->micro_batch, d, ranks);
        cfg->grad_accum = (int)(total_given / ((long long)cfg->micro_batch * d));
    }
    long long total = (long long)cfg->micro_batch * cfg->grad_accum * d;
    if (total_given && total != total_given)
        fl_die("train_batch_size %d != train_micro_batch_size_per_gpu %d x "
               "gradient_accumulation_steps %d x %d %s",
               total_given, cfg->micro_batch, cfg->grad_accum, d, ranks);
    if (total > 1 << 30)
        fl_die("train_micro_batch_size_per_gpu %d x gradient_accumulation_steps %d x %d %s is "
               "more than 2^30 sequences per step",
               cfg->micro_batch, cfg->grad_accum, d, ranks);
    cfg->train_batch_size = (int)total;
}

void fl_tp_check(const fl_train_config *cfg, const fl_model_config *model) {
    int t = cfg->tensor_parallel;
    if (cfg->sequence_parallel && t == 1)
        fl_die("sequence_parallel splits the tokens over the tensor-parallel ranks: it needs "
               "tensor_parallel.size above 1, which is 1 (--sequence-parallel=false turns it off)");
    data_parallel_size(cfg);
    if (t == 1) return;
    fl_model_tp_check(model, t);
    long long tokens = (long long)cfg->micro_batch * cfg->seq_len;
    if (cfg->sequence_parallel && tokens % t)
        fl_die("sequence_parallel: train_micro_batch_size_per_gpu %d x seq_len %d = %lld tokens "
               "do not split over tensor_parallel.size %d (%lld %% %d = %lld)",
               cfg->micro_batch, cfg->seq_len, tokens, t, tokens, t, tokens % t);
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
