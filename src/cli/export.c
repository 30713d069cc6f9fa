// export.c: `fitlm export`: a checkpoint's weights as a Hugging Face
// directory (model.safetensors or shards with an index, and config.json), the
// layout transformers' GPT2LMHeadModel or LlamaForCausalLM.from_pretrained
// loads, by the checkpoint's architecture.
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/safetensors.h"

static void help(void) {
    printf("usage: fitlm export CHECKPOINT [options]\n\n"
           "Writes the weights of a fitlm checkpoint (a directory: its newest; or a file) in\n"
           "the Hugging Face layout of its architecture (GPT2LMHeadModel or LlamaForCausalLM):\n"
           "model.safetensors (or model-0000k-of-0000n.safetensors and\n"
           "model.safetensors.index.json) and config.json.\n\n"
           "  --format NAME          safetensors (the only format so far; default)\n"
           "  -o, --out DIR          output directory (default: the checkpoint's directory)\n"
           "  --dtype NAME           fp32, bf16 or fp16 tensors (default: fp32)\n"
           "  --max-shard-size SIZE  split into shards above this size, e.g. 5G (default: 5G,\n"
           "                         as transformers' save_pretrained)\n");
}

int cmd_export(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    const char *ckpt = NULL, *out = NULL, *format = "safetensors", *dtype = "fp32";
    size_t max_shard = (size_t)5 << 30;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            if (ckpt) fl_die("export takes one checkpoint, got '%s' and '%s'", ckpt, a);
            ckpt = a;
            continue;
        }
        if (i + 1 >= argc) fl_die("option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--format"))
            format = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--out"))
            out = v;
        else if (!strcmp(a, "--dtype"))
            dtype = v;
        else if (!strcmp(a, "--max-shard-size"))
            max_shard = fl_parse_bytes(v, "--max-shard-size");
        else
            fl_die("unknown option '%s' (see --help)", a);
    }
    if (!ckpt) fl_die("no checkpoint given (usage: fitlm export CHECKPOINT [-o DIR])");
    if (strcmp(format, "safetensors"))
        fl_die("--format %s is not supported: the export format is safetensors", format);
    fl_dtype dt = !strcmp(dtype, "fp32")   ? FL_F32
                  : !strcmp(dtype, "bf16") ? FL_BF16
                  : !strcmp(dtype, "fp16") ? FL_F16
                                           : (fl_dtype)-1;
    if ((int)dt < 0) fl_die("--dtype must be fp32, bf16 or fp16, got '%s'", dtype);
    if (!fl_is_checkpoint(ckpt)) fl_die("%s is not a fitlm checkpoint", ckpt);

    fl_model model;
    char tokenizer[32];
    fl_ckpt_load_model(ckpt, &model, FL_F32, tokenizer, sizeof tokenizer);
    char dir[FL_FILE_PATH_MAX];
    if (out) {
        snprintf(dir, sizeof dir, "%s", out);
    } else { // beside the checkpoint: a directory itself, or a file's directory
        snprintf(dir, sizeof dir, "%s", ckpt);
        char *slash = strrchr(dir, '/');
        if (!fl_is_checkpoint_dir(ckpt)) {
            if (slash)
                *slash = 0;
            else
                strcpy(dir, ".");
        }
    }
    fl_hf_export(dir, &model, model.params, dt, max_shard);
    printf("exported %zu parameters (%s, %s, %s tensors, tokenizer %s) to %s\n", model.table.numel,
           ckpt, fl_arch_name(model.config.arch), fl_dtype_name(dt), tokenizer, dir);
    fl_model_free(&model);
    return 0;
}
