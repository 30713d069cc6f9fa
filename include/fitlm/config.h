// config.h: the training configuration. One table of options drives the JSON
// config reader, the command-line parser and the --help text, so the three
// cannot drift apart. JSON keys follow DeepSpeed's names where DeepSpeed has
// the concept (train_micro_batch_size_per_gpu, gradient_accumulation_steps,
// gradient_clipping, optimizer.params.lr, ...); flags override the file.
#ifndef FITLM_CONFIG_H
#define FITLM_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fitlm/core.h"
#include "fitlm/dtype.h"
#include "fitlm/shape.h"

#define FL_PATH_MAX 1024
#define FL_NAME_MAX 32

// DeepSpeed's zero_optimization block (sizes in elements, as DeepSpeed's).
// What each key means here is in src/parallel/zero.c; fl_parallel_check_config
// (fitlm/dist.h) checks them by stage.
typedef struct {
    int stage;                         // 0 (data parallel, DDP), 1, 2, 3
    float reduce_bucket_size;          // gradient reduction bucket (5e8)
    float allgather_bucket_size;       // stage 1/2 parameter all-gather bucket (5e8)
    int overlap_comm;                  // reduce during the backward pass (true)
    int contiguous_gradients;          // stage 2/3: the owned gradient in one buffer (true)
    int reduce_scatter;                // reduce-scatter rather than all-reduce (true)
    float prefetch_bucket_size;        // stage3_prefetch_bucket_size (5e7)
    float max_live_parameters;         // stage3_max_live_parameters (1e9)
    float max_reuse_distance;          // stage3_max_reuse_distance (1e9)
    float param_persistence_threshold; // stage3_param_persistence_threshold (1e5)
    // stage3_model_persistence_threshold (DeepSpeed: sys.maxsize): at most this
    // many elements in all persistent units together
    float model_persistence_threshold;
    float comm_timeout; // seconds a collective may wait (--comm-timeout)
    // derived from the optimizer (fl_config_finish), not keys:
    int fused_units;    // LOMO/AdaLomo without accumulation: each unit reduced and updated in
                        // the backward pass, no gradient buffer
    int whole_rows;     // AdaLomo: shards end at row boundaries (its statistics are per tensor)
    int offload_params; // offload_param.device nvme: stage 3's weight shard lives in the NVMe
                        // offload file (fl_dist_attach's store), not in RAM
} fl_zero_config;

// The rest of DeepSpeed's zero_optimization block, and its aio block: keys
// the engine needs no code for. fl_deepspeed_check_config and
// fl_offload_check_config accept each where fitlm already behaves as
// DeepSpeed means (state in RAM is "offloaded to cpu") and refuse it,
// naming it, where it does not; nothing reads them after but NVMe offload.
typedef struct {
    int allgather_partitions;            // true: all-gather (false: broadcasts)
    int use_multi_rank_bucket_allreduce; // true
    int grad_hooks;                      // stage 1 reduces from backward hooks (true)
    int load_from_fp32_weights;          // a resume takes the fp32 master weights (true)
    int elastic_checkpoint;              // load another world size's checkpoint (false)
    float sub_group_size;                // optimizer step tile (1e9)
    char offload_optimizer[FL_NAME_MAX]; // offload_optimizer.device: none | cpu | nvme
    char offload_param[FL_NAME_MAX];     // offload_param.device: none | cpu | nvme
    char opt_nvme_path[FL_PATH_MAX], param_nvme_path[FL_PATH_MAX];
    int opt_buffer_count, param_buffer_count;
    int opt_pin_memory, param_pin_memory;
    int opt_pipeline_read, opt_pipeline_write, opt_fast_init;
    float opt_ratio;                            // share of the optimizer offloaded (1)
    int opt_delayed_update, opt_delayed_warmup; // delayed_update, delayed_update_warmup
    int opt_accumulate_on_device;               // accumulate_on_device
    float param_buffer_size, param_max_in_cpu;  // NVMe buffers
    int cpu_offload, cpu_offload_param, cpu_offload_use_pin_memory; // deprecated forms
    int gather_16bit_on_save; // stage3_gather_16bit_weights_on_model_save (and its other names)
    float module_granularity_threshold;  // stage3_module_granularity_threshold (0)
    int use_all_reduce_for_fetch_params; // stage3_use_all_reduce_for_fetch_params
    int ignore_unused_parameters;        // true
    int legacy_stage1, round_robin_gradients;
    int hpz_partition_size; // zero_hpz_partition_size (1: off)
    int quantized_weights, quantized_nontrainable_weights, quantized_gradients;
    float loco_err_beta; // zeropp_loco_param.err_beta
    int loco_reset_t;    // zeropp_loco_param.reset_T
    int mics_shard_size; // -1: off
    int mics_hierarchical_params_gather;
    int memory_efficient_linear; // true
    int pipeline_loading_checkpoint, override_module_apply;
    int allow_untested_optimizer; // top level: zero_allow_untested_optimizer
    int force_ds_cpu_optimizer;   // zero_force_ds_cpu_optimizer
    // top level, DeepSpeed's engine: each at the value that is fitlm's way
    int dump_state, prescale_gradients, sparse_gradients;
    float gradient_predivide_factor;
    char grad_accum_dtype[FL_NAME_MAX]; // data_types.grad_accum_dtype
    char comm_dtype[FL_NAME_MAX];       // communication_data_type
    int fp16_auto_cast, bf16_immediate_grad_update, bf16_check_grad_overflow;
    // the compile block (torch.compile of the module; DeepCompile)
    int compile_disable, compile_deepcompile;
    char compile_backend[FL_NAME_MAX];
    // top-level aio block (NVMe offload's asynchronous I/O)
    int aio_block_size, aio_queue_depth, aio_thread_count;
    int aio_single_submit, aio_overlap_events, aio_use_gds, aio_intra_op;
} fl_zero_extra;

