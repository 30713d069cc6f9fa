// dist.h: data parallelism over the communicator (comm.h): DDP (ZeRO stage
// 0) and ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020, DeepSpeed's
// semantics and key names). Every rank holds the same model and reads its
// own data windows; a strategy plugs into the model's hooks (pre_unit,
// grad_ready, unit gradient binding) and into the optimizer's step
// (fl_optim_sync), and nothing else changes: fl_train_step runs it.
//
// The flat parameter buffer (numel elements) is split into contiguous
// shards, rank r owning [r*S, min((r+1)*S, numel)) with S = ceil(numel/N);
// a shard is where that rank's fp32 master weights, optimizer state and
// reduced gradient live (stage >= 1), and, under stage 3, the only part of
// the 16-bit weights it keeps between uses. Under DDP every rank owns the
// whole buffer.
//
//   stage 0  gradients all-reduced in buckets during the last micro-batch's
//            backward; every rank runs the whole optimizer
//   stage 1  the last micro-batch's gradients reduce-scattered in buckets to
//            their owners; each rank updates its shard; the new 16-bit
//            weights all-gathered
//   stage 2  as 1, but no whole gradient: each unit's gradient is computed in
//            scratch and reduce-scattered (every micro-batch) into the
//            owners' fp32 sums
//   stage 3  as 2, and the 16-bit weights are sharded too: a unit's weights
//            are all-gathered before its forward and again before its
//            backward (the next unit prefetched), then released
//
// Gradients are reduced in fp32 whatever the model's dtype.
#ifndef FITLM_DIST_H
#define FITLM_DIST_H

#include "fitlm/comm.h"
#include "fitlm/config.h"
#include "fitlm/model.h"
#include "fitlm/offload.h"
#include "fitlm/optim.h"

// The shard of `rank` among `world` ranks over numel elements.
void fl_zero_shard(size_t numel, int world, int rank, size_t *begin, size_t *end);
// The range `rank` owns under cfg: everything under DDP (stage 0); else its
// shard, which with cfg->whole_rows ends at row boundaries (the first row
// starting at or after each even split point).
void fl_dist_shard(const fl_zero_config *cfg, const fl_param_table *t, int world, int rank,
                   size_t *begin, size_t *end);

typedef struct fl_dist fl_dist;

// DeepSpeed's batch rule (src/parallel/parallel_config.c): any two of
// train_micro_batch_size_per_gpu, gradient_accumulation_steps and
// train_batch_size set the third over the data-parallel size d = world /
// (tensor_parallel x pipeline_parallel) (the world: cfg->ranks, or this
// job's), as Megatron's global_batch = micro x m x d; dies when t x p does
// not divide the world.
void fl_parallel_check_batch(fl_train_config *cfg);
// Refuses a tensor-parallel layout the model or the job cannot take, naming
// the numbers: world % t (and the data-parallel size d = world / t), n_head % t,
// n_kv_head % t (when t % n_kv_head == 0 with n_kv_head < t: refused, naming both
// numbers, as torchtitan refuses Megatron's gathered-QKV case), intermediate_size % t
// (fl_model_tp_check),
// sequence_parallel with t == 1, and under sequence parallelism
// micro_batch * seq_len % t. world: cfg->ranks if set (fitlm plan), else fl_comm_size().
// model: a finished shape (fl_model_config_finish: n_kv_head, intermediate_size).
void fl_tp_check(const fl_train_config *cfg, const fl_model_config *model);
// Megatron's decoder_first/last_pipeline_num_layers (cfg->pp_first_layers,
// pp_last_layers) into pipeline_split's explicit list of p x v entries: the
// first and last stage's blocks as given, the rest even over the middle
// stages, each stage's split evenly over its v chunks (Megatron's rules, each
// refused naming the numbers); dies when --pipeline-split is given too and
// says otherwise. Needs the finished model (cfg->model.n_layer).
void fl_pp_finish_split(fl_train_config *cfg);
// Refuses a pipeline-parallel layout before anything is allocated, naming
// the numbers and the option: world % (t x p) (world: cfg->ranks if set,
// else fl_comm_size()); virtual_stages above 1 without the interleaved
// schedule, interleaved with fewer than 2; fl_pp_schedule_check of (the
// schedule, p, m = gradient_accumulation_steps, v); a split that cannot
// work (fl_pp_config_split). With p > 1: ZeRO stages 2 and 3 (as DeepSpeed
// refuses them), LoRA and NF4 (as tensor parallelism refuses them), LOMO,
// AdaLomo and optimizer_in_backward (not yet). After the LoRA and NF4
// sections' checks (cfg->quant.enabled).
void fl_pp_check(const fl_train_config *cfg, const fl_model_config *model);
// The blocks of each of the n = p x v virtual stages (count: room for n),
// by cfg->pipeline_split over model's blocks: fl_pp_split with the model's
// parameters per block, in the embedding (virtual stage 0) and in the
// final norm and head (stage n - 1; with tied embeddings also the token
// embedding's copy that stage holds). Dies as fl_pp_split.
void fl_pp_config_split(const fl_train_config *cfg, const fl_model_config *model, int *count);
// The zero_optimization section: overlap_comm's default by stage, stage 3's
// keys only at stage 3, and LoRA or NF4 refused with data parallelism.
void fl_parallel_check_config(fl_train_config *cfg);
// Whether a run on the cpu over `world` data-parallel ranks goes through
// the data-parallel engine (fl_dist_attach): several ranks, or a ZeRO stage
// on one rank training the whole model. LoRA adapters on one rank take the
// plain path at any stage, which partitions nothing there.
int fl_dist_engine(const fl_train_config *cfg, int world);

