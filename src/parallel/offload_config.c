// offload_config.c: ZeRO-Offload's section of the config: DeepSpeed's
// offload_optimizer and offload_param blocks, and the aio block that tunes
// NVMe offload's I/O (offload.c). A device is none, cpu (the state is in
// RAM, where fitlm keeps it anyway) or nvme; each key is honoured or
// refused naming it, never ignored (the deprecated cpu_offload forms are
// mapped onto the devices before: fl_deepspeed_check_config).
#include <string.h>

#include "fitlm/offload.h"

#define ZERO "zero_optimization."

static int given(const fl_train_config *cfg, const char *key) {
    return fl_config_given(cfg, key);
}

// One offload block: device none, cpu (the state is in RAM, where fitlm
// keeps it anyway) or nvme; the NVMe keys of another device are refused.
// pin_memory is read only with an offload, as DeepSpeed reads it: the
// blocks of Qwen's, MiniCPM-V's and LLaVA-NeXT's ZeRO configs say
// "device": "none" beside "pin_memory": true.
static void check_offload(const fl_train_config *cfg, const char *block, const char *device,
                          const char *const *nvme_keys, size_t n_nvme) {
    char key[128];
    for (size_t i = 0; i < n_nvme && strcmp(device, "nvme"); i++) {
        snprintf(key, sizeof key, ZERO "%s.%s", block, nvme_keys[i]);
        if (given(cfg, key))
            fl_die("%s applies to NVMe offload (device nvme); %s.device is %s", key, block, device);
    }
}

// NVMe offload of ZeRO-3's weights: they go in the optimizer's file, which
// the step updates chunk by chunk, so the optimizer is offloaded too. On
// the cpu the gathered weights live in stage 3's own buffers; on a device
// (device_weights.c) a unit is read into buffer_count pinned buffers of
// buffer_size elements (DeepSpeed's parameter swap buffers) and uploaded
// from there. max_in_cpu (weights kept in host memory besides) is not
// offered: only the defaults of what does not apply are accepted.
static void check_nvme_params(fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    if (strcmp(x->offload_optimizer, "nvme"))
        fl_die(ZERO "offload_param.device nvme needs offload_optimizer.device nvme: fitlm keeps "
                    "the weights in the optimizer's NVMe file, where each step's update writes "
                    "them (offload_optimizer.device is %s)",
               x->offload_optimizer);
    if (*x->param_nvme_path && strcmp(x->param_nvme_path, x->opt_nvme_path))
        fl_die(ZERO "offload_param.nvme_path %s differs from offload_optimizer.nvme_path %s: "
                    "fitlm keeps the weights in the optimizer's file (give the same directory, "
                    "or leave offload_param.nvme_path out)",
               x->param_nvme_path, x->opt_nvme_path);
    int device = strcmp(cfg->device, "cpu") != 0;
    if (device && (x->param_buffer_count < 1 || x->param_buffer_count > FL_OFFLOAD_MAX_STAGING))
        fl_die(ZERO "offload_param.buffer_count %d: the pinned buffers a unit's weights are read "
                    "into on their way to the device number 1 to %d",
               x->param_buffer_count, FL_OFFLOAD_MAX_STAGING);
    if (device && !(x->param_buffer_size >= 1.0f))
        fl_die(ZERO "offload_param.buffer_size %g: the elements of a pinned buffer a unit's "
                    "weights are read into must be at least 1",
               x->param_buffer_size);
    const struct {
        const char *key;
        double value, def;
        int on_device; // honoured on a device
    } keys[] = {{"buffer_count", x->param_buffer_count, 5, 1},
                {"buffer_size", x->param_buffer_size, 1e8, 1},
                {"max_in_cpu", x->param_max_in_cpu, 1e9, 0}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        if (keys[i].value == keys[i].def || (device && keys[i].on_device)) continue;
        if (device)
            fl_die(ZERO "offload_param.%s %g: fitlm keeps no weights in host memory under "
                        "NVMe weight offload but the buffer_count pinned buffers they are "
                        "read through (DeepSpeed's default %g is accepted)",
                   keys[i].key, keys[i].value, keys[i].def);
        fl_die(ZERO "offload_param.%s %g: the weights gathered from the file live in stage "
                    "3's buffers, sized by stage3_prefetch_bucket_size and "
                    "stage3_max_live_parameters (DeepSpeed's default %g is accepted)",
               keys[i].key, keys[i].value, keys[i].def);
    }
    cfg->zero.offload_params = 1;
}

