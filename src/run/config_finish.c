// config_finish.c: a run's config made whole for the model and the optimizer: the
// model shape from its preset, the options and pretrained weights, then the
// config's checks, each section's by its subsystem in the order their derived
// values are read (fl_config_check); and the optimizer's settings.
#include <string.h>

#include "fitlm/comm.h"
#include "fitlm/device.h"
#include "fitlm/dist.h"
#include "fitlm/lora.h"
#include "fitlm/offload.h"
#include "fitlm/tokenizer.h"
#include "fitlm/train.h"

void fl_config_set_shape(fl_train_config *cfg, const fl_model_config *shape, const char *source) {
    const struct {
        const char *key;
        int *field, value;
    } dims[] = {
        {"model.n_layer", &cfg->model.n_layer, shape->n_layer},
        {"model.n_head", &cfg->model.n_head, shape->n_head},
        {"model.n_embd", &cfg->model.n_embd, shape->n_embd},
        {"model.max_seq_len", &cfg->model.max_seq_len, shape->max_seq_len},
        {"model.vocab_size", &cfg->model.vocab_size, shape->vocab_size},
        {"model.n_kv_head", &cfg->model.n_kv_head, shape->n_kv_head},
        {"model.intermediate_size", &cfg->model.intermediate_size, shape->intermediate_size},
        {"model.tie_word_embeddings", &cfg->tie_embeddings, shape->tie_embeddings},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
        if (fl_config_given(cfg, dims[i].key) && *dims[i].field != dims[i].value)
            fl_die("%s %d contradicts %s, whose model has %d", dims[i].key, *dims[i].field, source,
                   dims[i].value);
        *dims[i].field = dims[i].value;
    }
    const struct {
        const char *key;
        float *field, value;
    } reals[] = {
        {"model.rms_norm_eps", &cfg->model.norm_eps, shape->norm_eps},
        {"model.rope_theta", &cfg->model.rope_theta, shape->rope_theta},
    };
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++) {
        if (fl_config_given(cfg, reals[i].key) && *reals[i].field != reals[i].value)
            fl_die("%s %g contradicts %s, whose model has %g", reals[i].key, *reals[i].field,
                   source, reals[i].value);
        *reals[i].field = reals[i].value;
    }
    const char *arch = fl_arch_name(shape->arch);
    if (fl_config_given(cfg, "model.arch") && strcmp(cfg->model_arch, arch))
        fl_die("model.arch %s contradicts %s, a %s model", cfg->model_arch, source, arch);
    strcpy(cfg->model_arch, arch);
    // the source's shape, whatever the preset: a given preset only names defaults
    if (!fl_model_preset_takes_arch(cfg->model_preset)) strcpy(cfg->model_preset, "demo");
    // GPT-2 is always tied; the flag exists for LLaMA
    fl_config_set_given(cfg, "model.tie_word_embeddings", shape->arch == FL_ARCH_LLAMA);
}

// The demo model's own recipe, for the keys a run does not give. The demo
// sees 2,048 tokens a step, so (as nanoGPT's small character model does) it
// takes a higher rate, warmed up over half the run, and a beta2 of 0.99,
// which averages its noisy second moments over fewer steps: 320 steps then
// end where the general defaults' 400 do (the mean of three seeds; README,
// "Demo results"). Only the demo's shape trained from scratch with AdamW;
// another shape, pretrained weights or an adapter keep the general defaults.
static void demo_recipe(fl_train_config *cfg) {
    fl_model_config demo = {0};
    fl_model_preset(&demo, "demo");
    const fl_model_config *m = &cfg->model;
    if (m->arch != FL_ARCH_GPT2 || m->n_layer != demo.n_layer || m->n_head != demo.n_head ||
        m->n_embd != demo.n_embd || *cfg->init_from || *cfg->adapter || cfg->lora_enabled ||
        strcmp(cfg->optimizer, "adamw"))
        return;
    if (!fl_config_given(cfg, "train_steps")) cfg->steps = 320;
    if (!fl_config_given(cfg, "optimizer.params.lr")) cfg->lr = 6e-3f;
    if (!fl_config_given(cfg, "scheduler.params.warmup_num_steps"))
        cfg->warmup_steps = cfg->steps / 2;
    if (!fl_config_given(cfg, "optimizer.params.betas")) cfg->beta2 = 0.99f;
}

