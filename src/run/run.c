// run.c: opening a run (run.h) in the one order that works, its evaluation
// and checkpoints, and closing it.
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/comm.h"
#include "fitlm/run.h"
#include "fitlm/safetensors.h"
#include "agree.h"
#include "out_dir.h"

void fl_run_resume_open(fl_run_resume *res, const char *path, fl_train_config *cfg) {
    memset(res, 0, sizeof *res);
    res->path = path;
    res->ck = fl_ckpt_open(path);
    char *json = fl_train_ckpt_config(res->ck);
    char where[FL_FILE_PATH_MAX + 32];
    snprintf(where, sizeof where, "config in checkpoint %s", fl_ckpt_path(res->ck));
    fl_config_load_json_text(cfg, json, strlen(json), where);
    fl_free(json);
    fl_config_forget_invocation(cfg); // where this machine writes: this invocation's flags only
    res->saved = *cfg;
    // the directory the checkpoint is in: DIR itself, or a file's directory
    char copy[FL_FILE_PATH_MAX];
    snprintf(copy, sizeof copy, "%s", fl_ckpt_path(res->ck));
    snprintf(res->dir, sizeof res->dir, "%s", dirname(copy));
    snprintf(res->run_id, sizeof res->run_id, "%s", fl_ckpt_run(res->ck));
}

// The run's tokenizer, its files read once and stored in every checkpoint.
// A resume's is the copy its checkpoint contains, and pretrained weights
// bring theirs (a checkpoint's copy, a Hugging Face directory's
// tokenizer.json) unless the run names one: the path a checkpoint's config
// records is never read. A resume given a tokenizer path anew reads that,
// which must be the one the checkpoint holds, if it holds one.
static void open_tokenizer(fl_run *r, const fl_run_options *opt) {
    fl_train_config *cfg = &r->cfg;
    const fl_run_resume *res = opt->resume;
    fl_tokenizer_files *f = &r->tok_files;
    if (res) {
        fl_ckpt_tokenizer(res->ck, f);
        int named = opt->tokenizer_path_given || strcmp(cfg->tokenizer, f->name) ||
                    strcmp(cfg->tokenizer_path, res->saved.tokenizer_path);
        if (named) {
            fl_tokenizer_files given;
            fl_tokenizer_files_read(&given, cfg->tokenizer, cfg->tokenizer_path);
            if (f->n && !strcmp(cfg->tokenizer, f->name) && !fl_tokenizer_files_equal(&given, f))
                fl_die("the %s tokenizer at %s is not the one checkpoint %s was trained with "
                       "(the checkpoint holds a copy of that: drop --tokenizer-path to use it)",
                       cfg->tokenizer, cfg->tokenizer_path, fl_ckpt_path(res->ck));
            fl_tokenizer_files_free(f);
            *f = given;
        }
        r->tok_vocab = fl_tokenizer_files_vocab(f);
        return;
    }
    fl_tokenizer_files source = {0};
    if (*cfg->init_from && !fl_config_given(cfg, "tokenizer") &&
        fl_source_tokenizer(cfg->init_from, &source)) {
        strcpy(cfg->tokenizer, source.name);
        if (!fl_config_given(cfg, "tokenizer_path")) { // the files come with the weights
            if (!fl_is_checkpoint(cfg->init_from))     // a Hugging Face directory's, for the record
                snprintf(cfg->tokenizer_path, sizeof cfg->tokenizer_path, "%s", cfg->init_from);
            *f = source;
            r->tok_vocab = fl_tokenizer_files_vocab(f);
            return;
        }
    }
    fl_tokenizer_files_free(&source);
    fl_tokenizer_files_read(f, cfg->tokenizer, cfg->tokenizer_path);
    r->tok_vocab = fl_tokenizer_files_vocab(f);
}

