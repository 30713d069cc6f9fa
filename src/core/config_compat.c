// config_compat.c: DeepSpeed's keys that name no concept of fitlm's, each
// mapped onto fitlm's own or refused naming the key, the value and why;
// none is ignored. Mapped: the bf16/fp16 blocks onto precision,
// wall_clock_breakdown and memory_breakdown onto profile and mem_report,
// optimizer.type Adam onto adamw, the deprecated cpu_offload forms onto the
// offload blocks' device. Accepted switched off: the feature blocks fitlm
// does not run (monitors, profilers, ...). Refused: the engine's settings
// other than fitlm's way, activation checkpointing's partitioning, ZeRO's
// alternatives to what fitlm does one way and its features fitlm lacks
// (ZeRO++, MiCS, ...), aio's GPU and intra-op settings. Their entries stay
// in the option table (config.c), which reads them and prints them in
// --help; the sections fitlm runs check their own keys
// (fl_<subsystem>_check_config).
#include <stdio.h>
#include <string.h>

#include "fitlm/config.h"

#define ZERO "zero_optimization."

static int given(const fl_train_config *cfg, const char *key) {
    return fl_config_given(cfg, key);
}

// bf16.enabled / fp16.enabled: DeepSpeed's precision blocks, the same as
// --precision bf16 / fp16
static void map_precision(fl_train_config *cfg) {
    if (cfg->bf16_enabled && cfg->fp16_enabled)
        fl_die("bf16.enabled and fp16.enabled cannot both be true");
    const char *block = cfg->bf16_enabled ? "bf16" : cfg->fp16_enabled ? "fp16" : NULL;
    if (block) {
        if (fl_config_given(cfg, "precision") && strcmp(cfg->precision, block))
            fl_die("precision '%s' contradicts %s.enabled", cfg->precision, block);
        strcpy(cfg->precision, block);
    }
}

// A DeepSpeed switch `ds_key` onto fitlm's `key` (*field), unless both
// are given and disagree.
static void map_switch(fl_train_config *cfg, const char *ds_key, int ds_value, const char *key,
                       int *field) {
    if (!given(cfg, ds_key)) return;
    if (given(cfg, key) && *field != ds_value)
        fl_die("%s %s contradicts %s %s", key, *field ? "true" : "false", ds_key,
               ds_value ? "true" : "false");
    *field = ds_value;
}

// A config file's optimizer block is DeepSpeed's: what it leaves out takes
// DeepSpeed's defaults, not fitlm's (its FusedAdam's and DeepSpeedCPUAdam's
// betas 0.9,0.999, eps 1e-8 and weight_decay 0; torch.optim.SGD's
// weight_decay 0), unless a flag gives it ("auto": fitlm's own setting, as
// the Trainer fills it). Marked given, so that a checkpoint's config holds
// them and a resume reads them back. lr keeps fitlm's default: DeepSpeed's
// schedulers set the rate themselves.
// Whether key is neither given nor "auto"; if so it is marked given, for
// the value the caller sets.
static int fill(fl_train_config *cfg, const char *key) {
    if (given(cfg, key) || fl_config_auto(cfg, key)) return 0;
    fl_config_set_given(cfg, key, 1);
    return 1;
}

void fl_deepspeed_optimizer_defaults(fl_train_config *cfg) {
    if (!cfg->deepspeed_optimizer) return;
    int adamw = !strcmp(cfg->optimizer, "adamw") || !strcmp(cfg->optimizer, "adam"),
        sgd = !strcmp(cfg->optimizer, "sgd");
    if (adamw && fill(cfg, "optimizer.params.betas")) {
        cfg->beta1 = 0.9f;
        cfg->beta2 = 0.999f;
    }
    if (adamw && fill(cfg, "optimizer.params.eps")) cfg->eps = 1e-8f;
    if ((adamw || sgd) && fill(cfg, "optimizer.params.weight_decay")) cfg->weight_decay = 0.0f;
}

// bf16.check_grad_overflow true (DeepSpeed's BF16 optimizer): a step whose
// gradient is not finite is skipped and training goes on, which is fitlm's
// skip_nonfinite without a limit, unless the flag gives one. False lets
// DeepSpeed apply such a step (its weights become NaN); fitlm skips it and
// stops as diverged, writing no checkpoint of it.
static void map_bf16_overflow(fl_train_config *cfg) {
    if (!cfg->zero_extra.bf16_check_grad_overflow) return;
    if (strcmp(cfg->precision, "bf16")) {
        if (given(cfg, "bf16.enabled") && !cfg->bf16_enabled) return; // read no further
        fl_die("bf16.check_grad_overflow applies to bf16 training; precision is %s",
               cfg->precision);
    }
    if (!given(cfg, "skip_nonfinite")) cfg->skip_nonfinite = 1 << 30;
}