// A device other than the cpu runs one process training the whole model
// or LoRA adapters on it (dense or NF4 base weights) with AdamW, SGD, LOMO
// or AdaLomo, the update fused into the backward pass or not (issues 43,
// 46). ZeRO's stages partition over the data-parallel ranks, so on one
// process they partition nothing and the plain path runs (DeepSpeed's
// single-GPU configs as they are); what they offload is honoured: with
// AdamW or SGD the optimizer in host memory under offload_optimizer.device
// cpu or nvme (ZeRO-Offload), and under ZeRO-3 the weights too
// (offload_param device cpu with offload_optimizer cpu, or device nvme
// with offload_optimizer nvme: ZeRO-Infinity, the weights in the
// optimizer's NVMe file; device_weights.c). Under LoRA (the PEFT recipe of
// ZeRO-3 with CPU offload on one GPU) the adapters' optimizer goes to host
// memory under offload_optimizer.device cpu (device_adapters.c), and a
// dense frozen base under ZeRO-3's offload_param.device cpu, with or
// without it. Several ranks, splitting the model and the combinations not
// yet checked are refused before anything is allocated, as is a device
// this build or machine lacks.
static void device_check(const fl_train_config *cfg) {
    char why[256] = "";
    if (!fl_device_available(cfg->device, why, sizeof why)) fl_die("device: %s", why);
    if (!strcmp(cfg->device, "cpu")) return;
    const fl_zero_extra *x = &cfg->zero_extra;
    int ranks = cfg->ranks > 0 ? cfg->ranks : fl_comm_size();
    char what[96] = "";
    if (ranks > 1)
        snprintf(what, sizeof what, "%d ranks", ranks);
    else if (cfg->tensor_parallel > 1 || cfg->pipeline_parallel > 1)
        snprintf(what, sizeof what, "tensor or pipeline parallelism");
    else if (!strcmp(x->offload_param, "cpu") && strcmp(x->offload_optimizer, "cpu") &&
             !cfg->lora_enabled)
        snprintf(what, sizeof what,
                 "weight offload (offload_param.device cpu) without offload_optimizer.device cpu");
    else if (fl_dev_weights_offloaded(cfg) && cfg->quant.enabled)
        snprintf(what, sizeof what,
                 "offload_param under NF4 base weights (they stay on the device, 4 bits each)");
    else if (strcmp(x->offload_optimizer, "none") && cfg->lora.train_base)
        snprintf(what, sizeof what, "offload_optimizer under LoRA with lora.base_optimizer");
    else if (strcmp(x->offload_optimizer, "none") &&
             (!strcmp(cfg->optimizer, "lomo") || !strcmp(cfg->optimizer, "adalomo") ||
              cfg->optimizer_in_backward))
        snprintf(what, sizeof what, "offload_optimizer with the update in the backward pass");
    if (*what)
        fl_die("--device %s with %s is not supported yet: a device other than the cpu runs one "
               "process training the whole model or LoRA adapters (ZeRO's stages partition "
               "nothing there), with offload_optimizer (device cpu or nvme; under LoRA cpu) "
               "for AdamW or SGD, and at ZeRO-3 offload_param with offload_optimizer both on "
               "device cpu or both on nvme (under LoRA offload_param cpu for a dense base); "
               "several ranks, LoRA's base optimizer or the update in the backward pass with "
               "offload are not supported there yet; use --device cpu",
               cfg->device, what);
}

