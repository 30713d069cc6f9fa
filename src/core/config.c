// config.c: one option table drives the JSON reader, the flag parser and
// --help. A JSON key is a dotted path into nested objects
// ("optimizer.params.lr" is {"optimizer": {"params": {"lr": ...}}}).
// Types and ranges are checked here as a value is read; the rules between
// options are each subsystem's (fl_<subsystem>_check_config), DeepSpeed's
// keys without a fitlm concept config_compat.c's.
#include "fitlm/config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <omp.h>
#include <cJSON.h>

typedef enum { OPT_INT, OPT_U64, OPT_FLOAT, OPT_BOOL, OPT_STRING, OPT_CHOICE, OPT_PAIR } opt_type;

typedef struct {
    const char *key;  // JSON path
    const char *flag; // command-line flag
    opt_type type;
    size_t offset;       // into fl_train_config (second float of a pair follows the first)
    size_t size;         // buffer size of strings
    const char *def;     // default, as text
    double min, max;     // for numbers
    const char *choices; // "a|b|c" for OPT_CHOICE
    const char *help;
} option;

#define OFF(field) offsetof(fl_train_config, field)
#define STR(field) OFF(field), sizeof(((fl_train_config *)0)->field)
#define NUM(field) OFF(field), 0

static const option options[] = {
    {"model.preset", "--model", OPT_CHOICE, STR(model_preset), "demo", 0, 0,
     "demo|tiny|gpt2|gpt2-medium|gpt2-large|gpt2-xl|llama-tiny|llama-7b|tinyllama-1.1b|"
     "smollm-135m",
     "model shape preset (demo and tiny take --arch; the others name theirs). The demo's "
     "shape, trained from scratch with AdamW, has its own recipe for what is not given: 320 "
     "steps, lr 0.006, warmup half the steps, betas 0.9,0.99"},
    {"model.arch", "--arch", OPT_STRING, STR(model_arch), "", 0, 0, NULL,
     "architecture: gpt2 or llama (\"\" = the preset's; demo and tiny are gpt2 unless given)"},
    {"model.n_layer", "--n-layer", OPT_INT, NUM(model.n_layer), "0", 0, 1024, NULL,
     "transformer blocks (0 = the preset's)"},
    {"model.n_head", "--n-head", OPT_INT, NUM(model.n_head), "0", 0, 1024, NULL,
     "attention heads (0 = the preset's)"},
    {"model.n_embd", "--n-embd", OPT_INT, NUM(model.n_embd), "0", 0, 65536, NULL,
     "channels (0 = the preset's)"},
    {"model.max_seq_len", "--max-seq-len", OPT_INT, NUM(model.max_seq_len), "0", 0, 1048576, NULL,
     "position embeddings (0 = the preset's)"},
    {"model.n_kv_head", "--n-kv-head", OPT_INT, NUM(model.n_kv_head), "0", 0, 1024, NULL,
     "key/value heads, grouped-query attention (LLaMA; 0 = the preset's or n_head)"},
    {"model.intermediate_size", "--intermediate-size", OPT_INT, NUM(model.intermediate_size), "0",
     0, 1 << 20, NULL, "MLP width (LLaMA; 0 = the preset's or 4 x n_embd)"},
    {"model.rms_norm_eps", "--rms-norm-eps", OPT_FLOAT, NUM(model.norm_eps), "0", 0, 1, NULL,
     "RMSNorm epsilon (LLaMA; 0 = the preset's or 1e-5)"},
    {"model.rope_theta", "--rope-theta", OPT_FLOAT, NUM(model.rope_theta), "0", 0, 1e12, NULL,
     "rotary embedding base (LLaMA; 0 = the preset's or 10000)"},
    {"model.tie_word_embeddings", "--tie-word-embeddings", OPT_BOOL, NUM(tie_embeddings), "false",
     0, 0, NULL, "LM head shares the token embedding (LLaMA; GPT-2 always does)"},
    {"logits_chunk", "--logits-chunk", OPT_INT, NUM(logits_chunk), "0", 0, 1 << 24, NULL,
     "the LM head and the loss over this many positions at a time, each chunk's gradient taken "
     "at once, so that a large vocabulary's logits never exist whole (0 = the whole "
     "micro-batch's; not with tensor or pipeline parallelism)"},
    {"activation_checkpointing.policy", "--activation-checkpointing", OPT_CHOICE,
     STR(recompute_policy), "none", 0, 0, "none|selective|block",
     "recompute in backward: selective = norms and GELU/SwiGLU; block = whole blocks from their "
     "inputs"},
    {"activation_checkpointing.partition_activations", "--partition-activations", OPT_BOOL,
     NUM(ac_partition), "false", 0, 0, NULL,
     "DeepSpeed: split checkpoints across tensor-parallel ranks (refused: use "
     "--sequence-parallel)"},
    {"activation_checkpointing.cpu_checkpointing", "--cpu-checkpointing", OPT_BOOL, NUM(ac_cpu),
     "false", 0, 0, NULL, "DeepSpeed: offload partitioned checkpoints (needs partitioning)"},
    {"activation_checkpointing.contiguous_memory_optimization", "--contiguous-checkpoints",
     OPT_BOOL, NUM(ac_contiguous), "false", 0, 0, NULL,
     "DeepSpeed: copy partitioned checkpoints into one buffer (needs partitioning)"},
    {"activation_checkpointing.number_checkpoints", "--number-checkpoints", OPT_INT, NUM(ac_number),
     "0", 0, 1 << 20, NULL, "DeepSpeed: buffer size for contiguous_memory_optimization (needs it)"},
    {"activation_checkpointing.synchronize_checkpoint_boundary", "--sync-checkpoints", OPT_BOOL,
     NUM(ac_sync), "false", 0, 0, NULL,
     "DeepSpeed: a device synchronise per checkpoint (GPU only)"},
    {"activation_checkpointing.profile", "--checkpoint-profile", OPT_BOOL, NUM(ac_profile), "false",
     0, 0, NULL, "DeepSpeed: time each checkpoint (use --profile: per-op forward/backward times)"},
    {"model.vocab_size", "--vocab-size", OPT_INT, NUM(model.vocab_size), "0", 0, 1 << 30, NULL,
     "vocabulary (0 = the tokenizer's; larger is allowed)"},
    {"tokenizer", "--tokenizer", OPT_CHOICE, STR(tokenizer), "gpt2", 0, 0, "gpt2|byte|hf",
     "tokenizer (gpt2: GPT-2's BPE, vocab 50257; byte: one token per byte + <|endoftext|>, "
     "vocab 257; hf: a Hugging Face tokenizer.json, LLaMA-1/2/3 or GPT-2 style); the data must "
     "have been tokenized with it"},
    {"tokenizer_path", "--tokenizer-path", OPT_STRING, STR(tokenizer_path), "data/gpt2", 0, 0, NULL,
     "gpt2: the directory with encoder.json and vocab.bpe (GPT-2's, or one fitlm tokenize "
     "--learn-vocab wrote beside its shards); hf: a tokenizer.json or the directory holding it "
     "(a resume uses the copy its checkpoint holds)"},
    {"data", "--data", OPT_STRING, STR(data), "data/brown_gpt2", 0, 0, NULL,
     "training token shards: a directory (its train_*.bin), a glob pattern or a file"},
    {"val_data", "--val-data", OPT_STRING, STR(val_data), "", 0, 0, NULL,
     "validation token shards (\"\" = the val_*.bin beside the training shards, if any; "
     "\"none\" = no validation)"},
    {"train_micro_batch_size_per_gpu", "--batch", OPT_INT, NUM(micro_batch), "16", 1, 1 << 20, NULL,
     "micro-batch size B (sequences per forward pass)"},
    {"gradient_accumulation_steps", "--grad-accum", OPT_INT, NUM(grad_accum), "1", 1, 1 << 20, NULL,
     "micro-batches accumulated per optimizer step"},
    {"train_batch_size", "--train-batch-size", OPT_INT, NUM(train_batch_size), "0", 0, 1 << 30,
     NULL, "sequences per optimizer step = batch x grad-accum (0 = derived)"},
    {"tensor_parallel.size", "--tensor-parallel", OPT_INT, NUM(tensor_parallel), "1", 1, 1 << 20,
     NULL,
     "tensor parallelism (Megatron's): t ranks split each block's linears and attention heads "
     "and the vocabulary; the ranks mpirun starts form world / t data-parallel replicas of t "
     "(1 = none)"},
    {"tensor_model_parallel_size", NULL, OPT_INT, NUM(tensor_parallel), "1", 1, 1 << 20, NULL,
     "Megatron's name of tensor_parallel.size"},
    {"tensor_parallel.autotp_size", NULL, OPT_INT, NUM(tensor_parallel), "1", 1, 1 << 20, NULL,
     "DeepSpeed's name (AutoTP) of tensor_parallel.size"},
    {"sequence_parallel", "--sequence-parallel", OPT_BOOL, NUM(sequence_parallel), "false", 0, 0,
     NULL,
     "Megatron's sequence parallelism (needs tensor_parallel.size above 1): norms, dropout and "
     "residual adds each run on 1/t of the tokens"},
    {"pipeline_parallel.size", "--pipeline-parallel", OPT_INT, NUM(pipeline_parallel), "1", 1,
     1 << 20, NULL,
     "pipeline parallelism: p stages, each a contiguous run of blocks (the first also the "
     "embedding, the last the final norm, head and loss); the ranks mpirun starts form world / "
     "(t p) data-parallel replicas (1 = none)"},
    {"pipeline_model_parallel_size", NULL, OPT_INT, NUM(pipeline_parallel), "1", 1, 1 << 20, NULL,
     "Megatron's name of pipeline_parallel.size"},
    {"pipeline.stages", NULL, OPT_INT, NUM(pipeline_parallel), "1", 1, 1 << 20, NULL,
     "DeepSpeed's name of pipeline_parallel.size (\"auto\", its default: pipeline_parallel.size "
     "or Megatron's name decides)"},
    {"pipeline_parallel.schedule", "--pipeline-schedule", OPT_CHOICE, STR(pipeline_schedule),
     "1f1b", 0, 0, "gpipe|1f1b|interleaved",
     "gpipe (every forward, then every backward), 1f1b (one forward one backward) or "
     "interleaved (1F1B over --virtual-stages chunks a rank)"},
    {"pipeline_parallel.virtual_stages", "--virtual-stages", OPT_INT, NUM(virtual_stages), "1", 1,
     64, NULL, "chunks of blocks each pipeline rank holds (the interleaved schedule: 2 or more)"},
    {"num_virtual_stages_per_pipeline_rank", NULL, OPT_INT, NUM(virtual_stages), "1", 1, 64, NULL,
     "Megatron's name of pipeline_parallel.virtual_stages"},
    {"pipeline_parallel.split", "--pipeline-split", OPT_STRING, STR(pipeline_split), "parameters",
     0, 0, NULL,
     "blocks per stage: uniform, parameters (balanced, DeepSpeed's partition_method) or a list "
     "N,N,... of blocks per (virtual) stage"},
    {"decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers", OPT_INT,
     NUM(pp_first_layers), "0", 0, 1 << 20, NULL,
     "Megatron's: blocks of the first pipeline stage, the rest split evenly over the middle "
     "stages (0 = not given; becomes a pipeline_parallel.split list)"},
    {"decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers", OPT_INT,
     NUM(pp_last_layers), "0", 0, 1 << 20, NULL,
     "Megatron's: blocks of the last pipeline stage, the rest split evenly over the middle "
     "stages (0 = not given; becomes a pipeline_parallel.split list)"},
    {"zero_optimization.stage", "--zero-stage", OPT_INT, NUM(zero.stage), "0", 0, 3, NULL,
     "ZeRO stage over the ranks mpirun starts: 0 data parallel (DDP), 1 + optimizer states "
     "sharded, 2 + gradients, 3 + parameters"},
    {"zero_optimization.reduce_bucket_size", "--reduce-bucket-size", OPT_FLOAT,
     NUM(zero.reduce_bucket_size), "5e8", 0, 1e12, NULL,
     "elements per gradient reduction (all-reduce or reduce-scatter; 0, as DeepSpeed: each "
     "tensor's alone)"},
    {"zero_optimization.allgather_bucket_size", "--allgather-bucket-size", OPT_FLOAT,
     NUM(zero.allgather_bucket_size), "5e8", 1, 1e12, NULL,
     "elements per all-gather of updated weights (stages 1 and 2)"},
    {"zero_optimization.overlap_comm", "--overlap-comm", OPT_BOOL, NUM(zero.overlap_comm), "false",
     0, 0, NULL,
     "reduce gradients while the backward pass goes on (not given: false under stages 1 and 2, "
     "as DeepSpeed; true under stage 3, as DeepSpeed, and under DDP, as PyTorch's DDP)"},
    {"zero_optimization.contiguous_gradients", "--contiguous-gradients", OPT_BOOL,
     NUM(zero.contiguous_gradients), "true", 0, 0, NULL,
     "stages 2/3: a rank's gradient shard in one buffer (fitlm always does: false is refused)"},
    {"zero_optimization.reduce_scatter", "--reduce-scatter", OPT_BOOL, NUM(zero.reduce_scatter),
     "true", 0, 0, NULL, "reduce-scatter gradients to their owners (false: all-reduce)"},
    {"zero_optimization.stage3_prefetch_bucket_size", "--prefetch-bucket-size", OPT_FLOAT,
     NUM(zero.prefetch_bucket_size), "5e7", 0, 1e12, NULL,
     "stage 3: elements gathered ahead of the block running (whole blocks)"},
    {"zero_optimization.stage3_max_live_parameters", "--max-live-parameters", OPT_FLOAT,
     NUM(zero.max_live_parameters), "1e9", 0, 1e15, NULL,
     "stage 3: gathered elements alive at once"},
    {"zero_optimization.stage3_max_reuse_distance", "--max-reuse-distance", OPT_FLOAT,
     NUM(zero.max_reuse_distance), "1e9", 0, 1e15, NULL,
     "stage 3: 0 drops gathered weights after use; otherwise the forward's last blocks are "
     "reused by the backward"},
    {"zero_optimization.stage3_param_persistence_threshold", "--param-persistence-threshold",
     OPT_FLOAT, NUM(zero.param_persistence_threshold), "1e5", 0, 1e15, NULL,
     "stage 3: units smaller than this stay gathered for the whole step"},
    {"zero_optimization.stage3_model_persistence_threshold", NULL, OPT_FLOAT,
     NUM(zero.model_persistence_threshold), "9.223372e18", 0, 1e19, NULL,
     "stage 3: at most this many elements in all persistent units together"},
    // DeepSpeed's field names of the stage3_ keys (its config takes either)
    {"zero_optimization.prefetch_bucket_size", NULL, OPT_FLOAT, NUM(zero.prefetch_bucket_size),
     "5e7", 0, 1e12, NULL, "DeepSpeed's field name of stage3_prefetch_bucket_size"},
    {"zero_optimization.max_live_parameters", NULL, OPT_FLOAT, NUM(zero.max_live_parameters), "1e9",
     0, 1e15, NULL, "DeepSpeed's field name of stage3_max_live_parameters"},
    {"zero_optimization.max_reuse_distance", NULL, OPT_FLOAT, NUM(zero.max_reuse_distance), "1e9",
     0, 1e15, NULL, "DeepSpeed's field name of stage3_max_reuse_distance"},
    {"zero_optimization.param_persistence_threshold", NULL, OPT_FLOAT,
     NUM(zero.param_persistence_threshold), "1e5", 0, 1e15, NULL,
     "DeepSpeed's field name of stage3_param_persistence_threshold"},
    {"zero_optimization.model_persistence_threshold", NULL, OPT_FLOAT,
     NUM(zero.model_persistence_threshold), "9.223372e18", 0, 1e19, NULL,
     "DeepSpeed's field name of stage3_model_persistence_threshold"},
    {"zero_optimization.allgather_partitions", NULL, OPT_BOOL, NUM(zero_extra.allgather_partitions),
     "true", 0, 0, NULL,
     "stages 1/2: updated weights all-gathered (false, broadcasts, is refused)"},
    {"zero_optimization.use_multi_rank_bucket_allreduce", NULL, OPT_BOOL,
     NUM(zero_extra.use_multi_rank_bucket_allreduce), "true", 0, 0, NULL,
     "reduce_scatter false: whole buckets all-reduced (false is refused)"},
    {"zero_optimization.grad_hooks", NULL, OPT_BOOL, NUM(zero_extra.grad_hooks), "true", 0, 0, NULL,
     "stage 1: reduce from the backward pass (false is refused: use overlap_comm false)"},
    {"zero_optimization.load_from_fp32_weights", NULL, OPT_BOOL,
     NUM(zero_extra.load_from_fp32_weights), "true", 0, 0, NULL,
     "a resume restores the fp32 master weights (false is refused)"},
    {"zero_optimization.elastic_checkpoint", NULL, OPT_BOOL, NUM(zero_extra.elastic_checkpoint),
     "false", 0, 0, NULL, "load a checkpoint of another world size (true is refused)"},
    {"zero_optimization.sub_group_size", NULL, OPT_FLOAT, NUM(zero_extra.sub_group_size), "1e9", 0,
     1e15, NULL, "optimizer step tile: elements per NVMe offload chunk (in RAM: any value)"},
    {"zero_optimization.offload_optimizer.device", NULL, OPT_CHOICE,
     STR(zero_extra.offload_optimizer), "none", 0, 0, "none|cpu|nvme",
     "optimizer state: cpu = in RAM, where it is; nvme = in files under nvme_path"},
    {"zero_optimization.offload_optimizer.nvme_path", NULL, OPT_STRING,
     STR(zero_extra.opt_nvme_path), "", 0, 0, NULL, "NVMe offload: the directory of its files"},
    {"zero_optimization.offload_optimizer.buffer_count", NULL, OPT_INT,
     NUM(zero_extra.opt_buffer_count), "4", 1, 1 << 20, NULL,
     "NVMe offload: chunk buffers in RAM (sub_group_size elements of each tensor)"},
    {"zero_optimization.offload_optimizer.pin_memory", NULL, OPT_BOOL,
     NUM(zero_extra.opt_pin_memory), "false", 0, 0, NULL,
     "offloaded state in page-locked memory: no device copies here, either value"},
    {"zero_optimization.offload_optimizer.pipeline_read", NULL, OPT_BOOL,
     NUM(zero_extra.opt_pipeline_read), "false", 0, 0, NULL,
     "NVMe offload: read the next chunks while one is updated"},
    {"zero_optimization.offload_optimizer.pipeline_write", NULL, OPT_BOOL,
     NUM(zero_extra.opt_pipeline_write), "false", 0, 0, NULL,
     "NVMe offload: write a chunk back while the next is updated"},
    {"zero_optimization.offload_optimizer.fast_init", NULL, OPT_BOOL, NUM(zero_extra.opt_fast_init),
     "false", 0, 0, NULL,
     "NVMe offload: the files are written once at start either way (either value)"},
    {"zero_optimization.offload_optimizer.ratio", NULL, OPT_FLOAT, NUM(zero_extra.opt_ratio), "1",
     0, 1, NULL, "share of the optimizer state offloaded (below 1: stage 3 only)"},
    {"zero_optimization.offload_optimizer.delayed_update", NULL, OPT_BOOL,
     NUM(zero_extra.opt_delayed_update), "false", 0, 0, NULL,
     "on a device: each update runs during the next step, which computes with the weights one "
     "update older (ZeRO-Offload's delayed parameter update)"},
    {"zero_optimization.offload_optimizer.delayed_update_warmup", NULL, OPT_INT,
     NUM(zero_extra.opt_delayed_warmup), "40", 0, 1 << 30, NULL,
     "delayed_update: the first updates, run at once"},
    {"zero_optimization.offload_optimizer.accumulate_on_device", NULL, OPT_BOOL,
     NUM(zero_extra.opt_accumulate_on_device), "false", 0, 0, NULL,
     "on a device, 16-bit gradients under accumulation: their fp32 sum kept there (4 bytes a "
     "parameter) and sent down once a step, not summed on the host"},
    {"zero_optimization.offload_param.device", NULL, OPT_CHOICE, STR(zero_extra.offload_param),
     "none", 0, 0, "none|cpu|nvme",
     "stage 3 weights: cpu = in RAM, where they are; nvme = in offload_optimizer's file"},
    {"zero_optimization.offload_param.nvme_path", NULL, OPT_STRING, STR(zero_extra.param_nvme_path),
     "", 0, 0, NULL, "NVMe offload of the weights: offload_optimizer.nvme_path's (or empty)"},
    {"zero_optimization.offload_param.buffer_count", NULL, OPT_INT,
     NUM(zero_extra.param_buffer_count), "5", 0, 1 << 20, NULL,
     "NVMe weight buffers: on a device the pinned ones units are read into (1-64); on the cpu "
     "stage 3's ring instead (the default only)"},
    {"zero_optimization.offload_param.buffer_size", NULL, OPT_FLOAT,
     NUM(zero_extra.param_buffer_size), "1e8", 0, 1e15, NULL,
     "NVMe weight buffers: on a device their elements (at most a unit's); on the cpu stage 3's "
     "ring instead (the default only)"},
    {"zero_optimization.offload_param.max_in_cpu", NULL, OPT_FLOAT,
     NUM(zero_extra.param_max_in_cpu), "1e9", 0, 1e15, NULL,
     "weights kept in RAM under NVMe offload: stage 3's ring instead (the default only)"},
    {"zero_optimization.offload_param.pin_memory", NULL, OPT_BOOL, NUM(zero_extra.param_pin_memory),
     "false", 0, 0, NULL,
     "offloaded weights in page-locked memory: either value (on a device they are pinned "
     "either way)"},
    {"zero_optimization.cpu_offload", NULL, OPT_BOOL, NUM(zero_extra.cpu_offload), "false", 0, 0,
     NULL, "deprecated: offload_optimizer.device cpu"},
    {"zero_optimization.cpu_offload_param", NULL, OPT_BOOL, NUM(zero_extra.cpu_offload_param),
     "false", 0, 0, NULL, "deprecated: offload_param.device cpu"},
    {"zero_optimization.cpu_offload_use_pin_memory", NULL, OPT_BOOL,
     NUM(zero_extra.cpu_offload_use_pin_memory), "false", 0, 0, NULL,
     "deprecated: pin_memory of the offload blocks"},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", NULL, OPT_BOOL,
     NUM(zero_extra.gather_16bit_on_save), "false", 0, 0, NULL,
     "DeepSpeed's save_16bit_model gathering stage 3's weights: either value (a fitlm "
     "checkpoint holds every weight, by range under ZeRO, and fitlm export writes them whole)"},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", NULL, OPT_BOOL,
     NUM(zero_extra.gather_16bit_on_save), "false", 0, 0, NULL,
     "deprecated name of stage3_gather_16bit_weights_on_model_save"},
    {"zero_optimization.gather_16bit_weights_on_model_save", NULL, OPT_BOOL,
     NUM(zero_extra.gather_16bit_on_save), "false", 0, 0, NULL,
     "DeepSpeed's field name of stage3_gather_16bit_weights_on_model_save"},
    {"zero_optimization.stage3_module_granularity_threshold", NULL, OPT_FLOAT,
     NUM(zero_extra.module_granularity_threshold), "0", 0, 1e15, NULL,
     "stage 3: fitlm gathers whole blocks already, any value"},
    {"zero_optimization.module_granularity_threshold", NULL, OPT_FLOAT,
     NUM(zero_extra.module_granularity_threshold), "0", 0, 1e15, NULL,
     "DeepSpeed's field name of stage3_module_granularity_threshold"},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", NULL, OPT_BOOL,
     NUM(zero_extra.use_all_reduce_for_fetch_params), "false", 0, 0, NULL,
     "stage 3: fetch weights by all-reduce (true is refused)"},
    {"zero_optimization.use_all_reduce_for_fetch_params", NULL, OPT_BOOL,
     NUM(zero_extra.use_all_reduce_for_fetch_params), "false", 0, 0, NULL,
     "DeepSpeed's field name of stage3_use_all_reduce_for_fetch_params"},
    {"zero_optimization.ignore_unused_parameters", NULL, OPT_BOOL,
     NUM(zero_extra.ignore_unused_parameters), "true", 0, 0, NULL,
     "every parameter gets a gradient here: either value"},
    {"zero_optimization.legacy_stage1", NULL, OPT_BOOL, NUM(zero_extra.legacy_stage1), "false", 0,
     0, NULL, "DeepSpeed's old stage 1 (true is refused)"},
    {"zero_optimization.round_robin_gradients", NULL, OPT_BOOL,
     NUM(zero_extra.round_robin_gradients), "false", 0, 0, NULL,
     "offload's gradient copies to CPU: none here, either value"},
    {"zero_optimization.zero_hpz_partition_size", NULL, OPT_INT, NUM(zero_extra.hpz_partition_size),
     "1", 0, 1 << 20, NULL, "ZeRO++ secondary weight partition (above 1 is refused)"},
    {"zero_optimization.zero_quantized_weights", NULL, OPT_BOOL, NUM(zero_extra.quantized_weights),
     "false", 0, 0, NULL, "ZeRO++ quantised weight gathers (true is refused)"},
    {"zero_optimization.zero_quantized_nontrainable_weights", NULL, OPT_BOOL,
     NUM(zero_extra.quantized_nontrainable_weights), "false", 0, 0, NULL,
     "ZeRO++ quantised frozen weights (true is refused)"},
    {"zero_optimization.zero_quantized_gradients", NULL, OPT_BOOL,
     NUM(zero_extra.quantized_gradients), "false", 0, 0, NULL,
     "ZeRO++ quantised gradient reduction (true is refused)"},
    {"zero_optimization.zeropp_loco_param.err_beta", NULL, OPT_FLOAT, NUM(zero_extra.loco_err_beta),
     "0.8", 0, 1, NULL, "LoCo-ZeRO++ (refused)"},
    {"zero_optimization.zeropp_loco_param.reset_T", NULL, OPT_INT, NUM(zero_extra.loco_reset_t),
     "1024", 0, 1 << 30, NULL, "LoCo-ZeRO++ (refused)"},
    {"zero_optimization.mics_shard_size", NULL, OPT_INT, NUM(zero_extra.mics_shard_size), "-1", -1,
     1 << 20, NULL, "MiCS shard groups (-1: off; others are refused)"},
    {"zero_optimization.mics_hierarchical_params_gather", NULL, OPT_BOOL,
     NUM(zero_extra.mics_hierarchical_params_gather), "false", 0, 0, NULL,
     "MiCS (true is refused)"},
    {"zero_optimization.memory_efficient_linear", NULL, OPT_BOOL,
     NUM(zero_extra.memory_efficient_linear), "true", 0, 0, NULL,
     "stage 3: weights gathered again for the backward pass (false is refused)"},
    {"zero_optimization.pipeline_loading_checkpoint", NULL, OPT_BOOL,
     NUM(zero_extra.pipeline_loading_checkpoint), "false", 0, 0, NULL,
     "pipeline parallelism (true is refused)"},
    {"zero_optimization.override_module_apply", NULL, OPT_BOOL,
     NUM(zero_extra.override_module_apply), "true", 0, 0, NULL,
     "a PyTorch module hook (false is refused)"},
    {"zero_allow_untested_optimizer", NULL, OPT_BOOL, NUM(zero_extra.allow_untested_optimizer),
     "false", 0, 0, NULL, "every optimizer fitlm runs under ZeRO is supported: either value"},
    {"zero_force_ds_cpu_optimizer", NULL, OPT_BOOL, NUM(zero_extra.force_ds_cpu_optimizer), "true",
     0, 0, NULL, "an offloaded update is fitlm's own vectorised cpu AdamW or SGD: either value"},
    {"dump_state", NULL, OPT_BOOL, NUM(zero_extra.dump_state), "false", 0, 0, NULL,
     "DeepSpeed's engine state at the start (true is refused: fitlm prints the run's settings)"},
    {"prescale_gradients", NULL, OPT_BOOL, NUM(zero_extra.prescale_gradients), "false", 0, 0, NULL,
     "gradients divided before their reduction over ranks (true is refused)"},
    {"gradient_predivide_factor", NULL, OPT_FLOAT, NUM(zero_extra.gradient_predivide_factor), "1",
     0, 1e9, NULL, "a divisor applied before the reduction over ranks (another than 1 is refused)"},
    {"sparse_gradients", NULL, OPT_BOOL, NUM(zero_extra.sparse_gradients), "false", 0, 0, NULL,
     "sparse embedding gradients (true is refused: fitlm's are dense)"},
    {"data_types.grad_accum_dtype", NULL, OPT_CHOICE, STR(zero_extra.grad_accum_dtype), "fp32", 0,
     0, "fp32|bf16|fp16", "the micro-batches' gradient sum: fp32 (16-bit sums are refused)"},
    {"communication_data_type", NULL, OPT_CHOICE, STR(zero_extra.comm_dtype), "fp32", 0, 0,
     "fp32|bf16|fp16", "the gradients' reduction over ranks: fp32 (16-bit ones are refused)"},
    {"fp16.auto_cast", NULL, OPT_BOOL, NUM(zero_extra.fp16_auto_cast), "false", 0, 0, NULL,
     "DeepSpeed: the model's floating inputs cast to fp16 (a model's inputs here are token ids: "
     "either value)"},
    {"bf16.immediate_grad_update", NULL, OPT_BOOL, NUM(zero_extra.bf16_immediate_grad_update),
     "true", 0, 0, NULL,
     "each micro-batch's gradient added into the fp32 sum as it is made (false is refused)"},
    {"bf16.check_grad_overflow", NULL, OPT_BOOL, NUM(zero_extra.bf16_check_grad_overflow), "false",
     0, 0, NULL,
     "DeepSpeed's bf16 overflow check: true skips a step whose gradient is not finite and goes "
     "on (skip_nonfinite without a limit); false, where DeepSpeed applies it, fitlm stops as "
     "diverged"},
    {"compile.disable", NULL, OPT_BOOL, NUM(zero_extra.compile_disable), "false", 0, 0, NULL,
     "DeepSpeed: torch.compile of the module off; fitlm's kernels are compiled C and CUDA "
     "already: either value"},
    {"compile.backend", NULL, OPT_STRING, STR(zero_extra.compile_backend), "inductor", 0, 0, NULL,
     "DeepSpeed: torch.compile's backend; nothing here is a PyTorch module: any name"},
    {"compile.deepcompile", NULL, OPT_BOOL, NUM(zero_extra.compile_deepcompile), "false", 0, 0,
     NULL, "DeepSpeed's DeepCompile, ZeRO-3's schedule from the compiled graph (true is refused)"},
    {"aio.block_size", NULL, OPT_INT, NUM(zero_extra.aio_block_size), "1048576", 1, 1 << 30, NULL,
     "NVMe offload: bytes per I/O request"},
    {"aio.queue_depth", NULL, OPT_INT, NUM(zero_extra.aio_queue_depth), "8", 1, 4096, NULL,
     "NVMe offload: I/O requests in flight per I/O thread"},
    {"aio.thread_count", NULL, OPT_INT, NUM(zero_extra.aio_thread_count), "1", 1, 64, NULL,
     "NVMe offload: I/O threads, each with its own io_uring"},
    {"aio.single_submit", NULL, OPT_BOOL, NUM(zero_extra.aio_single_submit), "false", 0, 0, NULL,
     "NVMe offload: submit each request on its own (false: a batch at once)"},
    {"aio.overlap_events", NULL, OPT_BOOL, NUM(zero_extra.aio_overlap_events), "true", 0, 0, NULL,
     "NVMe offload: keep queue_depth requests in flight (false: batch after batch)"},
    {"aio.intra_op_parallelism", NULL, OPT_INT, NUM(zero_extra.aio_intra_op), "1", 0, 1 << 20, NULL,
     "NVMe offload: threads per request (other than 1 is refused)"},
    {"aio.use_gds", NULL, OPT_BOOL, NUM(zero_extra.aio_use_gds), "false", 0, 0, NULL,
     "GPUDirect Storage (true is refused)"},
    {"comm_timeout", "--comm-timeout", OPT_FLOAT, NUM(zero.comm_timeout), "600", 1, 1e7, NULL,
     "seconds a collective may wait before the job is ended (a dead or hung rank)"},
    {"seq_len", "--seq-len", OPT_INT, NUM(seq_len), "128", 1, 1048576, NULL, "sequence length T"},
    {"train_steps", "--steps", OPT_INT, NUM(steps), "400", 0, 1 << 30, NULL, "optimizer steps"},
    {"precision", "--precision", OPT_CHOICE, STR(precision), "fp32", 0, 0, "fp32|bf16|fp16",
     "storage precision of weights, activations and gradients (fp32 master weights otherwise)"},
    {"bf16.enabled", "--bf16", OPT_BOOL, NUM(bf16_enabled), "false", 0, 0, NULL,
     "DeepSpeed's bf16 block: same as --precision bf16"},
    {"fp16.enabled", "--fp16", OPT_BOOL, NUM(fp16_enabled), "false", 0, 0, NULL,
     "DeepSpeed's fp16 block: same as --precision fp16"},
    {"fp16.loss_scale", "--loss-scale", OPT_FLOAT, NUM(loss_scale), "0", 0, 1e30, NULL,
     "fp16 loss scale: 0 = dynamic, else static"},
    {"fp16.initial_scale_power", "--initial-scale-power", OPT_INT, NUM(initial_scale_power), "16",
     0, 120, NULL, "fp16 dynamic scaling starts at 2^this"},
    {"fp16.loss_scale_window", "--loss-scale-window", OPT_INT, NUM(loss_scale_window), "1000", 1,
     1 << 30, NULL, "clean steps before the fp16 scale doubles"},
    {"fp16.hysteresis", "--hysteresis", OPT_INT, NUM(hysteresis), "2", 1, 1 << 20, NULL,
     "overflows tolerated before the fp16 scale halves"},
    {"fp16.consecutive_hysteresis", "--consecutive-hysteresis", OPT_BOOL,
     NUM(consecutive_hysteresis), "false", 0, 0, NULL,
     "refill the hysteresis after every clean step"},
    {"fp16.min_loss_scale", "--min-loss-scale", OPT_FLOAT, NUM(min_loss_scale), "1", 1e-30, 1e30,
     NULL, "the fp16 scale never goes below this; an overflow there stops training"},
    {"optimizer_in_backward", "--optimizer-in-backward", OPT_BOOL, NUM(optimizer_in_backward),
     "false", 0, 0, NULL,
     "AdamW/SGD: update each block from the backward pass (no whole gradient; LOMO and AdaLomo "
     "always do)"},
    {"optimizer.type", "--optimizer", OPT_CHOICE, STR(optimizer), "adamw", 0, 0,
     "adamw|adam|sgd|lomo|adalomo",
     "optimizer (adam: DeepSpeed's Adam, AdamW unless adam_w_mode is false; lomo, adalomo: fused "
     "into the backward pass, no whole-model gradient, no fp32 master copy)"},
    {"optimizer.params.adam_w_mode", NULL, OPT_BOOL, NUM(adam_w_mode), "true", 0, 0, NULL,
     "DeepSpeed's Adam: weight decay decoupled (AdamW); false (L2 regularisation) is refused "
     "with weight decay"},
    {"optimizer.params.torch_adam", NULL, OPT_BOOL, NUM(torch_adam), "false", 0, 0, NULL,
     "DeepSpeed: torch's Adam or AdamW rather than its fused one, the same rule (fitlm's own "
     "vectorised AdamW either way)"},
    {"optimizer.params.lr", "--lr", OPT_FLOAT, NUM(lr), "0.003", 0, 1e3, NULL,
     "peak learning rate"},
    {"optimizer.params.bias_correction", NULL, OPT_BOOL, NUM(bias_correction), "true", 0, 0, NULL,
     "AdamW's bias correction of its moments (DeepSpeed's Adam's; false: BERT's Adam without "
     "it)"},
    {"optimizer.params.betas", "--betas", OPT_PAIR, NUM(beta1), "0.9,0.95", 0, 0.999999, NULL,
     "AdamW betas (beta1,beta2)"},
    {"optimizer.params.eps", "--eps", OPT_FLOAT, NUM(eps), "1e-8", 0, 1, NULL,
     "AdamW epsilon; AdaLomo's eps[0], added to g^2 (its default 1e-30 when not given)"},
    {"optimizer.params.eps2", "--eps2", OPT_FLOAT, NUM(eps2), "1e-3", 0, 1, NULL,
     "AdaLomo's eps[1]: floor of RMS(parameter) in its learning-rate scale"},
    {"optimizer.params.clip_threshold", "--clip-threshold", OPT_FLOAT, NUM(clip_threshold), "1.0",
     1e-6, 1e6, NULL, "AdaLomo: the RMS of an update is normalised down to this"},
    {"optimizer.params.decay_rate", "--decay-rate", OPT_FLOAT, NUM(decay_rate), "-0.8", -1, -1e-3,
     NULL, "AdaLomo: second-moment decay 1 - t^decay_rate"},
    {"optimizer.params.clip_grad_value", "--clip-grad-value", OPT_FLOAT, NUM(clip_value), "0", 0,
     1e9, NULL, "LOMO: clamp each gradient element to +-this (0 = off)"},
    {"optimizer.params.stochastic_rounding", "--stochastic-rounding", OPT_BOOL,
     NUM(stochastic_rounding), "true", 0, 0, NULL,
     "LOMO/AdaLomo on bf16/fp16 weights: round updates stochastically (false: to nearest; "
     "updates below half an ulp then vanish)"},
    {"optimizer.params.weight_decay", "--weight-decay", OPT_FLOAT, NUM(weight_decay), "0.1", 0, 1e3,
     NULL, "weight decay (matrices and wte; not biases, LayerNorm, wpe)"},
    {"optimizer.params.momentum", "--momentum", OPT_FLOAT, NUM(momentum), "0", 0, 0.999999, NULL,
     "SGD momentum"},
    {"gradient_clipping", "--grad-clip", OPT_FLOAT, NUM(grad_clip), "1.0", 0, 1e9, NULL,
     "global gradient-norm clip (0 = off; AdaLomo: 0 unless given)"},
    {"lora.enabled", "--lora", OPT_BOOL, NUM(lora_enabled), "false", 0, 0, NULL,
     "train LoRA adapters (PEFT's) on the frozen base instead of the whole model; saved as "
     "out/adapter (adapter_config.json + adapter_model.safetensors)"},
    {"lora.r", "--lora-r", OPT_INT, NUM(lora.r), "8", 1, 65536, NULL, "LoRA rank"},
    {"lora.lora_alpha", "--lora-alpha", OPT_FLOAT, NUM(lora.alpha), "8", 1e-6, 1e6, NULL,
     "LoRA scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)"},
    {"lora.lora_dropout", "--lora-dropout", OPT_FLOAT, NUM(lora.dropout), "0", 0, 0.999, NULL,
     "dropout on the adapters' input while training"},
    {"lora.target_modules", "--lora-target-modules", OPT_STRING, STR(lora.target_modules), "", 0, 0,
     NULL,
     "modules to adapt, comma-separated (LLaMA: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
     "down_proj; GPT-2: c_attn,attn.c_proj,c_fc,mlp.c_proj), or all-linear (every linear layer "
     "but the LM head); \"\" = the architecture's default (q_proj,v_proj; c_attn)"},
    {"lora.use_rslora", "--use-rslora", OPT_BOOL, NUM(lora.use_rslora), "false", 0, 0, NULL,
     "rank-stabilised LoRA: scaling lora_alpha / sqrt(r)"},
    {"lora.init_lora_weights", "--init-lora-weights", OPT_CHOICE, STR(lora_init), "true", 0, 0,
     "true|gaussian", "A Kaiming-uniform (true) or N(0, 1/r) (gaussian); B = 0 either way"},
    {"lora.bias", "--lora-bias", OPT_STRING, STR(lora_bias), "none", 0, 0, NULL,
     "none: biases stay frozen (PEFT's all and lora_only are not supported)"},
    {"lora.base_optimizer", "--lora-base-optimizer", OPT_CHOICE, STR(lora_base_optimizer), "none",
     0, 0, "none|lomo|adalomo",
     "LoRA + LOMO: the base weights are trained too, by this fused optimizer in the same "
     "backward (the adapters keep optimizer.type); none = a frozen base"},
    {"lora.base_lr", "--lora-base-lr", OPT_FLOAT, NUM(lora_base_lr), "0", 0, 1e3, NULL,
     "the base's learning rate under lora.base_optimizer, on the same schedule (0 = lr)"},
    {"adapter", "--adapter", OPT_STRING, STR(adapter), "", 0, 0, NULL,
     "a PEFT LoRA adapter directory to continue training (adapter_config.json + "
     "adapter_model.safetensors); its config sets the lora.* options"},
    {"quantization_config.bnb_4bit_quant_type", "--quantize", OPT_CHOICE, STR(quant_type), "none",
     0, 0, "none|nf4|fp4",
     "QLoRA: store the base's linear layers in 4 bits as bitsandbytes' NF4 (needs --lora; fp4 is "
     "not supported)"},
    {"quantization_config.bnb_4bit_use_double_quant", "--double-quant", OPT_BOOL,
     NUM(quant.double_quant), "false", 0, 0, NULL,
     "NF4: quantise the per-block absmax values too (8 bits, blocks of 256)"},
    {"quantization_config.blocksize", "--nf4-blocksize", OPT_INT, NUM(quant.blocksize), "64", 32,
     4096, NULL, "NF4 block size (a power of two)"},
    {"scheduler.type", "--scheduler", OPT_CHOICE, STR(scheduler), "cosine", 0, 0,
     "constant|cosine|linear|WarmupLR|WarmupDecayLR|WarmupCosineLR",
     "learning-rate decay after warmup; or DeepSpeed's schedules, by their parameters below "
     "(docs/training.md)"},
    {"scheduler.params.warmup_num_steps", "--warmup", OPT_INT, NUM(warmup_steps), "100", 0, 1 << 30,
     NULL, "linear warmup steps (DeepSpeed's schedules: 1000 unless given)"},
    {"scheduler.params.min_lr_ratio", "--min-lr-ratio", OPT_FLOAT, NUM(min_lr_ratio), "0.1", 0, 1,
     NULL, "learning-rate floor at the last step, as a fraction of lr"},
    {"scheduler.params.warmup_min_lr", "--warmup-min-lr", OPT_FLOAT, NUM(warmup_min_lr), "0", 0,
     1e3, NULL, "WarmupLR, WarmupDecayLR: the rate warmup starts from (and the decay ends at)"},
    {"scheduler.params.warmup_max_lr", "--warmup-max-lr", OPT_FLOAT, NUM(warmup_max_lr), "0.001", 0,
     1e3, NULL,
     "WarmupLR, WarmupDecayLR: the rate after warmup, the optimizer's lr (as DeepSpeed: "
     "WarmupLR's default is lr, WarmupDecayLR's 0.001)"},
    {"scheduler.params.warmup_type", "--warmup-type", OPT_CHOICE, STR(warmup_type), "log", 0, 0,
     "log|linear", "DeepSpeed's schedules: warmup along log(n+1)/log(warmup) or n/warmup"},
    {"scheduler.params.total_num_steps", "--total-num-steps", OPT_INT, NUM(total_num_steps), "0", 0,
     1 << 30, NULL,
     "WarmupDecayLR, WarmupCosineLR: DeepSpeed's iteration at which the decay ends (0 = the "
     "run's steps)"},
    {"scheduler.params.warmup_min_ratio", "--warmup-min-ratio", OPT_FLOAT, NUM(warmup_min_ratio),
     "0", 0, 1, NULL, "WarmupCosineLR: the rate warmup starts from, as a fraction of lr"},
    {"scheduler.params.cos_min_ratio", "--cos-min-ratio", OPT_FLOAT, NUM(cos_min_ratio), "0.0001",
     0, 1, NULL, "WarmupCosineLR: the floor the cosine ends at, as a fraction of lr"},
    {"eval_interval", "--eval-every", OPT_INT, NUM(eval_interval), "100", 0, 1 << 30, NULL,
     "validation loss every N steps (0 = only at the end)"},
    {"eval_iters", "--eval-iters", OPT_INT, NUM(eval_iters), "16", 1, 1 << 20, NULL,
     "validation batches per evaluation"},
    {"out_dir", "--out", OPT_STRING, STR(out_dir), "out", 0, 0, NULL,
     "checkpoint directory, written at the end and every save_every steps (empty = none)"},
    {"save_every", "--save-every", OPT_INT, NUM(save_every), "0", 0, 1 << 30, NULL,
     "also write a checkpoint every N steps (0 = only at the end)"},
    {"keep_checkpoints", "--keep-checkpoints", OPT_INT, NUM(keep_checkpoints), "2", 0, 1 << 20,
     NULL,
     "checkpoints of this run kept in out_dir, newest first (0 = all); another run's are never "
     "deleted"},
    {"overwrite", "--overwrite", OPT_BOOL, NUM(overwrite), "false", 0, 0, NULL,
     "start a new run in an out_dir that holds one (else refused: --resume it); the old run's "
     "checkpoints are not deleted, only replaced where this run writes the same step"},
    {"skip_nonfinite", "--skip-nonfinite", OPT_INT, NUM(skip_nonfinite), "0", 0, 1 << 30, NULL,
     "steps with a non-finite loss or gradient norm to skip (no update) before training stops "
     "as diverged (fp16 overflow steps are not counted)"},
    {"skip_update_lossz", "--skip-update-lossz", OPT_FLOAT, NUM(skip_update_lossz), "10", 0, 1e6,
     NULL,
     "spike guard (llm.c's -sl): skip a step whose loss lies more than this many standard "
     "deviations above the mean of the last normal steps' losses (0 = off)"},
    {"skip_update_gradz", "--skip-update-gradz", OPT_FLOAT, NUM(skip_update_gradz), "0", 0, 1e6,
     NULL,
     "spike guard (llm.c's -sg): the same test on the gradient norm, made before the update "
     "(0 = off: norm spikes are common in healthy runs and clipping bounds their updates)"},
    {"skip_update_window", "--skip-update-window", OPT_INT, NUM(skip_update_window), "128", 1,
     FL_SPIKE_WINDOW_MAX, NULL,
     "spike guard: the last normal steps whose values a step is judged against"},
    {"skip_update_min_steps", "--skip-update-min-steps", OPT_INT, NUM(skip_update_min_steps), "16",
     2, FL_SPIKE_WINDOW_MAX, NULL,
     "spike guard: normal steps seen (this run and the one it resumes) before any step is judged"},
    {"skip_update_max_in_row", "--skip-update-max-in-row", OPT_INT, NUM(skip_update_max_in_row),
     "5", 1, 1 << 20, NULL,
     "spike guard: consecutive skipped steps after which training stops with an error (the "
     "weights, not the data, are then the likely cause)"},
    {"resume", "--resume", OPT_STRING, STR(resume), "", 0, 0, NULL,
     "continue the run saved in this checkpoint directory or file, bit for bit (its config "
     "applies; flags given here override it)"},
    {"init_from", "--init-from", OPT_STRING, STR(init_from), "", 0, 0, NULL,
     "initial weights: a Hugging Face GPT-2 or LLaMA directory (config.json + safetensors), an "
     "llm.c "
     ".bin model file or a fitlm checkpoint; the model shape comes from it"},
    {"sample_tokens", "--sample-tokens", OPT_INT, NUM(sample_tokens), "400", 0, 1 << 20, NULL,
     "tokens of text sampled after training"},
    {"seed", "--seed", OPT_U64, NUM(seed), "1337", 0, 0, NULL, "random seed"},
    {"threads", "--threads", OPT_INT, NUM(threads), "0", 0, 4096, NULL, "threads (0 = all cores)"},
    {"device", "--device", OPT_CHOICE, STR(device), "cpu", 0, 0, "cpu|cuda|test",
     "where the model and optimizer live: cpu; cuda (one NVIDIA GPU, in a build with CUDA); test "
     "(the cpu's kernels on memory only the device table touches: checks the device seam) "
     "(docs/devices.md)"},
    {"mem_report", "--mem-report", OPT_BOOL, NUM(mem_report), "false", 0, 0, NULL,
     "print memory per tag and peak RSS at the end"},
    {"mem_report_every", "--mem-report-every", OPT_INT, NUM(mem_report_every), "0", 0, 1 << 30,
     NULL, "also print the memory report every N steps (0 = only at the end, with --mem-report)"},
    {"metrics_memory_every", "--metrics-memory-every", OPT_INT, NUM(metrics_memory_every), "10", 1,
     1 << 30, NULL, "memory per tag and RSS in OUT/metrics.jsonl at the first step and every N"},
    {"peak_tflops", "--peak-tflops", OPT_FLOAT, NUM(peak_tflops), "0", 0, 1e6, NULL,
     "peak TFLOP/s behind metrics.jsonl's MFU (0 = measured for ~0.1 s at the start, which a busy "
     "machine lowers)"},
    {"profile", "--profile", OPT_BOOL, NUM(profile), "false", 0, 0, NULL,
     "print a per-op profile after training: forward, backward and total ms per step, share of "
     "the step and GEMM GFLOP/s for each kernel, the data loader and the optimizer (the first "
     "step is not counted)"},
    {"wall_clock_breakdown", NULL, OPT_BOOL, NUM(wall_clock_breakdown), "false", 0, 0, NULL,
     "DeepSpeed's timing breakdown: the same as profile"},
    {"memory_breakdown", NULL, OPT_BOOL, NUM(memory_breakdown), "false", 0, 0, NULL,
     "DeepSpeed's memory report: the same as mem_report"},
    {"steps_per_print", "--steps-per-print", OPT_INT, NUM(steps_per_print), "1", 1, 1 << 30, NULL,
     "print the step line every N steps (not on a terminal, where one line is rewritten in "
     "place; the log and metrics.jsonl keep every step)"},
    {"mem_limit", "--mem-limit", OPT_STRING, STR(mem_limit), "", 0, 0, NULL,
     "refuse to start if the planned memory exceeds this (bytes, or with K/M/G/T; \"\" = the "
     "machine's available memory); with a --device other than the cpu, the device's budget, "
     "which its allocator also enforces (the host then has its available memory)"},
};

