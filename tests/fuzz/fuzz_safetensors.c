// fuzz_safetensors.c: libFuzzer target for the safetensors parser. Any
// input must be parsed or refused with a message; an accepted one must keep
// every tensor inside the data section.
#include "fitlm/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fl_safetensors st;
    char err[512] = {0};
    int rc = fl_safetensors_parse(data, size, &st, err, sizeof err);
    if (rc != 0 && !err[0]) __builtin_trap();
    for (int i = 0; rc == 0 && i < st.count; i++)
        if (st.tensors[i].begin > st.tensors[i].end || st.tensors[i].end > st.data_size)
            __builtin_trap();
    fl_safetensors_free(&st);
    return 0;
}
