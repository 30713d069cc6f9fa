// plan.c: `fitlm plan`: the memory a training run needs, per tag and per
// rank, printed before anything is allocated. Takes every `fitlm train`
// option (the same config parser, --zero-stage and the other
// zero_optimization keys included) plus --ranks (what mpirun -np would
// start), --rank, and a few for what the engine does not run, planned from
// their formulas.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/data.h"
#include "fitlm/io.h"
#include "fitlm/model.h"
#include "fitlm/config.h"
#include "fitlm/train.h"
#include "fitlm/offload.h"
#include "fitlm/plan.h"
#include "fitlm/tokenizer.h"

static void help(void) {
    printf("usage: fitlm plan [options]\n\n"
           "Prints the memory per tag (per rank) that 'fitlm train' with the same options would\n"
           "allocate (under 'mpirun -np N' with --ranks N), without allocating it: exact for what\n"
           "the engine runs (DDP and ZeRO 1-3 with --zero-stage, tensor parallelism with\n"
           "--tensor-parallel and --sequence-parallel included), from the published\n"
           "formulas (ZeRO, LOMO) for what it does not run yet, marked as such. Then compares\n"
           "the total with --mem-limit (per rank; default: the available memory shared by the\n"
           "ranks, as 'fitlm train' does) and, if it does not fit, lists what would. With a\n"
           "--device other than the cpu, --mem-limit is the device's budget instead (at most its\n"
           "free memory) and the host is checked against its available memory.\n\n"
           "plan-only options:\n"
           "  %-28s %s\n  %-28s default: 1\n"
           "  %-28s %s\n  %-28s default: 0\n"
           "  %-28s %s\n  %-28s default: off\n"
           "  %-28s %s\n  %-28s default: the model shape's count\n\n",
           "--ranks N",
           "ranks, as mpirun -np N starts (memory is per rank; N / --tensor-parallel data-parallel "
           "replicas)",
           "", "--rank R",
           "the rank planned (ZeRO shards differ by a few elements; 0: the largest); with "
           "--pipeline-parallel, its stage alone (default: every stage)",
           "", "--lomo", "LOMO by its formula: update fused into backward, no optimizer state", "",
           "--params N", "a raw parameter count (124439808, 7e9, 7B, 350M): model states only", "");
    fl_config_print_help(stdout);
}

typedef struct {
    int ranks, rank, rank_given, lomo;
    size_t params;
} plan_flags;

static int parse_int(const char *flag, const char *text, int min, int max) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (end == text || *end || errno || v < min || v > max)
        fl_die("option %s expects a whole number in [%d, %d], got '%s'", flag, min, max, text);
    return (int)v;
}

// Takes the plan-only flags out of argv (in place); returns the new argc.
static int take_plan_flags(int argc, char **argv, plan_flags *f) {
    int kept = 0;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        static const char *const valued[] = {"--ranks", "--rank", "--params"};
        int which = -1;
        for (int k = 0; k < 3; k++)
            if (strlen(valued[k]) == len && !strncmp(arg, valued[k], len)) which = k;
        if (which >= 0) {
            const char *value = eq ? eq + 1 : NULL;
            if (!value) {
                if (i + 1 >= argc) fl_die("option %s needs a value", valued[which]);
                value = argv[++i];
            }
            if (which == 0) f->ranks = parse_int("--ranks", value, 1, 1 << 20);
            if (which == 1) f->rank = parse_int("--rank", value, 0, (1 << 20) - 1);
            if (which == 1) f->rank_given = 1;
            if (which == 2) f->params = fl_plan_parse_count(value, "option --params");
        } else if (!strcmp(arg, "--lomo")) {
            f->lomo = 1;
        } else {
            argv[kept++] = argv[i];
            if (!strcmp(arg, "--config") && i + 1 < argc) argv[kept++] = argv[++i];
        }
    }
    return kept;
}

// Size of a data file, or 0 (with a note) when it cannot be read.
// What the data loaders and the tokenizer keep (tag other: the shard tables,
// the tokenizer's tables; the tokens are memory-mapped), measured by opening
// them as `fitlm train` does; 0 with a note when there is no data.
static size_t loader_bytes(const fl_train_config *cfg, size_t *peak) {
    struct stat st;
    if (!*cfg->data || stat(cfg->data, &st) != 0) {
        printf("note: no training data at '%s'; the data loader is counted as 0 bytes\n",
               cfg->data);
        *peak = 0;
        return 0;
    }
    size_t before = fl_mem_current(FL_MEM_OTHER);
    fl_loader train, val;
    fl_loader_open(&train, cfg->data, "train", cfg->seq_len, 0, 0, 0, 1);
    int has_val = fl_loader_open_val(&val, cfg->data, cfg->val_data, cfg->seq_len);
    // a run holds its tokenizer's files (its checkpoints store them) and,
    // when it samples at the end, the tokenizer
    fl_tokenizer_files files;
    fl_tokenizer_files_read(&files, cfg->tokenizer, cfg->tokenizer_path);
    fl_tokenizer *tok = cfg->sample_tokens > 0 ? fl_tokenizer_load_files(&files) : NULL;
    size_t bytes = fl_mem_current(FL_MEM_OTHER) - before;
    *peak = fl_mem_peak(FL_MEM_OTHER) - before;
    if (tok) fl_tokenizer_free(tok);
    fl_tokenizer_files_free(&files);
    if (has_val) fl_loader_close(&val);
    fl_loader_close(&train);
    return bytes;
}

