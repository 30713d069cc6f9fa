// llmc.c: llm.c model files (karpathy/llm.c, gpt2_124M.bin and
// gpt2_124M_bf16.bin) as a weight source. llm.c stacks each parameter kind
// over the layers (all ln1w, then all ln1b, ...) where our table goes layer
// by layer, and both store matrices (out, in), so every (kind, layer) slice
// is one row, read in order from the file.
#include "fitlm/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "fitlm/io.h"

#define LLMC_CHUNK  65536 // values converted at a time
#define LAYER_KINDS 12    // ln1w .. fcprojb, in our table's per-layer order too

typedef struct {
    FILE *f;
    const char *path;
    fl_llmc_header h;
} llmc_source;

// Reads a row's n values (dtype src_dt) from f and stores them in pieces.
static void read_row(fl_model *m, const llmc_source *l, int row, size_t n, float *buf,
                     void *chunk) {
    size_t es = fl_dtype_size(l->h.dtype);
    for (size_t i = 0; i < n; i += LLMC_CHUNK) {
        size_t len = n - i < LLMC_CHUNK ? n - i : LLMC_CHUNK;
        if (fread(chunk, es, len, l->f) != len) fl_die("cannot read %s: truncated", l->path);
        fl_convert(FL_F32, buf, l->h.dtype, chunk, len);
        fl_model_store_row(m, row, i, buf, len);
    }
}

static void llmc_check(fl_weight_source *s, const fl_param_table *t, const fl_quant_config *q) {
    (void)t; // the header's shape is the table's
    const llmc_source *l = s->state;
    if (q)
        fl_die("%s: NF4 quantisation (--quantize nf4) loads a Hugging Face model directory "
               "(config.json + safetensors), not an llm.c model file",
               l->path);
}

static void llmc_fill(fl_weight_source *s, fl_model *m) {
    llmc_source *l = s->state;
    const fl_llmc_header *h = &l->h;
    if (fseek(l->f, FL_LLMC_HEADER_BYTES, SEEK_SET) != 0)
        fl_die("cannot read %s: %s", l->path, strerror(errno));
    float *buf = fl_alloc(FL_MEM_WORKSPACE, LLMC_CHUNK * sizeof(float));
    void *chunk = fl_alloc(FL_MEM_WORKSPACE, LLMC_CHUNK * sizeof(float));
    const fl_param_view *v = fl_model_whole_table(m)->views; // the file's rows
    size_t C = (size_t)h->C, es = fl_dtype_size(h->dtype);
    // wte: V rows kept, llm.c's padded rows skipped (ours are zero)
    read_row(m, l, 0, (size_t)h->V * C, buf, chunk);
    if (fseek(l->f, (long)(((size_t)h->Vp - (size_t)h->V) * C * es), SEEK_CUR) != 0)
        fl_die("cannot read %s: %s", l->path, strerror(errno));
    read_row(m, l, 1, v[1].numel, buf, chunk);
    for (int k = 0; k < LAYER_KINDS; k++)
        for (int layer = 0; layer < h->L; layer++) {
            int row = 2 + layer * LAYER_KINDS + k;
            read_row(m, l, row, v[row].numel, buf, chunk);
        }
    for (int k = 0; k < 2; k++) { // lnfw, lnfb
        int row = 2 + h->L * LAYER_KINDS + k;
        read_row(m, l, row, v[row].numel, buf, chunk);
    }
    fl_free(buf);
    fl_free(chunk);
}

static void llmc_close(fl_weight_source *s) {
    llmc_source *l = s->state;
    fclose(l->f);
    fl_free(l);
}

void fl_llmc_source_open(fl_weight_source *s, const char *path) {
    int fd = fl_open_regular(path, "llm.c model file");
    struct stat st;
    if (fstat(fd, &st) != 0) fl_die("cannot stat llm.c model file %s: %s", path, strerror(errno));
    FILE *f = fdopen(fd, "rb");
    if (!f) fl_die("cannot open %s: %s", path, strerror(errno));
    uint8_t buf[FL_LLMC_HEADER_BYTES];
    size_t got = fread(buf, 1, sizeof buf, f);
    llmc_source *l = fl_alloc(FL_MEM_OTHER, sizeof *l);
    char err[512];
    if (fl_llmc_header_parse(buf, got, (uint64_t)st.st_size, &l->h, err, sizeof err) != 0)
        fl_die("llm.c model file %s: %s", path, err);
    l->f = f;
    l->path = path;
    memset(s, 0, sizeof *s);
    s->config = (fl_model_config){.max_seq_len = l->h.max_T,
                                  .vocab_size = l->h.V,
                                  .n_layer = l->h.L,
                                  .n_head = l->h.NH,
                                  .n_embd = l->h.C};
    s->state = l;
    s->check = llmc_check;
    s->fill = llmc_fill;
    s->close = llmc_close;
}

void fl_llmc_load(const char *path, fl_model *model, fl_dtype dt) {
    fl_weight_source s;
    fl_llmc_source_open(&s, path);
    fl_model_init_whole(model, &s, dt, NULL);
}