typedef struct {
    // model
    char model_preset[FL_NAME_MAX];   // demo | tiny | gpt2... | llama-tiny | llama-7b | ...
    char model_arch[FL_NAME_MAX];     // gpt2 | llama | "" (the preset's)
    fl_model_config model;            // fields left 0 come from the preset
    int tie_embeddings;               // model.tie_word_embeddings (LLaMA)
    char tokenizer[FL_NAME_MAX];      // gpt2 | byte | hf
    char tokenizer_path[FL_PATH_MAX]; // gpt2: encoder.json and vocab.bpe; hf: tokenizer.json
    char init_from[FL_PATH_MAX];      // pretrained weights, or ""
    // data: token shards
    char data[FL_PATH_MAX];
    char val_data[FL_PATH_MAX];
    // batch
    // activation checkpointing: the policy and DeepSpeed's activation_checkpointing keys
    char recompute_policy[FL_NAME_MAX]; // none | selective | block
    fl_recompute recompute;             // derived by fl_config_finish
    int logits_chunk; // positions per chunk of the LM head and loss (0: all); model.logits_chunk
    int ac_partition, ac_cpu, ac_contiguous, ac_number, ac_sync, ac_profile;
    int micro_batch;       // train_micro_batch_size_per_gpu
    int grad_accum;        // gradient_accumulation_steps
    int train_batch_size;  // DeepSpeed's micro * accum * replicas (world / t); 0 = derived
    fl_zero_config zero;   // zero_optimization; ranks come from mpirun
    int tensor_parallel;   // t: ways each block's linears, attention heads and the vocabulary are
                           // split (1: none)
    int sequence_parallel; // Megatron's --sequence-parallel (needs t > 1)
    // pipeline parallelism (pipeline.h): p stages of contiguous blocks
    int pipeline_parallel;               // p (1: none)
    char pipeline_schedule[FL_NAME_MAX]; // gpipe | 1f1b | interleaved
    int virtual_stages;                  // v: chunks a rank holds (interleaved: >= 2)
    char pipeline_split[FL_PATH_MAX];    // uniform | parameters | N,N,... blocks a (virtual) stage
    // Megatron's decoder_first/last_pipeline_num_layers (0: not given): the
    // first/last stage's blocks, the rest even over the middle; written into
    // pipeline_split as its list by fl_pp_finish_split
    int pp_first_layers, pp_last_layers;
    int ranks; // the world, all ranks: 0 = this job's (fl_comm_size); `fitlm plan --ranks N`
               // sets N. train_batch_size is split over its world / (t p) data-parallel
               // replicas
    fl_zero_extra zero_extra; // its keys that need no engine code (and aio)
    int seq_len;
    int steps;
    // precision: fp32 | bf16 | fp16 (DeepSpeed's bf16/fp16 blocks map here)
    char precision[FL_NAME_MAX];
    int bf16_enabled, fp16_enabled; // DeepSpeed's bf16.enabled / fp16.enabled
    float loss_scale;               // fp16.loss_scale: 0 = dynamic
    int initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis;
    float min_loss_scale;
    fl_dtype dtype; // derived by fl_config_finish
    // optimizer
    char optimizer[FL_NAME_MAX]; // adamw | sgd | lomo | adalomo (adam: mapped onto adamw)
    int adam_w_mode, torch_adam; // DeepSpeed's Adam's (config_compat.c)
    // a config file's optimizer block named its type: the block is
    // DeepSpeed's, whose params default as DeepSpeed's (config_compat.c)
    int deepspeed_optimizer;
    int bias_correction; // AdamW's (DeepSpeed's Adam's bias_correction)
    float lr, beta1, beta2, eps, weight_decay, momentum;
    float eps2, clip_threshold, decay_rate; // AdaLomo
    float clip_value;                       // LOMO's clip_grad_value
    int stochastic_rounding;                // LOMO/AdaLomo on 16-bit weights
    int optimizer_in_backward;              // AdamW/SGD updated unit by unit from the backward pass
    float grad_clip;                        // gradient_clipping, 0 = off
    // LoRA (PEFT's LoraConfig names) and NF4 base weights (bitsandbytes'
    // BitsAndBytesConfig names)
    int lora_enabled;
    fl_lora_config lora;                   // init and train_base derived by fl_lora_check_config
    char lora_init[FL_NAME_MAX];           // true | gaussian
    char lora_bias[FL_NAME_MAX];           // none
    char lora_base_optimizer[FL_NAME_MAX]; // none | lomo | adalomo (LoRA + LOMO)
    float lora_base_lr;                    // 0 = lr
    char adapter[FL_PATH_MAX];             // a PEFT adapter directory to start from
    char quant_type[FL_NAME_MAX];          // none | nf4 | fp4
    fl_quant_config quant;                 // enabled derived by fl_quant_check_config
    // schedule
    char scheduler[FL_NAME_MAX]; // constant | cosine | linear | WarmupLR | WarmupDecayLR |
                                 // WarmupCosineLR (DeepSpeed's)
    int warmup_steps;
    float min_lr_ratio;
    // DeepSpeed's schedules' parameters (fl_schedule_of)
    float warmup_min_lr, warmup_max_lr, warmup_min_ratio, cos_min_ratio;
    char warmup_type[FL_NAME_MAX]; // log | linear
    int total_num_steps;           // 0: the run's steps
    // evaluation, output, run
    int eval_interval, eval_iters;
    char out_dir[FL_PATH_MAX];
    int save_every, keep_checkpoints;
    int overwrite;      // a new run may start in an out_dir holding another
    int skip_nonfinite; // non-finite steps skipped before training stops
    // the spike guard (fl_spike_config): z-score thresholds (0 = off), the
    // window, the values needed before judging, the outliers in a row that stop
#define FL_SPIKE_WINDOW_MAX 1024
    float skip_update_lossz, skip_update_gradz;
    int skip_update_window, skip_update_min_steps, skip_update_max_in_row;
    char resume[FL_PATH_MAX];
    int sample_tokens;
    uint64_t seed;
    int threads;
    char device[FL_NAME_MAX]; // cpu | cuda | test: where the model and optimizer live
    int mem_report, mem_report_every;
    int steps_per_print;      // the console's plain step line every N steps (DeepSpeed's)
    int metrics_memory_every; // memory per tag in metrics.jsonl every N steps
    float peak_tflops;        // MFU's denominator; 0 = measured at the start
    int profile;              // per-op profile table after training
    int wall_clock_breakdown; // DeepSpeed's names for profile and mem_report (config_compat.c)
    int memory_breakdown;
    char mem_limit[FL_NAME_MAX]; // bytes with an optional K/M/G/T suffix; "" = available memory
    uint8_t given[256]; // by option-table index: set by the file or a flag (1), "auto" (2), or
                        // defaulted (0)
} fl_train_config;

