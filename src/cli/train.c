// train.c: `fitlm train`: the training loop. With no options it is the demo:
// the default model on the Brown corpus in GPT-2 tokens, then a checkpoint
// and a sample.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/comm.h"
#include "fitlm/config.h"
#include "fitlm/data.h"
#include "fitlm/dist.h"
#include "fitlm/io.h"
#include "fitlm/metrics.h"
#include "fitlm/offload.h"
#include "fitlm/optim.h"
#include "fitlm/plan.h"
#include "fitlm/profile.h"
#include "fitlm/safetensors.h"
#include "fitlm/tokenizer.h"
#include "fitlm/train.h"
#include "fitlm/mfu.h"

// Mean loss over cfg->eval_iters fixed batches of the whole step's batch
// (micro-batch x ranks sequences) spread over the validation data: under
// data parallelism rank r evaluates every N-th micro-batch of them, the same
// windows one process with the global batch would, and the sums are added.
static float evaluate(fl_model *model, const fl_loader *val, const fl_train_config *cfg,
                      int *inputs, int *targets) {
    // each batch's mean weighted by its targets, whose count varies with a
    // loss mask: the mean over every target evaluated
    int rank = fl_comm_rank(), world = fl_comm_size();
    double sums[2] = {0.0, 0.0}; // loss x targets, targets
    for (int k = 0; k < cfg->eval_iters; k++) {
        fl_loader_eval_batch(val, k * world + rank, cfg->eval_iters * world, inputs, targets,
                             cfg->micro_batch);
        float loss = fl_model_forward(model, inputs, targets, cfg->micro_batch, cfg->seq_len);
        sums[0] += (double)loss * model->n_targets;
        sums[1] += model->n_targets;
    }
    fl_comm_sum(sums, 2);
    return sums[1] ? (float)(sums[0] / sums[1]) : 0.0f;
}

static void help(void) {
    printf("usage: fitlm train [options]\n\n"
           "Trains a GPT-2 or LLaMA model on token shards (made by 'fitlm tokenize'). With no "
           "options: the demo\n"
           "(the 'demo' model on the Brown corpus in GPT-2 tokens, made by scripts/demo.sh).\n\n");
    fl_config_print_help(stdout);
}

// The value of --resume, looked up before the config is read: the
// checkpoint's config comes first, then the flags.
static const char *resume_arg(int argc, char **argv) {
    const char *path = NULL;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--resume") && i + 1 < argc) path = argv[i + 1];
        if (!strncmp(argv[i], "--resume=", 9)) path = argv[i] + 9;
    }
    return path && *path ? path : NULL;
}

// Whether `flag` (e.g. "--out") is on the command line, as "--out X" or "--out=X".
static int flag_given(int argc, char **argv, const char *flag) {
    size_t n = strlen(flag);
    for (int i = 0; i < argc; i++)
        if (!strncmp(argv[i], flag, n) && (argv[i][n] == 0 || argv[i][n] == '=')) return 1;
    return 0;
}

// The run's records in OUT (fitlm/metrics.h): log.txt, exact values (%.9g
// round-trips a float) as plain text, and metrics.jsonl, the same and more
// (tokens, throughput, MFU, memory) as JSON for `fitlm plot`.
typedef struct {
    fl_line_log text, json;
    double tokens; // trained on so far
    double flops_per_token, peak_flops;
} run_log;

// Tokens trained on by the kept records of a resumed metrics.jsonl (its last
// step's), or `fallback` when it has none.
static double tokens_so_far(const char *path, double fallback) {
    if (access(path, F_OK) != 0) return fallback;
    fl_metrics m;
    fl_metrics_read(path, &m);
    double tokens = m.n_steps && isfinite(m.steps[m.n_steps - 1].tokens)
                        ? m.steps[m.n_steps - 1].tokens
                        : fallback;
    fl_metrics_free(&m);
    return tokens;
}

static void open_log(run_log *log, const char *out_dir, int resume_step, double tokens_per_step) {
    memset(log, 0, sizeof *log);
    char path[FL_PATH_MAX + 32] = "";
    if (*out_dir) snprintf(path, sizeof path, "%s/log.txt", out_dir);
    fl_line_log_open(&log->text, path, "training log", resume_step, fl_text_line_step);
    if (*out_dir) snprintf(path, sizeof path, "%s/metrics.jsonl", out_dir);
    fl_line_log_open(&log->json, path, "metrics log", resume_step, fl_metrics_line_step);
    int start = resume_step > 0 ? resume_step : 0;
    log->tokens = start * tokens_per_step;
    if (*path && resume_step > 0) log->tokens = tokens_so_far(path, log->tokens);
}

static void log_eval(run_log *log, int step, float val_loss) {
    fl_line_log_printf(&log->text, "step %d val %.9g\n", step, val_loss);
    fl_metrics_eval e = {step, log->tokens, val_loss};
    fl_metrics_write_eval(&log->json, &e);
}

static void close_log(run_log *log) {
    fl_line_log_close(&log->text);
    fl_line_log_close(&log->json);
}