void fl_config_check(fl_train_config *cfg) {
    fl_deepspeed_check_config(cfg); // first: it maps keys the sections read
    fl_config_check_common(cfg);
    fl_parallel_check_batch(cfg);  // the accumulation LoRA and the optimizer read
    fl_tp_check(cfg, &cfg->model); // the layout, before any allocation: reads the micro-batch
    fl_pp_finish_split(cfg);       // Megatron's first/last stage blocks: a split list
    fl_lora_check_config(cfg);
    fl_quant_check_config(cfg);    // reads whether LoRA trains, and on what base
    fl_pp_check(cfg, &cfg->model); // the pipeline: reads m, LoRA and NF4
    fl_optim_check_config(cfg);    // reads the precision and LoRA's base optimizer
    fl_parallel_check_config(cfg); // reads whether LoRA or NF4 is on
    fl_offload_check_config(cfg);
    device_check(cfg); // reads the layout, offload, LoRA and the optimizer
}

void fl_config_finish(fl_train_config *cfg, int tokenizer_vocab) {
    fl_model_config shape = {0};
    fl_model_preset(&shape, cfg->model_preset);
    fl_model_config *m = &cfg->model;
    if (*cfg->model_arch) {
        fl_arch_kind arch;
        if (fl_arch_parse(cfg->model_arch, &arch))
            fl_die("model.arch must be gpt2 or llama, got '%s'", cfg->model_arch);
        if (arch != shape.arch && !fl_model_preset_takes_arch(cfg->model_preset))
            fl_die("model.arch %s contradicts model.preset %s, a %s model", cfg->model_arch,
                   cfg->model_preset, fl_arch_name(shape.arch));
        shape.arch = arch;
    }
    if (m->n_layer) shape.n_layer = m->n_layer;
    if (m->n_head) shape.n_head = m->n_head;
    if (m->n_kv_head) shape.n_kv_head = m->n_kv_head;
    if (m->n_embd) shape.n_embd = m->n_embd;
    if (m->max_seq_len) shape.max_seq_len = m->max_seq_len;
    if (m->intermediate_size) shape.intermediate_size = m->intermediate_size;
    if (m->norm_eps != 0.0f) shape.norm_eps = m->norm_eps;
    if (m->rope_theta != 0.0f) shape.rope_theta = m->rope_theta;
    if (fl_config_given(cfg, "model.tie_word_embeddings")) {
        if (shape.arch == FL_ARCH_GPT2 && !cfg->tie_embeddings)
            fl_die("model.tie_word_embeddings: GPT-2's LM head is always tied to wte");
        shape.tie_embeddings = cfg->tie_embeddings;
    }
    // the tokenizer's vocabulary; the data's shards are checked against the
    // model when training starts
    if (m->vocab_size && m->vocab_size < tokenizer_vocab)
        fl_die("model.vocab_size %d is smaller than the %s tokenizer's %d", m->vocab_size,
               cfg->tokenizer, tokenizer_vocab);
    if (m->vocab_size || !shape.vocab_size)
        shape.vocab_size = m->vocab_size ? m->vocab_size : tokenizer_vocab;
    fl_model_config_finish(&shape);
    *m = shape;
    m->logits_chunk = cfg->logits_chunk;
    if (cfg->logits_chunk && (cfg->tensor_parallel > 1 || cfg->pipeline_parallel > 1))
        fl_die("logits_chunk %d: not with tensor or pipeline parallelism (their LM heads keep "
               "the whole logits: the vocabulary-parallel loss, the last stage's tied copy); "
               "drop --logits-chunk",
               cfg->logits_chunk);
    if (cfg->seq_len > m->max_seq_len)
        fl_die("seq_len %d exceeds model.max_seq_len %d", cfg->seq_len, m->max_seq_len);
    strcpy(cfg->model_arch, fl_arch_name(m->arch));
    demo_recipe(cfg);
    fl_config_check(cfg);
    // what data parallelism needs to know of the optimizer
    fl_optimizer_config o = fl_config_optimizer(cfg);
    fl_dist_derive(&cfg->zero, &o);
}