#define N_OPTIONS (sizeof options / sizeof options[0])
enum { GIVEN = 1, GIVEN_AUTO = 2 }; // fl_train_config.given: set to a value, or to "auto"
_Static_assert(N_OPTIONS <= sizeof(((fl_train_config *)0)->given), "grow fl_train_config.given");

static size_t option_index(const char *key) {
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (!strcmp(options[i].key, key)) return i;
    FL_ASSERT(0);
}

// A number's or a switch's value (the names of one setting compared).
static double number_of(const fl_train_config *cfg, const option *o) {
    const void *v = (const char *)cfg + o->offset;
    return o->type == OPT_FLOAT                        ? *(const float *)v
           : o->type == OPT_INT || o->type == OPT_BOOL ? *(const int *)v
                                                       : 0.0;
}

// Options that set the same field are names of one setting
// (tensor_parallel.size, Megatron's and DeepSpeed's names for it;
// DeepSpeed's stage3_max_live_parameters and its field name
// max_live_parameters, ...: numbers and switches). A source (a config
// file, a checkpoint's config, the flags) giving two must give them the
// same value; a later source's name replaces an earlier one's, as any
// value of it does. `seen`: what this source has given so far; `before`:
// the field's value before o was set.
static void mark_given(fl_train_config *cfg, const option *o, uint8_t *seen, double before,
                       const char *where) {
    for (size_t i = 0; i < N_OPTIONS; i++) {
        const option *a = &options[i];
        if (a == o || a->offset != o->offset || !cfg->given[i]) continue;
        FL_ASSERT(a->type == o->type &&
                  (o->type == OPT_INT || o->type == OPT_FLOAT || o->type == OPT_BOOL));
        double now = number_of(cfg, o);
        if (seen[i] && now != before)
            fl_die("%s: %s %g contradicts %s %g (two names of one setting: give one)", where,
                   o->key, now, a->key, before);
        if (!seen[i]) cfg->given[i] = 0;
    }
    cfg->given[o - options] = GIVEN;
    seen[o - options] = 1;
}

