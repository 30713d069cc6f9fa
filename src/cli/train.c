// train.c: `fitlm train`: the training loop. With no options it is the demo:
// the default model on the Brown corpus in GPT-2 tokens, then a checkpoint
// and a sample. The run itself (its model, optimizer, strategy, data and
// step) is src/run's; this command reads the flags, prints and records.
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "helpers.h"
#include "train_log.h"
#include "fitlm/comm.h"
#include "fitlm/device.h"
#include "fitlm/profile.h"
#include "fitlm/run.h"
#include "fitlm/safetensors.h"
#include "fitlm/tokenizer.h"

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

// What a resume changes is allowed, and said: the continuation is then not
// the uninterrupted run's.
static void print_resume(const fl_run *run) {
    const fl_train_config *cfg = &run->cfg, *saved = &run->saved;
    int world = run->world, ck_world = run->ck_world;
    printf("resumed from step %d; continuing in %s\n", run->start,
           *cfg->out_dir ? cfg->out_dir : "(no output directory)");
    char changed[512] = "";
    size_t k = 0;
    const struct {
        const char *what;
        long long was, now;
    } diff[] = {{ck_world == world ? "batch" : "batch x ranks",
                 (long long)saved->micro_batch * ck_world, (long long)cfg->micro_batch * world},
                {"seq_len", saved->seq_len, cfg->seq_len},
                {"grad_accum", saved->grad_accum, cfg->grad_accum},
                {"seed", (long long)saved->seed, (long long)cfg->seed}};
    for (size_t i = 0; i < sizeof diff / sizeof diff[0]; i++)
        if (diff[i].was != diff[i].now && k < sizeof changed)
            k += (size_t)snprintf(changed + k, sizeof changed - k, "%s%s %lld (was %lld)",
                                  k ? ", " : "", diff[i].what, diff[i].now, diff[i].was);
    if (k)
        printf("notice: resuming with %s: the continuation differs from the uninterrupted run\n",
               changed);
    if (ck_world != world)
        printf("notice: resuming on %d rank%s (saved by %d): the same steps, summed in another "
               "order\n",
               world, world > 1 ? "s" : "", ck_world);
    // fitlm's own reductions sum in a fixed order whatever the thread
    // count, but the GEMM libraries (BLAS, oneDNN) may block by thread
    if (run->ck_threads && run->ck_threads != cfg->threads)
        printf("notice: threads %d differs from the checkpoint's %d: the continuation may not be "
               "bit-identical (the GEMM libraries may split sums by thread)\n",
               cfg->threads, run->ck_threads);
}

// What the run is: its config, parameters, strategy, memory plan and data;
// NF4's quantisation error; what a resume changes.
static void print_run(const fl_run *run) {
    const fl_train_config *cfg = &run->cfg;
    const fl_model *model = &run->model;
    int world = run->world;
    print_config(cfg, *run->shape_from ? run->shape_from : NULL);
    if (!run->dev->host) { // the backend, the card and its free memory
        char desc[256];
        run->dev->describe(run->dev, desc, sizeof desc);
        printf("device: %s\n", desc);
    }
    const fl_optimizer_config *oc = &run->optim.cfg;
    if (run->dev_offload && oc->delayed_update) // docs/offload.md: the delayed update
        printf("ZeRO-Offload: the cpu updates during the next step (delayed_update), which "
               "computes with the weights one update older, after %d update%s run at once\n",
               oc->delayed_warmup, oc->delayed_warmup == 1 ? "" : "s");
    else if (run->dev_offload) // docs/offload.md: whether the update overlaps the backward pass
        printf("ZeRO-Offload: the cpu updates %s\n",
               fl_optimizer_can_overlap(&run->optim)
                   ? "each unit during the last backward pass"
                   : "after the backward pass (clipping, fp16 or the spike guard's norm test "
                     "need the whole gradient first)");
    else if (run->dev_adapters) // docs/offload.md: LoRA's adapters
        printf("ZeRO-Offload: the cpu updates the LoRA adapters after the backward pass (their "
               "gradients down, the adapters up, whole)\n");
    if (run->dev_weights && run->lora)
        printf("weight offload: the frozen base in pinned host memory, each unit up ahead of "
               "use\n");
    size_t whole = fl_model_whole_table(model)->numel;
    printf("%zu parameters (%.2f M)", whole, whole / 1e6);
    int pp = model->pp.size; // rank 0 prints: the first stage's rows
    if (run->tp.size > 1)
        printf("; tensor parallel %d%s", run->tp.size,
               run->tp.sequence_parallel ? " with sequence parallelism" : "");
    if (pp > 1) printf("; pipeline parallel %d", pp);
    if (run->tp.size > 1 || pp > 1)
        printf(": %zu per rank%s", model->table.numel, pp > 1 ? " of the first stage" : "");
    if (run->lora)
        printf(" + %zu in LoRA adapters (%.3f%%)%s", model->lora.table.numel,
               100.0 * model->lora.table.numel / model->table.numel,
               run->train_base ? ", base trained too" : ", base frozen");
    if (!run->dist && cfg->zero.stage) // one process (device_check, fl_dist_engine)
        printf("; ZeRO-%d on one process: nothing to partition%s", cfg->zero.stage,
               cfg->zero.stage == 3 && !run->dev->host && !run->dev_weights
                   ? " (the whole model stays on the device)"
                   : "");
    if (run->dist) // the data-parallel ranks (under model parallelism, each a TP x PP group)
        printf("; %d %srank%s, %s", world, run->tp.size * pp > 1 ? "data-parallel " : "",
               world > 1 ? "s" : "",
               cfg->zero.stage ? (const char *[]){"", "ZeRO-1", "ZeRO-2", "ZeRO-3"}[cfg->zero.stage]
                               : "data parallel");
    printf("; planned memory %.1f MiB%s; train %s: %llu tokens (%s)", run->plan.total / 1048576.0,
           world * run->tp.size * pp > 1 ? " per rank" : "", cfg->data,
           (unsigned long long)run->train.n_tokens, run->train.tokenizer);
    if (run->has_val)
        printf(", val %llu tokens; unigram baseline %.4f nats/token",
               (unsigned long long)run->val.n_tokens, run->baseline);
    printf("\n");
    if (cfg->quant.enabled) {
        double mean, most, rms;
        fl_model_quant_error(model, &mean, &most, &rms);
        size_t nq;
        double per = fl_quant_bytes_per_param(&model->table, &cfg->quant, &nq);
        printf("NF4 base (block %d%s): %zu parameters at %.4f bytes each; quantisation error "
               "mean %.3g, max %.3g (%.2f%% and %.1f%% of the weights' RMS %.3g)\n",
               cfg->quant.blocksize, cfg->quant.double_quant ? ", double quantisation" : "", nq,
               per, mean, most, 100.0 * mean / rms, 100.0 * most / rms, rms);
    }
    if (run->resumed) print_resume(run);
}