// The config made whole: a resume's and the flags' settings checked against
// each other, the shape of the checkpoint or the pretrained weights taken,
// then fl_config_finish. r->config_json keeps the run as given.
static void configure(fl_run *r, const fl_run_options *opt) {
    fl_train_config *cfg = &r->cfg;
    const fl_run_resume *res = opt->resume;
    // the checkpoint's config must be read before any other: a flag only
    if (*cfg->resume && !res)
        fl_die("resume is a command-line option (--resume DIR), not a config-file key");
    if (res && (opt->init_from_given || strcmp(cfg->init_from, res->saved.init_from)))
        fl_die("--init-from and --resume together: a resumed run takes its weights from the "
               "checkpoint %s (drop --init-from)",
               fl_ckpt_path(res->ck));
    // A resume continues where its checkpoint is (or in --out, given now),
    // never in the out_dir recorded in the checkpoint's config: a copy of a
    // run must not write into, prune or truncate the original's.
    if (res && !opt->out_given) {
        if (strlen(res->dir) >= sizeof cfg->out_dir)
            fl_die("checkpoint directory name is too long: %s", res->dir);
        strcpy(cfg->out_dir, res->dir);
    }
    snprintf(r->run_id, sizeof r->run_id, "%s", res ? res->run_id : "");
    if (!*r->run_id) run_new_id(r->run_id, sizeof r->run_id); // or a checkpoint without one
    // about this invocation, not the run: not inherited by a resume
    fl_config_set_given(cfg, "overwrite", 0);
    open_tokenizer(r, opt);
    r->config_json = fl_config_to_json(cfg); // the run as given, for its checkpoints
    // A resumed or pretrained model brings its own shape: its weights are
    // opened once, here, and their rows read when the model is made.
    const char *shape_from = res ? res->path : *cfg->init_from ? cfg->init_from : "";
    snprintf(r->shape_from, sizeof r->shape_from, "%s", shape_from);
    if (res)
        fl_ckpt_source(&r->weights, res->ck);
    else if (*shape_from)
        fl_weight_source_open(&r->weights, cfg->init_from);
    if (*shape_from) fl_config_set_shape(cfg, &r->weights.config, shape_from);
    fl_config_finish(cfg, r->tok_vocab);
}

// Data first: the shards name their tokenizer and vocabulary.
static void open_data(fl_run *r) {
    const fl_train_config *cfg = &r->cfg;
    fl_loader *train = &r->train, *val = &r->val;
    fl_loader_open(train, cfg->data, "train", cfg->seq_len, cfg->seed, 1, r->rank, r->world);
    r->has_train = 1;
    if (strcmp(train->tokenizer, cfg->tokenizer))
        fl_die("the training data %s was tokenized with '%s', but the tokenizer is '%s' (set "
               "--tokenizer %s)",
               cfg->data, train->tokenizer, cfg->tokenizer, train->tokenizer);
    int tokenizer_vocab = r->tok_vocab;
    if ((int)train->vocab_size != tokenizer_vocab) {
        char learnt[FL_PATH_MAX + 16]; // where fitlm tokenize --learn-vocab puts its tokenizer
        snprintf(learnt, sizeof learnt, "%s/encoder.json", cfg->data);
        int beside = access(learnt, R_OK) == 0;
        fl_die("the training data %s has a vocabulary of %u, but the %s tokenizer at %s has %d: "
               "the data was tokenized with another one%s%s%s",
               cfg->data, train->vocab_size, cfg->tokenizer, r->tok_files.from, tokenizer_vocab,
               beside ? " (its directory holds a learnt one: --tokenizer-path " : "",
               beside ? cfg->data : "", beside ? ")" : "");
    }
    if ((int)train->vocab_size > cfg->model.vocab_size)
        fl_die("the training data %s has a vocabulary of %u, larger than the model's %d", cfg->data,
               train->vocab_size, cfg->model.vocab_size);
    r->has_val = fl_loader_open_val(val, cfg->data, cfg->val_data, cfg->seq_len);
    if (r->has_val &&
        (strcmp(val->tokenizer, train->tokenizer) || val->vocab_size != train->vocab_size))
        fl_die("the validation data (tokenizer %s) does not match the training data (tokenizer %s)",
               val->tokenizer, train->tokenizer);
    if (r->has_val) {
        // before the model exists, so its scratch never adds to a memory peak
        r->baseline = fl_loader_unigram_xent(train, val);
        // masked examples record the bytes of their targets (the answers)
        r->bytes_per_token = (double)val->source_bytes / (double)val->n_targets;
    }
}

