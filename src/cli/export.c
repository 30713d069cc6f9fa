// export.c: `fitlm export`: a checkpoint's weights as a Hugging Face
// directory (model.safetensors or shards with an index, and config.json), the
// layout transformers' GPT2LMHeadModel or LlamaForCausalLM.from_pretrained
// loads, by the checkpoint's architecture (a sharded checkpoint's rows are
// gathered from its shard files by fl_ckpt_read). With --merge, a base (checkpoint
// or pretrained weights) with a PEFT LoRA adapter merged into it, W +
// scaling * B @ A computed in fp32, as PEFT's merge_and_unload gives it.
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/tokenizer.h"
#include "fitlm/safetensors.h"

static void help(void) {
    printf("usage: fitlm export CHECKPOINT [options]\n"
           "       fitlm export BASE --adapter DIR --merge [options]\n\n"
           "Writes the weights of a fitlm checkpoint (a directory: its newest; or a file) in\n"
           "the Hugging Face layout of its architecture (GPT2LMHeadModel or LlamaForCausalLM):\n"

           "model.safetensors (or model-0000k-of-0000n.safetensors and\n"
           "model.safetensors.index.json) and config.json. A sharded checkpoint (of mpirun\n"
           "-np N fitlm train --zero-stage 1-3: a manifest and a file per rank) is gathered\n"
           "row by row from its shard files.\n\n"
           "With --merge, BASE is a fitlm checkpoint, a Hugging Face GPT-2 or LLaMA directory\n"
           "or an llm.c model file, and DIR a PEFT LoRA adapter (adapter_config.json and\n"
           "adapter_model.safetensors, as `fitlm train` or peft's save_pretrained write it):\n"
           "the written model is BASE with W + scaling * B @ A merged into each adapted\n"
           "layer, computed in fp32 and rounded once to --dtype (never re-quantised).\n\n"
           "An earlier export in the output directory is replaced as a whole: the new one\n"
           "is written to DIR.tmp.<pid> beside it and swapped in, so a failure or a kill\n"
           "leaves the old export or the new one, never a mix of the two (the directory's\n"
           "other files stay; the next export removes a killed one's leftovers). A directory\n"
           "holding checkpoints, as the default one does, is updated in place, one file at\n"
           "a time: give -o DIR for an all-or-nothing replacement. Weights holding NaN or\n"
           "Inf are refused, naming the tensor.\n\n"
           "A Hugging Face tokenizer goes with the weights (tokenizer.json, and\n"
           "tokenizer_config.json when it had one): the copy the checkpoint holds, the one\n"
           "its run trained with (or a base directory's), else the file --tokenizer-path\n"
           "names; never a path recorded inside the checkpoint. It is parsed and its\n"
           "vocabulary checked against the model before anything is written.\n\n"
           "  --format NAME          safetensors (the only format so far; default)\n"
           "  -o, --out DIR          output directory (default: the checkpoint's directory;\n"
           "                         required with --merge onto a base that is not one)\n"
           "  --dtype NAME           fp32, bf16 or fp16 tensors (default: fp32)\n"
           "  --max-shard-size SIZE  split into shards above this size, e.g. 5G (default: 5G,\n"
           "                         as transformers' save_pretrained)\n"
           "  --tokenizer-path PATH  the tokenizer.json (or its directory) to export with the\n"
           "                         weights, instead of the checkpoint's copy; its vocabulary\n"
           "                         must be the model's\n"
           "  --adapter DIR          the PEFT LoRA adapter to merge (with --merge)\n"
           "  --merge                merge --adapter into the base's weights\n"
           "  --quantize nf4         with --merge: the base's linear layers as NF4, dequantised:\n"
           "                         the weights a QLoRA adapter was trained on (a Hugging\n"
           "                         Face base directory); the merge is written in --dtype,\n"
           "                         never re-quantised\n"
           "  --double-quant         with --quantize: double-quantised absmax, as in training\n"
           "  --nf4-blocksize N      with --quantize: the NF4 block size (default: 64)\n"
           "  --device NAME          where the model is loaded: cpu, cuda or test (default:\n"
           "                         cpu; the export is the same; docs/devices.md)\n");
}

// The directory a path names, or holds it (a file's directory).
static void dir_of(char *out, size_t size, const char *path) {
    struct stat st;
    snprintf(out, size, "%s", path);
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return;
    char *slash = strrchr(out, '/');
    if (slash)
        *slash = 0;
    else
        snprintf(out, size, ".");
}

// The tokenizer goes out only as one the loader parses, fitting the model:
// every id a row (the checkpoint's own copy: the run checked it against the
// data; its model may have more rows, --vocab-size), and a file named now
// exactly the model's vocabulary.
static void check_tokenizer(const fl_tokenizer_files *f, const fl_model *m, const char *source,
                            int named) {
    fl_tokenizer *tok = fl_tokenizer_load_files(f); // dies naming the file and the problem
    int vocab = fl_tokenizer_vocab_size(tok), rows = m->config.vocab_size;
    fl_tokenizer_free(tok);
    if (named ? vocab != rows : vocab > rows)
        fl_die("tokenizer %s has a vocabulary of %d, but the model of %s has %d: it is not this "
               "model's tokenizer (nothing exported)",
               f->where[0], vocab, source, rows);
}

