// loss_scale.c: dynamic loss scaling for fp16 with DeepSpeed's semantics
// (runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale), defaults
// initial_scale_power 16, loss_scale_window 1000, hysteresis 2,
// consecutive_hysteresis false, min_loss_scale 1.
#include <math.h>

#include "fitlm/optim.h"

void fl_loss_scaler_init(fl_loss_scaler *s, float static_scale, int initial_scale_power, int window,
                         int hysteresis, int consecutive_hysteresis, float min_scale) {
    s->dynamic = static_scale == 0.0f;
    s->scale = s->dynamic ? ldexpf(1.0f, initial_scale_power) : static_scale;
    s->min_scale = min_scale;
    s->window = window;
    s->hysteresis = s->cur_hysteresis = hysteresis;
    s->consecutive_hysteresis = consecutive_hysteresis;
    s->iter = 0;
    s->last_overflow_iter = -1;
}

int fl_loss_scaler_update(fl_loss_scaler *s, int overflow) {
    int status = 0;
    if (!s->dynamic) {
        // a static scale never changes; the overflowing step is still skipped
    } else if (overflow) {
        if (s->hysteresis == 1 || s->cur_hysteresis == 1) {
            if (s->scale == s->min_scale)
                status = -1; // stuck: nothing left to try
            else
                s->scale = fmaxf(s->scale / 2.0f, s->min_scale);
        } else {
            s->cur_hysteresis--;
        }
        s->last_overflow_iter = s->iter;
    } else {
        if (s->consecutive_hysteresis) s->cur_hysteresis = s->hysteresis;
        if ((s->iter - s->last_overflow_iter) % s->window == 0) {
            if (!s->consecutive_hysteresis) s->cur_hysteresis = s->hysteresis;
            s->scale *= 2.0f;
        }
    }
    s->iter++;
    return status;
}
