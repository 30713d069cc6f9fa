// agree.c: a run's ranks checked against each other before any collective
// whose sizes their settings decide (run_agree, agree.h). Ranks started
// with different settings would otherwise overflow a buffer inside MPI (a
// different model shape), fail with MPI's own error, or train apart without
// a word (a different learning rate or seed); a different save_every would
// meet another rank's collective with its checkpoint's.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agree.h"
#include "fitlm/io.h"

void run_agree(const fl_run *r, const fl_comm_group *g) {
    const fl_train_config *cfg = &r->cfg;
    // the build and the kernels' ISA path first: they decide the bits of the rest
    char *settings = fl_config_canonical(cfg), *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f) fl_die("out of memory");
    fprintf(f, "build.id=%s\nbuild.isa=%s\nrun.start_step=%d\n%s", fl_build_id(),
            fl_isa_name(fl_cpu_isa()), r->start, settings);
    if (fclose(f)) fl_die("out of memory");
    free(settings);
    fl_comm_agree(g, "builds and settings", text);
    free(text);
    fl_param_table t = {0};
    fl_model_table(&t, &cfg->model);
    text = fl_params_canonical(&t, cfg->dtype);
    fl_params_free(&t);
    fl_comm_agree(g, "parameter tables", text);
    free(text);
}

void run_agree_weights(const fl_run *r, const fl_comm_group *g) {
    const fl_model *m = &r->model;
    // alone, or a ZeRO-3 shard each: nothing to compare (the hash reads every weight)
    if (fl_comm_group_size(g) < 2 || fl_model_sharded(m)) return;
    const void *data[3];
    size_t bytes[3];
    int spans = fl_model_weight_spans(m, data, bytes);
    uint32_t crc = 0;
    // a device's weights are read through a bounded host buffer
    enum { STAGE = 1 << 20 };
    uint8_t *stage = m->dev->host ? NULL : fl_alloc(FL_MEM_OTHER, STAGE);
    for (int i = 0; i < spans; i++)
        for (size_t at = 0; at < bytes[i]; at += STAGE) {
            size_t n = bytes[i] - at < STAGE ? bytes[i] - at : STAGE;
            const uint8_t *src = (const uint8_t *)data[i] + at;
            if (stage) fl_dev_download(m->dev, stage, src, n);
            crc = fl_crc32(crc, stage ? stage : src, n);
        }
    fl_free(stage);
    char text[64];
    snprintf(text, sizeof text, "weights.crc32=%08x\n", (unsigned)crc);
    fl_comm_agree(g,
                  "weights (the same settings, but the files they were read from hold other "
                  "contents on another machine)",
                  text);
}