int fl_config_given(const fl_train_config *cfg, const char *key) {
    return cfg->given[option_index(key)] == GIVEN;
}

int fl_config_auto(const fl_train_config *cfg, const char *key) {
    return cfg->given[option_index(key)] == GIVEN_AUTO;
}

void fl_config_set_given(fl_train_config *cfg, const char *key, int on) {
    cfg->given[option_index(key)] = (uint8_t)on;
}

// ----------------------------------------------------------------------------
// setting one option from text (defaults, flags) or from JSON

static int choice_index(const option *o, const char *value) {
    const char *p = o->choices;
    int i = 0;
    size_t n = strlen(value);
    while (*p) {
        const char *end = strchr(p, '|');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncasecmp(p, value, n) == 0) return i;
        if (!end) break;
        p = end + 1;
        i++;
    }
    return -1;
}

// The field an option sets, inside the config struct.
static void *field(fl_train_config *cfg, const option *o) {
    return (char *)cfg + o->offset;
}

static void check_range(const option *o, double v, const char *where) {
    if (!(v >= o->min && v <= o->max))
        fl_die("%s: %s = %g is out of range [%g, %g]", where, o->key, v, o->min, o->max);
}

static double parse_number(const option *o, const char *text, const char *where) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    while (isspace((unsigned char)*end)) end++;
    if (end == text || *end || errno || !isfinite(v))
        fl_die("%s: %s expects a number, got '%s'", where, o->key, text);
    return v;
}

