// mfu.c: the FLOP count and the measured peak behind the "mfu" of
// metrics.jsonl (see mfu.h). The peak is measured, not looked up: a CPU's
// sustained multiply-add rate depends on its frequency under load, which no
// table of models knows.
#include <stdio.h>

#include "../core/fma_peak.h"
#include "fitlm/kernels.h"
#include "fitlm/mfu.h"

double fl_mfu_flops_per_token(const fl_model *m, int T, int base_frozen) {
    double N = (double)m->table.numel, Nl = m->lora.cfg.r ? (double)m->lora.table.numel : 0.0;
    double L = m->config.n_layer, C = m->config.n_embd;
    return (base_frozen ? 4.0 : 6.0) * N + 6.0 * Nl + 12.0 * L * C * T;
}

double fl_mfu_peak(fl_dtype dtype, int threads, char *how, size_t how_size) {
    // what the GEMMs run on: bf16 through oneDNN on AMX tiles or vdpbf16ps
    // where matmul takes them (src/kernels/matmul.c); otherwise, and for
    // fp32 and fp16 (converted to fp32), fp32 FMAs
    fma_peak_isa isa = fma_peak_pick_isa();
    int native = matmul_native_bf16(dtype);
    if (native && fma_peak_has(FMA_PEAK_AMX_BF16))
        isa = FMA_PEAK_AMX_BF16;
    else if (native && fma_peak_has(FMA_PEAK_BF16_DP))
        isa = FMA_PEAK_BF16_DP;
    // one short measurement after the calibration (which also warms up)
    double gflops = fma_peak_gflops(isa, threads, 0.03, 1, NULL, NULL);
    snprintf(how, how_size, "%s (%s), %d thread%s, measured at the start",
             isa == FMA_PEAK_AMX_BF16  ? "bf16 tiles"
             : isa == FMA_PEAK_BF16_DP ? "bf16 dot product"
                                       : "fp32 FMA",
             fma_peak_isa_name(isa), threads, threads == 1 ? "" : "s");
    return gflops * 1e9;
}
