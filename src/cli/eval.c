// eval.c: `fitlm eval`: a model's mean loss per token, perplexity and bits
// per byte over the whole of some token shards or a text file, every target
// token counted once (the rule: fitlm/eval.h). How a model is compared before
// and after fine-tuning, and how a test checks one without training.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/config.h"
#include "fitlm/data.h"
#include "fitlm/eval.h"
#include "fitlm/io.h"
#include "fitlm/safetensors.h"
#include "fitlm/tokenizer.h"

typedef struct {
    const char *checkpoint, *init_from, *adapter, *data, *text, *split, *precision, *device;
    const char *tokenizer, *tokenizer_path;
    int seq_len, batch, threads, json, logits_chunk;
} eval_options;

static void help(void) {
    printf("usage: fitlm eval --checkpoint PATH|--init-from DIR --data SHARDS|--text FILE "
           "[options]\n\n"
           "The model's mean cross-entropy per target token (nats), its perplexity exp(loss),\n"
           "bits per byte (total nats / ln 2 / source bytes) and the counts, over the whole\n"
           "data, the same for any --batch and thread count.\n\n"
           "Every token but a shard's first is a target exactly once. A shard's tokens are\n"
           "cut into windows of T+1 tokens with stride T (window k: tokens kT..kT+T, the\n"
           "training loader's windows), so a token is predicted from the tokens since its\n"
           "window's start; a shard's last window takes the tail, the fewer than T targets\n"
           "left, padded. Shards of examples (`tokenize --format jsonl`) hold windows of\n"
           "T+1 already (T is theirs): only the tokens their mask marks are targets.\n\n"
           "  --checkpoint PATH    a fitlm checkpoint (a directory: its newest; or a file)\n"
           "  --init-from PATH     pretrained weights: a Hugging Face GPT-2 or LLaMA directory\n"
           "                       or an llm.c model file (one of the two is required)\n"
           "  --adapter DIR        a PEFT LoRA adapter on that model (default: none)\n"
           "  --quantize nf4       the base's linear layers in NF4, as a QLoRA adapter was\n"
           "                       trained on them (with --init-from a Hugging Face directory)\n"
           "  --double-quant       with --quantize: double-quantised absmax\n"
           "  --nf4-blocksize N    with --quantize: the NF4 block size (default: 64)\n"
           "  --data SHARDS        token shards: a directory (its <split>_*.bin), a glob\n"
           "                       pattern or a file; bytes: what the shards record\n"
           "  --split NAME         the shards of a --data directory: val or train (default: "
           "val)\n"
           "  --text FILE          a UTF-8 text, tokenized as one document (after the\n"
           "                       tokenizer's <s>, else <|endoftext|>); bytes: the file's\n"
           "                       (one of --data and --text is required)\n"
           "  --seq-len T          window length (default: the data's layout for examples,\n"
           "                       else the model's context)\n"
           "  --batch B            windows per forward pass; memory grows with B x T\n"
           "                       (default: 4)\n"
           "  --logits-chunk N     the LM head and the loss over N positions at a time, so\n"
           "                       that only N x vocabulary logits exist (default: 0, all\n"
           "                       B x T positions'; the same loss either way)\n"
           "  --precision NAME     fp32, bf16 or fp16 (default: the checkpoint's, else fp32)\n"
           "  --tokenizer NAME     for --text, and checked against the data's: gpt2, byte or hf\n"
           "                       (default: the checkpoint's; hf for a Hugging Face\n"
           "                       directory with a tokenizer.json; else gpt2)\n"
           "  --tokenizer-path DIR gpt2: encoder.json and vocab.bpe; hf: tokenizer.json or its\n"
           "                       directory (default: the copy the checkpoint holds; the\n"
           "                       Hugging Face directory's; else data/gpt2)\n"
           "  --threads N          threads, 0 = all cores (default: 0)\n"
           "  --device NAME        where the model runs: cpu, cuda or test (default: cpu;\n"
           "                       docs/devices.md)\n"
           "  --json               one JSON object on stdout (loss, perplexity, bits_per_byte,\n"
           "                       tokens, bytes, seconds, model, adapter, data, ...)\n\n"
           "A progress bar goes to stderr when it is a terminal; otherwise one line at the end.\n");
}

