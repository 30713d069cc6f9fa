// train_log.h: what `fitlm train` records and prints of a run's steps
// (src/cli/train_log.c): log.txt and metrics.jsonl in OUT (fitlm/metrics.h),
// the step's line or progress bar, and the reports after the last step.
#ifndef FITLM_CLI_TRAIN_LOG_H
#define FITLM_CLI_TRAIN_LOG_H

#include "fitlm/comm.h"
#include "fitlm/metrics.h"
#include "fitlm/run.h"

#define RECENT 16 // step times the ETA takes the median of

typedef struct {
    fl_line_log text, json;
    double tokens; // trained on so far
    double tokens_per_step, flops_per_token, peak_flops;
    int tty;                  // stdout is a terminal: a progress bar rewritten in place
    double recent_ms[RECENT]; // the last steps' times
    int skipped, nonfinite;   // fp16 overflows skipped; non-finite steps skipped
    long spikes;              // steps the spike guard skipped (a resumed run's too)
    fl_comm_stats comm;       // the training steps' traffic (not evaluation's)
    double step_seconds;      // summed over the steps run
    // ZeRO-Offload on a device: the offload's timed waits as last read, and
    // after the first timed step (its one-time set-up left out of the summary)
    fl_dev_offload_waits waits, waits_first;
    // on a device: the host's waits behind queued work, over the steps
    // after the first (a one-time set-up's left out, as the offload's)
    long host_waits, waits_steps;
} run_log;

// Opens the run's records (rank 0 writes them; a resume keeps those up to
// its step) and writes the run's MFU record.
void run_log_open(run_log *log, const fl_run *run);
void run_log_eval(run_log *log, int step, float val_loss);
// The step's line (or progress bar), log.txt's line and metrics.jsonl's record.
// host_waits: the step's waits behind queued work on a device (-1: not counted).
void run_log_step(run_log *log, const fl_run *run, int step, float lr, const fl_train_result *r,
                  double ms, long host_waits);
void run_log_close(run_log *log);
// Adds the collectives' traffic since `before` (a step's) to log->comm.
void run_log_comm(run_log *log, const fl_comm_stats *before);
// Dies on a diverged step (non-finite, not an fp16 overflow the scaler
// skipped), unless --skip-nonfinite still allows skipping it.
void run_check_finite(run_log *log, const fl_train_config *cfg, int step, const fl_train_result *r);
// Reports a step the spike guard skipped; dies after skip_update_max_in_row
// of them in a row.
void run_check_spike(run_log *log, const fl_train_config *cfg, int step, const fl_train_result *r);
// Every rank's memory report, in rank order (ranks beyond the first print
// nothing on stdout: theirs go to stderr).
void rank_memory_report(void);
// The communication and NVMe offload traffic per step (io0: the offload's
// counters before the first step).
// ZeRO-Offload on a device: the share of the steps the device waited on the
// host (after the first step, when there were more).
void run_print_traffic(const run_log *log, const fl_run *run, const fl_offload_stats *io0,
                       int steps_run);

#endif
