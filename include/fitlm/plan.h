// plan.h: memory planning. Before anything is allocated, predicts the bytes
// per allocator tag (per rank) that a training run will need: exactly, from
// the same size lists the model, the optimizer and the data-parallel
// strategy (DDP, ZeRO 1-3) allocate by, for what the engine runs; from the
// published formulas (ZeRO, LOMO) for what it does not run (a raw parameter
// count, LoRA/NF4/LOMO/AdaLomo together with several ranks or a ZeRO
// stage), marked as such.
#ifndef FITLM_PLAN_H
#define FITLM_PLAN_H

#include <stddef.h>
#include <stdio.h>

#include "fitlm/config.h"
#include "fitlm/core.h"
#include "fitlm/device.h"
#include "fitlm/dtype.h"
#include "fitlm/model.h"
#include "fitlm/offload.h"
#include "fitlm/optim.h"
#include "fitlm/pipeline.h"

typedef struct {
    // The model: a model shape (GPT-2 or LLaMA) (fl_model_config_finish is applied to a copy),
    // or, when num_params > 0, a raw parameter count (e.g. 7e9) planned by
    // the model-state formulas alone (no activations: there is no shape).
    fl_model_config model;
    size_t num_params;
    size_t largest_tensor; // elements, for raw counts under LOMO/ZeRO (0 = unknown)
    fl_dtype dtype;        // of weights, gradients and activations
    fl_optimizer_config optim;
    int B, T;          // micro-batch and sequence length (B = 0: no activations)
    int threads;       // the attention workspace is one slice per thread
    size_t data_bytes; // what the data loaders and tokenizer keep (FL_MEM_OTHER), measured
    size_t data_peak;  // the peak of FL_MEM_OTHER while opening them (a tokenizer's files
                       // are read whole): the tag's peak is at least this
    int sample_tokens; // > 0: the run ends by sampling this many tokens
    int random_init;   // the weights are drawn from the seed (fl_params_init_bytes' buffer)
    // strategies
    int ranks;               // ranks (>= 1, what mpirun -np starts): t x d, d data-parallel
    int tensor_parallel;     // t: ranks of a tensor-parallel group (1: none); divides ranks
    int sequence_parallel;   // with t > 1: Megatron's sequence parallelism
    int zero_stage;          // 0 (plain data parallel), 1, 2 or 3, over the d replicas
    int rank;                // the world rank planned; its data-parallel index rank / t % d
                             // picks its shard: 0, the largest (fl_zero_shard)
    fl_zero_config zero;     // the other zero_optimization keys (buckets, stage 3's); .stage unused
    int whole_weights_first; // ZeRO-3: pretrained weights load whole on every rank before it
                             // keeps its shard (a random start or a resume allocates the shard
                             // only)
    fl_recompute recompute;  // activation checkpointing policy (planned exactly)
    int lomo; // formula-only LOMO (--lomo): no optimizer state, one tensor's gradient
    // LoRA (lora.r > 0; optim is then the adapters' optimizer, base_optim the
    // base's under lora.train_base) and NF4 base weights, planned exactly
    fl_lora_config lora;
    fl_optimizer_config base_optim;
    fl_quant_config quant;
    // NVMe offload of the optimizer (optim.paged): its buffers in RAM, its
    // files on disk
    fl_offload_config offload;
    // pipeline parallelism (pipeline.h), the config's: with p > 1 each stage
    // is planned as the executor runs it (ranks = t x p x d in Megatron's
    // order: `rank`'s stage is rank / (t d))
    int pipeline_parallel; // p: stages of contiguous blocks (1: none); t x p divides ranks
    int virtual_stages;    // v: chunks a pipeline rank holds (1; interleaved: 2 or more)
    int pipeline_schedule; // FL_PP_GPIPE, FL_PP_1F1B or FL_PP_INTERLEAVED
    int pipeline_split;    // FL_PP_SPLIT_UNIFORM, _PARAMETERS or _EXPLICIT: how stage_blocks came
    // blocks of each of the p x v virtual stages (fl_pp_config_split; chunk c
    // of pipeline rank r is virtual stage c p + r)
    int stage_blocks[FL_PP_MAX_VIRTUAL];
    int one_stage; // p > 1: 0 plans every stage (the figures the largest's); 1 only rank's
    // where the model and optimizer live (NULL: the cpu). On a device other
    // than the cpu the placement rule (docs/devices.md) puts tags params,
    // grads, master, optim, acts and workspace there; the model's workspace
    // sizes are the device's (fl_model_memory's dev)
    const fl_device *dev;
    // --mem-limit on a device other than the cpu: the device's budget, the
    // cap on its bytes below its available memory (0: none)
    size_t device_cap;
    // ZeRO-Offload on that device (offload_optimizer.device cpu or nvme,
    // one process, planned as stage 0 as it runs): the optimizer's bytes are
    // the host's (pinned with pin_memory), the copies of the weights and
    // gradients its pinned memory; the device's gradients are its ring
    // (fl_dev_offload_grad_bytes). Under LoRA the adapters' optimizer
    // (device_adapters.c): its bytes the host's, pinned copies of the
    // adapters and their gradients, which the device keeps too
    int dev_offload;
    // and ZeRO-3's weights offloaded from it (offload_param): the device
    // holds the resident units and the ring (fl_dev_weights_bytes); under
    // LoRA the frozen base's, from a pinned copy of it (with or without
    // dev_offload)
    int dev_weights;
} fl_plan_request;