// Plans before the model is allocated: a run that cannot fit stops here
// with advice, rather than being killed by the kernel halfway through.
// What the loaders and the tokenizer keep (tag other) is measured for it.
static void plan_run(fl_run *r, int whole_weights_first) {
    const fl_train_config *cfg = &r->cfg;
    // (the TP group's table, made with the layout, is the plan's own term)
    size_t tp_table = r->tp.size > 1 ? fl_tp_ops_bytes(r->tp.size) : 0;
    size_t data_bytes = fl_mem_current(FL_MEM_OTHER) - tp_table,
           data_peak = fl_mem_peak(FL_MEM_OTHER);
    fl_plan_request req;
    fl_plan_request_from_config(&req, cfg, data_bytes);
    req.data_peak = data_peak;
    req.whole_weights_first = whole_weights_first;
    req.ranks = r->world * r->tp.size * r->stage.size; // t x p x d
    // under pipeline parallelism, this rank's own stage
    if (r->stage.size > 1) {
        req.rank = fl_comm_rank();
        req.one_stage = 1;
    }
    fl_plan_compute(&req, &r->plan);
    // on a device --mem-limit is the device's budget (req.device_cap), and
    // the host has its available memory
    int host_limit = *cfg->mem_limit && !req.device_cap;
    size_t limit = host_limit ? fl_parse_bytes(cfg->mem_limit, "mem_limit") : fl_mem_available();
    // the ranks on this machine share its memory
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!host_limit && local && atoi(local) > 1) limit /= (size_t)atoi(local);
    fl_plan_check_fits(&req, &r->plan, limit);
    // and the device's allocator holds the run to it, the context included
    fl_mem_device_set_cap(req.device_cap);
    fl_mem_device_set_reserved(req.device_cap ? r->dev->reserved(r->dev) : 0);
}

// The model's weights, each row stored once from its source (NF4 rows
// quantised as they are stored): pretrained weights whole, a checkpoint's,
// or a random start; ZeRO-3 over several ranks keeps only its shard of a
// random start or a checkpoint. A resume's weights are its checkpoint's,
// except a frozen LoRA base, which it does not hold: init_from's, or the
// seed's.
static void init_model(fl_run *r, int pretrained, size_t own_begin, size_t own_end) {
    const fl_train_config *cfg = &r->cfg;
    const fl_quant_config *quant = cfg->quant.enabled ? &cfg->quant : NULL;
    fl_weight_source *weights = &r->weights;
    if (r->resumed && r->lora && !r->train_base) {
        fl_weight_source_close(weights);
        if (pretrained)
            fl_weight_source_open(weights, cfg->init_from);
        else
            fl_weight_source_random(weights, &cfg->model, cfg->seed);
    } else if (!*r->shape_from) {
        fl_weight_source_random(weights, &cfg->model, cfg->seed);
    }
    int shard = !pretrained && r->dist && cfg->zero.stage == 3 && r->world > 1;
    fl_model_init_tp(&r->model, weights, cfg->dtype, quant, shard ? own_begin : 0,
                     shard ? own_end : SIZE_MAX, &r->tp, &r->stage);
    fl_weight_source_close(weights);
}

// A single file or a sharded checkpoint of any world size: the whole
// weights, and the master and state of this rank's range (dist: its shard);
// the loader's position split over this world's ranks.
static void restore(fl_run *r, fl_ckpt *ck) {
    fl_optimizer_map(&r->optim);
    fl_train_ckpt_restore(ck, &r->model, &r->optim, r->base, &r->train.state, r->train.tokenizer);
    fl_optimizer_unmap(&r->optim);
    r->ck_threads = fl_train_ckpt_threads(ck);
    r->ck_world = fl_train_ckpt_world(ck);
    if (r->train.state.index > r->train.per_rank)
        fl_die("checkpoint %s is at window %llu of an epoch of %llu: the training data has "
               "changed since it was saved",
               fl_ckpt_path(ck), (unsigned long long)r->train.state.index,
               (unsigned long long)r->train.per_rank);
}

// The data-parallel group: the world, or under tensor parallelism the ranks
// of this TP rank's index.
static const fl_comm_group *dp_group(const fl_run *r) {
    return r->layout.tp ? r->layout.dp_group : fl_comm_world();
}

// This rank's pipeline stage: the split of the blocks over p x v virtual
// stages, and its chunks' activation sets under the schedule.
static void pipeline_stage(fl_run *r) {
    const fl_train_config *cfg = &r->cfg;
    int counts[FL_PP_MAX_VIRTUAL];
    fl_pp_config_split(cfg, &cfg->model, counts);
    fl_pp_stage_of(&r->stage, fl_pp_schedule_kind(cfg->pipeline_schedule), cfg->pipeline_parallel,
                   cfg->virtual_stages, cfg->grad_accum, r->layout.pp_rank, counts);
}