void fl_config_set_lora(fl_train_config *cfg, const fl_lora_config *adapter, const char *source) {
    const fl_lora_config *l = &cfg->lora;
    const struct {
        const char *key;
        int differs;
    } keys[] = {
        {"lora.r", l->r != adapter->r},
        {"lora.lora_alpha", l->alpha != adapter->alpha},
        {"lora.lora_dropout", l->dropout != adapter->dropout},
        {"lora.target_modules", strcmp(l->target_modules, adapter->target_modules) != 0},
        {"lora.use_rslora", l->use_rslora != adapter->use_rslora},
        {"lora.init_lora_weights", l->init != adapter->init},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (fl_config_given(cfg, keys[i].key) && keys[i].differs)
            fl_die("%s contradicts the adapter %s (its adapter_config.json)", keys[i].key, source);
    int train_base = l->train_base;
    cfg->lora = *adapter;
    cfg->lora.train_base = train_base;
}

static fl_optim_kind kind_of(const char *name) {
    static const char *const kinds[] = {"adamw", "sgd", "lomo", "adalomo"}; // by fl_optim_kind
    int kind = 0;
    while (strcmp(name, kinds[kind])) kind++; // a checked choice
    return (fl_optim_kind)kind;
}

fl_optimizer_config fl_config_base_optimizer(const fl_train_config *cfg) {
    FL_ASSERT(cfg->lora.train_base);
    fl_optimizer_config o = fl_config_optimizer(cfg);
    o.kind = kind_of(cfg->lora_base_optimizer);
    o.paged = 0;
    o.in_backward = 0;
    // LOMO's defaults (lomo_optim): no weight decay; AdaLomo's own eps
    o.weight_decay = 0.0f;
    if (o.kind == FL_OPT_ADALOMO) o.eps = 1e-30f;
    return o;
}

fl_optimizer_config fl_config_optimizer(const fl_train_config *cfg) {
    fl_optim_kind kind = kind_of(cfg->optimizer);
    fl_optimizer_config o = {
        .kind = kind,
        .beta1 = cfg->beta1,
        .no_bias_correction = !cfg->bias_correction,
        .beta2 = cfg->beta2,
        .eps = cfg->eps,
        .weight_decay = cfg->weight_decay,
        .momentum = cfg->momentum,
        .max_grad_norm = cfg->grad_clip,
        .grad_accum = cfg->grad_accum,
        .loss_scale = cfg->loss_scale,
        .initial_scale_power = cfg->initial_scale_power,
        .loss_scale_window = cfg->loss_scale_window,
        .hysteresis = cfg->hysteresis,
        .consecutive_hysteresis = cfg->consecutive_hysteresis,
        .min_loss_scale = cfg->min_loss_scale,
        .clip_value = cfg->clip_value,
        .stochastic_rounding = cfg->stochastic_rounding,
        .seed = cfg->seed,
        .eps2 = cfg->eps2,
        .clip_threshold = cfg->clip_threshold,
        .decay_rate = cfg->decay_rate,
        .paged = !strcmp(cfg->zero_extra.offload_optimizer, "nvme"),
        .in_backward = cfg->optimizer_in_backward,
        .delayed_update = cfg->zero_extra.opt_delayed_update,
        .delayed_warmup = cfg->zero_extra.opt_delayed_warmup,
        .accumulate_on_device = cfg->zero_extra.opt_accumulate_on_device,
        .pin_memory = cfg->zero_extra.opt_pin_memory,
        .spike = {cfg->skip_update_lossz, cfg->skip_update_gradz, cfg->skip_update_window,
                  cfg->skip_update_min_steps, cfg->skip_update_max_in_row},
    };
    return o;
}