static void set_number(fl_train_config *cfg, const option *o, double v, const char *where) {
    void *base = field(cfg, o);
    switch (o->type) {
    case OPT_INT:
        if (v != floor(v)) fl_die("%s: %s expects a whole number, got %g", where, o->key, v);
        check_range(o, v, where);
        *(int *)base = (int)v;
        break;
    case OPT_U64:
        if (v != floor(v) || v < 0 || v >= 9007199254740992.0)
            fl_die("%s: %s expects a whole number in [0, 2^53) (larger ones as a string), got %g",
                   where, o->key, v);
        *(uint64_t *)base = (uint64_t)v;
        break;
    case OPT_FLOAT:
        check_range(o, v, where);
        *(float *)base = (float)v;
        break;
    default:
        FL_ASSERT(0);
    }
}

static void set_string(fl_train_config *cfg, const option *o, const char *value,
                       const char *where) {
    char *dst = field(cfg, o);
    if (strlen(value) >= o->size)
        fl_die("%s: %s is too long (%zu characters, at most %zu)", where, o->key, strlen(value),
               o->size - 1);
    if (o->type == OPT_CHOICE) {
        int k = choice_index(o, value);
        if (k < 0) fl_die("%s: %s must be one of %s, got '%s'", where, o->key, o->choices, value);
        const char *p = o->choices; // the list's spelling, whatever the case given
        while (k--) p = strchr(p, '|') + 1;
        memcpy(dst, p, strlen(value));
        dst[strlen(value)] = 0;
        return;
    }
    strcpy(dst, value);
}

