// llmc_header.c: validation of llm.c model-file headers, apart from the
// loader so the fuzz target can link it without the model.
#include "fitlm/safetensors.h"

#include <stdio.h>

static int32_t get_i32(const uint8_t *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

int fl_llmc_header_parse(const uint8_t *buf, size_t n, uint64_t file_size, fl_llmc_header *out,
                         char *err, size_t errlen) {
    if (n < FL_LLMC_HEADER_BYTES || file_size < FL_LLMC_HEADER_BYTES)
        return fl_errorf(err, errlen, "%llu bytes: too short for the %d-byte header",
                         (unsigned long long)(n < file_size ? n : file_size), FL_LLMC_HEADER_BYTES);
    int32_t h[8];
    for (int i = 0; i < 8; i++) h[i] = get_i32(buf + 4 * i);
    if (h[0] != FL_LLMC_MAGIC)
        return fl_errorf(err, errlen, "bad magic %d (want %d): not an llm.c model file", h[0],
                         FL_LLMC_MAGIC);
    if (h[1] != 3 && h[1] != 5)
        return fl_errorf(err, errlen, "version %d is not supported (3: fp32, 5: bf16)", h[1]);
    const struct {
        const char *name;
        int32_t value, max;
    } fields[] = {{"max_seq_len", h[2], 1 << 20}, {"vocab_size", h[3], 1 << 30},
                  {"num_layers", h[4], 1024},     {"num_heads", h[5], 1 << 16},
                  {"channels", h[6], 1 << 16},    {"padded_vocab_size", h[7], INT32_MAX}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].value < 1 || fields[i].value > fields[i].max)
            return fl_errorf(err, errlen, "%s %d is outside [1, %d]", fields[i].name,
                             fields[i].value, fields[i].max);
    if (h[6] % h[5] != 0)
        return fl_errorf(err, errlen, "channels %d not divisible by num_heads %d", h[6], h[5]);
    if (h[7] < h[3])
        return fl_errorf(err, errlen, "padded_vocab_size %d is smaller than vocab_size %d", h[7],
                         h[3]);
    *out = (fl_llmc_header){.version = h[1],
                            .dtype = h[1] == 3 ? FL_F32 : FL_BF16,
                            .max_T = h[2],
                            .V = h[3],
                            .L = h[4],
                            .NH = h[5],
                            .C = h[6],
                            .Vp = h[7]};
    // Within the limits above this stays far below 2^64.
    uint64_t C = (uint64_t)out->C;
    uint64_t params = ((uint64_t)out->Vp + (uint64_t)out->max_T + 2) * C +
                      (uint64_t)out->L * (12 * C * C + 13 * C);
    uint64_t want = FL_LLMC_HEADER_BYTES + params * fl_dtype_size(out->dtype);
    if (file_size != want)
        return fl_errorf(
            err, errlen,
            "the file has %llu bytes, its header (V %d, Vp %d, L %d, C %d, maxT %d, %s) "
            "implies %llu",
            (unsigned long long)file_size, out->V, out->Vp, out->L, out->C, out->max_T,
            fl_dtype_name(out->dtype), (unsigned long long)want);
    out->num_params = (size_t)params;
    return 0;
}
