// no_cuda.c: a build without the CUDA backend (no CUDA compiler found, or
// FITLM_CUDA=OFF) says so when `--device cuda` is asked for.
#include "fitlm/device.h"

#include <stdio.h>

const fl_device *fl_device_cuda_table(char *why, size_t why_size) {
    snprintf(why, why_size,
             "'cuda' asked for, but this build has no CUDA backend (CMake found no CUDA compiler, "
             "or FITLM_CUDA was OFF): rebuild on a machine with nvcc, or use --device cpu");
    return NULL;
}