// A step's tokens (FL_MEM_OTHER): on a device in its pinned memory, which
// the step's copies move without waiting (copy_async from pageable memory
// may sync)
static int *token_buffer(const fl_device *d, size_t n) {
    if (!d || d->host) return fl_alloc(FL_MEM_OTHER, n * sizeof(int));
    return d->host_alloc(d, FL_MEM_OTHER, n * sizeof(int));
}

static void token_buffer_free(const fl_device *d, int *p) {
    if (!d || d->host)
        fl_free(p);
    else
        d->host_free(d, p);
}

void fl_run_open(fl_run *r, const fl_train_config *config, const fl_run_options *opt) {
    memset(r, 0, sizeof *r);
    r->cfg = *config;
    fl_train_config *cfg = &r->cfg;
    fl_run_resume *res = opt->resume;
    fl_ckpt *ck = res ? res->ck : NULL;
    FL_ASSERT(!(ck && opt->own_batches)); // a resume restores the data's position
    r->rank = opt->alone ? 0 : fl_comm_rank();
    r->world = opt->alone ? 1 : fl_comm_size();
    r->lead = r->rank == 0;
    r->ck_world = 1;
    if (res) r->saved = res->saved;
    configure(r, opt);
    // the device every model and optimizer of the run is made on (its
    // refusals were fl_config_finish's)
    r->dev = fl_device_get(cfg->device);
    fl_device_use(r->dev);
    fl_comm_set_timeout(cfg->zero.comm_timeout);
    FL_ASSERT(!opt->alone || cfg->zero.stage == 0);
    r->tp = (fl_tp){1, 0, 0, NULL};
    fl_pp_stage_whole(&r->stage, cfg->model.n_layer);
    if (cfg->tensor_parallel > 1 && (cfg->lora_enabled || cfg->quant.enabled))
        fl_die("tensor parallelism (--tensor-parallel %d) with %s is not supported: train "
               "the adapters without it, or the whole model with it",
               cfg->tensor_parallel, cfg->lora_enabled ? "LoRA adapters" : "NF4 base weights");
    if (cfg->tensor_parallel > 1 || cfg->pipeline_parallel > 1) {
        // Megatron's groups; the data is the DP group's
        if (opt->alone) fl_die("internal: a run alone cannot be split by model parallelism");
        fl_layout_init(&r->layout, cfg->tensor_parallel, cfg->pipeline_parallel);
        if (cfg->tensor_parallel > 1)
            r->tp = (fl_tp){cfg->tensor_parallel, r->layout.tp_rank, cfg->sequence_parallel,
                            fl_tp_ops_group(r->layout.tp_group)};
        if (cfg->pipeline_parallel > 1) pipeline_stage(r);
        r->rank = r->layout.dp_rank;
        r->world = r->layout.dp;
    }
    // On a device, one process (device_check): ZeRO's stages partition
    // nothing, the plain path runs; ZeRO-Offload puts the optimizer in host
    // memory, paged from an NVMe file under device nvme. LoRA on one rank
    // takes the plain path on the cpu too (fl_dist_engine).
    int offloads = !r->dev->host && strcmp(cfg->zero_extra.offload_optimizer, "none");
    int dev_offload = offloads && !cfg->lora_enabled; // the model's optimizer, else the adapters'
    int dev_adapters = offloads && cfg->lora_enabled;
    r->dist = !opt->alone && r->dev->host && fl_dist_engine(cfg, r->world);
    r->resumed = ck != NULL;
    r->start = ck ? fl_ckpt_step(ck) : 0;
    if (ck && cfg->steps <= r->start)
        fl_die("train_steps %d is not above the checkpoint's step %d (%s): nothing to train; give "
               "--steps above %d",
               cfg->steps, r->start, fl_ckpt_path(ck), r->start);
    // the ranks run the same thing, checked before anything is written or sent
    if (!opt->alone) run_agree(r, fl_comm_world());
    // rank 0 owns the output directory; the others find it ready
    if (*cfg->out_dir && r->lead)
        run_prepare_out_dir(cfg->out_dir, ck ? res->dir : NULL, cfg->overwrite);
    if (!opt->alone) fl_comm_barrier(fl_comm_world());
    if (*cfg->adapter) { // the adapter's LoRA config, which the lora.* options must not contradict
        fl_lora_config adapter;
        fl_peft_read_config(cfg->adapter, &adapter);
        fl_config_set_lora(cfg, &adapter, cfg->adapter);
    }
    fl_set_threads(cfg->threads);
    fl_optimizer_config ocfg = fl_config_optimizer(cfg);
    r->lora = cfg->lora_enabled;
    r->train_base = r->lora && cfg->lora.train_base;
    fl_optimizer_config bcfg = r->train_base ? fl_config_base_optimizer(cfg) : ocfg;
    if (r->train_base && cfg->dtype == FL_F16)
        fl_die("lora.base_optimizer with fp16 is not supported (two loss scalers would have to "
               "agree): use --precision bf16");

    if (!opt->own_batches) open_data(r);
    r->tok = cfg->sample_tokens > 0 ? fl_tokenizer_load_files(&r->tok_files) : NULL;
    // pretrained weights load whole (a resume has its own, unless they are
    // a LoRA run's frozen base, which the checkpoint does not hold)
    int pretrained = *cfg->init_from && (!ck || (r->lora && !r->train_base));
    plan_run(r, pretrained);

    // the range of the flat buffer this rank's optimizer covers (ZeRO: its shard)
    fl_param_table rows; // this rank's (its slices under tensor parallelism)
    fl_model_config shape = cfg->model;
    shape.tp_size = r->tp.size;
    fl_model_rank_table(&rows, &shape, r->tp.rank);
    if (r->stage.size > 1) { // the stage's rows
        fl_param_table rank = rows;
        fl_model_stage_table(&rows, &rank, &shape, &r->stage, NULL);
        fl_params_free(&rank);
    }
    size_t own_begin = 0, own_end = rows.numel;
    if (r->dist) fl_dist_range(&cfg->zero, &rows, dp_group(r), &own_begin, &own_end);
    fl_params_free(&rows);
    // weight offload on a device (ZeRO-3 with offload_param): the whole
    // weights are built in pinned host memory, the offload's copy, and never
    // held by the device
    int dev_weights = fl_dev_weights_offloaded(cfg);
    if (dev_weights) fl_device_use(fl_device_pinned(r->dev));
    init_model(r, pretrained, own_begin, own_end);
    fl_model *model = &r->model;
    void *host_params = NULL;
    if (dev_weights) {
        fl_device_use(r->dev);
        model->dev = r->dev;
        host_params = model->params;
        model->params = NULL;
        if (r->lora) r->base_host = host_params; // the frozen base's: no optimizer's copy
    }
    if (r->lora) {
        fl_model_add_lora(model, &cfg->lora, cfg->seed);
        if (*cfg->adapter) fl_peft_load(cfg->adapter, model);
    }
    model->config.logits_chunk = cfg->model.logits_chunk; // a run setting, not the source's
    fl_model_alloc_acts(model, cfg->micro_batch, cfg->seq_len, cfg->recompute,
                        r->dist       ? fl_dist_unit_grads(&cfg->zero)
                        : dev_offload ? FL_GRADS_HOOK // the offload's device ring
                        : r->lora     ? r->train_base && fl_optimizer_unit_grads(&bcfg)
                                      : fl_optimizer_unit_grads(&ocfg));
    // what the optimizer trains: the adapters under LoRA (the base too, by
    // its own fused optimizer, under LoRA + LOMO), else the model
    ocfg.sharded_grads = r->dist && cfg->zero.stage >= 2; // ZeRO-2/3 sum their own shards
    if (dev_offload)
        r->dev_offload = fl_dev_offload_init(model, &r->optim, &ocfg, host_params);
    else if (dev_adapters)
        r->dev_adapters = fl_dev_adapters_init(model, &r->optim, &ocfg);
    else if (r->lora)
        fl_optimizer_init(&r->optim, &ocfg, &model->lora.table, cfg->dtype, model->lora.params,
                          model->lora.grads);
    else
        fl_optimizer_init_at(&r->optim, &ocfg, &model->table, cfg->dtype, model->params,
                             model->params_begin, model->grads, own_begin, own_end);
    if (r->train_base) {
        fl_optimizer_init(&r->base_optim, &bcfg, &model->table, cfg->dtype, model->params,
                          model->grads);
        r->base = &r->base_optim;
    }
    if (r->tp.size > 1) r->optim.tp = &model->tp;
    // NVMe offload: the master and the optimizer state move to a file,
    // filled from the weights now (a resume then overwrites it)
    fl_offload_config oc = fl_offload_config_of(cfg);
    if (ocfg.paged) { // its directory and room were checked with the plan
        r->offload = fl_offload_optimizer(&r->optim, &oc, cfg->zero.offload_params);
        // NVMe weight offload on a device: the file holds the weights now
        if (dev_weights && cfg->zero.offload_params) fl_dev_offload_drop_params(r->dev_offload);
    }
    r->base_lr = cfg->lora_base_lr > 0.0f ? cfg->lora_base_lr : cfg->lr;
    if (ck) {
        restore(r, ck);
        if (r->dev_offload) fl_dev_offload_upload(r->dev_offload); // restored on the host
        if (r->dev_adapters) fl_dev_adapters_upload(r->dev_adapters);
        fl_ckpt_close(ck);
        res->ck = NULL;
    }
    // weight offload: each unit goes up from the pinned copy (offload_param
    // cpu) or the NVMe file (nvme) ahead of use
    if (dev_weights)
        r->dev_weights =
            cfg->zero.offload_params
                ? fl_dev_weights_attach(model, NULL, r->offload, &cfg->zero, &oc)
                : fl_dev_weights_attach(model, r->lora ? r->base_host : r->optim.params, NULL,
                                        &cfg->zero, &oc);
    if (r->dist) {
        // under pipeline parallelism the data-parallel reduction runs once
        // after the pipeline's last backward, as DeepSpeed's ReduceGrads
        fl_zero_config zero = cfg->zero;
        if (r->stage.size > 1) zero.overlap_comm = 0;
        r->strategy = fl_dist_attach(model, &r->optim, &zero, r->offload, dp_group(r));
    }
    if (r->stage.size > 1)
        r->pipe = fl_pipeline_attach(model, &r->optim, r->layout.pp_group,
                                     fl_pp_schedule_kind(cfg->pipeline_schedule), cfg->grad_accum,
                                     cfg->micro_batch, cfg->seq_len);
    // (the data-parallel ranks hold the same; TP ranks their own slices)
    if (!opt->alone) run_agree_weights(r, dp_group(r));
    r->schedule = fl_schedule_of(cfg);
    // a step's micro-batches, loaded before it: the step weights every target
    // token of the accumulated batch alike
    size_t tokens = (size_t)cfg->micro_batch * cfg->seq_len * cfg->grad_accum;
    r->inputs = token_buffer(r->dev, tokens);
    r->targets = token_buffer(r->dev, tokens);
}