// A signal reaches the ranks at slightly different moments: they stop
// after the same step when any of them has one.
static int any_rank(int flag) {
    double v = flag;
    fl_comm_max(fl_comm_world(), &v, 1);
    return v != 0.0;
}

// After the last step (none interrupted the run): the final evaluation,
// checkpoint and PEFT adapter, then a sample. `saved_at`: the step of the
// last checkpoint written.
static void finish(fl_run *run, run_log *log, double seconds, int saved_at, int interrupted) {
    const fl_train_config *cfg = &run->cfg;
    if (run->has_val && !interrupted) {
        float val_loss = fl_run_evaluate(run, cfg->steps);
        printf("final val loss %.4f nats/token (%.4f nats/byte) after %d steps (%.1f s); unigram "
               "baseline %.4f nats/token\n",
               val_loss, val_loss / run->bytes_per_token, cfg->steps, seconds, run->baseline);
        run_log_eval(log, cfg->steps, val_loss);
    }
    run_log_close(log);
    if (*cfg->out_dir && saved_at != cfg->steps && cfg->steps > run->start && !interrupted) {
        fl_run_save(run, cfg->steps);
        printf("checkpoint written to %s (step %d)\n", cfg->out_dir, cfg->steps);
    }
    if (*cfg->out_dir && run->lora) { // the adapters as PEFT saves them
        char dir[FL_PATH_MAX + 16];
        snprintf(dir, sizeof dir, "%s/adapter", cfg->out_dir);
        fl_peft_save(dir, &run->model, *cfg->init_from ? cfg->init_from : cfg->model_preset);
        printf("LoRA adapter written to %s (PEFT format)\n", dir);
    }
    fl_tokenizer *tok = run->tok;
    if (tok && !stop_signal) { // interrupted, or a signal during the evaluation: no sample
        int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(cfg->sample_tokens + 4) * sizeof(int));
        // a sample starts like a fresh document
        tokens[0] = fl_tokenizer_bos(tok) >= 0 ? fl_tokenizer_bos(tok) : fl_tokenizer_eot(tok);
        fl_rng rng;
        fl_rng_seed(&rng, cfg->seed);
        printf("--- sample (temperature 0.8, top-k 40) ---\n");
        if (run->pipe)
            fl_pipeline_generate(run->pipe, tokens, 1, cfg->sample_tokens, 0.8f, 40, &rng,
                                 print_token, tok);
        else
            fl_model_generate(&run->model, tokens, 1, cfg->sample_tokens, 0.8f, 40, &rng,
                              print_token, tok);
        printf("\n---\n");
        fl_free(tokens);
    }
    if ((cfg->mem_report || cfg->mem_report_every) && !interrupted) rank_memory_report();
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
    // a resume's config comes first (the checkpoint's), then the flags
    fl_train_config given;
    fl_config_defaults(&given);
    fl_run_resume resume;
    const char *resume_path = resume_arg(argc, argv);
    if (resume_path) fl_run_resume_open(&resume, resume_path, &given);
    fl_config_parse_args(&given, argc, argv);
    fl_run_options opt = {.resume = resume_path ? &resume : NULL,
                          .out_given = flag_given(argc, argv, "--out"),
                          .init_from_given = flag_given(argc, argv, "--init-from"),
                          .tokenizer_path_given = flag_given(argc, argv, "--tokenizer-path")};
    fl_run run;
    fl_run_open(&run, &given, &opt);
    const fl_train_config *cfg = &run.cfg;
    int start = run.start;
    print_run(&run);
    run_log log;
    run_log_open(&log, &run);

    int saved_at = -1, interrupted = 0;
    catch_signals();
    double train_start = fl_now();
    fl_offload_stats io0 = {0};
    if (run.offload) fl_offload_stats_get(run.offload, &io0);
    fl_profile_use_clock(fl_device_profile_clock(fl_device_default())); // a GPU: its own clock
    fl_profile_reset();
    for (int step = start; step < cfg->steps; step++) {
        if (run.has_val && cfg->eval_interval && step % cfg->eval_interval == 0 &&
            (step > start || !run.resumed)) {
            float val_loss = fl_run_evaluate(&run, step);
            printf("%sstep %5d | val loss %.4f\n", log.tty ? "\r\033[K" : "", step, val_loss);
            run_log_eval(&log, step, val_loss);
        }
        // Only the training step is profiled (not evaluation, logging or
        // checkpoints), and not the first one: warm-up (page faults, kernel setup).
        fl_profile_enable(cfg->profile && step > start);
        // a profiled step on a device is timed from and to an idle device,
        // so that its ops' device times fall inside its wall time (the last
        // updates of a step otherwise run after its timer stops)
        const fl_device *dev = fl_device_default();
        float lr = fl_run_lr(&run, step); // before the step, which counts its update
        if (fl_profile_on) dev->sync(dev);
        double t0 = fl_now();
        fl_comm_stats c0 = fl_comm_get_stats();
        const fl_device *rd = run.dev; // the model's: its waits behind queued work
        long w0 = rd->host_stalls ? rd->host_stalls(rd) : -1;
        fl_train_result r = fl_run_step(&run, step);
        long waits = w0 >= 0 ? rd->host_stalls(rd) - w0 : -1;
        if (fl_profile_on) dev->sync(dev);
        double ms = (fl_now() - t0) * 1e3;
        run_log_comm(&log, &c0);
        if (fl_profile_on) fl_profile_step(ms / 1e3);
        fl_profile_enable(0);
        run_log_step(&log, &run, step, lr, &r, ms, waits);
        run_check_finite(&log, cfg, step, &r);
        run_check_spike(&log, cfg, step, &r);
        if (cfg->mem_report_every && (step + 1) % cfg->mem_report_every == 0) {
            printf("%s", log.tty ? "\n" : "");
            rank_memory_report();
        }
        // One reading of the flag: a signal arriving between the save and
        // the stop must not stop the run without its checkpoint (nor stop
        // one rank while the others go on); it is seen after the next step.
        int stop = stop_signal;
        if (world > 1 && any_rank(stop) && !stop) stop = stop_signal = SIGTERM;
        // not while the spike guard is skipping: the weights may be what spikes
        int save = cfg->save_every && (step + 1) % cfg->save_every == 0 && !r.spikes_in_row;
        if (*cfg->out_dir && (save || stop) && saved_at != step + 1) {
            fl_run_save(&run, step + 1);
            saved_at = step + 1;
        }
        fflush(stdout);
        if (stop) { // after the step and its checkpoint: nothing is lost
            const char *sig = stop == SIGINT ? "SIGINT" : "SIGTERM";
            if (log.tty) printf("\n");
            if (*cfg->out_dir)
                printf("interrupted by %s after step %d: checkpoint written to %s (continue with "
                       "fitlm train --resume %s)\n",
                       sig, step + 1, cfg->out_dir, cfg->out_dir);
            else
                printf("interrupted by %s after step %d: no checkpoint (out_dir is empty)\n", sig,
                       step + 1);
            fflush(stdout);
            interrupted = 1;
            break;
        }
    }
    if (log.tty && !interrupted) printf("\n");
    fl_run_flush(&run); // the last step's delayed update, for the sample and the report
    double seconds = fl_now() - train_start;
    if (cfg->profile && !interrupted) fl_profile_print(stdout);
    fl_profile_use_clock(NULL);
    run_print_traffic(&log, &run, &io0, cfg->steps - start);
    if (log.spikes)
        printf("spike guard: %ld step%s skipped as loss or gradient-norm outliers (see "
               "skip_update_lossz, skip_update_gradz)\n",
               log.spikes, log.spikes == 1 ? "" : "s");
    finish(&run, &log, seconds, saved_at, interrupted);
    fl_run_close(&run);
    return fl_comm_finalize(stop_signal ? 128 + stop_signal : 0);
}