// The terminal's progress line: a bar, the step, loss, throughput and the
// time left at the median of the last steps' times (a median: an evaluation
// or checkpoint step does not throw it).
#define RECENT 16
static void progress_line(int step, int steps, float loss, double tok_s, const double *recent_ms,
                          int n_recent) {
    double sorted[RECENT];
    int n = n_recent < RECENT ? n_recent : RECENT;
    memcpy(sorted, recent_ms, sizeof(double) * (size_t)n);
    for (int i = 1; i < n; i++) // insertion sort: at most RECENT values
        for (int j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
            double t = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = t;
        }
    long eta = lround((steps - step) * sorted[n / 2] / 1e3);
    char bar[21];
    int filled = (int)((long)20 * step / steps);
    for (int i = 0; i < 20; i++) bar[i] = i < filled ? '#' : '.';
    bar[20] = 0;
    printf("\r\033[K[%s] %3d%% step %d/%d | loss %.4f | %.0f tok/s | ETA %ld:%02ld:%02ld", bar,
           (int)(100L * step / steps), step, steps, loss, tok_s, eta / 3600, eta / 60 % 60,
           eta % 60);
}

// ----------------------------------------------------------------------------
// the output directory: one run at a time, never another run's files

// Takes DIR/.lock (flock, held until the process exits: the kernel releases
// it however the process ends) and writes the pid into it. A second run into
// DIR fails at once naming the first's pid.
static void lock_dir(const char *dir) {
    char path[FL_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) fl_die("cannot create the lock file %s: %s", path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char pid[32] = "";
        ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        pid[n > 0 ? n : 0] = 0;
        pid[strcspn(pid, "\n")] = 0;
        fl_die("%s is in use by another fitlm run (process %s): one run per directory; wait for "
               "it to finish, stop it, or choose another --out",
               dir, *pid ? pid : "unknown");
    }
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n)
        fl_die("cannot write the lock file %s: %s", path, strerror(errno));
    // fd stays open: the lock lives as long as the process
}

// Whether DIR holds a run: `latest`, a checkpoint file or a log.
static int holds_run(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int found = 0;
    for (struct dirent *e; !found && (e = readdir(d));) {
        int step, n = 0;
        found =
            !strcmp(e->d_name, "latest") || !strcmp(e->d_name, "log.txt") ||
            !strcmp(e->d_name, "metrics.jsonl") ||
            (sscanf(e->d_name, "ckpt_%d.fitlm%n", &step, &n) == 1 && n == (int)strlen(e->d_name));
    }
    closedir(d);
    return found;
}

static int same_dir(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

// Makes out_dir ready for this run: created, locked, a killed writer's
// temporary files deleted, and refused when it holds another run that this
// one does not continue (resume_dir: the directory of the resumed checkpoint).
static void prepare_out_dir(const char *out_dir, const char *resume_dir, int overwrite) {
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        fl_die("cannot create output directory %s: %s", out_dir, strerror(errno));
    if (access(out_dir, W_OK) != 0)
        fl_die("cannot write into output directory %s: %s", out_dir, strerror(errno));
    lock_dir(out_dir);
    fl_ckpt_clean_tmp(out_dir); // ours now: a leftover is a dead writer's
    if (resume_dir && same_dir(resume_dir, out_dir)) return;
    if (!overwrite && holds_run(out_dir))
        fl_die("%s already holds a run (checkpoints, latest, log.txt or metrics.jsonl): continue "
               "it with --resume %s, or start over in it with --overwrite (its checkpoints are not "
               "deleted first, only replaced where this run saves the same step), or choose "
               "another --out",
               out_dir, out_dir);
}

// A new id for a run: its checkpoints carry it, and pruning deletes no
// checkpoint of another id. Time and pid: unique among the runs of a directory.
static void new_run_id(char *out, size_t size) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x =
        ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 40);
    snprintf(out, size, "%016llx", (unsigned long long)x);
}

// ----------------------------------------------------------------------------
// interrupts: SIGINT or SIGTERM asks the loop to stop after the current step
// and save; a second signal exits at once (the checkpoint writer's temporary
// file + rename leaves the previous checkpoint as it was).

static volatile sig_atomic_t stop_signal = 0;

static void on_signal(int sig) {
    if (stop_signal) _exit(128 + sig);
    stop_signal = sig;
}

static void catch_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

// The config header, with the shape's true origin (a checkpoint or a
// pretrained directory) in place of a preset name.
static void print_config(const fl_train_config *cfg, const char *shape_from) {
    char *text = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&text, &n);
    if (!m) fl_die("out of memory");
    fl_config_print(cfg, m);
    fclose(m);
    const char *arch = strstr(text, " (");
    if (shape_from && !strncmp(text, "model ", 6) && arch)
        printf("model from %s%s", shape_from, arch);
    else
        fputs(text, stdout);
    free(text);
}

// Whether the trained weights are all finite: checked before a checkpoint
// is written, so a diverged model never replaces a good one.
// Whether every rank's weights (the range its optimizer updates) are finite.
static int weights_finite(const fl_optimizer *optim, const fl_optimizer *base) {
    const fl_optimizer *sets[2] = {optim, base};
    double bad = 0.0;
    for (int i = 0; i < 2; i++) {
        const fl_optimizer *o = sets[i];
        if (!o) continue;
        size_t first = o->rule->state_begin, n = o->rule->state_end - first;
        if (o->master ? fl_has_inf_or_nan(FL_F32, o->master, n)
                      : fl_has_inf_or_nan(
                            o->dtype, fl_at_const(o->dtype, o->params, first - o->params_first), n))
            bad = 1.0;
    }
    fl_comm_max(&bad, 1);
    return bad == 0.0;
}