// Mean loss over cfg->eval_iters fixed batches of the whole step's batch
// (micro-batch x ranks sequences) spread over the validation data: under
// data parallelism rank r evaluates every N-th micro-batch of them, the same
// windows one process with the global batch would, and the sums are added.
void fl_run_flush(fl_run *r) {
    fl_dev_offload_flush(r->dev_offload);
}

float fl_run_evaluate(fl_run *r, int step) {
    const fl_train_config *cfg = &r->cfg;
    FL_ASSERT(r->has_val);
    fl_run_flush(r);
    // each batch's mean weighted by its targets, whose count varies with a
    // loss mask: the mean over every target evaluated
    double sums[2] = {0.0, 0.0}; // loss x targets, targets
    int bad = -1;                // this rank's first batch with a non-finite loss
    float bad_loss = 0.0f;
    for (int k = 0; k < cfg->eval_iters; k++) {
        fl_loader_eval_batch(&r->val, k * r->world + r->rank, cfg->eval_iters * r->world, r->inputs,
                             r->targets, cfg->micro_batch);
        int n_targets;
        float loss;
        if (r->pipe) {
            loss = fl_pipeline_forward(r->pipe, r->inputs, r->targets, &n_targets);
        } else {
            loss =
                fl_model_forward(&r->model, r->inputs, r->targets, cfg->micro_batch, cfg->seq_len);
            n_targets = r->model.n_targets;
        }
        if (!isfinite(loss) && bad < 0) bad = k * r->world + r->rank, bad_loss = loss;
        sums[0] += (double)loss * n_targets;
        sums[1] += n_targets;
    }
    if (r->world > 1) fl_comm_sum(dp_group(r), sums, 2); // a non-finite sum is every rank's
    if (!isfinite(sums[0])) {
        char where[96] = "on another rank";
        if (bad >= 0)
            snprintf(where, sizeof where, "validation batch %d of %d gave %g", bad,
                     cfg->eval_iters * r->world, bad_loss);
        fl_die("the validation loss at step %d is not finite (%s): the weights overflow the "
               "logits; no checkpoint is written from them",
               step, where);
    }
    return sums[1] ? (float)(sums[0] / sums[1]) : 0.0f;
}