static void set_pair(fl_train_config *cfg, const option *o, double a, double b, const char *where) {
    check_range(o, a, where);
    check_range(o, b, where);
    float *dst = field(cfg, o);
    dst[0] = (float)a;
    dst[1] = (float)b;
}

static void set_bool_text(fl_train_config *cfg, const option *o, const char *value,
                          const char *where) {
    int *dst = field(cfg, o);
    if (!strcmp(value, "true") || !strcmp(value, "1"))
        *dst = 1;
    else if (!strcmp(value, "false") || !strcmp(value, "0"))
        *dst = 0;
    else
        fl_die("%s: %s expects true or false, got '%s'", where, o->key, value);
}

// 64-bit integers from text, exactly (a double holds only 53 bits)
int fl_parse_u64(const char *text, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (!isdigit((unsigned char)*text) || *end || errno) return -1;
    *out = v;
    return 0;
}

static void set_u64_text(fl_train_config *cfg, const option *o, const char *value,
                         const char *where) {
    if (fl_parse_u64(value, (uint64_t *)field(cfg, o)))
        fl_die("%s: %s expects a whole number in [0, 2^64), got '%s'", where, o->key, value);
}

static void set_from_text(fl_train_config *cfg, const option *o, const char *value,
                          const char *where) {
    switch (o->type) {
    case OPT_U64:
        set_u64_text(cfg, o, value, where);
        break;
    case OPT_STRING:
    case OPT_CHOICE:
        set_string(cfg, o, value, where);
        break;
    case OPT_BOOL:
        set_bool_text(cfg, o, value, where);
        break;
    case OPT_PAIR: {
        const char *comma = strchr(value, ',');
        if (!comma) fl_die("%s: %s expects two numbers 'a,b', got '%s'", where, o->key, value);
        char first[64];
        size_t n = (size_t)(comma - value);
        if (n >= sizeof first) fl_die("%s: %s: '%s' is too long", where, o->key, value);
        memcpy(first, value, n);
        first[n] = 0;
        set_pair(cfg, o, parse_number(o, first, where), parse_number(o, comma + 1, where), where);
        break;
    }
    default:
        set_number(cfg, o, parse_number(o, value, where), where);
    }
}

