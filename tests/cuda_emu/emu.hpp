// emu.hpp: what the CUDA emulator's runtime (emu.cc) shares with its
// cuBLASLt (cublaslt.cc). C++, inside tests/cuda_emu/ only.
#ifndef FITLM_CUDA_EMU_H
#define FITLM_CUDA_EMU_H

#include <stddef.h>

#include <functional>
#include <mutex>

#include "cuda_runtime.h"

namespace fl_emu {

// held by every entry point: the emulated GPU runs one piece of work at a time
extern std::recursive_mutex lock;
// Stops the run with the emulator's message: a use of CUDA that is an
// error on a GPU too.
[[noreturn]] void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// whether [p, p + bytes) lies inside one device allocation
int is_device(const void *p, size_t bytes);
// Queues `run` on stream s (NULL: the legacy stream, which waits for all
// work before it and runs at once); on the device's clock it takes the
// time it takes the emulator.
void enqueue(cudaStream_t s, std::function<void()> run);
// The same for work whose end on the device's clock run(start) says.
void enqueue_timed(cudaStream_t s, std::function<double(double)> run);

} // namespace fl_emu

#endif