// optimizer.type Adam: DeepSpeed's Adam, which is AdamW (weight decay
// decoupled from the moments) unless adam_w_mode is false, when it adds the
// decay to the gradient (L2), which fitlm does not run; without weight
// decay the two are one rule. Type AdamW is AdamW whatever adam_w_mode
// says, so false there is a contradiction.
static void map_adam(fl_train_config *cfg) {
    int adam = !strcmp(cfg->optimizer, "adam"), adamw = !strcmp(cfg->optimizer, "adamw");
    if (given(cfg, "optimizer.params.torch_adam") && !adam && !adamw)
        fl_die("optimizer.params.torch_adam applies to optimizer.type Adam and AdamW, not %s",
               cfg->optimizer);
    if (given(cfg, "optimizer.params.adam_w_mode") && !adam && !adamw)
        fl_die("optimizer.params.adam_w_mode applies to optimizer.type Adam, not %s",
               cfg->optimizer);
    if (given(cfg, "optimizer.params.adam_w_mode") && adamw && !cfg->adam_w_mode)
        fl_die("optimizer.params.adam_w_mode false contradicts optimizer.type AdamW, which "
               "decouples weight decay whatever adam_w_mode says (DeepSpeed's Adam with "
               "adam_w_mode false adds it to the gradient)");
    if (!adam) return;
    if (!cfg->adam_w_mode && cfg->weight_decay != 0.0f)
        fl_die("optimizer.type Adam with adam_w_mode false and weight_decay %g%s adds the decay "
               "to the gradient (L2 regularisation), which fitlm does not run: use adam_w_mode "
               "true (AdamW, DeepSpeed's default) or weight_decay 0",
               cfg->weight_decay,
               given(cfg, "optimizer.params.weight_decay") ? "" : " (fitlm's default)");
    strcpy(cfg->optimizer, "adamw");
}

// DeepSpeed's activation_checkpointing keys beside the policy: each is
// refused with what fitlm does instead, never ignored.
static void refuse_checkpointing(const fl_train_config *cfg) {
    if (cfg->ac_partition)
        fl_die("activation_checkpointing.partition_activations partitions checkpoints across "
               "tensor-parallel ranks; fitlm's sequence parallelism (--sequence-parallel, with "
               "--tensor-parallel above 1) keeps the activations between blocks split over them");
    if (cfg->ac_cpu)
        fl_die("activation_checkpointing.cpu_checkpointing offloads partitioned checkpoints "
               "(DeepSpeed: needs partition_activations); fitlm's activations are in host memory "
               "already");
    if (cfg->ac_contiguous || fl_config_given(cfg, "activation_checkpointing.number_checkpoints"))
        fl_die("activation_checkpointing.contiguous_memory_optimization and number_checkpoints "
               "apply to partitioned checkpoints (DeepSpeed: need partition_activations); "
               "fitlm's checkpoints are one contiguous buffer already");
    if (cfg->ac_sync)
        fl_die("activation_checkpointing.synchronize_checkpoint_boundary synchronises a GPU "
               "stream; fitlm's kernels are synchronous");
    if (cfg->ac_profile)
        fl_die("activation_checkpointing.profile: use --profile (the per-op forward and backward "
               "times, recomputation included)");
}

// A setting fitlm cannot honour: the key (under zero_optimization), the
// value given and why.
static void refuse(int bad, const char *key, const char *value, const char *why) {
    if (bad) fl_die(ZERO "%s %s: %s", key, value, why);
}

// cpu_offload and cpu_offload_param are DeepSpeed's old spellings of an
// offload block's device cpu: the same here, but not both at once.
static void deprecated_offload(fl_train_config *cfg, const char *old, int on, const char *block,
                               char *device) {
    char oldkey[96], devkey[96];
    snprintf(oldkey, sizeof oldkey, ZERO "%s", old);
    snprintf(devkey, sizeof devkey, ZERO "%s.device", block);
    if (!given(cfg, oldkey)) return;
    if (given(cfg, devkey))
        fl_die("%s is the deprecated form of %s (device cpu): give one of them, not both", oldkey,
               devkey);
    if (on) strcpy(device, "cpu");
}

// The deprecated forms onto the offload blocks' devices, whose keys
// fl_offload_check_config then checks.
static void map_offload(fl_train_config *cfg) {
    fl_zero_extra *x = &cfg->zero_extra;
    deprecated_offload(cfg, "cpu_offload", x->cpu_offload, "offload_optimizer",
                       x->offload_optimizer);
    deprecated_offload(cfg, "cpu_offload_param", x->cpu_offload_param, "offload_param",
                       x->offload_param);
    int opt_on = strcmp(x->offload_optimizer, "none") != 0;
    int param_on = strcmp(x->offload_param, "none") != 0;
    if (x->cpu_offload_use_pin_memory && !opt_on && !param_on)
        fl_die(ZERO "cpu_offload_use_pin_memory applies to an offload (device cpu); neither "
                    "offload_optimizer nor offload_param has one");
}

