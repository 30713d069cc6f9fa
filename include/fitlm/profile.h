// profile.h: where the time of a training step goes, op by op. The thread
// that orchestrates the step times each kernel call around it (the calls are
// sequential at that level; each runs its own OpenMP region), accumulating
// seconds, calls and GEMM FLOPs per op slot and pass. Disabled, a timed call
// costs one branch on a global flag. Not thread-safe: call from one thread.
#ifndef FITLM_PROFILE_H
#define FITLM_PROFILE_H

#include <stdio.h>

#include "fitlm/core.h"

typedef enum {
    FL_OP_ENCODER,
    FL_OP_LAYERNORM, // ln_1, ln_2 and ln_f
    FL_OP_RMSNORM,   // LLaMA's norms
    FL_OP_MM_QKV,    // attention: the fused QKV GEMM
    FL_OP_MM_ATTPROJ,
    FL_OP_MM_FC, // MLP
    FL_OP_MM_FCPROJ,
    FL_OP_MM_LMHEAD,
    FL_OP_LORA,    // the adapters' GEMMs and dropout
    FL_OP_DEQUANT, // NF4 weights dequantised for a GEMM
    FL_OP_ROPE,    // rotary position embedding of q and k
    FL_OP_ATTENTION,
    FL_OP_GELU,
    FL_OP_SWIGLU,   // LLaMA's MLP gate
    FL_OP_RESIDUAL, // forward only: its backward passes the gradient through
    FL_OP_XENT,     // softmax + cross-entropy
    FL_OP_ZERO_GRAD,
    FL_OP_ZERO_ACTS, // the residual stream's gradient set to 0 before kernels add into it
    FL_OP_OPTIMIZER, // micro-batch accumulation, norm, clip, update
    FL_OP_LOADER,
    FL_OP_COMM, // data and tensor parallelism: staging, starting and waiting for collectives
                // (and ZeRO-3's reads of weights offloaded to NVMe)
    FL_OP_COUNT
} fl_op;

typedef enum {
    FL_FWD,
    FL_BWD,
    FL_STEP, // outside the model's passes: data, gradients' zeroing, optimizer
    FL_NPASSES
} fl_pass;

typedef struct {
    double seconds[FL_NPASSES];
    double flops[FL_NPASSES]; // GEMMs and attention only
    double bytes[FL_NPASSES]; // the memory-bound kernels: the least bytes they move
    long long calls[FL_NPASSES];
} fl_op_stats;

extern int fl_profile_on; // read by FL_PROFILE; set it with fl_profile_enable

void fl_profile_enable(int on);
void fl_profile_reset(void); // clears the slots and the step count
void fl_profile_add(fl_op op, fl_pass pass, double seconds, double flops, double bytes);
// Counts one profiled step of `seconds` (the whole step, so that what the
// slots do not cover shows as "other").
void fl_profile_step(double seconds);
int fl_profile_steps(void);
const fl_op_stats *fl_profile_stats(fl_op op);
const char *fl_op_name(fl_op op);

// A device that runs its work behind the host's back (a GPU: a kernel call
// returns when it is queued) times the slots on its own clock: mark() notes
// a point in its work's order, seconds(a, b) is the time between two marks
// once the work has reached b (and releases both). The marks of a step are
// read at fl_profile_step (after the step, which waited for its results).
typedef struct {
    void *(*mark)(void *ctx);
    double (*seconds)(void *ctx, void *a, void *b);
    void *ctx;
} fl_profile_clock;

// The clock the slots are timed on from now (NULL: the host's, fl_now).
void fl_profile_use_clock(const fl_profile_clock *clock);
// FL_PROFILE's halves: a mark before the statement (NULL on the host's
// clock) and the slot's time from it and t0 (fl_now before it).
void *fl_profile_mark(void);
void fl_profile_end(fl_op op, fl_pass pass, void *mark, double t0, double flops, double bytes);

// Runs the statement(s), timed into slot `op` of `pass` when profiling is on;
// `flops` is evaluated only then.
#define FL_PROFILE(op, pass, flops, ...) FL_PROFILE_IO(op, pass, flops, 0.0, __VA_ARGS__)
// The same with the least bytes the statement reads and writes (a
// memory-bound kernel's floor is them at the memory's bandwidth).
#define FL_PROFILE_IO(op, pass, flops, bytes, ...)                                                 \
    do {                                                                                           \
        if (!fl_profile_on) {                                                                      \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            double fl_profile_t0_ = fl_now();                                                      \
            void *fl_profile_mark_ = fl_profile_mark();                                            \
            __VA_ARGS__;                                                                           \
            fl_profile_end(op, pass, fl_profile_mark_, fl_profile_t0_, flops, bytes);              \
        }                                                                                          \
    } while (0)

// One row of the table, per profiled step.
typedef struct {
    const char *name;
    double calls;                    // all passes
    double fwd_ms, bwd_ms, total_ms; // total = forward + backward + outside them
    double share;                    // percent of the step time
    double fwd_gflops, bwd_gflops;   // achieved: GEMMs' and attention's products (else 0)
    double gbytes;                   // the least GB the op moves (memory-bound kernels, else 0)
} fl_profile_row;

#define FL_PROFILE_ROWS (FL_OP_COUNT + 1) // the slots and "other"

// Fills rows[FL_PROFILE_ROWS]: the slots that were called and "other" (step
// time minus the slots), by total time, largest first; returns the count.
int fl_profile_rows(fl_profile_row *rows);
// The rows as a markdown table with a total row (nothing profiled: one line).
void fl_profile_print(FILE *out);

#endif