// NVMe offload's traffic per training step, and how much of it the step
// waited for (the rest was hidden behind the update and the next chunks').
static void print_offload(const fl_offload *f, const fl_offload_stats *from, int steps,
                          double step_seconds) {
    fl_offload_stats s;
    fl_offload_stats_get(f, &s);
    double rd = (double)(s.bytes_read - from->bytes_read) / steps,
           wr = (double)(s.bytes_written - from->bytes_written) / steps,
           wait = (s.wait_s - from->wait_s) / steps, busy = (s.busy_s - from->busy_s) / steps;
    printf("NVMe offload per step (%s%s): read %.3f GB, written %.3f GB, I/O %.2f s (%.2f GB/s); "
           "the step waited %.2f s of its %.2f s for it (%.0f%% of the I/O time hidden)",
           fl_offload_path(f), fl_offload_direct(f) ? ", O_DIRECT" : "", rd / 1e9, wr / 1e9, busy,
           busy > 0 ? (rd + wr) / busy / 1e9 : 0.0, wait, step_seconds / steps,
           busy > 0 ? 100.0 * (1.0 - (wait < busy ? wait : busy) / busy) : 100.0);
    double weights = (s.weights_s - from->weights_s) / steps;
    if (weights > 0) printf("; ZeRO-3's reads of offloaded weights waited %.2f s", weights);
    printf("\n");
}

// A checkpoint after `step` (a paged optimizer's state read through its
// mapping), unless the weights have diverged: a good checkpoint is never
// replaced by a bad one.
static void save_checkpoint(const fl_train_config *cfg, int step, int dist, fl_model *model,
                            fl_optimizer *optim, const fl_optimizer *base, const fl_loader *train,
                            const char *config_json, const char *run_id) {
    fl_optimizer_map(optim);
    if (!weights_finite(optim, base))
        fl_die("the weights are not finite after step %d: not writing a checkpoint over the good "
               "ones in %s (training diverged; lower the learning rate)",
               step, cfg->out_dir);
    if (dist) // every rank its shard (DDP: rank 0 all), agreed before anything is visible
        fl_train_ckpt_save_dist(cfg->out_dir, step, model, optim, &train->state, train->tokenizer,
                                config_json, cfg->keep_checkpoints, run_id);
    else
        fl_train_ckpt_save_run(cfg->out_dir, step, model, optim, base, &train->state,
                               train->tokenizer, config_json, cfg->keep_checkpoints, run_id);
    fl_optimizer_unmap(optim);
}

// Ranks beyond the first print nothing on stdout (their errors still reach
// stderr, naming the rank); a memory report is every rank's, in rank order.
static void rank_memory_report(void) {
    int world = fl_comm_size();
    for (int r = 0; r < world; r++) {
        if (r == fl_comm_rank()) {
            FILE *out = r == 0 ? stdout : stderr;
            if (world > 1) fprintf(out, "memory of rank %d:\n", r);
            fl_mem_report(out);
            fflush(out);
        }
        fl_comm_barrier();
    }
}

// A signal reaches the ranks at slightly different moments: they stop
// after the same step when any of them has one.
static int any_rank(int flag) {
    double v = flag;
    fl_comm_max(&v, 1);
    return v != 0.0;
}