static int same_file(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

int cmd_export(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    const char *ckpt = NULL, *out = NULL, *format = "safetensors", *dtype = "fp32";
    const char *adapter = NULL, *tokenizer_path = NULL, *device = "cpu";
    int merge = 0;
    fl_quant_config quant = {0, 64, 0};
    size_t max_shard = (size_t)5 << 30;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            if (ckpt) fl_die("export takes one checkpoint, got '%s' and '%s'", ckpt, a);
            ckpt = a;
            continue;
        }
        if (!strcmp(a, "--merge")) {
            merge = 1;
            continue;
        }
        int used = cli_quant_option(argc, argv, i, &quant);
        if (used) {
            i += used - 1;
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
        else if (!strcmp(a, "--adapter"))
            adapter = v;
        else if (!strcmp(a, "--tokenizer-path"))
            tokenizer_path = v;
        else if (!strcmp(a, "--device"))
            device = v;
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
    if (adapter && !merge)
        fl_die("--adapter needs --merge: export writes a whole model; the adapter files are "
               "already PEFT's format");
    if (merge && !adapter) fl_die("--merge needs --adapter DIR: the PEFT adapter to merge");
    if (!quant.enabled && (quant.double_quant || quant.blocksize != 64))
        fl_die("--double-quant and --nf4-blocksize apply with --quantize nf4");
    if (quant.enabled && !merge)
        fl_die("--quantize nf4 applies to --merge (the base a QLoRA adapter was trained on); "
               "a plain export never writes 4-bit weights");
    cli_use_device(device);
    int is_ckpt = fl_is_checkpoint(ckpt);
    if (!merge && !is_ckpt) fl_die("%s is not a fitlm checkpoint", ckpt);

    char dir[FL_FILE_PATH_MAX], base_dir[FL_FILE_PATH_MAX];
    dir_of(base_dir, sizeof base_dir, ckpt);
    if (out) {
        snprintf(dir, sizeof dir, "%s", out);
    } else { // beside the checkpoint: a directory itself, or a file's directory
        if (!is_ckpt)
            fl_die("--merge onto %s needs -o DIR: the default, the base's directory, would "
                   "overwrite the base",
                   ckpt);
        snprintf(dir, sizeof dir, "%s", base_dir);
    }
    if (merge && !is_ckpt && same_file(dir, base_dir))
        fl_die("-o %s is the base's directory: the merged model would overwrite the base", dir);

    fl_model model;
    char tokenizer[32] = "";
    if (is_ckpt)
        fl_ckpt_load_model(ckpt, &model, FL_F32, tokenizer, sizeof tokenizer);
    else // NF4 rows are dequantised by the merge: the weights the adapter was trained on
        fl_pretrained_load(ckpt, &model, FL_F32, &quant);
    // a Hugging Face tokenizer goes with the weights, so the directory loads whole
    fl_tokenizer_files tok;
    if (tokenizer_path)
        fl_tokenizer_files_read(&tok, "hf", tokenizer_path);
    else
        fl_source_tokenizer(ckpt, &tok);
    int hf_tok = !strcmp(tok.name, "hf");
    if (hf_tok) check_tokenizer(&tok, &model, ckpt, tokenizer_path != NULL);
    if (!merge) {
        fl_model_check_finite(&model, ckpt, NULL);
        // the writer reads host memory: a device's fp32 weights come down once
        const fl_device *dev = model.dev;
        size_t bytes = model.table.numel * sizeof(float);
        float *host = dev->host ? NULL : fl_alloc(FL_MEM_OTHER, bytes);
        if (host) fl_dev_download(dev, host, model.params, bytes);
        fl_hf_export_with(dir, &model, host ? host : model.params, dt, max_shard,
                          hf_tok ? &tok : NULL);
        fl_free(host);
        fl_tokenizer_files_free(&tok);
        printf("exported %zu parameters (%s, %s, %s tensors, tokenizer %s) to %s\n",
               model.table.numel, ckpt, fl_arch_name(model.config.arch), fl_dtype_name(dt),
               tokenizer, dir);
        fl_model_free(&model);
        return 0;
    }
    // The base is loaded in fp32 so the merge sees its exact values and the
    // result is rounded once, to the dtype asked for.
    fl_lora_config lc;
    fl_peft_read_config(adapter, &lc);
    fl_model_add_lora(&model, &lc, 0);
    fl_peft_load(adapter, &model);
    fl_model_check_finite(&model, ckpt, adapter);
    float *merged = fl_alloc(FL_MEM_WORKSPACE, model.table.numel * sizeof(float));
    fl_model_merged_f32(&model, merged);
    fl_hf_export_with(dir, &model, merged, dt, max_shard, hf_tok ? &tok : NULL);
    fl_tokenizer_files_free(&tok);
    printf("merged adapter %s (r %d, %zu adapter parameters) into %s (%s%s): exported %zu "
           "parameters as %s tensors to %s\n",
           adapter, lc.r, model.lora.table.numel, ckpt, fl_arch_name(model.config.arch),
           quant.enabled ? ", NF4 dequantised" : "", model.table.numel, fl_dtype_name(dt), dir);
    fl_free(merged);
    fl_model_free(&model);
    return 0;
}
