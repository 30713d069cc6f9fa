// pipeline.h: pipeline parallelism's schedules, their validator and the
// stage split (src/parallel/schedule.c, src/parallel/pipeline_split.c).
//
// p ranks each hold v chunks of the model; chunk c of rank r is virtual
// stage c*p + r of n = p*v (v = 1: the rank's stage). Virtual stage 0 also
// holds the embedding, virtual stage n-1 the final norm, the LM head and the
// loss. A step runs m micro-batches; each rank runs a list of actions:
// a forward or a backward of one micro-batch on one of its chunks.
//
//   gpipe        every forward, then every backward (m in flight)
//   1f1b         warm-up min(p - r - 1, m) forwards, steady one forward then
//                one backward, cool-down backwards (Megatron's
//                forward_backward_pipelining_without_interleaving): at most
//                min(p - r, m) in flight
//   interleaved  Megatron's interleaved 1F1B with v chunks a rank, micro-
//                batches in groups of p (m a multiple of p), each group
//                forward through chunk 0, then 1, ...; backward through
//                chunk v-1 first: warm-up 2(p - r - 1) + (v - 1)p forwards,
//                capped at m v
//
// A forward of virtual stage s > 0 waits for virtual stage s-1's output of
// the same micro-batch; a backward of s < n-1 for s+1's input gradient.
// Sends never block (they are non-blocking and waited on later), so a list
// can only deadlock by waiting for a receive that is never sent.
#ifndef FITLM_PIPELINE_H
#define FITLM_PIPELINE_H

#include <stddef.h>

enum { FL_PP_GPIPE, FL_PP_1F1B, FL_PP_INTERLEAVED };
enum { FL_PP_FORWARD, FL_PP_BACKWARD };

typedef struct {
    int kind;  // FL_PP_FORWARD or FL_PP_BACKWARD
    int micro; // 0..m-1
    int chunk; // 0..v-1: virtual stage chunk * p + rank
} fl_pp_action;

// "gpipe", "1f1b", "interleaved" -> FL_PP_*; -1 for another name.
int fl_pp_schedule_kind(const char *name);
const char *fl_pp_schedule_name(int kind);

// 0 when (kind, p, m, v) is a schedule this engine runs; else -1 with the
// reason (naming the numbers) in why: p, m, v >= 1; gpipe and 1f1b take
// v = 1; interleaved takes v >= 2 and m a multiple of p.
int fl_pp_schedule_check(int kind, int p, int m, int v, char *why, size_t n);
// Rank `rank`'s 2*m*v actions in the order it runs them, into out (room for
// 2*m*v); returns 2*m*v. Dies naming the numbers unless fl_pp_schedule_check
// accepts them and 0 <= rank < p. Each chunk's forwards, and its backwards,
// take the micro-batches in increasing order (gradients accumulate in the
// order one process sums them).
int fl_pp_schedule(int kind, int p, int m, int v, int rank, fl_pp_action *out);
// Runs every rank's list against the others' (an action starts once what it
// receives has been sent) and checks: each (micro-batch, chunk) forward and
// backward once on every rank, each backward after its forward, the
// micro-batches in flight on a rank (forwards without their backward yet)
// never above fl_pp_in_flight_bound, and every list runs to its end (no
// deadlock). 0 when all hold, else -1 with the first failure in why, naming
// the schedule, p, m, v, the rank and the action (a deadlock: every stuck
// rank, its action and what it waits for).
int fl_pp_validate(int kind, int p, int m, int v, char *why, size_t n);
// The same checks on given lists: lists[r] with counts[r] actions for rank
// r = 0..p-1, against kind's in-flight bound. fl_pp_validate runs it on
// fl_pp_schedule's lists.
int fl_pp_validate_lists(int kind, int p, int m, int v, const fl_pp_action *const *lists,
                         const int *counts, char *why, size_t n);
// The schedule's bound on micro-batches in flight on `rank`, all chunks
// together: gpipe m v; 1f1b min(p - rank, m); interleaved Megatron's
// warm-up + 1, capped at m v.
int fl_pp_in_flight_bound(int kind, int p, int m, int v, int rank);
// The most micro-batches in flight on chunk `chunk` of `rank` at once over
// its list: the activation sets that chunk needs.
int fl_pp_chunk_in_flight(int kind, int p, int m, int v, int rank, int chunk);

// ----------------------------------------------------------------------------
// stage split: L blocks over n = p*v virtual stages, each a contiguous,
// non-empty run of blocks in order.

enum { FL_PP_SPLIT_UNIFORM, FL_PP_SPLIT_PARAMETERS, FL_PP_SPLIT_EXPLICIT };