// Whether every rank's weights (the range its optimizer updates) are finite,
// before the checkpoint after `step`. The step is reduced with the flag: ranks
// that reach this reduction at different steps (their settings agreed at the
// start, so only an engine bug) are named as that, never taken for divergence.
static int weights_finite(const fl_run *r, int step) {
    const fl_optimizer *sets[2] = {&r->optim, r->base};
    double bad = 0.0;
    for (int i = 0; i < 2; i++) {
        const fl_optimizer *o = sets[i];
        if (!o) continue;
        size_t first = o->rule->state_begin, n = o->rule->state_end - first;
        fl_dtype dt = o->master ? FL_F32 : o->dtype;
        const void *w = o->master ? (const void *)o->master
                                  : fl_at_const(o->dtype, o->params, first - o->params_first);
        // a device's weights are checked there: a sum of squares is not
        // finite exactly when a value is not (fp32's squares stay finite)
        if (o->dev->host ? fl_has_inf_or_nan(dt, w, n) : !isfinite(o->dev->sumsq(dt, w, n)))
            bad = 1.0;
    }
    double v[3] = {bad, step, -step};
    if (fl_comm_size() > 1) fl_comm_max(fl_comm_world(), v, 3);
    if (v[1] != step || v[2] != -step)
        fl_die("internal: the ranks reached the checkpoint of step %d at different steps (%g to "
               "%g)",
               step, -v[2], v[1]);
    return v[0] == 0.0;
}

