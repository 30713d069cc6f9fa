// pretrained.c: weights from elsewhere, told apart by what the path holds: a
// fitlm checkpoint (fl_is_checkpoint), a Hugging Face GPT-2 or
// LLaMA directory or .safetensors file (config.json says which), or an llm.c
// model file (its magic; always GPT-2).
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "fitlm/io.h"
#include "fitlm/safetensors.h"

void fl_weight_source_open(fl_weight_source *s, const char *path) {
    struct stat st;
    if (stat(path, &st) != 0)
        fl_die("cannot open pretrained weights %s: %s", path, strerror(errno));
    size_t len = strlen(path);
    if (fl_is_checkpoint(path))
        fl_ckpt_source_open(s, path);
    else if (S_ISDIR(st.st_mode) || (len > 12 && !strcmp(path + len - 12, ".safetensors")))
        fl_hf_source_open(s, path);
    else // its reader names what is wrong when it is not one
        fl_llmc_source_open(s, path);
}

void fl_pretrained_load(const char *path, fl_model *model, fl_dtype dt, const fl_quant_config *q) {
    fl_weight_source s;
    fl_weight_source_open(&s, path);
    fl_model_init_whole(model, &s, dt, q);
}