// NVMe offload of the optimizer: what it pages and where.
static void check_nvme_optimizer(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    if (!*x->opt_nvme_path)
        fl_die(ZERO "offload_optimizer.device nvme needs offload_optimizer.nvme_path (a directory "
                    "on the disk the state is to live on)");
    if (!strcmp(cfg->optimizer, "lomo") || !strcmp(cfg->optimizer, "adalomo"))
        fl_die(ZERO "offload_optimizer.device nvme with optimizer %s: %s", cfg->optimizer,
               !strcmp(cfg->optimizer, "lomo")
                   ? "LOMO keeps no optimizer state and no master weights: there is nothing to "
                     "offload"
                   : "AdaLomo's factored state is a few floats per row and it keeps no master "
                     "weights: there is nothing worth offloading (use device none)");
    if (x->opt_ratio < 1.0f)
        fl_die(ZERO "offload_optimizer.ratio %g: a partial offload is DeepSpeed's CPU-offload "
                    "feature; with device nvme the whole state is offloaded (use 1)",
               x->opt_ratio);
}

// The delayed update (ZeRO-Offload's DPU, device_offload.c): the host
// updates while the device runs the next step, so there must be a device,
// and no weights the device fetches from the host copy it rewrites.
static void check_delayed(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    if (given(cfg, ZERO "offload_optimizer.delayed_update_warmup") && !x->opt_delayed_update)
        fl_die(ZERO "offload_optimizer.delayed_update_warmup applies to the delayed update; "
                    "offload_optimizer.delayed_update is false");
    if (!x->opt_delayed_update) return;
    if (!strcmp(x->offload_optimizer, "none"))
        fl_die(ZERO "offload_optimizer.delayed_update applies to an offload (device cpu or nvme); "
                    "offload_optimizer.device is none");
    if (!strcmp(cfg->device, "cpu"))
        fl_die(ZERO "offload_optimizer.delayed_update overlaps the host's update with a device's "
                    "next step: it needs --device cuda (or test); on the cpu the optimizer "
                    "already runs where the model does");
    if (cfg->lora_enabled)
        fl_die(ZERO "offload_optimizer.delayed_update with LoRA adapters is not supported: "
                    "their update on the host is short beside the step, with nothing to hide");
    if (strcmp(x->offload_param, "none"))
        fl_die(ZERO "offload_optimizer.delayed_update with offload_param.device %s is not "
                    "supported: the device fetches each unit's weights from the host copy the "
                    "delayed update rewrites during the step",
               x->offload_param);
}

// The fp32 gradient sum on the device (device_offload.c): under
// accumulation, with a device.
static void check_accumulate_on_device(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    if (!x->opt_accumulate_on_device) return;
    const char *why =
        !strcmp(x->offload_optimizer, "none") ? "it applies to an offload (device cpu or nvme); "
                                                "offload_optimizer.device is none"
        : !strcmp(cfg->device, "cpu")
            ? "it needs --device cuda (or test); on the cpu the gradients are summed "
              "where the model is"
        : cfg->grad_accum < 2 ? "there is no accumulation to sum (gradient_accumulation_steps is 1)"
        : cfg->lora_enabled   ? "LoRA's adapters' gradients come down whole after each "
                                "micro-batch (a few per cent of the model's), 16-bit ones summed "
                                "on the host, fp32 ones summed on the device already"
                              : NULL;
    if (why) fl_die(ZERO "offload_optimizer.accumulate_on_device: %s", why);
}

