// fuzz_llmc_header.c: libFuzzer target for the llm.c model-file header
// check, with the input's own size as the file size and, so that the size
// check can pass too, with a file size taken from the 8 bytes after the
// header.
#include "fitlm/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(const uint8_t *data, size_t size, uint64_t file_size) {
    fl_llmc_header h;
    char err[512] = {0};
    if (fl_llmc_header_parse(data, size, file_size, &h, err, sizeof err) == 0) {
        if (h.V > h.Vp || h.C % h.NH != 0 || h.num_params == 0) __builtin_trap();
    } else if (!err[0]) {
        __builtin_trap();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check(data, size, size);
    if (size >= FL_LLMC_HEADER_BYTES + 8) {
        uint64_t fs = 0;
        for (int i = 0; i < 8; i++) fs |= (uint64_t)data[FL_LLMC_HEADER_BYTES + i] << (8 * i);
        check(data, FL_LLMC_HEADER_BYTES, fs);
    }
    return 0;
}