// One pipeline stage's figures (pipeline rank `stage`, its chunks' blocks).
enum { FL_PLAN_MAX_STAGES = 256 };
typedef struct {
    int stage, blocks;
    size_t params;      // parameters it holds (a tied copy included)
    size_t acts, total; // bytes: tag acts (its activation sets), every tag
} fl_plan_stage;

typedef struct {
    size_t bytes[FL_MEM_NTAGS]; // per rank: each tag's peak
    // of each tag's peak, what set-up frees again (ZeRO-3: the whole 16-bit
    // weights every rank initialises before keeping its shard): bytes - freed
    // is what the tag holds from the first step on
    size_t freed[FL_MEM_NTAGS];
    size_t total;        // sum over tags: a bound on the peak of the sum
    size_t num_params;   // this rank's (under tensor parallelism: its slices)
    size_t model_states; // params + grads + master + optim
    // several ranks or a ZeRO stage planned exactly: the model states of the
    // ZeRO paper's formula for comparison (0: not computed)
    size_t formula_model_states;
    size_t disk; // per rank: bytes of NVMe offload files under disk_dir (0: none)
    char disk_dir[FL_PATH_MAX];
    // NVMe offload: what the master, the optimizer state and (offload_param)
    // the weights' shard would take in RAM instead (per tag), for "what would
    // fit without offload"
    size_t unpaged[FL_MEM_NTAGS];
    // pipeline parallelism: the stages planned (0: none), each one's
    // figures, and the stage whose figures bytes[] holds (of every stage:
    // the largest total, which decides whether the run fits)
    int stages, peak_stage;
    fl_plan_stage stage[FL_PLAN_MAX_STAGES];
    // per rank, of bytes[] and total: what lies on the request's device (all
    // 0 on the cpu); the rest is host memory
    size_t device[FL_MEM_NTAGS];
    size_t device_total;
    // of bytes[] of the tags a device holds: what lies in the host's
    // pageable memory (the host's transient workspace on any device: the
    // step's row sums of squares, the sampler's logits row and sort; the
    // offloaded optimizer's state without offload_optimizer.pin_memory),
    // the pinned bytes (pinned[]) apart
    size_t hosted[FL_MEM_NTAGS];
    // per rank, of the host's bytes: what is pinned (ZeRO-Offload on a device)
    size_t pinned[FL_MEM_NTAGS];
    size_t pinned_total;
    int runnable;   // 1: the engine runs this, and the figures are its exact sizes
    char note[320]; // "" or what the figures leave out / "not runnable yet: ..."
} fl_plan;

// A request with the engine's defaults: one rank, no ZeRO (zero_optimization's
// defaults), no strategies (pipeline: p 1, v 1, 1F1B, split by parameters;
// stage_blocks all 0, no shape being known).
void fl_plan_request_init(fl_plan_request *r);
// The request a `fitlm train` run with this finished config makes, with
// data_bytes = what its data loaders and tokenizer hold (measured after opening them);
// the pipeline's fields from cfg's (stage_blocks: fl_pp_config_split over cfg->model).
void fl_plan_request_from_config(fl_plan_request *r, const fl_train_config *cfg, size_t data_bytes);