static void parse_args(int argc, char **argv, eval_options *o, fl_quant_config *quant) {
    for (int i = 0; i < argc; i++) {
        const char *flag = argv[i];
        int used = cli_quant_option(argc, argv, i, quant);
        if (used) {
            i += used - 1;
            continue;
        }
        if (!strcmp(flag, "--json")) {
            o->json = 1;
            continue;
        }
        if (strncmp(flag, "--", 2) != 0) fl_die("unexpected argument '%s' (see --help)", flag);
        if (i + 1 >= argc) fl_die("option %s needs a value", flag);
        const char *v = argv[++i];
        if (!strcmp(flag, "--checkpoint"))
            o->checkpoint = v;
        else if (!strcmp(flag, "--init-from"))
            o->init_from = v;
        else if (!strcmp(flag, "--adapter"))
            o->adapter = v;
        else if (!strcmp(flag, "--data"))
            o->data = v;
        else if (!strcmp(flag, "--split"))
            o->split = v;
        else if (!strcmp(flag, "--text"))
            o->text = v;
        else if (!strcmp(flag, "--seq-len"))
            o->seq_len = cli_whole(flag, v, 1, 1 << 20);
        else if (!strcmp(flag, "--batch"))
            o->batch = cli_whole(flag, v, 1, 1 << 16);
        else if (!strcmp(flag, "--logits-chunk"))
            o->logits_chunk = cli_whole(flag, v, 0, 1 << 24);
        else if (!strcmp(flag, "--precision"))
            o->precision = v;
        else if (!strcmp(flag, "--tokenizer"))
            o->tokenizer = v;
        else if (!strcmp(flag, "--tokenizer-path"))
            o->tokenizer_path = v;
        else if (!strcmp(flag, "--threads"))
            o->threads = cli_whole(flag, v, 0, 4096);
        else if (!strcmp(flag, "--device"))
            o->device = v;
        else
            fl_die("unknown option '%s' (see --help)", flag);
    }
    if (!o->checkpoint == !o->init_from)
        fl_die("give one model: --checkpoint PATH (a fitlm checkpoint) or --init-from PATH "
               "(pretrained weights)");
    if (!o->data == !o->text)
        fl_die("give the data to evaluate on: --data SHARDS or --text FILE (one of the two)");
    if (strcmp(o->split, "val") && strcmp(o->split, "train"))
        fl_die("--split must be val or train, got '%s'", o->split);
    if (!quant->enabled && (quant->double_quant || quant->blocksize != 64))
        fl_die("--double-quant and --nf4-blocksize apply with --quantize nf4");
    if (quant->enabled && o->checkpoint)
        fl_die("--quantize nf4 applies to --init-from (a Hugging Face base a QLoRA adapter was "
               "trained on), not to --checkpoint");
    if (o->checkpoint && !fl_is_checkpoint(o->checkpoint))
        fl_die("%s is not a fitlm checkpoint (for Hugging Face or llm.c weights use --init-from)",
               o->checkpoint);
}

static fl_dtype dtype_of(const char *name) {
    for (int d = FL_F32; d <= FL_F16; d++)
        if (!strcmp(name, fl_dtype_name((fl_dtype)d))) return (fl_dtype)d;
    fl_die("--precision must be fp32, bf16 or fp16, got '%s'", name);
}

// The precision a checkpoint's run trained in (its meta's).
static fl_dtype ckpt_precision(const char *path) {
    fl_ckpt *ck = fl_ckpt_open(path);
    cJSON *meta = cJSON_Parse(fl_ckpt_meta(ck));
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(meta, "precision");
    fl_dtype dt = FL_F32;
    for (int d = FL_F32; d <= FL_F16 && cJSON_IsString(p); d++)
        if (!strcmp(p->valuestring, fl_dtype_name((fl_dtype)d))) dt = (fl_dtype)d;
    cJSON_Delete(meta);
    fl_ckpt_close(ck);
    return dt;
}

// ----------------------------------------------------------------------------
// the data: shards from disk, or a text's tokens as one shard in memory

typedef struct {
    fl_shard *shards;
    int n_shards;
    uint8_t *text_tokens; // --text: the file's tokens, as a shard holds them
    uint64_t bytes;       // source text bytes the tokens encode
} eval_data;

