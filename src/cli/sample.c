// sample.c: `fitlm sample`: generate text from a checkpoint or pretrained
// weights (Hugging Face GPT-2 or LLaMA, llm.c), optionally with a PEFT LoRA
// adapter applied on top (unmerged: the linear units add its update).
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/model.h"
#include "fitlm/safetensors.h"
#include "fitlm/tokenizer.h"

typedef struct {
    const char *checkpoint, *adapter, *prompt, *tokenizer, *tokenizer_path, *device;
    int tokens, top_k, threads;
    float temperature;
    unsigned long long seed;
} sample_options;

static void help(void) {
    printf("usage: fitlm sample [options]\n\n"
           "  --checkpoint PATH    a fitlm checkpoint (directory or file), a Hugging Face GPT-2\n"
           "                       or LLaMA directory or an llm.c model file (default: out)\n"
           "  --adapter DIR        a PEFT LoRA adapter for that base (adapter_config.json and\n"
           "                       adapter_model.safetensors) to sample with (default: none)\n"
           "  --quantize nf4       the base's linear layers in NF4, as a QLoRA adapter was\n"
           "                       trained on them (a Hugging Face base directory)\n"
           "  --double-quant       with --quantize: double-quantised absmax, as in training\n"
           "  --nf4-blocksize N    with --quantize: the NF4 block size (default: 64)\n"
           "  --prompt TEXT        text to continue, after the tokenizer's BOS (LLaMA's <s>)\n"
           "                       or else <|endoftext|> (default: none)\n"
           "  --tokenizer NAME     gpt2, byte or hf (default: the checkpoint's; hf for a Hugging\n"
           "                       Face directory with a tokenizer.json; gpt2 for others)\n"
           "  --tokenizer-path DIR gpt2: encoder.json and vocab.bpe; hf: a tokenizer.json or its\n"
           "                       directory (default: the copy a checkpoint holds of its\n"
           "                       run's, never the path its config records; a Hugging Face\n"
           "                       directory's tokenizer.json; else data/gpt2)\n"
           "  --tokens N           tokens to generate (default: 400)\n"
           "  --temperature X      softmax temperature, 0 = greedy (default: 0.8)\n"
           "  --top-k K            sample among the K most likely tokens, 0 = all (default: 40)\n"
           "  --seed N             random seed, 0 to 2^64-1 (default: 1337)\n"
           "  --threads N          threads, 0 = all cores (default: 0)\n"
           "  --device NAME        where the model runs: cpu, cuda or test (default: cpu;\n"
           "                       docs/devices.md)\n");
}

// The syntax of train's --seed: the whole 64-bit range, exactly.
static unsigned long long seed_of(const char *flag, const char *text) {
    uint64_t v;
    if (fl_parse_u64(text, &v))
        fl_die("option %s expects a whole number in [0, 2^64), got '%s'", flag, text);
    return v;
}