// Per-tag bytes per rank. For runnable requests (a model shape, no --lomo;
// several ranks or a ZeRO stage only without LoRA, NF4 or a fused optimizer,
// which fl_dist_attach refuses) this is exactly what `fitlm train` (under
// mpirun -np ranks) allocates at its peak per tag on rank `rank`:
//   fl_model_memory(model with tp_size t, sequence_parallel, dtype, B, T, threads,
//                   recompute, unit_grads)                params, grads, acts, workspace, other
//     (unit_grads: ZeRO-2/3, or a fused optimizer; under tensor parallelism
//     the rank's slices, the whole table beside them, the vocabulary-parallel
//     loss's and the sequence-parallel buffers)
//   + fl_optimizer_memory_table(optim, dtype, table, [begin, end))
//                                                         master, optim, fp32 gradient sum
//     (table: the rank's (fl_model_rank_table); [begin, end): all of it, or
//     under ZeRO-1/2/3 the shard of its data-parallel index over d = ranks / t)
//   + fl_dist_memory(zero, table, ...)                    grads, comm, params (ZeRO-3)
//     (reduced fp32 gradient, buckets, ZeRO-3's shard, resident units and
//     gather ring; ZeRO-3 frees the whole weights after: freed[params])
//   + t > 1: the TP group's scratch, the largest of the model's calls
//     (fl_tp_scratch_bytes: all-reduces of B*T x n_embd in the dtype, or
//     under sequence parallelism reduce-scatters to B*T/t x n_embd and the
//     sums of one unit's norm gradients; the loss's B*T x 2 fp32 sums)  comm
//     and the group's table (fl_tp_ops_bytes)             other
//   + optim.paged: fl_offload_memory(offload, [begin, end)) offload (chunk buffers), other
//     (and the files: disk)
//   + data_bytes                                          other (loaders' tables, tokenizer)
//   (other: at least data_peak, its peak while the data and tokenizer were opened)
//   + 2 x grad_accum x B*T*sizeof(int)                    other (a step's inputs and targets)
//   + sample_tokens > 0: vocab_size * (4 + 8)             workspace (logits row, sampler's sort)
//                        (t > 1: the row is t x the vocabulary columns per rank, plus
//                        one rank's columns; with sequence parallelism T ints of context)
//                        (sample_tokens + 4) * sizeof(int) other (the sampled tokens)
// Pipeline parallelism (p > 1, ranks = t x p x d): the stage of pipeline
// rank s (fl_pp_stage_of over stage_blocks, its chunks' activation sets
// under the schedule for m = grad_accum micro-batches) is planned as above
// with the model, the optimizer and ZeRO-1/DDP (over the d ranks of its
// data-parallel group) on the stage's table, plus fl_pipeline_memory (the
// executor's send buffers, comm; its lists, other) and the pipeline group's
// table (fl_tp_ops_bytes(p), other). With one_stage only rank's stage;
// else every stage (into stage[], the largest total into bytes[]).
// Anything else is planned per rank from the model-state formulas (see
// plan.c) with runnable = 0 and a note "not runnable yet: ...". Dies naming
// the numbers when t does not divide ranks, and on tensor parallelism with
// LoRA, NF4 or AdaLomo, which `fitlm train` refuses.
void fl_plan_compute(const fl_plan_request *r, fl_plan *out);

// NVMe offload: the bytes of RAM the offloaded tensors would take without it.
size_t fl_plan_offloaded(const fl_plan *p);

// A table per tag (bytes, MiB/GiB), the total, bytes per parameter and
// whether the engine runs it.
void fl_plan_print(const fl_plan *p, FILE *out);

// Writes what would fit under `limit` bytes (per rank), computed by
// re-planning: the largest micro-batch (halving) that fits, bf16 instead of
// fp32, activation checkpointing, formula-only LOMO, and ZeRO-2/3 over the
// fewest ranks (each rank with `limit` bytes: one per machine); what the
// engine does not run is marked "(not runnable yet)". One line each.
void fl_plan_alternatives(const fl_plan_request *r, size_t limit, char *buf, size_t size);

// If p's host bytes (total - device_total) exceed limit: fl_die with the
// limit, the bytes, the three largest tags and the alternatives that would
// fit. Returns otherwise, and when limit is 0 (unknown, as
// fl_mem_available returns without /proc/meminfo). With NVMe offload, also
// dies unless its directory has p->disk bytes free. On a device, then the
// same for device_total against the device's available memory
// (fl_plan_device_limit).
void fl_plan_check_fits(const fl_plan_request *r, const fl_plan *p, size_t limit);
// The device's budget for r: its available memory, capped by device_cap
// (--mem-limit, a card's total memory: less what the device holds itself,
// its context) (0: none known, or the cpu).
size_t fl_plan_device_limit(const fl_plan_request *r);
// As fl_plan_alternatives, for the device's bytes under `limit`: a smaller
// micro-batch, bf16, activation checkpointing (what a device runs).
void fl_plan_device_alternatives(const fl_plan_request *r, size_t limit, char *buf, size_t size);

// Parses a parameter count: "124439808", "7e9", "7B", "1.5b", "350M", "64K".
// Dies naming `what` on bad input.
size_t fl_plan_parse_count(const char *text, const char *what);

#endif