// The shards `pattern` names, found and checked as the training loader
// finds them but without its windows: a stream shorter than one window is
// still data here.
static void open_shards(eval_data *d, const char *pattern, const char *split) {
    d->shards = fl_shards_open(pattern, split, &d->n_shards);
    for (int i = 0; i < d->n_shards; i++) d->bytes += d->shards[i].source_bytes;
}

// The data against the model: tokenizer ("" when the weights record none)
// and vocabulary.
static void check_shards(const eval_data *d, const char *pattern, const char *tokenizer,
                         const fl_model *m) {
    const fl_shard *s = &d->shards[0];
    if (*tokenizer && strcmp(s->tokenizer, tokenizer))
        fl_die("the data %s was tokenized with '%s', but the model's tokenizer is '%s' (tokenize "
               "the text with --tokenizer %s)",
               pattern, s->tokenizer, tokenizer, tokenizer);
    if ((int)s->vocab_size > m->config.vocab_size)
        fl_die("the data %s has a vocabulary of %u (tokenizer %s), larger than the model's %d: it "
               "was tokenized for another model",
               pattern, s->vocab_size, s->tokenizer, m->config.vocab_size);
}

static void open_text(eval_data *d, const char *path, const fl_tokenizer_files *files,
                      const fl_model *m) {
    fl_tokenizer *tok = fl_tokenizer_load_files(files);
    int vocab = fl_tokenizer_vocab_size(tok);
    if (vocab > m->config.vocab_size)
        fl_die("the %s tokenizer's vocabulary (%d) is larger than the model's (%d): choose the "
               "tokenizer the model was trained with (--tokenizer)",
               fl_tokenizer_name(tok), vocab, m->config.vocab_size);
    fl_text text;
    fl_text_load(&text, path);
    fl_tokens ids = {0};
    int start = fl_tokenizer_bos(tok) >= 0 ? fl_tokenizer_bos(tok) : fl_tokenizer_eot(tok);
    fl_tokenizer_encode(tok, text.bytes, text.n, &ids);
    size_t n = 1 + ids.n;
    // stored as a 4-byte shard would hold them, so one reader serves both
    d->text_tokens = fl_alloc(FL_MEM_OTHER, n * 4);
    fl_put_u32(d->text_tokens, (uint32_t)start);
    for (size_t i = 0; i < ids.n; i++)
        fl_put_u32(d->text_tokens + 4 * (i + 1), (uint32_t)ids.ids[i]);
    d->shards = fl_alloc(FL_MEM_OTHER, sizeof(fl_shard));
    d->n_shards = 1;
    fl_shard *s = memset(d->shards, 0, sizeof(fl_shard));
    snprintf(s->path, sizeof s->path, "%s", path);
    snprintf(s->tokenizer, sizeof s->tokenizer, "%s", fl_tokenizer_name(tok));
    s->vocab_size = (uint32_t)vocab;
    s->width = 4;
    s->n_tokens = n;
    s->source_bytes = text.n;
    s->version = 1; // a stream, no mask
    s->n_targets = n;
    s->tokens = d->text_tokens;
    d->bytes = text.n;
    fl_tokens_free(&ids);
    fl_text_free(&text);
    fl_tokenizer_free(tok);
}

static void close_data(eval_data *d) {
    if (d->text_tokens)
        fl_free(d->text_tokens);
    else
        for (int i = 0; i < d->n_shards; i++) fl_shard_close(&d->shards[i]);
    fl_free(d->shards);
}

// ----------------------------------------------------------------------------
// progress and results

typedef struct {
    double t0, last;
    int T;
} progress_state;

// A bar on stderr, redrawn at most ten times a second and at the end.
static void show_progress(void *ctx, uint64_t done, uint64_t total) {
    progress_state *p = ctx;
    double now = fl_now();
    if (done < total && now - p->last < 0.1) return;
    p->last = now;
    double frac = total ? (double)done / (double)total : 1.0, secs = now - p->t0;
    char bar[31];
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = 0;
    fprintf(stderr, "\reval [%s] %3.0f%% %llu/%llu windows, %.0f tokens/s, %.0f s left  ", bar,
            100 * frac, (unsigned long long)done, (unsigned long long)total,
            secs > 0 ? (double)done * p->T / secs : 0.0, done ? secs * (1 / frac - 1) : 0.0);
    if (done == total) fputc('\n', stderr);
}