static void set_from_json(fl_train_config *cfg, const option *o, const cJSON *item,
                          const char *where) {
    switch (o->type) {
    case OPT_STRING:
    case OPT_CHOICE:
        if (!cJSON_IsString(item)) fl_die("%s: %s must be a string", where, o->key);
        set_string(cfg, o, item->valuestring, where);
        break;
    case OPT_BOOL:
        if (!cJSON_IsBool(item)) fl_die("%s: %s must be true or false", where, o->key);
        *(int *)field(cfg, o) = cJSON_IsTrue(item);
        break;
    case OPT_PAIR:
        if (!cJSON_IsArray(item) || cJSON_GetArraySize(item) != 2 ||
            !cJSON_IsNumber(cJSON_GetArrayItem(item, 0)) ||
            !cJSON_IsNumber(cJSON_GetArrayItem(item, 1)))
            fl_die("%s: %s must be an array of two numbers", where, o->key);
        set_pair(cfg, o, cJSON_GetArrayItem(item, 0)->valuedouble,
                 cJSON_GetArrayItem(item, 1)->valuedouble, where);
        break;
    default:
        if (o->type == OPT_U64 && cJSON_IsString(item)) {
            set_u64_text(cfg, o, item->valuestring, where);
            break;
        }
        if (!cJSON_IsNumber(item)) fl_die("%s: %s must be a number", where, o->key);
        set_number(cfg, o, item->valuedouble, where);
    }
}