// DeepSpeed's choices between ways of doing what fitlm does one way, and
// its features fitlm lacks: the default is accepted, the rest refused.
static void check_zero_choices(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    refuse(!cfg->zero.contiguous_gradients, "contiguous_gradients", "false",
           "fitlm always keeps a rank's gradient shard in one contiguous buffer (drop the key or "
           "set it true)");
    refuse(!x->allgather_partitions, "allgather_partitions", "false",
           "DeepSpeed then broadcasts each rank's updated weights; fitlm all-gathers them (drop "
           "the key or set it true)");
    refuse(!x->use_multi_rank_bucket_allreduce, "use_multi_rank_bucket_allreduce", "false",
           "DeepSpeed then reduces each rank's part of a bucket to it separately; fitlm "
           "reduce-scatters buckets, or all-reduces them whole with reduce_scatter false");
    refuse(!x->grad_hooks, "grad_hooks", "false",
           "reducing after the backward pass is overlap_comm false in fitlm");
    refuse(!x->load_from_fp32_weights, "load_from_fp32_weights", "false",
           "a resume restores the fp32 master weights from the checkpoint, bit for bit; fitlm "
           "does not rebuild them from the 16-bit weights");
    refuse(x->elastic_checkpoint, "elastic_checkpoint", "true",
           "loading a checkpoint saved by another number of ranks is not supported (DeepSpeed no "
           "longer supports it either)");
    refuse(x->use_all_reduce_for_fetch_params, "stage3_use_all_reduce_for_fetch_params", "true",
           "fitlm fetches stage 3 weights by all-gather");
    refuse(x->legacy_stage1, "legacy_stage1", "true",
           "DeepSpeed's old stage 1 implementation has no counterpart; stage 1 is fitlm's");
    if (x->hpz_partition_size > 1)
        fl_die(ZERO "zero_hpz_partition_size %d: ZeRO++ hierarchical partitioning (a secondary "
                    "copy of the weights within a node) is not supported; use 1",
               x->hpz_partition_size);
    const char *why_q = "ZeRO++ quantised communication is not supported: fitlm gathers weights "
                        "in the model's dtype and reduces gradients in fp32";
    refuse(x->quantized_weights, "zero_quantized_weights", "true", why_q);
    refuse(x->quantized_nontrainable_weights, "zero_quantized_nontrainable_weights", "true", why_q);
    refuse(x->quantized_gradients, "zero_quantized_gradients", "true", why_q);
    if (given(cfg, ZERO "zeropp_loco_param.err_beta") ||
        given(cfg, ZERO "zeropp_loco_param.reset_T"))
        fl_die(ZERO "zeropp_loco_param: LoCo-ZeRO++ corrects zero_quantized_gradients, which is "
                    "not supported");
    if (x->mics_shard_size != -1)
        fl_die(ZERO "mics_shard_size %d: MiCS (sharding within groups of ranks) is not "
                    "supported; stage 3 shards over every rank (use -1)",
               x->mics_shard_size);
    refuse(x->mics_hierarchical_params_gather, "mics_hierarchical_params_gather", "true",
           "MiCS is not supported");
    refuse(!x->memory_efficient_linear, "memory_efficient_linear", "false",
           "fitlm's stage 3 gathers a block's weights again for its backward pass rather than "
           "keep them from the forward (stage3_max_reuse_distance sets what is kept)");
    refuse(x->pipeline_loading_checkpoint, "pipeline_loading_checkpoint", "true",
           "it loads stage 3 checkpoints into a pipeline, and stage 3 with pipeline "
           "parallelism is refused (as DeepSpeed refuses it); fitlm's checkpoints load under "
           "any layout as they are");
    refuse(!x->override_module_apply, "override_module_apply", "false",
           "it switches off a hook on PyTorch's nn.Module.apply, which has no counterpart here");
}

// aio's settings without a counterpart here (the rest tune NVMe offload:
// fl_offload_check_config)
static void refuse_aio(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    if (x->aio_intra_op != 1)
        fl_die("aio.intra_op_parallelism %d: fitlm splits a transfer into block_size requests "
               "spread over thread_count threads instead (use 1)",
               x->aio_intra_op);
    if (x->aio_use_gds)
        fl_die("aio.use_gds true: GPUDirect Storage moves data between NVMe and a GPU; fitlm "
               "has no GPU (use false)");
}