static void print_json(const eval_options *o, const fl_model *m, fl_dtype dt, int T, int B,
                       const fl_eval_sum *s, uint64_t bytes, double seconds,
                       const char *tokenizer) {
    double loss = s->nats / (double)s->tokens;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "loss", loss);
    cJSON_AddNumberToObject(j, "perplexity", exp(loss));
    if (bytes)
        cJSON_AddNumberToObject(j, "bits_per_byte", s->nats / log(2.0) / (double)bytes);
    else
        cJSON_AddNullToObject(j, "bits_per_byte");
    cJSON_AddNumberToObject(j, "nats", s->nats);
    cJSON_AddNumberToObject(j, "tokens", (double)s->tokens);
    cJSON_AddNumberToObject(j, "bytes", (double)bytes);
    cJSON_AddNumberToObject(j, "windows", (double)s->windows);
    cJSON_AddNumberToObject(j, "seconds", seconds);
    cJSON_AddStringToObject(j, "model", o->checkpoint ? o->checkpoint : o->init_from);
    if (o->adapter)
        cJSON_AddStringToObject(j, "adapter", o->adapter);
    else
        cJSON_AddNullToObject(j, "adapter");
    cJSON_AddStringToObject(j, "data", o->data ? o->data : o->text);
    cJSON_AddStringToObject(j, "tokenizer", tokenizer);
    cJSON_AddStringToObject(j, "arch", fl_arch_name(m->config.arch));
    cJSON_AddStringToObject(j, "precision", fl_dtype_name(dt));
    cJSON_AddNumberToObject(j, "seq_len", T);
    cJSON_AddNumberToObject(j, "batch", B);
    char *text = cJSON_PrintUnformatted(j);
    if (!text) fl_die("out of memory");
    puts(text);
    free(text);
    cJSON_Delete(j);
}

static void print_human(const eval_options *o, const fl_model *m, fl_dtype dt, int T, int B,
                        const fl_eval_sum *s, uint64_t bytes, double seconds,
                        const char *tokenizer) {
    double loss = s->nats / (double)s->tokens;
    printf("model      %s (%s, %zu parameters, %s)\n", o->checkpoint ? o->checkpoint : o->init_from,
           fl_arch_name(m->config.arch), m->table.numel, fl_dtype_name(dt));
    if (o->adapter) printf("adapter    %s (%zu parameters)\n", o->adapter, m->lora.table.numel);
    printf("data       %s (tokenizer %s)\n", o->data ? o->data : o->text, tokenizer);
    printf("windows    %llu of %d+1 tokens, batch %d\n", (unsigned long long)s->windows, T, B);
    printf("tokens     %llu\n", (unsigned long long)s->tokens);
    printf("loss       %.6f nats/token\n", loss);
    printf("perplexity %.4f\n", exp(loss));
    if (bytes) {
        printf("bytes      %llu\n", (unsigned long long)bytes);
        printf("bits/byte  %.6f\n", s->nats / log(2.0) / (double)bytes);
    } else {
        printf("bits/byte  n/a (the shards record no source bytes)\n");
    }
    printf("time       %.2f s (%.0f tokens/s)\n", seconds,
           seconds > 0 ? (double)s->tokens / seconds : 0.0);
}