// aio tunes NVMe offload's asynchronous I/O: honoured with it (offload.h),
// an error without it.
static void check_aio(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    // DeepSpeed's defaults are what an aio block copied from elsewhere holds
    const struct {
        const char *key;
        int value, def;
    } keys[] = {{"aio.block_size", x->aio_block_size, 1048576},
                {"aio.queue_depth", x->aio_queue_depth, 8},
                {"aio.thread_count", x->aio_thread_count, 1},
                {"aio.single_submit", x->aio_single_submit, 0},
                {"aio.overlap_events", x->aio_overlap_events, 1}};
    int nvme = !strcmp(x->offload_optimizer, "nvme");
    for (size_t i = 0; i < sizeof keys / sizeof keys[0] && !nvme; i++)
        if (keys[i].value != keys[i].def)
            fl_die("%s %d tunes NVMe offload's I/O; zero_optimization.offload_optimizer.device "
                   "is %s, not nvme (DeepSpeed's default %d is accepted)",
                   keys[i].key, keys[i].value, x->offload_optimizer, keys[i].def);
}

void fl_offload_check_config(fl_train_config *cfg) {
    fl_zero_extra *x = &cfg->zero_extra;
    int stage = cfg->zero.stage;
    static const char *const opt_nvme[] = {"nvme_path", "buffer_count", "pipeline_read",
                                           "pipeline_write", "fast_init"};
    static const char *const param_nvme[] = {"nvme_path", "buffer_count", "buffer_size",
                                             "max_in_cpu"};
    check_offload(cfg, "offload_optimizer", x->offload_optimizer, opt_nvme,
                  sizeof opt_nvme / sizeof opt_nvme[0]);
    check_offload(cfg, "offload_param", x->offload_param, param_nvme,
                  sizeof param_nvme / sizeof param_nvme[0]);
    int opt_on = strcmp(x->offload_optimizer, "none") != 0;
    int param_on = strcmp(x->offload_param, "none") != 0;
    // DeepSpeed's scopes: optimizer offload with ZeRO, parameter offload and
    // a partial optimizer offload with stage 3
    if (opt_on && stage == 0)
        fl_die(ZERO "offload_optimizer applies to ZeRO stages 1-3; zero_optimization.stage is 0");
    if (param_on && stage != 3)
        fl_die(ZERO "offload_param applies to ZeRO stage 3; zero_optimization.stage is %d", stage);
    if (given(cfg, ZERO "offload_optimizer.ratio") && !opt_on)
        fl_die(ZERO "offload_optimizer.ratio applies to an offload (device cpu or nvme); "
                    "offload_optimizer.device is none");
    if (!strcmp(x->offload_optimizer, "nvme")) check_nvme_optimizer(cfg);
    cfg->zero.offload_params = 0;
    if (!strcmp(x->offload_param, "nvme") && stage == 3) check_nvme_params(cfg);
    if (x->opt_ratio < 1.0f && stage != 3)
        fl_die(ZERO "offload_optimizer.ratio %g: a partial offload needs ZeRO stage 3 (as "
                    "DeepSpeed); zero_optimization.stage is %d",
               x->opt_ratio, stage);
    // on the cpu the whole state is where the model is either way
    if (x->opt_ratio < 1.0f && strcmp(cfg->device, "cpu"))
        fl_die(ZERO "offload_optimizer.ratio %g: a partial offload (part of the optimizer "
                    "state kept on the device) is not supported on --device %s: the whole "
                    "state is offloaded (use 1)",
               x->opt_ratio, cfg->device);
    check_delayed(cfg);
    check_accumulate_on_device(cfg);
    check_aio(cfg);
}

int fl_dev_weights_offloaded(const fl_train_config *cfg) {
    return strcmp(cfg->device, "cpu") && cfg->zero.stage == 3 &&
           strcmp(cfg->zero_extra.offload_param, "none");
}
