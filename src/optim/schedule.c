// schedule.c: learning-rate schedules.
//
// fitlm's: warmup is linear over warmup_steps (step 0 already gets
// lr/warmup, as llm.c, so no step is wasted at lr 0); after it the rate is
// constant, or decays to min_lr_ratio*lr at total_steps along a cosine or a
// line, and stays at that floor afterwards.
//
// DeepSpeed's (deepspeed/runtime/lr_schedules.py), in its arithmetic
// (doubles): its scheduler starts at iteration -1 and steps after each
// update an fp16 overflow did not skip, so the update after n applied ones
// runs at iteration n - 1's rate. Warmup runs over max(2, warmup_steps)
// iterations along log(i + 1) / log(warmup) or i / warmup, from `from`
// (WarmupCosineLR: from * lr) to lr; then WarmupLR stays at lr,
// WarmupDecayLR falls along a line to `from` at total_steps, WarmupCosineLR
// along a cosine to min_lr_ratio * lr.
#include "fitlm/optim.h"

#include <math.h>
#include <string.h>

static const struct {
    const char *name;
    fl_sched_kind kind;
} kinds[] = {{"constant", FL_SCHED_CONSTANT},
             {"cosine", FL_SCHED_COSINE},
             {"linear", FL_SCHED_LINEAR},
             {"WarmupLR", FL_SCHED_WARMUP_LR},
             {"WarmupDecayLR", FL_SCHED_WARMUP_DECAY_LR},
             {"WarmupCosineLR", FL_SCHED_WARMUP_COSINE_LR}};

fl_schedule fl_schedule_of(const fl_train_config *cfg) {
    fl_sched_kind kind = FL_SCHED_CONSTANT;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (!strcmp(cfg->scheduler, kinds[i].name)) kind = kinds[i].kind;
    fl_schedule s = {kind, cfg->lr, cfg->warmup_steps, cfg->steps, cfg->min_lr_ratio, 0.0f, 0};
    if (!fl_schedule_by_updates(&s)) return s;
    s.log_warmup = !strcmp(cfg->warmup_type, "log");
    if (cfg->total_num_steps) s.total_steps = cfg->total_num_steps;
    if (kind == FL_SCHED_WARMUP_COSINE_LR) {
        s.from = cfg->warmup_min_ratio;
        s.min_lr_ratio = cfg->cos_min_ratio;
    } else {
        s.from = cfg->warmup_min_lr; // lr is warmup_max_lr (fl_optim_check_config)
    }
    return s;
}

int fl_schedule_by_updates(const fl_schedule *s) {
    return s->kind >= FL_SCHED_WARMUP_LR;
}

static float fitlm_lr(const fl_schedule *s, int step) {
    if (step < s->warmup_steps) return s->lr * (float)(step + 1) / (float)s->warmup_steps;
    if (s->kind == FL_SCHED_CONSTANT) return s->lr;
    float floor = s->min_lr_ratio * s->lr;
    int span = s->total_steps - s->warmup_steps;
    if (span <= 0 || step >= s->total_steps) return floor;
    float progress = (float)(step - s->warmup_steps) / (float)span;
    float shape =
        s->kind == FL_SCHED_COSINE ? 0.5f * (1.0f + cosf((float)M_PI * progress)) : 1.0f - progress;
    return floor + (s->lr - floor) * shape;
}

static float deepspeed_lr(const fl_schedule *s, int updates) {
    int i = updates - 1, cosine = s->kind == FL_SCHED_WARMUP_COSINE_LR;
    double lr = s->lr, from = s->from;
    if (i < 0) return cosine ? 0.0f : s->from; // set before its first step
    int warmup = s->warmup_steps > 2 ? s->warmup_steps : 2;
    double span = s->total_steps - warmup > 1 ? s->total_steps - warmup : 1;
    if (i < warmup) {
        double g = s->log_warmup ? 1.0 / log((double)warmup) * log(i + 1.0) : (double)i / warmup;
        return cosine ? (float)(lr * (from + g * (1.0 - from))) : (float)(from + (lr - from) * g);
    }
    if (s->kind == FL_SCHED_WARMUP_DECAY_LR)
        return (float)(from + (lr - from) * fmax(0.0, (s->total_steps - i) / span));
    if (cosine) {
        double floor = s->min_lr_ratio, progress = fmin(1.0, (i - warmup + 1) / span);
        return (float)(lr * fmax(0.0, floor + (1.0 - floor) * (1.0 + cos(M_PI * progress)) / 2));
    }
    return s->lr;
}

float fl_lr_at(const fl_schedule *s, int n) {
    return fl_schedule_by_updates(s) ? deepspeed_lr(s, n) : fitlm_lr(s, n);
}