// Parses "uniform", "parameters" or a comma-separated list of n block
// counts ("4,6,6,4"); dies naming `what` (the option) on anything else.
// counts receives the list (room for FL_PP_MAX_VIRTUAL), *n_counts its length
// (0 for the named methods).
enum { FL_PP_MAX_VIRTUAL = 1024 };
int fl_pp_split_parse(const char *text, const char *what, int *counts, int *n_counts);
// Blocks per virtual stage, into count[0..n):
//   uniform     DeepSpeed's partition_uniform: L / n each, the first L % n
//               stages one more;
//   parameters  DeepSpeed's partition_method "parameters": contiguous runs
//               minimising the largest stage's parameters, virtual stage 0
//               weighing embed_params more and stage n-1 head_params more
//               (each block block_params, above 0 unless n is 1); ties go
//               the earlier stages' way (each block in turn to the stage
//               lightest with it, the earliest of equals: 10 alike blocks
//               over 4 stages are 3,3,2,2, as uniform);
//   explicit    explicit_counts as given (n of them: a parsed list's length
//               against n is the caller's check, fl_pp_config_split's).
// Dies naming the numbers and the option (pipeline_parallel.split) when
// L < n (a virtual stage without a block), an explicit entry is below 1, or
// they do not sum to L (Megatron#1304 built 28 of 30 layers without a word);
// then checks the result with fl_pp_split_check.
void fl_pp_split(int method, int L, int n, const int *explicit_counts, size_t block_params,
                 size_t embed_params, size_t head_params, int *count);
// Dies unless count[0..n) covers blocks 0..L-1 each exactly once (every
// entry >= 1, sum L), naming the first block left out or the excess.
void fl_pp_split_check(int L, int n, const int *count);

// ----------------------------------------------------------------------------
// the executor (src/parallel/pipeline.c): a model holding one stage
// (fl_model_init_tp with a fl_pp_stage) runs its rank's list of a step over
// the pipeline group, point to point, non-blocking.
//
// Tied embeddings: the last stage holds a copy of the token embedding for
// its LM head (FL_PARAM_TIED_COPY), which computes no gradient of its own:
// it sends the head's output gradient and input to stage 0, which computes
// the weight's gradient there, added to the embedding's in one process's
// order (so a pipeline's fp32 result is one process's, bitwise), and after
// each step stage 0 sends the updated rows back into the copy.

#include "fitlm/comm.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"

// The stage of pipeline rank `rank`: virtual stage i holds counts[i] blocks
// (i < p v, fl_pp_split), chunk c = virtual stage c p + rank, each chunk
// with the activation sets the schedule keeps in flight on it
// (fl_pp_chunk_in_flight) for m micro-batches.
void fl_pp_stage_of(fl_pp_stage *s, int kind, int p, int v, int m, int rank, const int *counts);

typedef struct fl_pipeline fl_pipeline;
// Attaches the executor to a model of one stage and its optimizer (over the
// stage's rows; data parallelism's sync, if any, already attached), over the
// pipeline group g (group rank = stage), for steps of m micro-batches of
// B x T under schedule `kind`. Copies stage 0's token embedding into the
// last stage's copy (a collective over g).
fl_pipeline *fl_pipeline_attach(fl_model *m, fl_optimizer *o, const fl_comm_group *g, int kind,
                                int m_micro, int B, int T);
// One step: the rank's list over the m micro-batches (inputs and targets
// (m, B, T), the same on every stage), then the optimizer's step (its norm
// and fp16 overflow over every stage); the loss, the last stage's, is every
// rank's.
fl_train_result fl_pipeline_step(fl_pipeline *pl, const int *inputs, const int *targets, float lr);
// A forward of one batch through the stages (evaluation): the mean loss,
// and its target count in *n_targets, on every rank.
float fl_pipeline_forward(fl_pipeline *pl, const int *tokens, const int *targets, int *n_targets);
// fl_model_generate through the stages: every rank gets every token.
void fl_pipeline_generate(fl_pipeline *pl, int *tokens, int n_prompt, int n_new, float temperature,
                          int top_k, fl_rng *rng, void (*on_token)(int token, void *ctx),
                          void *ctx);
// Bytes per tag the executor allocates on pipeline rank `rank` (comm: its
// send buffers, each micro-batch's input gradient per chunk, and on the
// last stage of a tied model the LM head's output gradient and input;
// other: itself, its list of actions and its records per micro-batch and
// per set).
void fl_pipeline_memory(const fl_model_config *c, fl_dtype dt, const fl_pp_stage *s, int m_micro,
                        int B, int T, size_t bytes[FL_MEM_NTAGS]);
void fl_pipeline_free(fl_pipeline *pl);

#endif