// A paged optimizer's state is read through its mapping.
void fl_run_save(fl_run *r, int step) {
    const fl_train_config *cfg = &r->cfg;
    FL_ASSERT(r->has_train && *cfg->out_dir);
    fl_run_flush(r); // a checkpoint holds no update in flight
    fl_optimizer_map(&r->optim);
    if (!weights_finite(r, step))
        fl_die("the weights are not finite after step %d: not writing a checkpoint over the good "
               "ones in %s (training diverged; lower the learning rate)",
               step, cfg->out_dir);
    if (r->dist || r->layout.tp) // every rank its shard (DDP: rank 0 all), agreed before
                                 // anything is visible
        fl_train_ckpt_save_dist(cfg->out_dir, step, &r->model, &r->optim, &r->train.state,
                                &r->tok_files, r->config_json, cfg->keep_checkpoints, r->run_id);
    else
        fl_train_ckpt_save_run(cfg->out_dir, step, &r->model, &r->optim, r->base, &r->train.state,
                               &r->tok_files, r->config_json, cfg->keep_checkpoints, r->run_id);
    fl_optimizer_unmap(&r->optim);
}

void fl_run_close(fl_run *r) {
    token_buffer_free(r->dev, r->inputs);
    token_buffer_free(r->dev, r->targets);
    fl_free(r->config_json);
    fl_pipeline_free(r->pipe);
    fl_dist_free(r->strategy);
    fl_dev_weights_free(r->dev_weights); // its reads of the NVMe file landed
    fl_offload_free(r->offload);
    fl_optimizer_free(&r->optim);
    fl_dev_offload_free(r->dev_offload);
    fl_dev_adapters_free(r->dev_adapters);
    if (r->base_host) {
        const fl_device *pin = fl_device_pinned(r->dev);
        pin->free(pin, r->base_host);
    }
    if (r->base) fl_optimizer_free(r->base);
    fl_model_free(&r->model);
    if (r->layout.tp) fl_layout_free(&r->layout);
    if (r->tok) fl_tokenizer_free(r->tok);
    fl_tokenizer_files_free(&r->tok_files);
    if (r->has_val) fl_loader_close(&r->val);
    if (r->has_train) fl_loader_close(&r->train);
    fl_device_use(NULL); // the cpu again for whatever the process makes next
    fl_mem_device_set_cap(0);
    fl_mem_device_set_reserved(0);
}
