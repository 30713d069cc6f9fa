// pretrained.c: weights from elsewhere, told apart by what the path holds: a
// fitlm checkpoint (fl_is_checkpoint), a Hugging Face GPT-2 or
// LLaMA directory or .safetensors file (config.json says which), or an llm.c
// model file (its magic; always GPT-2).
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "fitlm/safetensors.h"

// The first n bytes of a file (fewer when it is shorter); -1 if unreadable
// or not a regular file (O_NONBLOCK: opening a FIFO must not hang).
static ssize_t head(const char *path, uint8_t *buf, size_t n, uint64_t *size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return -1;
    struct stat st;
    int regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    ssize_t got = regular ? pread(fd, buf, n, 0) : -1;
    if (size) *size = regular ? (uint64_t)st.st_size : 0;
    close(fd);
    return got;
}

typedef enum { SRC_CKPT, SRC_HF, SRC_LLMC } source_kind;

static source_kind kind_of(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0)
        fl_die("cannot open pretrained weights %s: %s", path, strerror(errno));
    if (fl_is_checkpoint(path)) return SRC_CKPT;
    if (S_ISDIR(st.st_mode)) return SRC_HF;
    size_t len = strlen(path);
    if (len > 12 && !strcmp(path + len - 12, ".safetensors")) return SRC_HF;
    return SRC_LLMC; // its loader names what is wrong when it is not one
}

// config.json of a Hugging Face directory, or beside a .safetensors file.
static void hf_config(const char *path, fl_model_config *cfg) {
    char json_path[FL_FILE_PATH_MAX], copy[FL_FILE_PATH_MAX];
    struct stat st;
    snprintf(copy, sizeof copy, "%s", path);
    snprintf(json_path, sizeof json_path, "%s/config.json",
             stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? path : dirname(copy));
    size_t n;
    char *text = (char *)fl_file_read_all(json_path, FL_HF_MAX_JSON_BYTES, &n, "config file");
    char err[256];
    if (fl_hf_config_parse(text, n, cfg, err, sizeof err) != 0) fl_die("%s: %s", json_path, err);
    fl_free(text);
}

void fl_pretrained_config(const char *path, fl_model_config *cfg) {
    switch (kind_of(path)) {
    case SRC_CKPT: {
        fl_ckpt *ck = fl_ckpt_open(path);
        fl_ckpt_model_config(ck, cfg);
        fl_ckpt_close(ck);
        break;
    }
    case SRC_HF:
        hf_config(path, cfg);
        break;
    case SRC_LLMC: {
        uint8_t buf[FL_LLMC_HEADER_BYTES];
        uint64_t size = 0;
        ssize_t got = head(path, buf, sizeof buf, &size);
        if (got < 0) fl_die("cannot read %s: %s", path, strerror(errno));
        fl_llmc_header h;
        char err[256];
        if (fl_llmc_header_parse(buf, (size_t)got, size, &h, err, sizeof err) != 0)
            fl_die("%s is neither a fitlm checkpoint, a Hugging Face model nor an llm.c model "
                   "file: %s",
                   path, err);
        memset(cfg, 0, sizeof *cfg);
        cfg->arch = FL_ARCH_GPT2;
        cfg->max_seq_len = h.max_T;
        cfg->vocab_size = h.V;
        cfg->n_layer = h.L;
        cfg->n_head = h.NH;
        cfg->n_embd = h.C;
        break;
    }
    }
}

void fl_pretrained_load(const char *path, fl_model *model, fl_dtype dt) {
    fl_pretrained_load_quant(path, model, dt, NULL);
}

void fl_pretrained_load_quant(const char *path, fl_model *model, fl_dtype dt,
                              const fl_quant_config *q) {
    source_kind kind = kind_of(path);
    if (q && q->enabled) {
        if (kind != SRC_HF)
            fl_die("%s: NF4 quantisation (--quantize nf4) loads a Hugging Face model directory "
                   "(config.json + safetensors), not %s",
                   path, kind == SRC_CKPT ? "a fitlm checkpoint" : "an llm.c model file");
        fl_hf_load_quant(path, model, dt, q);
        return;
    }
    switch (kind) {
    case SRC_CKPT: {
        char tokenizer[64];
        fl_ckpt_load_model(path, model, dt, tokenizer, sizeof tokenizer);
        break;
    }
    case SRC_HF:
        fl_hf_load(path, model, dt);
        break;
    case SRC_LLMC:
        fl_llmc_load(path, model, dt);
        break;
    }
}