// Fills the defaults (the values --help prints).
void fl_config_defaults(fl_train_config *cfg);
// Reads a JSON config file over the current values. Unknown keys, wrong
// types and out-of-range values are fatal errors naming the file and key.
// An optimizer block naming its type sets cfg->deepspeed_optimizer (a
// checkpoint's config, read as text, does not).
void fl_config_load_json(fl_train_config *cfg, const char *path);
// With cfg->deepspeed_optimizer, the block's params neither given nor
// "auto" take DeepSpeed's defaults, marked given (config_compat.c).
void fl_deepspeed_optimizer_defaults(fl_train_config *cfg);
// Parses argv (after the subcommand) over the current values. "--config
// FILE" is applied first wherever it appears, so flags always override it.
void fl_config_parse_args(fl_train_config *cfg, int argc, char **argv);
// Reads JSON config text (as fl_config_load_json; `where` names it in errors).
void fl_config_load_json_text(fl_train_config *cfg, const char *text, size_t n, const char *where);
// The options set by a file or a flag (not defaulted), as a JSON config that
// fl_config_load_json_text reads back into the same run; fl_free the result.
char *fl_config_to_json(const fl_train_config *cfg);
// Every option's value, resolved (after fl_config_finish), as canonical
// "key=value\n" lines in the table's order: the text the ranks of a run
// agree on (fl_comm_agree). Left out: what describes this machine, not
// the run (threads, mem_limit, peak_tflops, the NVMe offload directories).
// free() the result.
char *fl_config_canonical(const fl_train_config *cfg);
// Resets the options that belong to an invocation, not to the run (the ones
// fl_config_to_json leaves out: --resume, the reports, mem_limit, NVMe
// offload's offload_optimizer, offload_param and aio blocks), to their
// defaults, not given: a resume never takes them from a checkpoint's config,
// whatever wrote it (docs/checkpoints-and-formats.md).
void fl_config_forget_invocation(fl_train_config *cfg);
// The checks of the options no subsystem owns: threads (0: all cores),
// mem_limit, precision (dtype) and its fp16 keys, the recompute policy.
// Each subsystem checks its own section (fl_<subsystem>_check_config);
// fl_config_check (fitlm/train.h) runs them all in order.
void fl_config_check_common(fl_train_config *cfg);
// DeepSpeed's keys that name no concept of fitlm's (src/core/config_compat.c):
// mapped onto fitlm's options (the bf16/fp16 blocks onto precision, the
// deprecated cpu_offload forms onto the offload devices) before the sections
// check theirs, or refused naming the key, the value and why.
void fl_deepspeed_check_config(fl_train_config *cfg);
// A top-level key of a config file `where` that is one of DeepSpeed's
// feature blocks fitlm does not run (monitors, profilers, ...), given its
// "enabled" (1, 0, or -1 where it has none): 1 if the block is switched off
// and so read no further; a block switched on dies naming what fitlm does
// instead; 0 for any other key.
int fl_deepspeed_feature_off(const char *where, const char *key, int enabled);
// Whether an option (by JSON key) was set by a file or a flag; set it.
int fl_config_given(const fl_train_config *cfg, const char *key);
// Whether a config file set it to "auto" (left to fitlm's own setting, as
// Hugging Face's Trainer fills it from its arguments; no flag given since).
int fl_config_auto(const fl_train_config *cfg, const char *key);
void fl_config_set_given(fl_train_config *cfg, const char *key, int on);
void fl_config_print_help(FILE *out);
void fl_config_print(const fl_train_config *cfg, FILE *out);

// Parses a whole decimal number in [0, 2^64) exactly, as the seed options
// take it (no detour through a double); 0 on success, -1 otherwise.
int fl_parse_u64(const char *text, uint64_t *out);
// Parses a size such as "12G", "512M", "1048576" (bytes); dies naming `what`.
size_t fl_parse_bytes(const char *text, const char *what);

#endif
