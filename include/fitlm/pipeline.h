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
//                batches in groups of p (m a multiple of p): warm-up
//                2(p - r - 1) + (v - 1)p forwards, capped at m v
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
// 2*m*v). Dies naming the numbers unless fl_pp_schedule_check accepts them.
int fl_pp_schedule(int kind, int p, int m, int v, int rank, fl_pp_action *out);
// Runs every rank's list against the others' (an action starts once what it
// receives has been sent) and checks: each (micro-batch, chunk) forward and
// backward once on every rank, each backward after its forward, the
// micro-batches in flight on a rank (forwards without their backward yet)
// never above fl_pp_in_flight_bound, and every list runs to its end (no
// deadlock). 0 when all hold, else -1 with the first failure in why.
int fl_pp_validate(int kind, int p, int m, int v, char *why, size_t n);
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

#endif
