// eval.h: a model's loss over whole token data, every target counted once.
//
// A stream (a version 1 shard) is cut into windows of T+1 tokens with
// stride T (window k: tokens kT .. kT+T; inputs the first T, targets the
// last T), as the training loader cuts it; the shard's last window holds
// what is left (fewer than T targets), its missing positions padded with
// target -1. So every token of a stream but its first is a target exactly
// once, seen with the tokens since its window's start as context; a stream
// of fewer than two tokens has none. A version 2 shard is laid out in
// windows of T+1 already (T must be its layout's) and its mask decides
// which tokens are targets. Targets of -1 (padding, masked) are not
// counted. Windows are taken in data order, B at a time, and the per-token
// losses are summed in double in that order: the result is the same for
// any batch size and thread count.
#ifndef FITLM_EVAL_H
#define FITLM_EVAL_H

#include <stdint.h>

#include "fitlm/data.h"
#include "fitlm/model.h"

typedef struct {
    double nats;      // summed cross-entropy (natural log) of the counted targets
    uint64_t tokens;  // targets counted (not -1)
    uint64_t windows; // windows run
} fl_eval_sum;

// Windows of T+1 tokens (stride T) that cover the shards, tails included.
uint64_t fl_eval_windows(const fl_shard *shards, int n_shards, int T);

// Runs the model (activations allocated for at least B x T) over every
// window of the shards, B windows per forward; progress (may be NULL) is
// called after each forward with the windows done and their total.
void fl_eval_shards(fl_model *m, const fl_shard *shards, int n_shards, int B, int T,
                    fl_eval_sum *out, void (*progress)(void *ctx, uint64_t done, uint64_t total),
                    void *ctx);

#endif
