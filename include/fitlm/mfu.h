// mfu.h: model FLOPs utilisation for the training metrics: the model's
// FLOPs per trained token, and the peak they are quoted against.
#ifndef FITLM_MFU_H
#define FITLM_MFU_H

#include <stddef.h>

#include "fitlm/model.h"

// Forward + backward FLOPs of one trained token, llm.c's and nanoGPT's
// estimate (PaLM, appendix B): 6 N + 12 L C T, N every parameter (the padded
// vocabulary included), the last term attention's scores and weighted sums
// over a context of T. A frozen base (LoRA without a base optimizer) computes
// no weight gradients: 4 N for it, 6 N for the adapters. Recomputation is
// not counted: that is MFU, not hardware utilisation.
double fl_mfu_flops_per_token(const fl_model *m, int T, int base_frozen);

// The peak FLOP/s of `threads` threads on the arithmetic the GEMMs of this
// precision run on, measured now (~0.1 s) with independent register-resident
// multiply-add chains (src/core/fma_peak.h, as bench/peak_fma measures it):
// bf16 on AMX-BF16 tiles or the AVX512_BF16 dot product where the CPU has
// them, else (and for fp32 and fp16) fp32 FMA. `how` receives a description
// ("fp32 FMA (avx512), 2 threads, measured at the start").
double fl_mfu_peak(fl_dtype dtype, int threads, char *how, size_t how_size);

#endif