int cmd_train(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    // under mpirun: one rank of several (a plain run starts no MPI)
    fl_comm_init(NULL, NULL);
    int rank = fl_comm_rank(), world = fl_comm_size();
    if (rank > 0 && !freopen("/dev/null", "w", stdout))
        fl_die("cannot silence rank %d's output: %s", rank, strerror(errno));
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    const char *resume = resume_arg(argc, argv);
    fl_ckpt *ck = NULL;
    fl_train_config saved = cfg; // the checkpoint's run, for what a resume changes
    char resume_dir[FL_PATH_MAX] = "", run_id[64] = "";
    if (resume) {
        ck = fl_ckpt_open(resume);
        char *json = fl_train_ckpt_config(ck);
        char where[FL_FILE_PATH_MAX + 32];
        snprintf(where, sizeof where, "config in checkpoint %s", fl_ckpt_path(ck));
        fl_config_load_json_text(&cfg, json, strlen(json), where);
        fl_free(json);
        saved = cfg;
        // the directory the checkpoint is in: DIR itself, or a file's directory
        char copy[FL_FILE_PATH_MAX];
        snprintf(copy, sizeof copy, "%s", fl_ckpt_path(ck));
        snprintf(resume_dir, sizeof resume_dir, "%s", dirname(copy));
        snprintf(run_id, sizeof run_id, "%s", fl_ckpt_run(ck));
    }
    fl_config_parse_args(&cfg, argc, argv);
    // the checkpoint's config must be read before any other: a flag only
    if (*cfg.resume && !resume)
        fl_die("resume is a command-line option (--resume DIR), not a config-file key");
    if (resume && (flag_given(argc, argv, "--init-from") || strcmp(cfg.init_from, saved.init_from)))
        fl_die("--init-from and --resume together: a resumed run takes its weights from the "
               "checkpoint %s (drop --init-from)",
               fl_ckpt_path(ck));
    // A resume continues where its checkpoint is (or in --out, given now),
    // never in the out_dir recorded in the checkpoint's config: a copy of a
    // run must not write into, prune or truncate the original's.
    if (resume && !flag_given(argc, argv, "--out")) {
        if (strlen(resume_dir) >= sizeof cfg.out_dir)
            fl_die("checkpoint directory name is too long: %s", resume_dir);
        strcpy(cfg.out_dir, resume_dir);
    }
    if (!*run_id) new_run_id(run_id, sizeof run_id); // a new run, or a checkpoint without one
    // about this invocation, not the run: not inherited by a resume
    fl_config_set_given(&cfg, "overwrite", 0);
    // Pretrained weights bring their tokenizer (a Hugging Face directory's
    // tokenizer.json, a checkpoint's run's) unless the run names one.
    if (!resume && *cfg.init_from && !fl_config_given(&cfg, "tokenizer")) {
        char name[sizeof cfg.tokenizer], path[sizeof cfg.tokenizer_path];
        if (fl_source_tokenizer(cfg.init_from, name, sizeof name, path, sizeof path)) {
            strcpy(cfg.tokenizer, name);
            if (!fl_config_given(&cfg, "tokenizer_path")) strcpy(cfg.tokenizer_path, path);
        }
    }
    char *config_json = fl_config_to_json(&cfg); // the run as given, for its checkpoints
    // A resumed or pretrained model brings its own shape: its weights are
    // opened once, here, and their rows read when the model is made.
    const char *shape_from = resume ? resume : *cfg.init_from ? cfg.init_from : NULL;
    fl_weight_source weights = {0};
    if (ck)
        fl_ckpt_source(&weights, ck);
    else if (shape_from)
        fl_weight_source_open(&weights, shape_from);
    if (shape_from) fl_config_set_shape(&cfg, &weights.config, shape_from);
    fl_config_finish(&cfg);
    fl_comm_set_timeout(cfg.zero.comm_timeout);
    int dist = fl_dist_wanted(&cfg.zero);
    int start = ck ? fl_ckpt_step(ck) : 0;
    if (ck && cfg.steps <= start)
        fl_die("train_steps %d is not above the checkpoint's step %d (%s): nothing to train; give "
               "--steps above %d",
               cfg.steps, start, fl_ckpt_path(ck), start);
    // rank 0 owns the output directory; the others find it ready
    if (*cfg.out_dir && rank == 0)
        prepare_out_dir(cfg.out_dir, ck ? resume_dir : NULL, cfg.overwrite);
    fl_comm_barrier();
    if (*cfg.adapter) { // the adapter's LoRA config, which the lora.* options must not contradict
        fl_lora_config adapter;
        fl_peft_read_config(cfg.adapter, &adapter);
        fl_config_set_lora(&cfg, &adapter, cfg.adapter);
    }
    fl_set_threads(cfg.threads);
    int B = cfg.micro_batch, T = cfg.seq_len;
    fl_optimizer_config ocfg = fl_config_optimizer(&cfg);
    int lora = cfg.lora_enabled, train_base = lora && cfg.lora.train_base;
    fl_optimizer_config bcfg = train_base ? fl_config_base_optimizer(&cfg) : ocfg;
    if (train_base && cfg.dtype == FL_F16)
        fl_die("lora.base_optimizer with fp16 is not supported (two loss scalers would have to "
               "agree): use --precision bf16");

    // Data first: the shards name their tokenizer and vocabulary. What the
    // loaders and the tokenizer keep (tag other) is measured for the plan.
    fl_loader train, val;
    fl_loader_open(&train, cfg.data, "train", T, cfg.seed, 1, rank, world);
    if (strcmp(train.tokenizer, cfg.tokenizer))
        fl_die("the training data %s was tokenized with '%s', but the tokenizer is '%s' (set "
               "--tokenizer %s)",
               cfg.data, train.tokenizer, cfg.tokenizer, train.tokenizer);
    int tokenizer_vocab = fl_tokenizer_vocab_of(cfg.tokenizer, cfg.tokenizer_path);
    if ((int)train.vocab_size != tokenizer_vocab) {
        char learnt[FL_PATH_MAX + 16]; // where fitlm tokenize --learn-vocab puts its tokenizer
        snprintf(learnt, sizeof learnt, "%s/encoder.json", cfg.data);
        int beside = access(learnt, R_OK) == 0;
        fl_die("the training data %s has a vocabulary of %u, but the %s tokenizer at %s has %d: "
               "the data was tokenized with another one%s%s%s",
               cfg.data, train.vocab_size, cfg.tokenizer,
               strcmp(cfg.tokenizer, "byte") ? cfg.tokenizer_path : "(built in)", tokenizer_vocab,
               beside ? " (its directory holds a learnt one: --tokenizer-path " : "",
               beside ? cfg.data : "", beside ? ")" : "");
    }
    if ((int)train.vocab_size > cfg.model.vocab_size)
        fl_die("the training data %s has a vocabulary of %u, larger than the model's %d", cfg.data,
               train.vocab_size, cfg.model.vocab_size);
    int has_val = fl_loader_open_val(&val, cfg.data, cfg.val_data, T);
    if (has_val && (strcmp(val.tokenizer, train.tokenizer) || val.vocab_size != train.vocab_size))
        fl_die("the validation data (tokenizer %s) does not match the training data (tokenizer %s)",
               val.tokenizer, train.tokenizer);
    // before the model exists, so its scratch never adds to a memory peak
    double baseline = has_val ? fl_loader_unigram_xent(&train, &val) : 0.0;
    fl_tokenizer *tok =
        cfg.sample_tokens > 0 ? fl_tokenizer_load(cfg.tokenizer, cfg.tokenizer_path) : NULL;
    // tag other so far: the config's text, the loaders' tables, the tokenizer
    size_t data_bytes = fl_mem_current(FL_MEM_OTHER), data_peak = fl_mem_peak(FL_MEM_OTHER);

    // Plan before allocating the model: a run that cannot fit stops here
    // with advice, rather than being killed by the kernel halfway through.
    fl_plan_request req;
    fl_plan_request_from_config(&req, &cfg, data_bytes);
    req.data_peak = data_peak;
    // pretrained weights load whole (a resume takes its own)
    req.whole_weights_first = *cfg.init_from && (!resume || (lora && !train_base));
    req.ranks = world;
    fl_plan plan;
    fl_plan_compute(&req, &plan);
    size_t limit = *cfg.mem_limit ? fl_parse_bytes(cfg.mem_limit, "mem_limit") : fl_mem_available();
    // the ranks on this machine share its memory
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!*cfg.mem_limit && local && atoi(local) > 1) limit /= (size_t)atoi(local);
    fl_plan_check_fits(&req, &plan, limit);

    // The model: pretrained weights (a resume has its own, unless they are
    // a LoRA run's frozen base, which the checkpoint does not hold), NF4 rows
    // quantised as they load, then the adapters.
    fl_model model;
    const fl_quant_config *quant = cfg.quant.enabled ? &cfg.quant : NULL;
    // ZeRO-3 over several ranks: a rank's shard only (a resume reads its
    // range); pretrained weights load whole, then the rank keeps its shard
    int pretrained = *cfg.init_from && (!resume || (lora && !train_base));
    // the range of the flat buffer this rank's optimizer covers (ZeRO: its shard)
    size_t own_begin = 0, own_end = fl_model_num_params(&cfg.model);
    if (dist) {
        fl_param_table t;
        fl_model_table(&t, &cfg.model);
        fl_dist_range(&cfg.zero, &t, &own_begin, &own_end);
        fl_params_free(&t);
    }
    // a resume's weights are its checkpoint's, but a frozen LoRA base's,
    // which it does not hold: that is init_from's, or the seed's
    if (resume && lora && !train_base) {
        fl_weight_source_close(&weights);
        if (pretrained)
            fl_weight_source_open(&weights, cfg.init_from);
        else
            fl_weight_source_random(&weights, &cfg.model, cfg.seed);
    } else if (!shape_from) {
        fl_weight_source_random(&weights, &cfg.model, cfg.seed);
    }
    int shard = !pretrained && dist && cfg.zero.stage == 3 && world > 1;
    fl_model_init_from(&model, &weights, cfg.dtype, quant, shard ? own_begin : 0,
                       shard ? own_end : SIZE_MAX);
    fl_weight_source_close(&weights);
    if (lora) {
        fl_model_add_lora(&model, &cfg.lora, cfg.seed);
        if (*cfg.adapter) fl_peft_load(cfg.adapter, &model);
    }
    fl_model_alloc_acts(&model, B, T, cfg.recompute,
                        dist   ? fl_dist_unit_grads(&cfg.zero)
                        : lora ? train_base && fl_optimizer_unit_grads(&bcfg)
                               : fl_optimizer_unit_grads(&ocfg));
    // what the optimizer trains: the adapters under LoRA (the base too, by
    // its own fused optimizer, under LoRA + LOMO), else the model
    fl_optimizer optim, base_optim;
    ocfg.sharded_grads = dist && cfg.zero.stage >= 2; // ZeRO-2/3 sum their own shards
    if (lora)
        fl_optimizer_init(&optim, &ocfg, &model.lora.table, cfg.dtype, model.lora.params,
                          model.lora.grads);
    else
        fl_optimizer_init_at(&optim, &ocfg, &model.table, cfg.dtype, model.params,
                             model.params_begin, model.grads, own_begin, own_end);
    if (train_base)
        fl_optimizer_init(&base_optim, &bcfg, &model.table, cfg.dtype, model.params, model.grads);
    fl_optimizer *base = train_base ? &base_optim : NULL;
    // NVMe offload: the master and the optimizer state move to a file,
    // filled from the weights now (a resume then overwrites it)
    fl_offload *offload = NULL;
    if (ocfg.paged) { // its directory and room were checked with the plan
        fl_offload_config oc = fl_offload_config_of(&cfg);
        offload = fl_offload_optimizer(&optim, &oc, cfg.zero.offload_params);
    }
    float base_lr = cfg.lora_base_lr > 0.0f ? cfg.lora_base_lr : cfg.lr;
    int ck_threads = 0, ck_world = 1;
    if (ck) {
        // a single file or a sharded checkpoint of any world size: the whole
        // weights, and the master and state of this rank's range (dist: its
        // shard); the loader's position split over this world's ranks
        fl_optimizer_map(&optim);
        fl_train_ckpt_restore(ck, &model, &optim, base, &train.state, train.tokenizer);
        fl_optimizer_unmap(&optim);
        ck_threads = fl_train_ckpt_threads(ck);
        ck_world = fl_train_ckpt_world(ck);
        if (train.state.index > train.per_rank)
            fl_die("checkpoint %s is at window %llu of an epoch of %llu: the training data has "
                   "changed since it was saved",
                   fl_ckpt_path(ck), (unsigned long long)train.state.index,
                   (unsigned long long)train.per_rank);
        fl_ckpt_close(ck);
    }
    fl_dist *strategy = dist ? fl_dist_attach(&model, &optim, &cfg.zero, offload) : NULL;
    fl_schedule schedule = {!strcmp(cfg.scheduler, "cosine")   ? FL_SCHED_COSINE
                            : !strcmp(cfg.scheduler, "linear") ? FL_SCHED_LINEAR
                                                               : FL_SCHED_CONSTANT,
                            cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio};
    // a step's micro-batches, loaded before it: the step weights every target
    // token of the accumulated batch alike
    size_t micro_tokens = (size_t)B * T;
    int *inputs = fl_alloc(FL_MEM_OTHER, micro_tokens * cfg.grad_accum * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, micro_tokens * cfg.grad_accum * sizeof(int));

    print_config(&cfg, shape_from);
    printf("%zu parameters (%.2f M)", model.table.numel, model.table.numel / 1e6);
    if (lora)
        printf(" + %zu in LoRA adapters (%.3f%%)%s", model.lora.table.numel,
               100.0 * model.lora.table.numel / model.table.numel,
               train_base ? ", base trained too" : ", base frozen");
    if (dist)
        printf("; %d rank%s, %s", world, world > 1 ? "s" : "",
               cfg.zero.stage ? (const char *[]){"", "ZeRO-1", "ZeRO-2", "ZeRO-3"}[cfg.zero.stage]
                              : "data parallel");
    printf("; planned memory %.1f MiB%s; train %s: %llu tokens (%s)", plan.total / 1048576.0,
           world > 1 ? " per rank" : "", cfg.data, (unsigned long long)train.n_tokens,
           train.tokenizer);
    double bytes_per_token = 0.0;
    if (has_val) {
        // masked examples record the bytes of their targets (the answers)
        bytes_per_token = (double)val.source_bytes / (double)val.n_targets;
        printf(", val %llu tokens; unigram baseline %.4f nats/token",
               (unsigned long long)val.n_tokens, baseline);
    }
    printf("\n");
    if (quant) {
        double mean, most, rms;
        fl_model_quant_error(&model, &mean, &most, &rms);
        size_t nq;
        double per = fl_quant_bytes_per_param(&model.table, &cfg.quant, &nq);
        printf("NF4 base (block %d%s): %zu parameters at %.4f bytes each; quantisation error "
               "mean %.3g, max %.3g (%.2f%% and %.1f%% of the weights' RMS %.3g)\n",
               cfg.quant.blocksize, cfg.quant.double_quant ? ", double quantisation" : "", nq, per,
               mean, most, 100.0 * mean / rms, 100.0 * most / rms, rms);
    }
    if (resume) {
        printf("resumed from step %d; continuing in %s\n", start,
               *cfg.out_dir ? cfg.out_dir : "(no output directory)");
        // what a resume changes is allowed, and said: the continuation is
        // then not the uninterrupted run's
        char changed[512] = "";
        size_t k = 0;
        const struct {
            const char *what;
            long long was, now;
        } diff[] = {{ck_world == world ? "batch" : "batch x ranks",
                     (long long)saved.micro_batch * ck_world, (long long)cfg.micro_batch * world},
                    {"seq_len", saved.seq_len, cfg.seq_len},
                    {"grad_accum", saved.grad_accum, cfg.grad_accum},
                    {"seed", (long long)saved.seed, (long long)cfg.seed}};
        for (size_t i = 0; i < sizeof diff / sizeof diff[0]; i++)
            if (diff[i].was != diff[i].now && k < sizeof changed)
                k += (size_t)snprintf(changed + k, sizeof changed - k, "%s%s %lld (was %lld)",
                                      k ? ", " : "", diff[i].what, diff[i].now, diff[i].was);
        if (k)
            printf("notice: resuming with %s: the continuation differs from the uninterrupted "
                   "run\n",
                   changed);
        if (ck_world != world)
            printf("notice: resuming on %d rank%s (saved by %d): the same steps, summed in "
                   "another order\n",
                   world, world > 1 ? "s" : "", ck_world);
        // fitlm's own reductions sum in a fixed order whatever the thread
        // count, but the GEMM libraries (BLAS, oneDNN) may block by thread
        if (ck_threads && ck_threads != cfg.threads)
            printf("notice: threads %d differs from the checkpoint's %d: the continuation may "
                   "not be bit-identical (the GEMM libraries may split sums by thread)\n",
                   cfg.threads, ck_threads);
    }
    run_log log;
    double tokens_per_step = (double)micro_tokens * cfg.grad_accum * world; // every rank's
    const char *log_dir = rank == 0 ? cfg.out_dir : ""; // rank 0 writes the shared files
    open_log(&log, log_dir, resume ? start : -1, tokens_per_step);
    // MFU's numerator and denominator, recorded with the run (the peak is
    // measured only when there is a metrics log to write it in)
    log.flops_per_token = fl_mfu_flops_per_token(&model, T, lora && !train_base);
    if (*log_dir) {
        char how[128] = "given (--peak-tflops)";
        log.peak_flops = cfg.peak_tflops > 0
                             ? cfg.peak_tflops * 1e12
                             : fl_mfu_peak(cfg.dtype, fl_threads(), how, sizeof how);
        fl_metrics_run run = {.step = start,
                              .params = (double)model.table.numel,
                              .flops_per_token = log.flops_per_token,
                              .tokens_per_step = tokens_per_step,
                              .peak_flops = log.peak_flops,
                              .peak = how};
        fl_metrics_write_run(&log.json, &run);
    }
    double recent_ms[RECENT];

    int tty = isatty(STDOUT_FILENO), skipped = 0, saved_at = -1, nonfinite = 0, interrupted = 0;
    catch_signals();
    double train_start = fl_now();
    fl_comm_stats comm = {0}; // the training steps' traffic (not evaluation's)
    fl_offload_stats io0 = {0};
    if (offload) fl_offload_stats_get(offload, &io0);
    double step_seconds = 0.0;
    fl_profile_reset();
    for (int step = start; step < cfg.steps; step++) {
        if (has_val && cfg.eval_interval && step % cfg.eval_interval == 0 &&
            (step > start || !ck)) {
            float val_loss = evaluate(&model, &val, &cfg, inputs, targets);
            printf("%sstep %5d | val loss %.4f\n", tty ? "\r\033[K" : "", step, val_loss);
            log_eval(&log, step, val_loss);
        }
        // Only the training step is profiled (not evaluation, logging or
        // checkpoints), and not the first one: warm-up (page faults, kernel setup).
        fl_profile_enable(cfg.profile && step > start);
        double t0 = fl_now();
        for (int micro = 0; micro < cfg.grad_accum; micro++)
            FL_PROFILE(FL_OP_LOADER, FL_STEP, 0.0,
                       fl_loader_next(&train, inputs + micro * micro_tokens,
                                      targets + micro * micro_tokens, B));
        float lr = fl_lr_at(&schedule, step);
        fl_comm_stats c0 = fl_comm_get_stats();
        fl_train_result r =
            train_base ? fl_lora_lomo_step(&model, &optim, base, inputs, targets, B, T, lr,
                                           lr * (base_lr / cfg.lr))
                       : fl_train_step(&model, &optim, inputs, targets, cfg.grad_accum, B, T, lr);
        float loss = r.loss;
        skipped += r.skipped;
        double ms = (fl_now() - t0) * 1e3;
        fl_comm_stats c1 = fl_comm_get_stats();
        comm.elements += c1.elements - c0.elements;
        comm.bytes += c1.bytes - c0.bytes;
        comm.wait_seconds += c1.wait_seconds - c0.wait_seconds;
        comm.collectives += c1.collectives - c0.collectives;
        step_seconds += ms / 1e3;
        if (fl_profile_on) fl_profile_step(ms / 1e3);
        fl_profile_enable(0);
        double tok_s = tokens_per_step / (ms / 1e3);
        recent_ms[(step - start) % RECENT] = ms;
        if (tty) { // rewritten in place
            progress_line(step + 1, cfg.steps, loss, tok_s, recent_ms, step - start + 1);
            if (cfg.dtype == FL_F16 && skipped) printf(" | skipped %d", skipped);
        } else { // one plain line per step: what scripts and tests read
            printf("step %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s", step + 1,
                   cfg.steps, loss, lr, r.grad_norm, ms, tok_s);
            if (cfg.dtype == FL_F16)
                printf(" | scale %g%s | skipped %d", r.loss_scale, r.skipped ? " OVERFLOW" : "",
                       skipped);
            printf("\n");
        }
        fl_line_log_printf(&log.text, "step %d loss %.9g lr %.9g norm %.9g scale %.9g\n", step + 1,
                           (float)loss, lr, r.grad_norm, r.loss_scale);
        log.tokens += tokens_per_step;
        double flops = log.flops_per_token * tok_s;
        fl_metrics_step m = {.step = step + 1,
                             .tokens = log.tokens,
                             .loss = loss,
                             .lr = lr,
                             .grad_norm = r.grad_norm,
                             .loss_scale = r.loss_scale,
                             .skipped = r.skipped,
                             .tokens_per_s = tok_s,
                             .ms = ms,
                             .mfu = log.peak_flops > 0.0 ? flops / log.peak_flops : NAN};
        int memory = step == start || (step + 1) % cfg.metrics_memory_every == 0 ||
                     (cfg.mem_report_every && (step + 1) % cfg.mem_report_every == 0);
        fl_metrics_write_step(&log.json, &m, memory);
        // Divergence: a non-finite loss or norm that is not an fp16 overflow
        // the scaler skipped. Skipped steps changed nothing (fl_optimizer_step,
        // or LOMO's first pass); a single-pass LOMO step has already updated.
        int overflow = r.skipped && cfg.dtype == FL_F16;
        if (!overflow && (r.skipped || !isfinite(loss) || !isfinite(r.grad_norm))) {
            if (tty) printf("\n");
            char norm[32]; // a fused first pass that skipped reports no norm
            if (r.skipped && isfinite(r.grad_norm))
                snprintf(norm, sizeof norm, "inf or NaN");
            else
                snprintf(norm, sizeof norm, "%g", r.grad_norm);
            if (!r.skipped)
                fl_die("training diverged at step %d: loss %g, gradient norm %s, and the update "
                       "was already applied (LOMO/AdaLomo without clipping check the norm only "
                       "after updating: set --grad-clip for a first pass that can skip). No "
                       "checkpoint is written for it%s%s%s",
                       step + 1, loss, norm, *cfg.out_dir ? ": " : "", cfg.out_dir,
                       *cfg.out_dir ? "/latest, if any, stays the last good one" : "");
            if (++nonfinite > cfg.skip_nonfinite)
                fl_die("training diverged at step %d: loss %g, gradient norm %s (not finite; the "
                       "step was not applied%s). No checkpoint is written for it%s%s%s. Lower "
                       "the learning rate, or let --skip-nonfinite N skip up to N such steps",
                       step + 1, loss, norm,
                       cfg.skip_nonfinite ? ", and --skip-nonfinite's budget is spent" : "",
                       *cfg.out_dir ? ": " : "", cfg.out_dir,
                       *cfg.out_dir ? "/latest, if any, stays the last good one" : "");
            printf("%sstep %d skipped: loss %g, gradient norm %s: not finite (%d of "
                   "--skip-nonfinite %d)\n",
                   tty ? "\n" : "", step + 1, loss, norm, nonfinite, cfg.skip_nonfinite);
        }
        if (cfg.mem_report_every && (step + 1) % cfg.mem_report_every == 0) {
            printf("%s", tty ? "\n" : "");
            rank_memory_report();
        }
        // One reading of the flag: a signal arriving between the save and
        // the stop must not stop the run without its checkpoint (nor stop
        // one rank while the others go on); it is seen after the next step.
        int stop = stop_signal;
        if (world > 1 && any_rank(stop) && !stop) stop = stop_signal = SIGTERM;
        int save = cfg.save_every && (step + 1) % cfg.save_every == 0;
        if (*cfg.out_dir && (save || stop) && saved_at != step + 1) {
            save_checkpoint(&cfg, step + 1, dist, &model, &optim, base, &train, config_json,
                            run_id);
            saved_at = step + 1;
        }
        fflush(stdout);
        if (stop) { // after the step and its checkpoint: nothing is lost
            int sig = stop;
            if (tty) printf("\n");
            if (*cfg.out_dir)
                printf("interrupted by %s after step %d: checkpoint written to %s (continue with "
                       "fitlm train --resume %s)\n",
                       sig == SIGINT ? "SIGINT" : "SIGTERM", step + 1, cfg.out_dir, cfg.out_dir);
            else
                printf("interrupted by %s after step %d: no checkpoint (out_dir is empty)\n",
                       sig == SIGINT ? "SIGINT" : "SIGTERM", step + 1);
            fflush(stdout);
            interrupted = 1;
            break;
        }
    }
    if (tty && !interrupted) printf("\n");
    double seconds = fl_now() - train_start;
    if (cfg.profile && !interrupted) fl_profile_print(stdout);
    int steps_run = cfg.steps - start;
    if (world > 1 && steps_run > 0)
        printf("communication per step and rank: %.4g elements (%.3f x the %zu parameters), "
               "%.4g MB, %.1f collectives; %.1f%% of the step time waiting on them\n",
               comm.elements / steps_run, comm.elements / steps_run / (double)model.table.numel,
               model.table.numel, comm.bytes / steps_run / 1e6,
               (double)comm.collectives / steps_run, 100.0 * comm.wait_seconds / step_seconds);
    if (offload && steps_run > 0) print_offload(offload, &io0, steps_run, step_seconds);
    if (has_val && !interrupted) {
        float val_loss = evaluate(&model, &val, &cfg, inputs, targets);
        printf("final val loss %.4f nats/token (%.4f nats/byte) after %d steps (%.1f s); unigram "
               "baseline %.4f nats/token\n",
               val_loss, val_loss / bytes_per_token, cfg.steps, seconds, baseline);
        log_eval(&log, cfg.steps, val_loss);
    }
    close_log(&log);
    if (*cfg.out_dir && saved_at != cfg.steps && cfg.steps > start && !interrupted) {
        save_checkpoint(&cfg, cfg.steps, dist, &model, &optim, base, &train, config_json, run_id);
        printf("checkpoint written to %s (step %d)\n", cfg.out_dir, cfg.steps);
    }
    if (*cfg.out_dir && lora) { // the adapters as PEFT saves them
        char dir[FL_PATH_MAX + 16];
        snprintf(dir, sizeof dir, "%s/adapter", cfg.out_dir);
        fl_peft_save(dir, &model, *cfg.init_from ? cfg.init_from : cfg.model_preset);
        printf("LoRA adapter written to %s (PEFT format)\n", dir);
    }
    if (tok && !stop_signal) { // interrupted, or a signal during the evaluation: no sample
        int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(cfg.sample_tokens + 4) * sizeof(int));
        // a sample starts like a fresh document
        tokens[0] = fl_tokenizer_bos(tok) >= 0 ? fl_tokenizer_bos(tok) : fl_tokenizer_eot(tok);
        fl_rng rng;
        fl_rng_seed(&rng, cfg.seed);
        printf("--- sample (temperature 0.8, top-k 40) ---\n");
        fl_model_generate(&model, tokens, 1, cfg.sample_tokens, 0.8f, 40, &rng, print_token, tok);
        printf("\n---\n");
        fl_free(tokens);
    }
    if ((cfg.mem_report || cfg.mem_report_every) && !interrupted) rank_memory_report();
    fl_free(inputs);
    fl_free(targets);
    fl_free(config_json);
    fl_dist_free(strategy);
    fl_offload_free(offload);
    fl_optimizer_free(&optim);
    if (base) fl_optimizer_free(base);
    fl_model_free(&model);
    if (tok) fl_tokenizer_free(tok);
    if (has_val) fl_loader_close(&val);
    fl_loader_close(&train);
    return fl_comm_finalize(stop_signal ? 128 + stop_signal : 0);
}