// ----------------------------------------------------------------------------
// defaults, JSON, flags

void fl_config_defaults(fl_train_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_OPTIONS; i++)
        set_from_text(cfg, &options[i], options[i].def, "defaults");
}

static int is_prefix_of_a_key(const char *path) {
    size_t n = strlen(path);
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (!strncmp(options[i].key, path, n) && options[i].key[n] == '.') return 1;
    return 0;
}

// "auto" for a number or a switch (DeepSpeed's pipeline.stages; Hugging
// Face's configs, whose Trainer fills it in from its own arguments): left
// to fitlm's own setting, its flag or default, or for a setting of several
// names the others (fl_config_auto; a checkpoint's config keeps "auto").
static int is_auto(const option *o, const cJSON *item) {
    return o->type != OPT_STRING && o->type != OPT_CHOICE && cJSON_IsString(item) &&
           !strcmp(item->valuestring, "auto");
}

// A block's "enabled": 1 or 0, or -1 where it is no object or has no
// boolean "enabled".
static int switch_of(const cJSON *item) {
    const cJSON *e =
        cJSON_IsObject(item) ? cJSON_GetObjectItemCaseSensitive(item, "enabled") : NULL;
    return cJSON_IsBool(e) ? cJSON_IsTrue(e) : -1;
}

static void load_object(fl_train_config *cfg, const cJSON *obj, const char *prefix,
                        const char *path, uint8_t *seen) {
    for (const cJSON *item = obj->child; item; item = item->next) {
        char key[256];
        int n = snprintf(key, sizeof key, "%s%s%s", prefix, *prefix ? "." : "", item->string);
        if (n < 0 || (size_t)n >= sizeof key)
            fl_die("%s: key '%s' is too long", path, item->string);
        const option *o = NULL;
        for (size_t i = 0; i < N_OPTIONS; i++)
            if (!strcmp(options[i].key, key)) o = &options[i];
        if (o && is_auto(o, item)) {
            cfg->given[o - options] = GIVEN_AUTO;
            continue;
        }
        if (cJSON_IsNull(item) && (o || is_prefix_of_a_key(key)))
            continue; // DeepSpeed's None (a key or a block): its default, fitlm's
        if (o) {
            double before = number_of(cfg, o);
            set_from_json(cfg, o, item, path);
            mark_given(cfg, o, seen, before, path);
        } else if (is_prefix_of_a_key(key)) {
            if (!cJSON_IsObject(item)) fl_die("%s: %s must be an object", path, key);
            load_object(cfg, item, key, path, seen);
        } else if (!*prefix && fl_deepspeed_feature_off(path, key, switch_of(item))) {
            continue; // DeepSpeed reads a block switched off no further
        } else if (!*prefix && key[0] == '_' && cJSON_IsString(item)) {
            continue; // a comment ("_comment": JSON has none), which DeepSpeed reads no further
        } else {
            // DeepSpeed's top level passes over keys it does not know (its
            // sections refuse them): a key there is safe to drop
            fl_die("%s: unknown key '%s'%s (see 'fitlm train --help' for the keys this version "
                   "supports)",
                   path, key,
                   *prefix ? "" : "; DeepSpeed passes over a top-level key it does not know");
        }
    }
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

// cJSON keeps every duplicate and lookups see the first: a key given twice
// (at any depth) is refused rather than half-honoured.
static void check_duplicates(const cJSON *item, const char *path, const char *where) {
    int n = cJSON_GetArraySize(item);
    if (cJSON_IsObject(item) && n > 1) {
        const cJSON **sorted = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *sorted);
        int k = 0;
        for (const cJSON *c = item->child; c; c = c->next) sorted[k++] = c;
        qsort(sorted, (size_t)n, sizeof *sorted, by_name);
        for (int i = 1; i < n; i++)
            if (!strcmp(sorted[i - 1]->string, sorted[i]->string))
                fl_die("%s: duplicate key '%s%s%s'", where, path, *path ? "." : "",
                       sorted[i]->string);
        fl_free(sorted);
    }
    int i = 0;
    for (const cJSON *c = item->child; c; c = c->next, i++) {
        if (!cJSON_IsObject(c) && !cJSON_IsArray(c)) continue;
        char sub[256]; // for messages only: a longer path is cut short
        if (cJSON_IsObject(item))
            snprintf(sub, sizeof sub, "%s%s%s", path, *path ? "." : "", c->string);
        else
            snprintf(sub, sizeof sub, "%s[%d]", path, i);
        check_duplicates(c, sub, where);
    }
}

// Reads config text; returns whether it has an optimizer block naming its type.
static int load_text(fl_train_config *cfg, const char *text, size_t n, const char *where) {
    const char *why;
    size_t at;
    cJSON *root = fl_json_parse(text, n, &why, &at);
    if (!root) fl_die("%s: %s at line %d (byte %zu)", where, why, fl_text_line_of(text, at), at);
    fl_json_check_nul(text, n, where); // a value cut at a NUL would be another
    if (!cJSON_IsObject(root)) fl_die("%s: the top level must be a JSON object", where);
    check_duplicates(root, "", where);
    uint8_t seen[N_OPTIONS] = {0};
    load_object(cfg, root, "", where, seen);
    const cJSON *opt = cJSON_GetObjectItemCaseSensitive(root, "optimizer");
    int typed = cJSON_IsObject(opt) && cJSON_GetObjectItemCaseSensitive(opt, "type");
    cJSON_Delete(root);
    return typed;
}

void fl_config_load_json_text(fl_train_config *cfg, const char *text, size_t n, const char *where) {
    load_text(cfg, text, n, where);
}

void fl_config_load_json(fl_train_config *cfg, const char *path) {
    size_t n;
    char *text = (char *)fl_file_read_all(path, 1 << 24, &n, "config file");
    char where[FL_PATH_MAX + 16];
    snprintf(where, sizeof where, "config file %s", path);
    if (load_text(cfg, text, n, where)) cfg->deepspeed_optimizer = 1;
    fl_free(text);
}

// The object at dotted path `key` (creating it), for the last component.
static cJSON *parent_of(cJSON *root, const char *key, const char **leaf) {
    char part[128];
    const char *p = key, *dot;
    while ((dot = strchr(p, '.'))) {
        size_t len = (size_t)(dot - p);
        FL_ASSERT(len < sizeof part);
        memcpy(part, p, len);
        part[len] = 0;
        cJSON *next = cJSON_GetObjectItemCaseSensitive(root, part);
        root = next ? next : cJSON_AddObjectToObject(root, part);
        p = dot + 1;
    }
    *leaf = p;
    return root;
}

// Options about this invocation rather than the run: a resumed run does not
// inherit them from its checkpoint. NVMe offload's blocks say where and how
// this machine keeps the state on its disk (never a number of the run: the
// offloaded run is bitwise the one in RAM), so a checkpoint from elsewhere
// never names a directory to write in. The device is where this invocation
// computes: a checkpoint holds no device pointers and resumes on any.
static int run_only(const option *o) {
    static const char *keys[] = {"resume",           "profile",        "mem_report",
                                 "mem_report_every", "mem_limit",      "metrics_memory_every",
                                 "peak_tflops",      "device",         "wall_clock_breakdown",
                                 "memory_breakdown", "steps_per_print"};
    static const char *prefixes[] = {"zero_optimization.offload_optimizer.",
                                     "zero_optimization.offload_param.", "aio."};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strcmp(o->key, keys[i])) return 1;
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
        if (!strncmp(o->key, prefixes[i], strlen(prefixes[i]))) return 1;
    return 0;
}

void fl_config_forget_invocation(fl_train_config *cfg) {
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (run_only(&options[i])) {
            set_from_text(cfg, &options[i], options[i].def, "defaults");
            cfg->given[i] = 0;
        }
}

char *fl_config_to_json(const fl_train_config *cfg) {
    cJSON *root = cJSON_CreateObject();
    for (size_t i = 0; i < N_OPTIONS; i++) {
        const option *o = &options[i];
        if (!cfg->given[i] || run_only(o)) continue;
        const char *leaf;
        cJSON *parent = parent_of(root, o->key, &leaf);
        if (cfg->given[i] == GIVEN_AUTO) {
            cJSON_AddStringToObject(parent, leaf, "auto");
            continue;
        }
        const void *v = (const char *)cfg + o->offset;
        switch (o->type) {
        case OPT_INT:
            cJSON_AddNumberToObject(parent, leaf, *(const int *)v);
            break;
        case OPT_U64: { // as text: a JSON number (a double) holds only 53 bits
            char text[24];
            snprintf(text, sizeof text, "%llu", (unsigned long long)*(const uint64_t *)v);
            cJSON_AddStringToObject(parent, leaf, text);
            break;
        }
        case OPT_FLOAT:
            cJSON_AddNumberToObject(parent, leaf, *(const float *)v);
            break;
        case OPT_BOOL:
            cJSON_AddBoolToObject(parent, leaf, *(const int *)v);
            break;
        case OPT_PAIR: {
            cJSON *arr = cJSON_AddArrayToObject(parent, leaf);
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(((const float *)v)[0]));
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(((const float *)v)[1]));
            break;
        }
        default:
            cJSON_AddStringToObject(parent, leaf, (const char *)v);
        }
    }
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    size_t n = strlen(text);
    char *out = fl_alloc(FL_MEM_OTHER, n + 1);
    memcpy(out, text, n + 1);
    cJSON_free(text);
    return out;
}