// DeepSpeed's feature blocks with an "enabled" switch that fitlm does not
// run: each switched off (enabled false) is read no further, as DeepSpeed
// reads it; on, or without the switch, it is refused with what fitlm does.
int fl_deepspeed_feature_off(const char *where, const char *key, int enabled) {
    static const struct {
        const char *block, *is, *instead;
    } feature[] = {
        {"amp", "Apex mixed-precision (amp) integration", "use the bf16 or fp16 block"},
        {"flops_profiler", "FLOPs profiler",
         "--profile times each op with its GEMM GFLOP/s, and OUT/metrics.jsonl holds the MFU"},
        {"tensorboard", "TensorBoard monitor",
         "fitlm writes OUT/metrics.jsonl and OUT/log.txt, and fitlm plot draws them"},
        {"wandb", "Weights & Biases monitor",
         "fitlm writes OUT/metrics.jsonl and OUT/log.txt, and fitlm plot draws them"},
        {"csv_monitor", "CSV monitor",
         "fitlm writes OUT/metrics.jsonl and OUT/log.txt, and fitlm plot draws them"},
        {"comet", "Comet monitor",
         "fitlm writes OUT/metrics.jsonl and OUT/log.txt, and fitlm plot draws them"},
        {"comms_logger", "communication logger",
         "fitlm prints its collectives' elements, bytes and wait per step after a run of "
         "several ranks"},
        {"autotuning", "autotuner", "fitlm plan gives a run's exact memory and what would fit"},
        {"elasticity", "elastic training", "a run has a fixed number of ranks"},
        {"eigenvalue", "eigenvalue computation", "it is not offered"},
        {"progressive_layer_drop", "progressive layer drop", "it is not offered"},
        {"curriculum_learning", "curriculum learning", "it is not offered"},
        {"data_efficiency", "data efficiency library", "it is not offered"},
        {"nebula", "Nebula checkpointing", "fitlm writes its own checkpoints (out_dir)"}};
    for (size_t i = 0; i < sizeof feature / sizeof feature[0]; i++) {
        if (strcmp(key, feature[i].block)) continue;
        if (enabled == 0) return 1;
        fl_die("%s: %s %s: DeepSpeed's %s, which fitlm does not run (%s); a block with "
               "\"enabled\": false is accepted",
               where, key, enabled == 1 ? "enabled" : "without \"enabled\": false", feature[i].is,
               feature[i].instead);
    }
    return 0;
}

// DeepSpeed's engine settings at the value that is what fitlm does; any
// other refused naming it.
static void refuse_engine(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    if (x->dump_state)
        fl_die("dump_state true: DeepSpeed's engine state; fitlm prints the run's settings at the "
               "start and `fitlm train --help` every option");
    if (x->prescale_gradients || x->gradient_predivide_factor != 1.0f)
        fl_die("prescale_gradients true or gradient_predivide_factor %g: fitlm divides no "
               "gradient before its reduction over ranks (each token's loss is weighted by the "
               "target tokens of the step on all ranks before the backward pass, and the "
               "reduction sums)",
               x->gradient_predivide_factor);
    if (x->sparse_gradients) fl_die("sparse_gradients true: fitlm's embedding gradients are dense");
    if (strcmp(x->grad_accum_dtype, "fp32"))
        fl_die("data_types.grad_accum_dtype %s: fitlm sums the micro-batches' gradients in fp32",
               x->grad_accum_dtype);
    if (!x->bf16_immediate_grad_update)
        fl_die("bf16.immediate_grad_update false: fitlm adds each micro-batch's gradient into the "
               "fp32 sum as it is made");
    if (x->compile_deepcompile)
        fl_die("compile.deepcompile true: DeepCompile schedules ZeRO-3's fetches and offloads "
               "from a compiled PyTorch graph; fitlm's stage 3 fetches whole blocks by its "
               "stage3_* keys (use false)");
    if (strcmp(x->comm_dtype, "fp32"))
        fl_die("communication_data_type %s: fitlm reduces gradients over ranks in fp32 (16-bit "
               "gradients are staged into fp32 buckets)",
               x->comm_dtype);
}

void fl_deepspeed_check_config(fl_train_config *cfg) {
    refuse_engine(cfg);
    refuse_checkpointing(cfg);
    map_precision(cfg);
    map_bf16_overflow(cfg); // reads the precision
    // DeepSpeed's per-phase step times: fitlm's per-op profile after training
    map_switch(cfg, "wall_clock_breakdown", cfg->wall_clock_breakdown, "profile", &cfg->profile);
    // DeepSpeed's memory report: fitlm's memory per tag and peak RSS
    map_switch(cfg, "memory_breakdown", cfg->memory_breakdown, "mem_report", &cfg->mem_report);
    map_adam(cfg);
    check_zero_choices(cfg);
    map_offload(cfg);
    refuse_aio(cfg);
}
