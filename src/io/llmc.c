// llmc.c: loading llm.c model files (karpathy/llm.c, gpt2_124M.bin and
// gpt2_124M_bf16.bin). llm.c stacks each parameter kind over the layers
// (all ln1w, then all ln1b, ...) where our table goes layer by layer, and
// both store matrices (out, in), so every (kind, layer) slice is one
// contiguous copy.
#include "fitlm/safetensors.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "fitlm/io.h"

#define LLMC_CHUNK  65536 // values converted at a time
#define LAYER_KINDS 12    // ln1w .. fcprojb, in our table's per-layer order too

// Reads n values of dtype src_dt from f into dst (dtype dt).
static void read_values(FILE *f, const char *path, fl_dtype src_dt, fl_dtype dt, void *dst,
                        size_t n, void *chunk) {
    size_t es = fl_dtype_size(src_dt);
    for (size_t i = 0; i < n; i += LLMC_CHUNK) {
        size_t len = n - i < LLMC_CHUNK ? n - i : LLMC_CHUNK;
        if (fread(chunk, es, len, f) != len) fl_die("cannot read %s: truncated", path);
        fl_convert(dt, fl_at(dt, dst, i), src_dt, chunk, len);
    }
}

void fl_llmc_load(const char *path, fl_model *model, fl_dtype dt) {
    FILE *f = fopen(path, "rb");
    if (!f) fl_die("cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode))
        fl_die("%s is not a regular file", path);
    uint8_t buf[FL_LLMC_HEADER_BYTES];
    size_t got = fread(buf, 1, sizeof buf, f);
    fl_llmc_header h;
    char err[512];
    if (fl_llmc_header_parse(buf, got, (uint64_t)st.st_size, &h, err, sizeof err) != 0)
        fl_die("llm.c model file %s: %s", path, err);
    fl_model_config cfg = {
        .max_seq_len = h.max_T, .vocab_size = h.V, .n_layer = h.L, .n_head = h.NH, .n_embd = h.C};
    fl_model_init(model, &cfg, dt, 0);

    const fl_param_view *v = model->table.views;
    void *chunk = fl_alloc(FL_MEM_WORKSPACE, LLMC_CHUNK * sizeof(float));
    size_t C = (size_t)h.C, es = fl_dtype_size(h.dtype);
    // wte: V rows kept, llm.c's padded rows skipped (ours are zero)
    read_values(f, path, h.dtype, dt, model->params, (size_t)h.V * C, chunk);
    if (fseek(f, (long)(((size_t)h.Vp - (size_t)h.V) * C * es), SEEK_CUR) != 0)
        fl_die("cannot read %s: %s", path, strerror(errno));
    read_values(f, path, h.dtype, dt, fl_at(dt, model->params, v[1].offset), v[1].numel, chunk);
    for (int k = 0; k < LAYER_KINDS; k++)
        for (int l = 0; l < h.L; l++) {
            const fl_param_view *lv = &v[2 + l * LAYER_KINDS + k];
            read_values(f, path, h.dtype, dt, fl_at(dt, model->params, lv->offset), lv->numel,
                        chunk);
        }
    for (int k = 0; k < 2; k++) { // lnfw, lnfb
        const fl_param_view *fv = &v[2 + h.L * LAYER_KINDS + k];
        read_values(f, path, h.dtype, dt, fl_at(dt, model->params, fv->offset), fv->numel, chunk);
    }
    fl_free(chunk);
    fclose(f);
}