// Options that describe this machine rather than the run: ranks on
// different machines may differ in them (the kernels give the same bits
// at any thread count; NVMe offload's files are each rank's own, in the
// machine's scratch directory).
static int machine_only(const option *o) {
    static const char *keys[] = {"threads", "mem_limit", "peak_tflops",
                                 "zero_optimization.offload_optimizer.nvme_path",
                                 "zero_optimization.offload_param.nvme_path"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strcmp(o->key, keys[i])) return 1;
    return 0;
}

// A string on one line: printable ASCII as it is, anything else (and the
// backslash) as \xNN.
static void put_escaped(FILE *f, const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p >= 0x20 && *p < 0x7f && *p != '\\')
            fputc(*p, f);
        else
            fprintf(f, "\\x%02x", *p);
}

// The fewest digits that read back as the same float (at most 9 do), so
// that two floats differ in the text exactly when they differ.
static void put_float(FILE *f, float v) {
    char text[32];
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, (double)v);
        if (strtof(text, NULL) == v) break;
    }
    fputs(text, f);
}

char *fl_config_canonical(const fl_train_config *cfg) {
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f) fl_die("out of memory");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        const option *o = &options[i];
        if (machine_only(o)) continue;
        const void *v = (const char *)cfg + o->offset;
        fprintf(f, "%s=", o->key);
        switch (o->type) {
        case OPT_INT:
            fprintf(f, "%d", *(const int *)v);
            break;
        case OPT_U64:
            fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)v);
            break;
        case OPT_FLOAT:
            put_float(f, *(const float *)v);
            break;
        case OPT_BOOL:
            fprintf(f, "%s", *(const int *)v ? "true" : "false");
            break;
        case OPT_PAIR:
            put_float(f, ((const float *)v)[0]);
            fputc(',', f);
            put_float(f, ((const float *)v)[1]);
            break;
        default:
            put_escaped(f, (const char *)v);
        }
        fputc('\n', f);
    }
    if (fclose(f)) fl_die("out of memory");
    return text;
}

static const option *find_flag(const char *flag, size_t len) {
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (options[i].flag && strlen(options[i].flag) == len &&
            !strncmp(options[i].flag, flag, len))
            return &options[i];
    return NULL;
}

void fl_config_parse_args(fl_train_config *cfg, int argc, char **argv) {
    // The config file first, wherever --config appears: flags override it.
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) fl_die("--config needs a file name");
            fl_config_load_json(cfg, argv[++i]);
        } else if (!strncmp(argv[i], "--config=", 9)) {
            fl_config_load_json(cfg, argv[i] + 9);
        }
    }
    uint8_t seen[N_OPTIONS] = {0};
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--config")) {
            i++;
            continue;
        }
        if (!strncmp(arg, "--config=", 9)) continue;
        if (strncmp(arg, "--", 2) != 0)
            fl_die("unexpected argument '%s' (options start with --)", arg);
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        const option *o = find_flag(arg, len);
        if (!o) fl_die("unknown option '%.*s' (see --help)", (int)len, arg);
        const char *value;
        if (eq) {
            value = eq + 1;
        } else if (o->type == OPT_BOOL) {
            value = "true";
        } else {
            if (i + 1 >= argc) fl_die("option %s needs a value", o->flag);
            value = argv[++i];
        }
        char where[64];
        snprintf(where, sizeof where, "option %s", o->flag);
        double before = number_of(cfg, o);
        set_from_text(cfg, o, value, where);
        mark_given(cfg, o, seen, before, where);
    }
    // what the flags left of a config file's optimizer block: DeepSpeed's
    // defaults, given (the run's config, which checkpoints keep, has them)
    fl_deepspeed_optimizer_defaults(cfg);
}

// ----------------------------------------------------------------------------
// the options no subsystem owns

// precision (DeepSpeed's bf16/fp16 blocks are mapped onto it before, by
// fl_deepspeed_check_config); fp16 options only with fp16, or in an fp16
// block that says enabled false, or "auto" while the precision is another
// (which DeepSpeed reads no further: a config's settings for an fp16 run,
// kept while it trains otherwise)
static void finish_precision(fl_train_config *cfg) {
    cfg->dtype = !strcmp(cfg->precision, "bf16")   ? FL_BF16
                 : !strcmp(cfg->precision, "fp16") ? FL_F16
                                                   : FL_F32;
    static const char *fp16_keys[] = {
        "fp16.loss_scale", "fp16.initial_scale_power",    "fp16.loss_scale_window",
        "fp16.hysteresis", "fp16.consecutive_hysteresis", "fp16.min_loss_scale"};
    int fp16_off = (fl_config_given(cfg, "fp16.enabled") && !cfg->fp16_enabled) ||
                   fl_config_auto(cfg, "fp16.enabled"); // ("auto": the precision decides)
    for (size_t i = 0; i < sizeof fp16_keys / sizeof fp16_keys[0]; i++)
        if (cfg->dtype != FL_F16 && fl_config_given(cfg, fp16_keys[i]) && !fp16_off)
            fl_die("%s applies to fp16 training; precision is %s", fp16_keys[i], cfg->precision);
}

void fl_config_check_common(fl_train_config *cfg) {
    if (cfg->threads == 0) cfg->threads = omp_get_num_procs();
    FL_ASSERT(fl_recompute_parse(cfg->recompute_policy, &cfg->recompute) == 0);
    finish_precision(cfg);
    if (*cfg->mem_limit) fl_parse_bytes(cfg->mem_limit, "mem_limit");
}

size_t fl_parse_bytes(const char *text, const char *what) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    double unit = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K':
        unit = 1024.0, end++;
        break;
    case 'M':
        unit = 1048576.0, end++;
        break;
    case 'G':
        unit = 1073741824.0, end++;
        break;
    case 'T':
        unit = 1099511627776.0, end++;
        break;
    }
    // 24G, 24GB, 24Gi and 24GiB all read as binary units
    if (unit > 1 && toupper((unsigned char)*end) == 'I') end++;
    if (toupper((unsigned char)*end) == 'B') end++;
    if (end == text || *end || errno || !(v > 0) || v * unit > 1.8e19)
        fl_die("%s: expected a size such as 8G, 512M or 1048576, got '%s'", what, text);
    return (size_t)(v * unit);
}

void fl_config_print_help(FILE *out) {
    fprintf(out, "options (JSON config key in brackets; flags override the file):\n");
    fprintf(out, "  %-28s %s\n", "--config FILE", "JSON config file with DeepSpeed-style keys");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        const option *o = &options[i];
        static const char *metavar[] = {"N", "N", "X", "", "PATH", "NAME", "A,B"};
        char usage[96];
        if (o->flag)
            snprintf(usage, sizeof usage, "%s %s", o->flag, metavar[o->type]);
        else // DeepSpeed's keys that a flag would only clutter
            snprintf(usage, sizeof usage, "(config file only)");
        fprintf(out, "  %-28s %s%s%s%s\n  %-28s [%s] default: %s\n", usage, o->help,
                o->choices ? " (" : "", o->choices ? o->choices : "", o->choices ? ")" : "", "",
                o->key, *o->def ? o->def : "\"\"");
    }
}

// The schedule, in its own parameters (DeepSpeed's total_num_steps: the
// run's steps unless given).
static void print_schedule(const fl_train_config *cfg, FILE *out) {
    const char *s = cfg->scheduler;
    int end = cfg->total_num_steps ? cfg->total_num_steps : cfg->steps;
    if (!strcmp(s, "WarmupLR") || !strcmp(s, "WarmupDecayLR"))
        fprintf(out, "(%s from %g, warmup %d %s", s, cfg->warmup_min_lr, cfg->warmup_steps,
                cfg->warmup_type);
    if (!strcmp(s, "WarmupLR")) fprintf(out, ") ");
    if (!strcmp(s, "WarmupDecayLR")) fprintf(out, ", total_num_steps %d) ", end);
    if (!strcmp(s, "WarmupCosineLR"))
        fprintf(out, "(%s from %g lr, warmup %d %s, to %g lr, total_num_steps %d) ", s,
                cfg->warmup_min_ratio, cfg->warmup_steps, cfg->warmup_type, cfg->cos_min_ratio,
                end);
    if (!strstr(s, "Warmup"))
        fprintf(out, "(%s, warmup %d, floor %g) ", s, cfg->warmup_steps, cfg->min_lr_ratio);
}

void fl_config_print(const fl_train_config *cfg, FILE *out) {
    const fl_model_config *m = &cfg->model;
    fprintf(out,
            "model %s (%s): n_layer %d, n_head %d (kv %d), n_embd %d, mlp %d, vocab %d (padded "
            "%d), max_seq_len %d, activation checkpointing %s",
            cfg->model_preset, fl_arch_name(m->arch), m->n_layer, m->n_head, m->n_kv_head,
            m->n_embd, m->intermediate_size, m->vocab_size, m->padded_vocab_size, m->max_seq_len,
            cfg->recompute_policy);
    if (cfg->logits_chunk) fprintf(out, ", logits in chunks of %d positions", cfg->logits_chunk);
    fputc('\n', out);
    fprintf(out, "batch %d x %d tokens, grad accum %d, %d steps | %s lr %g ", cfg->micro_batch,
            cfg->seq_len, cfg->grad_accum, cfg->steps, cfg->optimizer, cfg->lr);
    print_schedule(cfg, out);
    if (!strcmp(cfg->optimizer, "adamw"))
        fprintf(out, "betas %g,%g%s ", cfg->beta1, cfg->beta2,
                cfg->bias_correction ? "" : " without bias correction");
    fprintf(out, "wd %g clip %g | %s | seed %llu, %d threads\n", cfg->weight_decay, cfg->grad_clip,
            cfg->precision, (unsigned long long)cfg->seed, cfg->threads);
}
