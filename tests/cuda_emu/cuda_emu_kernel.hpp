// cuda_emu_kernel.hpp: the kernel side of the CUDA emulator (C++). A kernel
// is an ordinary function; a launch queues it on its stream and, when the
// stream runs, every block runs in turn with one fiber per thread, so
// __syncthreads and the warp shuffles are real barriers: a barrier that not
// every thread reaches, or a shuffle naming a lane that has left, stops the
// run with the kernel's name (translate.pl rewrites kernel<<<...>>>(args)
// into fl_emu::launcher(kernel, ...)(args) and the __shared__ declarations
// into per-block arrays, filled with 0xFF at each block's start).
#ifndef FITLM_CUDA_EMU_KERNEL_H
#define FITLM_CUDA_EMU_KERNEL_H

#include <math.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__
#define __restrict__ __restrict
#define __align__(n)           __attribute__((aligned(n))) // as CUDA's host_defines.h
#define __launch_bounds__(...)                             // an occupancy hint to nvcc

struct uint3 {
    unsigned int x, y, z;
};

// CUDA's vector type of two floats, 8-byte aligned as vector_types.h's
struct alignas(8) float2 {
    float x, y;
};
static inline float2 make_float2(float x, float y) {
    return float2{x, y};
}

// CUDA's 16-byte vector types (vector_types.h), 16-byte aligned
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) {
    return float4{x, y, z, w};
}
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return uint4{x, y, z, w};
}

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};

// the running thread's coordinates (one fiber runs at a time)
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
static const int warpSize = 32;

namespace fl_emu {

// Queues body on stream s as kernel `name` of grid x block threads with
// `smem` bytes of dynamic shared memory (the launch's checks happen here,
// as a real launch's, and show at cudaGetLastError).
void launch(const char *name, const void *func, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
            std::function<void()> body);
// the running block's dynamic shared memory
void *dynamic_shared();
// the running block's instance of a __shared__ array declared at `site`
void *shared_array(const void *site, size_t bytes);
// a barrier of the block, or of the lanes in mask of the running warp
void block_barrier();
// lane l of the running warp gets bits of lane src(l) (the caller's own
// bits where src is out of the width or not in mask)
unsigned long long exchange(unsigned mask, unsigned long long bits, int mode, int arg, int width);
enum { SHFL_IDX, SHFL_DOWN, SHFL_UP, SHFL_XOR };
// a barrier of the lanes in mask of the running warp (__syncwarp; wmma:
// whether a WMMA call's, which only lanes at WMMA calls may share)
void warp_barrier(unsigned mask, int wmma);
// Stops the run: "kernel <name>: " and the message.
[[noreturn]] void kernel_die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// The start of the warp-collective WMMA call `call` (mma.h): where
// elem_bytes is not 0, stops the run unless ptr is 32-byte aligned, ldm a
// multiple of 16 bytes and the `span` elements from ptr inside one device
// allocation or shared array; then waits for the whole warp, whose lanes
// must name the same call and arguments. Returns the warp's staging area
// of wmma_staging floats.
enum { wmma_staging = 1280 };
float *wmma_enter(const char *call, const void *ptr, unsigned ldm, int layout, size_t elem_bytes,
                  size_t span);
// A lane's part of a warp-collective PTX instruction (fl_emu_ptx.h): the
// instruction's name and up to 24 bytes of its operands.
struct ptx_slot {
    const char *call;
    unsigned char bytes[24];
};
// The start of PTX instruction `call` (ldmatrix, mma.sync): the lane's
// `bytes` of `mine` into its slot, then a barrier of the whole warp, whose
// lanes must all name `call`. Returns the warp's 32 slots, which stay as
// they are until every lane has reached the warp's next instruction.
const ptx_slot *ptx_enter(const char *call, const void *mine, size_t bytes);
// whether [p, p + bytes) lies inside the running block's shared memory
int in_shared_memory(const void *p, size_t bytes);
// cp.async of 16 bytes (fl_emu_ptx.h): queued in the thread's open group
// (!full: zeros), made only when a wait covers its group, so a kernel
// that reads the bytes before waiting reads what was there before. The
// thread's open group committed; the copies of all but the `pending`
// newest committed groups made, oldest first.
void cp_async(void *dst, const void *src, int full);
void cp_async_commit();
void cp_async_wait(int pending);

template <class F> struct launcher_t;
template <class... P> struct launcher_t<void (*)(P...)> {
    const char *name;
    void (*k)(P...);
    dim3 grid, block;
    size_t smem;
    cudaStream_t s;
    // the arguments converted to the parameters' types at the launch, as CUDA does
    void operator()(typename std::decay<P>::type... a) const {
        std::tuple<typename std::decay<P>::type...> args(a...);
        void (*f)(P...) = k;
        launch(name, (const void *)k, grid, block, smem, s, [f, args]() { std::apply(f, args); });
    }
};

template <class... P>
launcher_t<void (*)(P...)> launcher(const char *name, void (*k)(P...), dim3 grid, dim3 block,
                                    size_t smem = 0, cudaStream_t s = 0) {
    return launcher_t<void (*)(P...)>{name, k, grid, block, smem, s};
}

template <class T> T shfl(unsigned mask, T v, int mode, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof v);
    bits = exchange(mask, bits, mode, arg, width);
    memcpy(&v, &bits, sizeof v);
    return v;
}

} // namespace fl_emu

