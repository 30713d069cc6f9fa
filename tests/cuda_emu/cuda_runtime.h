// cuda_runtime.h of the CUDA emulator (tests/cuda_emu/): the part of the
// CUDA runtime API that src/cuda/ uses, run on the CPU, so that the CUDA
// backend's host code and kernels are executed and checked on machines
// without a GPU (FITLM_CUDA_EMU=ON, docs/testing.md). Not NVIDIA's header:
// only the names src/cuda/ calls, with the documented semantics. C for
// cuda.c; under C++ the kernel side too (cuda_emu_kernel.hpp).
#ifndef FITLM_CUDA_EMU_RUNTIME_H
#define FITLM_CUDA_EMU_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
} cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

typedef enum cudaDataType_t {
    CUDA_R_32F = 0,
    CUDA_R_16F = 2,
    CUDA_R_16BF = 14,
} cudaDataType_t;
typedef cudaDataType_t cudaDataType;

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int warpSize;
    int maxThreadsPerBlock;
    int maxGridSize[3];
    int major, minor;
    int multiProcessorCount;
};

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;

#define cudaStreamDefault      0x0
#define cudaStreamNonBlocking  0x1
#define cudaEventDefault       0x0
#define cudaEventDisableTiming 0x2
#define cudaHostAllocDefault   0x0
#define cudaHostAllocPortable  0x1

const char *cudaGetErrorString(cudaError_t err);
const char *cudaGetErrorName(cudaError_t err);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t e);

// the emulator's own entry points behind the C++ templates below
cudaError_t fl_emu_memcpy_to_symbol(void *symbol, size_t symbol_bytes, const void *src,
                                    size_t bytes, size_t offset);
cudaError_t fl_emu_func_set_attribute(const void *func, int attr, int value);

#ifdef __cplusplus
}

template <class T> cudaError_t cudaMalloc(T **p, size_t bytes) {
    return cudaMalloc((void **)p, bytes);
}
template <class T> cudaError_t cudaHostAlloc(T **p, size_t bytes, unsigned int flags) {
    return cudaHostAlloc((void **)p, bytes, flags);
}
template <class T>
cudaError_t cudaMemcpyToSymbol(const T &symbol, const void *src, size_t bytes, size_t offset = 0,
                               enum cudaMemcpyKind kind = cudaMemcpyHostToDevice) {
    (void)kind;
    return fl_emu_memcpy_to_symbol((void *)&symbol, sizeof symbol, src, bytes, offset);
}
template <class F> cudaError_t cudaFuncSetAttribute(F *func, enum cudaFuncAttribute attr, int v) {
    return fl_emu_func_set_attribute((const void *)func, (int)attr, v);
}

#include "cuda_emu_kernel.hpp"
#endif

#endif
