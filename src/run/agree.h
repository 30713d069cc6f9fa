// agree.h: the check, before a run's first collective, that its ranks run
// the same thing (src/run/agree.c), private to src/run.
#ifndef FITLM_RUN_AGREE_H
#define FITLM_RUN_AGREE_H

#include "fitlm/comm.h"
#include "fitlm/run.h"

// The ranks of g agree on the build, the resolved settings and the step a
// resume starts at, then on the parameter table; otherwise rank 0 stops the
// job naming the first differing key, both values and both ranks.
void run_agree(const fl_run *r, const fl_comm_group *g);
// Then, once the weights are loaded (and restored), on their contents where
// every rank holds them whole (no ZeRO-3 shard): the same path may hold other
// files on another machine, which would train apart without a word
// (PyTorch's DDP and DeepSpeed broadcast rank 0's instead).
void run_agree_weights(const fl_run *r, const fl_comm_group *g);

#endif
