// fuzz_ckpt.c: libFuzzer target for the checkpoint parser: the input is a
// whole checkpoint file image (prefix, JSON header, tensors).
#include "fitlm/io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[512] = {0};
    if (fl_ckpt_parse(data, size, err, sizeof err) != 0 && !err[0]) __builtin_trap();
    return 0;
}
