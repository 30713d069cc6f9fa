// schedule.c: learning-rate schedules. Warmup is linear over warmup_steps
// (step 0 already gets lr/warmup, as llm.c, so no step is wasted at lr 0);
// after it the rate is constant, or decays to min_lr_ratio*lr at total_steps
// along a cosine or a line, and stays at that floor afterwards.
#include "fitlm/optim.h"

#include <math.h>

float fl_lr_at(const fl_schedule *s, int step) {
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