int cmd_eval(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    eval_options o = {.split = "val", .tokenizer = "", .batch = 4, .device = "cpu"};
    fl_quant_config quant = {0, 64, 0};
    parse_args(argc, argv, &o, &quant);
    if (o.threads) fl_set_threads(o.threads);
    cli_use_device(o.device);

    const char *path = o.checkpoint ? o.checkpoint : o.init_from;
    int from_ckpt = fl_is_checkpoint(path) && !quant.enabled;
    // The tokenizer: a checkpoint records its name and its run's files; a
    // Hugging Face directory may hold a tokenizer.json; else GPT-2's. The
    // data is checked against a name only when it is known.
    // the data is checked against the model's tokenizer only when it is
    // known (GPT-2's is a guess for weights that do not say)
    // (a checkpoint's: the copy it holds, never the path its config records)
    char model_tok[FL_NAME_MAX];
    fl_tokenizer_files files;
    int known = fl_source_tokenizer(path, &files);
    snprintf(model_tok, sizeof model_tok, "%s", known ? files.name : "");
    fl_dtype dt = from_ckpt ? ckpt_precision(path) : FL_F32;
    if (o.precision) dt = dtype_of(o.precision);
    fl_model model;
    char ckpt_tok[FL_NAME_MAX];
    if (from_ckpt)
        fl_ckpt_load_model(path, &model, dt, ckpt_tok, sizeof ckpt_tok);
    else
        fl_pretrained_load(path, &model, dt, &quant);
    if (*o.tokenizer) snprintf(model_tok, sizeof model_tok, "%s", o.tokenizer);
    if (o.tokenizer_path || (*o.tokenizer && strcmp(o.tokenizer, files.name))) {
        char name[FL_NAME_MAX];
        snprintf(name, sizeof name, "%s", *o.tokenizer ? o.tokenizer : files.name);
        fl_tokenizer_files_free(&files);
        fl_tokenizer_files_read(&files, name, o.tokenizer_path);
    }
    if (o.adapter) { // before the activations: their workspace covers the adapters'
        fl_lora_config lc;
        fl_peft_read_config(o.adapter, &lc);
        fl_model_add_lora(&model, &lc, 0);
        fl_peft_load(o.adapter, &model);
    }
    fl_model_check_finite(&model, path, o.adapter);

    eval_data data = {0};
    if (o.data) {
        open_shards(&data, o.data, o.split);
        check_shards(&data, o.data, model_tok, &model);
    } else {
        open_text(&data, o.text, &files, &model);
    }
    fl_tokenizer_files_free(&files);
    const fl_shard *first = &data.shards[0];
    // examples laid out in windows (version 2) bring their T
    int laid_out = first->version == 2 ? (int)first->layout.seq_len : 0;
    int T = o.seq_len ? o.seq_len : laid_out ? laid_out : model.config.max_seq_len, B = o.batch;
    if (laid_out && T != laid_out)
        fl_die("the data %s was laid out in windows of %d+1 tokens (fitlm tokenize --seq-len): "
               "evaluate it with --seq-len %d",
               o.data, laid_out, laid_out);
    if (T > model.config.max_seq_len)
        fl_die("sequence length %d is longer than the model's context, %d tokens%s", T,
               model.config.max_seq_len, laid_out ? " (the data's layout)" : "");
    const char *data_tok = first->tokenizer;
    uint64_t windows = fl_eval_windows(data.shards, data.n_shards, T);
    if (windows && (uint64_t)B > windows) B = (int)windows; // no activations for empty rows
    model.config.logits_chunk = o.logits_chunk;
    fl_model_alloc_acts(&model, B, T, FL_RECOMPUTE_NONE, 1); // forward only: no gradients

    progress_state p = {fl_now(), 0.0, T};
    int tty = isatty(STDERR_FILENO);
    fl_eval_sum sum;
    fl_eval_shards(&model, data.shards, data.n_shards, B, T, &sum, tty ? show_progress : NULL, &p);
    double seconds = fl_now() - p.t0;
    if (!sum.tokens)
        fl_die("the data %s holds no target tokens to evaluate (every target is masked, or no "
               "shard has two tokens)",
               o.data ? o.data : o.text);
    // every loss was finite (fl_eval_shards); its exponential may still not be
    double loss = sum.nats / (double)sum.tokens;
    if (!isfinite(exp(loss)))
        fl_die("the loss on %s, %g nats/token, makes the perplexity overflow: the weights "
               "overflow the logits (a huge weight?)",
               o.data ? o.data : o.text, loss);
    if (!tty)
        fprintf(stderr, "eval: %llu windows, %llu tokens in %.2f s\n",
                (unsigned long long)sum.windows, (unsigned long long)sum.tokens, seconds);
    if (o.json)
        print_json(&o, &model, dt, T, B, &sum, data.bytes, seconds, data_tok);
    else
        print_human(&o, &model, dt, T, B, &sum, data.bytes, seconds, data_tok);
    close_data(&data);
    fl_model_free(&model);
    return 0;
}