// Fills what the strategy takes from the optimizer (cfg->fused_units,
// cfg->whole_rows); fl_config_finish and the planner call it.
void fl_dist_derive(fl_zero_config *cfg, const fl_optimizer_config *o);

// Whether a run needs a strategy: more than one rank, or a ZeRO stage.
int fl_dist_wanted(const fl_zero_config *cfg);
// Whether a model for this stage keeps one unit's gradients at a time
// (fl_model_alloc_acts' unit_grads): stages 2 and 3, and a fused optimizer
// (cfg->fused_units) at any stage.
int fl_dist_unit_grads(const fl_zero_config *cfg);

// Attaches the strategy of cfg->stage over the data-parallel group dp (the
// world, fl_comm_world(), without tensor or pipeline parallelism; ranks
// numbered within it, and every collective of the strategy over it) to a
// model (fl_model_alloc_acts done, with unit_grads as
// fl_dist_unit_grads says) and its optimizer (fl_optimizer_init_range over
// this rank's shard, fl_dist_range; the whole buffer under DDP). Every rank
// must hold the same weights (the same seed or file). Stage 3 then keeps
// only this rank's shard of the weights. Dies naming the key on a config it
// cannot honour. cfg->offload_params (stage 3): the shard goes to `store`,
// the optimizer's NVMe offload with paged weights (offload.h), instead.
fl_dist *fl_dist_attach(fl_model *m, fl_optimizer *o, const fl_zero_config *cfg, fl_offload *store,
                        const fl_comm_group *dp);
void fl_dist_free(fl_dist *d);
// The range of the flat buffer this rank's optimizer covers (fl_dist_shard
// of this rank's place in the data-parallel group dp).
void fl_dist_range(const fl_zero_config *cfg, const fl_param_table *t, const fl_comm_group *dp,
                   size_t *begin, size_t *end);

// Bytes per tag that fl_dist_attach allocates on `rank` for a model of
// table t (n_layer blocks, dtype dt) whose optimizer has a whole fp32
// gradient sum (accum_buffer: 16-bit weights with accumulation, stages 0/1)
// or not. Stage 3 then frees the whole weights: *params_freed bytes, which
// count in the peak but not after.
void fl_dist_memory(const fl_zero_config *cfg, const fl_param_table *t, int n_layer, fl_dtype dt,
                    int accum_buffer, int world, int rank, size_t bytes[FL_MEM_NTAGS],
                    size_t *params_freed);

// Stage 3's units for a table: unit ui's range [lo, hi) (ui = unit + 1),
// whether it stays gathered for the step (resident: the embedding and the
// units under the persistence thresholds), the ring buffers' size (the
// largest other unit) and the prefetch depth, by the stage3_* keys
// (stage3_max_live_parameters caps the prefetch, as DeepSpeed's: below the
// residents and one block there is none). Also the ring of weight offload
// on a device (device_weights.c).
typedef struct {
    int n_units;
    size_t *lo, *hi;
    int *resident;
    size_t resident_total, ring_size;
    int depth, n_ring;
} fl_stage3_layout;
void fl_stage3_layout_init(fl_stage3_layout *y, const fl_param_table *t, int L,
                           const fl_zero_config *c);
void fl_stage3_layout_free(fl_stage3_layout *y);

// Stage 3: the weights of this rank's shard ([begin, end) of the flat
// buffer, fl_dist_range) and whole rows for checkpoints and exports:
// fl_dist_gather_row fills `out` (host memory: row numel values of the
// model's dtype) on every rank (a collective: every rank calls it for the
// same row).
// Other stages: the model's own buffer.
void *fl_dist_params_shard(fl_dist *d);
void fl_dist_gather_row(fl_dist *d, int row, void *out);

#endif