#define FL_EMU_SHARED(T, name, dims)                                                               \
    static const char name##_site = 0;                                                             \
    T(&name) dims = *(T(*) dims)fl_emu::shared_array(&name##_site, sizeof(T dims))

inline void __syncthreads() {
    fl_emu::block_barrier();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    fl_emu::warp_barrier(mask, 0);
}
template <class T> T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return fl_emu::shfl(mask, v, fl_emu::SHFL_IDX, src, width);
}
template <class T> T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return fl_emu::shfl(mask, v, fl_emu::SHFL_DOWN, (int)delta, width);
}
template <class T> T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return fl_emu::shfl(mask, v, fl_emu::SHFL_UP, (int)delta, width);
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return fl_emu::shfl(mask, v, fl_emu::SHFL_XOR, lane_mask, width);
}

// the intrinsics src/cuda/ uses, with their IEEE meaning (built without
// contraction into FMA, as nvcc --fmad=false)
inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
inline float __fmul_rn(float a, float b) {
    return a * b;
}
inline float __fadd_rn(float a, float b) {
    return a + b;
}
inline float __fsub_rn(float a, float b) {
    return a - b;
}
inline float __fdiv_rn(float a, float b) {
    return a / b;
}
inline float __fmaf_rn(float a, float b, float c) {
    return fmaf(a, b, c);
}
inline double __dmul_rn(double a, double b) {
    return a * b;
}
inline double __dadd_rn(double a, double b) {
    return a + b;
}
inline float rsqrtf(float x) {
    return 1.0f / sqrtf(x);
}
inline float __expf(float x) {
    return expf(x);
}
inline float __logf(float x) {
    return logf(x);
}
inline float __fdividef(float a, float b) {
    return a / b;
}
// CUDA's min and max overloads
inline int min(int a, int b) {
    return a < b ? a : b;
}
inline int max(int a, int b) {
    return a > b ? a : b;
}
inline unsigned int min(unsigned int a, unsigned int b) {
    return a < b ? a : b;
}
inline unsigned int max(unsigned int a, unsigned int b) {
    return a > b ? a : b;
}
inline long long min(long long a, long long b) {
    return a < b ? a : b;
}
inline long long max(long long a, long long b) {
    return a > b ? a : b;
}
inline float min(float a, float b) {
    return fminf(a, b);
}
inline float max(float a, float b) {
    return fmaxf(a, b);
}

#endif