int cmd_sample(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    sample_options o = {"out", NULL, "", "", NULL, "cpu", 400, 40, 0, 0.8f, 1337};
    fl_quant_config quant = {0, 64, 0};
    for (int i = 0; i < argc; i++) {
        const char *flag = argv[i];
        int used = cli_quant_option(argc, argv, i, &quant);
        if (used) {
            i += used - 1;
            continue;
        }
        if (strncmp(flag, "--", 2) != 0) fl_die("unexpected argument '%s' (see --help)", flag);
        if (i + 1 >= argc) fl_die("option %s needs a value", flag);
        const char *v = argv[++i];
        if (!strcmp(flag, "--checkpoint"))
            o.checkpoint = v;
        else if (!strcmp(flag, "--adapter"))
            o.adapter = v;
        else if (!strcmp(flag, "--prompt"))
            o.prompt = v;
        else if (!strcmp(flag, "--tokenizer"))
            o.tokenizer = v;
        else if (!strcmp(flag, "--tokenizer-path"))
            o.tokenizer_path = v;
        else if (!strcmp(flag, "--tokens"))
            o.tokens = cli_whole(flag, v, 0, 1 << 20);
        else if (!strcmp(flag, "--temperature"))
            o.temperature = (float)cli_number(flag, v, 0, 100);
        else if (!strcmp(flag, "--top-k"))
            o.top_k = cli_whole(flag, v, 0, 1 << 30);
        else if (!strcmp(flag, "--seed"))
            o.seed = seed_of(flag, v);
        else if (!strcmp(flag, "--threads"))
            o.threads = cli_whole(flag, v, 0, 4096);
        else if (!strcmp(flag, "--device"))
            o.device = v;
        else
            fl_die("unknown option '%s' (see --help)", flag);
    }
    if (o.threads) fl_set_threads(o.threads);
    if (!quant.enabled && (quant.double_quant || quant.blocksize != 64))
        fl_die("--double-quant and --nf4-blocksize apply with --quantize nf4");
    cli_use_device(o.device);

    fl_model model;
    // the tokenizer the weights come with (a Hugging Face directory's
    // tokenizer.json, the copy a checkpoint holds), unless the flags name another
    fl_tokenizer_files files;
    fl_source_tokenizer(o.checkpoint, &files);
    char tokenizer[32];
    snprintf(tokenizer, sizeof tokenizer, "%s", files.name);
    if (fl_is_checkpoint(o.checkpoint) && !quant.enabled)
        fl_ckpt_load_model(o.checkpoint, &model, FL_F32, tokenizer, sizeof tokenizer);
    else
        fl_pretrained_load(o.checkpoint, &model, FL_F32, &quant);
    if (o.adapter) { // before the activations: their workspace covers the adapters'
        fl_lora_config lc;
        fl_peft_read_config(o.adapter, &lc);
        fl_model_add_lora(&model, &lc, 0);
        fl_peft_load(o.adapter, &model);
    }
    fl_model_check_finite(&model, o.checkpoint, o.adapter);
    // (another tokenizer named without --tokenizer-path: its default files)
    if (o.tokenizer_path || (*o.tokenizer && strcmp(o.tokenizer, tokenizer))) {
        fl_tokenizer_files_free(&files);
        fl_tokenizer_files_read(&files, *o.tokenizer ? o.tokenizer : tokenizer, o.tokenizer_path);
    }
    fl_tokenizer *tok = fl_tokenizer_load_files(&files);
    fl_tokenizer_files_free(&files);
    // every token the model can sample must decode
    if (fl_tokenizer_vocab_size(tok) != model.config.vocab_size)
        fl_die("the %s tokenizer's vocabulary (%d) is not the model's (%d): choose the tokenizer "
               "the model was trained with (--tokenizer)",
               fl_tokenizer_name(tok), fl_tokenizer_vocab_size(tok), model.config.vocab_size);
    // no backward; of the logits only the last position's, the one sampled from
    // (the head over one position: logits_chunk 1)
    model.config.logits_chunk = 1;
    fl_model_alloc_acts(&model, 1, model.config.max_seq_len, FL_RECOMPUTE_NONE, 1);

    fl_tokens prompt = {0};
    // a sample starts like a fresh document: BOS if the tokenizer has one
    int start = fl_tokenizer_bos(tok) >= 0 ? fl_tokenizer_bos(tok) : fl_tokenizer_eot(tok);
    fl_tokenizer_encode(tok, (const uint8_t *)o.prompt, strlen(o.prompt), &prompt);
    int n_prompt = 1 + (int)prompt.n;
    int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(n_prompt + o.tokens) * sizeof(int));
    tokens[0] = start;
    for (size_t i = 0; i < prompt.n; i++) tokens[1 + i] = prompt.ids[i];
    fl_tokens_free(&prompt);
    fl_rng rng;
    fl_rng_seed(&rng, o.seed);
    fputs(o.prompt, stdout);
    fl_model_generate(&model, tokens, n_prompt, o.tokens, o.temperature, o.top_k, &rng, print_token,
                      tok);
    putchar('\n');
    fl_free(tokens);
    fl_tokenizer_free(tok);
    fl_model_free(&model);
    return 0;
}
