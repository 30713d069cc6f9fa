// out_dir.h: a run's output directory and id (src/run/out_dir.c), private
// to src/run.
#ifndef FITLM_RUN_OUT_DIR_H
#define FITLM_RUN_OUT_DIR_H

#include <stddef.h>

// Makes out_dir ready for this run: created, locked, a killed writer's
// temporary files deleted, and refused when it holds another run that this
// one does not continue (resume_dir: the directory of the resumed checkpoint).
void run_prepare_out_dir(const char *out_dir, const char *resume_dir, int overwrite);
// A new id for a run: its checkpoints carry it, and pruning deletes no
// checkpoint of another id.
void run_new_id(char *out, size_t size);

#endif