int cmd_plan(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    plan_flags f = {1, 0, 0, 0, 0};
    char **args = fl_alloc(FL_MEM_OTHER, ((size_t)argc + 1) * sizeof(char *));
    memcpy(args, argv, (size_t)argc * sizeof(char *));
    int n = take_plan_flags(argc, args, &f);
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    fl_config_parse_args(&cfg, n, args);
    // `fitlm train` holds the run's config text (tag other) from here on
    size_t other_before = fl_mem_current(FL_MEM_OTHER);
    char *config_json = fl_config_to_json(&cfg);
    size_t json_bytes = fl_mem_current(FL_MEM_OTHER) - other_before;
    cfg.ranks = f.ranks;  // DeepSpeed's batch rule, for them
    if (*cfg.init_from) { // as `fitlm train`: a pretrained model brings its own shape
        fl_weight_source src;
        fl_weight_source_open(&src, cfg.init_from);
        fl_config_set_shape(&cfg, &src.config, cfg.init_from);
        fl_weight_source_close(&src);
    }
    fl_config_finish(&cfg, fl_tokenizer_vocab_of(cfg.tokenizer, cfg.tokenizer_path));
    fl_free(args);
    // as `fitlm train` does before planning: oneDNN sizes a bf16 GEMM's
    // scratchpad (tag workspace) by the threads it will run on
    fl_set_threads(cfg.threads);

    size_t data_peak, data = loader_bytes(&cfg, &data_peak);
    data += json_bytes;
    data_peak += json_bytes;
    fl_free(config_json);
    fl_plan_request r;
    fl_plan_request_from_config(&r, &cfg, data);
    r.data_peak = data_peak;
    r.ranks = f.ranks;
    if (f.rank >= f.ranks) fl_die("option --rank %d: must be below --ranks %d", f.rank, f.ranks);
    r.rank = f.rank;
    r.one_stage = f.rank_given; // under pipeline parallelism: that rank's stage alone
    r.lomo = f.lomo;
    r.num_params = f.params;

    const fl_model_config *m = &cfg.model;
    if (f.params)
        printf("model: %zu parameters (a raw count: model states only, no activations)\n",
               f.params);
    else
        printf("model %s: n_layer %d, n_head %d, n_embd %d, vocab %d (padded %d), max_seq_len %d: "
               "%zu parameters\n",
               *cfg.init_from ? cfg.init_from : cfg.model_preset, m->n_layer, m->n_head, m->n_embd,
               m->vocab_size, m->padded_vocab_size, m->max_seq_len, fl_model_num_params(m));
    printf("%s | %s", fl_dtype_name(cfg.dtype), cfg.optimizer);
    if (r.optim.kind == FL_OPT_SGD) printf(" (momentum %g)", r.optim.momentum);
    char layout[192] = ""; // t x p x d under tensor or pipeline parallelism
    if (cfg.pipeline_parallel > 1)
        snprintf(layout, sizeof layout,
                 " (tensor parallel %d x pipeline parallel %d (%s%s%.0d) x %d data-parallel)",
                 cfg.tensor_parallel, cfg.pipeline_parallel, cfg.pipeline_schedule,
                 cfg.virtual_stages > 1 ? " virtual stages " : "",
                 cfg.virtual_stages > 1 ? cfg.virtual_stages : 0,
                 f.ranks / (cfg.tensor_parallel * cfg.pipeline_parallel));
    else if (cfg.tensor_parallel > 1)
        snprintf(layout, sizeof layout, " (tensor parallel %d%s x %d data-parallel)",
                 cfg.tensor_parallel, cfg.sequence_parallel ? " with sequence parallelism" : "",
                 f.ranks / cfg.tensor_parallel);
    char offload[160] = ""; // what ZeRO offloads, and how the optimizer's step runs then
    const fl_zero_extra *x = &cfg.zero_extra;
    if (strcmp(x->offload_optimizer, "none"))
        snprintf(offload, sizeof offload, ", optimizer offloaded to %s%s%s%s%s",
                 x->offload_optimizer, strcmp(x->offload_param, "none") ? ", weights to " : "",
                 strcmp(x->offload_param, "none") ? x->offload_param : "",
                 x->opt_delayed_update ? ", delayed update" : "",
                 x->opt_accumulate_on_device ? ", fp32 sum on the device" : "");
    // on a device one process, LoRA one rank: ZeRO's partition is the whole
    // (the plain path)
    const char *one = cfg.zero.stage && (!r.dev->host || (cfg.lora_enabled && f.ranks == 1))
                          ? " (one process: nothing to partition)"
                          : "";
    char chunks[64] = "";
    if (cfg.logits_chunk)
        snprintf(chunks, sizeof chunks, " | logits in chunks of %d positions", cfg.logits_chunk);
    printf(
        " | micro-batch %d x %d tokens, grad accum %d | %d rank%s%s, ZeRO stage %d%s%s%s%s%s%s | "
        "%d threads\n",
        cfg.micro_batch, cfg.seq_len, cfg.grad_accum, f.ranks, f.ranks > 1 ? "s" : "", layout,
        cfg.zero.stage, one, offload, cfg.recompute ? " | activation checkpointing " : "",
        cfg.recompute ? cfg.recompute_policy : "", chunks, f.lomo ? " | LOMO" : "", cfg.threads);
    printf("data: %zu bytes (data loaders, tokenizer and the config's text; tokens are "
           "memory-mapped)\n\n",
           data);

    fl_plan p;
    fl_plan_compute(&r, &p);
    fl_plan_print(&p, stdout);
    // as `fitlm train` refuses it: NVMe offload's directory must hold its files
    if (p.disk)
        fl_offload_check_path("zero_optimization.offload_optimizer.nvme_path", p.disk_dir, p.disk);

    // as `fitlm train` checks: the device's free memory
    size_t device_limit = fl_plan_device_limit(&r);
    if (p.device_total && device_limit) {
        char desc[256], free_[FL_SIZE_TEXT], need[FL_SIZE_TEXT];
        r.dev->describe(r.dev, desc, sizeof desc);
        fl_size_text_pair(device_limit, p.device_total, free_, need);
        if (r.device_cap)
            printf("\ndevice budget %s (--mem-limit%s, at most the free memory) on %s: %s "
                   "needed, %s\n",
                   free_, r.dev->reserved(r.dev) ? " less what the device holds itself" : "", desc,
                   need, p.device_total <= device_limit ? "fits" : "does NOT fit");
        else
            printf("\ndevice memory %s free on %s: %s needed, %s\n", free_, desc, need,
                   p.device_total <= device_limit ? "fits" : "does NOT fit");
        size_t held = r.dev->reserved(r.dev);
        if (held)
            printf("the device holds %zu bytes itself (its context; --mem-limit, a card's total "
                   "memory, counts them)\n",
                   held);
        if (p.device_total > device_limit) {
            char alt[2048];
            fl_plan_device_alternatives(&r, device_limit, alt, sizeof alt);
            printf("what would fit on the device:\n%s", alt);
        }
    }
    // as `fitlm train` checks: the available memory shared by the ranks
    // (mpirun -np N on this machine), or --mem-limit per rank
    // (on a device --mem-limit is the device's budget, above)
    int host_limit = *cfg.mem_limit && !r.device_cap;
    size_t limit = host_limit ? fl_parse_bytes(cfg.mem_limit, "--mem-limit") : fl_mem_available();
    if (!limit) {
        printf("\nmemory limit: unknown (no /proc/meminfo); give --mem-limit to check the fit\n");
        return 0;
    }
    char source[96] = "--mem-limit";
    if (!host_limit && f.ranks > 1) {
        limit /= (size_t)f.ranks;
        snprintf(source, sizeof source, "available memory / %d ranks on this machine", f.ranks);
    } else if (!host_limit) {
        snprintf(source, sizeof source, "available memory");
    }
    // the limit against the plan's host bytes (and the run without offload):
    // exact bytes where the rounded sizes would read the same
    char lim[FL_SIZE_TEXT], total[FL_SIZE_TEXT], disk[FL_SIZE_TEXT], ram[FL_SIZE_TEXT];
    size_t host = p.total - p.device_total;
    fl_size_text_pair(limit, host, lim, total);
    printf("\nmemory limit %s%s (%s): %s\n", lim, f.ranks > 1 ? " per rank" : "", source,
           host <= limit ? "fits" : "does NOT fit");
    if (p.disk) {
        size_t without = p.total - p.bytes[FL_MEM_OFFLOAD] + fl_plan_offloaded(&p);
        fl_size_text_pair(without, limit, ram, lim);
        printf("NVMe offload: %s on disk under %s: fits; without offload %s of RAM: %s\n",
               fl_size_text(p.disk, disk), p.disk_dir, ram,
               without <= limit ? "fits" : "does NOT fit");
    }
    if (host > limit) {
        char alt[2048];
        fl_plan_alternatives(&r, limit, alt, sizeof alt);
        printf("what would fit:\n%s", alt);
    }
    return 0;
}
