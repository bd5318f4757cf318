// CUDA device vocabulary for compiling kernels/*.cu as ordinary C++ on the host: the
// emulated device (`--device emu`, and the kernel tests) runs the very sources NVRTC
// compiles for a GPU, so the kernels can be executed and held to their Rust twins on a
// machine without one.
//
// Model of execution (kernels/emu_runtime.cpp): the blocks of a grid run one after another
// on the calling thread; every CUDA thread of a block is a fiber with its own stack. A
// fiber runs until it reaches a synchronization point: `__syncthreads` (all threads of the
// block), or a warp-synchronous operation (`__syncwarp`, shuffles, ballots, `mma`), which
// waits for all 32 lanes of its warp. A barrier that cannot complete (threads waiting at
// different barriers, or a thread that has exited while others wait) is reported as a
// divergent barrier and fails the launch; it never hangs.
//
// `__shared__` variables are `static`: one copy, used by one block at a time (the runtime
// serializes launches process-wide). Strict mode (NINFER_EMU_STRICT=1) fills them all (see
// the emu_shared section below) with 0xff bytes (NaN as floats) before every block, as a
// GPU's shared memory starts as garbage, and resumes a block's threads in reverse order: a
// value one thread writes and another reads without a barrier between them then arrives
// late, or as poison, instead of passing.
//
// The race checker (NINFER_EMU_RACECHECK=1) builds this code with GCC's ThreadSanitizer
// instrumentation, and the runtime itself receives the `__tsan_*` calls: every load and
// store a kernel makes to shared memory (dynamic, or a `__shared__` static) is recorded
// with the thread and the block's synchronization epoch, and two accesses to one word by
// different threads, at least one a write, that no barrier orders fail the launch. Only
// `__syncthreads` (the whole block) and `__syncwarp` (the warp) order memory; shuffles,
// ballots and `mma` synchronize the fibers here but are not memory barriers in CUDA, so
// they order nothing for the checker. Atomics are not recorded. Global memory is not
// checked.
//
// Arithmetic is IEEE single/double with no contraction (-ffp-contract=off), so the
// explicitly rounded intrinsics are exact; `expf`, `exp2f`, `log` and friends are the
// host's libm, not the GPU's (a limit of the emulation).

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define NINFER_EMU 1

// Code the race checker's instrumentation must leave alone: the runtime, which receives the
// instrumentation's calls, and atomics, whose accesses never race with one another.
#if defined(__SANITIZE_THREAD__)
#define EMU_UNCHECKED __attribute__((no_sanitize_thread))
#else
#define EMU_UNCHECKED
#endif

// Device functions have internal linkage, so their `__shared__` statics are plain local
// statics (not COMDAT) and can live in one section, `emu_shared`, which the runtime fills
// with a poison value before each block in strict mode (NINFER_EMU_STRICT=1). GCC before
// 14 ignores the section of a static local in a function template: those (qkv_prep's,
// attn_mma's, moe_gemm's) stay in .bss, and the host hands their places to the runtime
// (`ninfer_emu_static_shared`) so strict mode poisons them as well.
#define __device__ static
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section("emu_shared")))
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 {
    unsigned x, y, z;
};

struct float2 {
    float x, y;
};
struct int2 {
    int x, y;
};
struct int4 {
    int x, y, z, w;
};
static inline float2 make_float2(float x, float y) {
    float2 r;
    r.x = x;
    r.y = y;
    return r;
}

// ---------------------------------------------------------------- execution state

// The fiber now running and the block it belongs to (set by the runtime).
struct EmuThread {
    emu_dim3 tid;
    unsigned linear;  // threadIdx.x + blockDim.x * (threadIdx.y + ...)
    unsigned lane, warp;
    unsigned xchg;  // warp exchanges done so far: selects the slot buffer
};
static EmuThread* emu_cur;
static emu_dim3 emu_block_idx, emu_block_dim, emu_grid_dim;
static unsigned char* emu_dynamic_smem;

#define threadIdx (emu_cur->tid)
#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim

#define DYNAMIC_SHARED(T, name) T* name = (T*)emu_dynamic_smem

// Synchronization points, implemented by the runtime: each returns when the barrier
// completes. `site` identifies the call site so that threads waiting at different
// barriers are seen as divergent.
enum EmuWarpOp { EMU_SYNCWARP = 1, EMU_SHFL = 2, EMU_BALLOT = 3, EMU_MMA = 4 };
static void emu_block_barrier(int site);
static void emu_warp_barrier(int op, int site);
// Per-warp exchange slots, double-buffered so one barrier per exchange suffices.
static uint64_t* emu_warp_slots(int parity);
// Registers one lane hands to a warp's tensor-core product (the largest: mma3_tf32_x4's).
#define EMU_MMA_SLOT 24
static uint32_t* emu_warp_mma_slots(int parity);
static inline int emu_next_parity() {
    return (int)(emu_cur->xchg++ & 1u);
}

#define __syncthreads() emu_block_barrier(__LINE__)
#define __syncwarp(...) emu_warp_barrier(EMU_SYNCWARP, __LINE__)

// ---------------------------------------------------------------- bit casts and rounding

static inline unsigned __float_as_uint(float v) {
    unsigned u;
    std::memcpy(&u, &v, 4);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}
static inline float __int_as_float(int i) {
    return __uint_as_float((unsigned)i);
}
static inline int __float_as_int(float v) {
    return (int)__float_as_uint(v);
}
static inline float __fdiv_rn(float a, float b) {
    return a / b;
}
static inline float __fmul_rn(float a, float b) {
    return a * b;
}
static inline float __fadd_rn(float a, float b) {
    return a + b;
}
static inline float __fsub_rn(float a, float b) {
    return a - b;
}
// Round to nearest even (the host's default rounding mode), as cvt.rni.
static inline int __float2int_rn(float v) {
    return (int)std::nearbyint(v);
}
static inline int __clz(int x) {
    return x == 0 ? 32 : __builtin_clz((unsigned)x);
}

static inline int min(int a, int b) {
    return a < b ? a : b;
}
static inline int max(int a, int b) {
    return a > b ? a : b;
}
static inline unsigned min(unsigned a, unsigned b) {
    return a < b ? a : b;
}
static inline unsigned max(unsigned a, unsigned b) {
    return a > b ? a : b;
}
static inline long long min(long long a, long long b) {
    return a < b ? a : b;
}
static inline long long max(long long a, long long b) {
    return a > b ? a : b;
}

// ---------------------------------------------------------------- atomics

// Blocks run one at a time and fibers switch only at barriers: a plain update is atomic.
// Not instrumented: the race checker does not record atomics.
EMU_UNCHECKED static inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}

// ---------------------------------------------------------------- warp operations

template <typename T>
static inline uint64_t emu_bits(T v) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
static inline T emu_from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// Every lane publishes `v`, then reads lane `src`'s (its own value when `src` is out of
// the warp, as __shfl_down does past the last lane).
template <typename T>
static inline T emu_shuffle(unsigned mask, T v, int src, int site) {
    (void)mask;  // the kernels use full masks; a lane that has exited fails the barrier
    int p = emu_next_parity();
    uint64_t* slots = emu_warp_slots(p);
    unsigned lane = emu_cur->lane;
    slots[lane] = emu_bits(v);
    emu_warp_barrier(EMU_SHFL, site);
    if (src < 0 || src > 31) return v;
    return emu_from_bits<T>(slots[src]);
}

#define __shfl_xor_sync(mask, v, o) emu_shuffle((mask), (v), (int)(emu_cur->lane ^ (unsigned)(o)), __LINE__)
#define __shfl_sync(mask, v, s) emu_shuffle((mask), (v), (int)((unsigned)(s) & 31u), __LINE__)
#define __shfl_down_sync(mask, v, d) emu_shuffle((mask), (v), (int)(emu_cur->lane + (unsigned)(d)), __LINE__)

static inline unsigned emu_ballot(unsigned mask, bool pred, int site) {
    (void)mask;
    int p = emu_next_parity();
    uint64_t* slots = emu_warp_slots(p);
    slots[emu_cur->lane] = pred ? 1u : 0u;
    emu_warp_barrier(EMU_BALLOT, site);
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r |= (unsigned)(slots[l] & 1u) << l;
    return r;
}
#define __ballot_sync(mask, pred) emu_ballot((mask), (pred), __LINE__)

// ---------------------------------------------------------------- mma.m16n8k16 (bf16)

static inline float emu_bf16_lo(uint32_t r) {
    return __uint_as_float(r << 16);
}
static inline float emu_bf16_hi(uint32_t r) {
    return __uint_as_float(r & 0xffff0000u);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, from the PTX ISA fragment layout
// (g = lane / 4, c = lane % 4):
//   A 16x16: a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B 16x8:  b0 = (k 2c..2c+1, n g), b1 = (k 2c+8.., n g)
//   C 16x8:  c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..2c+1)
// Products of bf16 values are exact in f32; they are summed in k order in f32, then added
// to the accumulator (the hardware's order and internal precision are not specified).
static inline void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                  uint32_t b0, uint32_t b1) {
    int p = emu_next_parity();
    uint32_t* s = emu_warp_mma_slots(p);
    unsigned lane = emu_cur->lane;
    uint32_t* mine = s + lane * 6;
    mine[0] = a0;
    mine[1] = a1;
    mine[2] = a2;
    mine[3] = a3;
    mine[4] = b0;
    mine[5] = b1;
    emu_warp_barrier(EMU_MMA, __LINE__);
    // A(row, k) and B(k, col) read back from the lanes that hold them.
    auto A = [&](int row, int k) -> float {
        int g = row & 7, hi_row = row >> 3, kc = k & 7, hi_k = k >> 3;
        int l = g * 4 + (kc >> 1);
        uint32_t r = s[l * 6 + hi_row + 2 * hi_k];
        return (kc & 1) ? emu_bf16_hi(r) : emu_bf16_lo(r);
    };
    auto B = [&](int k, int col) -> float {
        int kc = k & 7, hi_k = k >> 3;
        int l = col * 4 + (kc >> 1);
        uint32_t r = s[l * 6 + 4 + hi_k];
        return (kc & 1) ? emu_bf16_hi(r) : emu_bf16_lo(r);
    };
    int g = (int)lane >> 2, cc = (int)lane & 3;
    for (int e = 0; e < 4; ++e) {
        int row = g + (e >= 2 ? 8 : 0), col = 2 * cc + (e & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        c[e] += acc;
    }
}

// ---------------------------------------------------------------- mma.m16n8k8 (tf32)

static inline float emu_tf32(uint32_t r) {
    return __uint_as_float(r & 0xffffe000u);
}

// mma3_tf32_x4 (kernels/common.cuh): for t < 4, acc[t] += lo(A) hi(B_t), then hi(A) lo(B_t),
// then hi(A) hi(B_t), each one mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, here in
// one exchange among the warp's lanes instead of twelve (g = lane / 4, c = lane % 4):
//   A 16x8: a[0] = (g, c), a[1] = (g+8, c), a[2] = (g, c+4), a[3] = (g+8, c+4)
//   B 8x8:  b[t][0] = (k c, n g), b[t][1] = (k c+4, n g)
//   C 16x8: as mma_bf16_16816
// Only the top 19 bits of each operand are read (the tf32 value); products of two tf32
// values are exact in f32, each mma's eight summed in k order in f32, then added to the
// accumulator.
static inline void mma3_tf32_x4(float (&acc)[4][4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                const uint32_t (&bh)[4][2], const uint32_t (&bl)[4][2]) {
    int p = emu_next_parity();
    uint32_t* s = emu_warp_mma_slots(p);
    unsigned lane = emu_cur->lane;
    uint32_t* mine = s + lane * EMU_MMA_SLOT;
    for (int r = 0; r < 4; ++r) {
        mine[r] = ah[r];
        mine[4 + r] = al[r];
    }
    for (int t = 0; t < 4; ++t)
        for (int h = 0; h < 2; ++h) {
            mine[8 + 2 * t + h] = bh[t][h];
            mine[16 + 2 * t + h] = bl[t][h];
        }
    emu_warp_barrier(EMU_MMA, __LINE__);
    // This lane's operands read back from the lanes holding them: A's rows g and g + 8, and
    // B_t's columns 2c and 2c + 1, hi ([0]) and lo ([1]), over k.
    const int g = (int)lane >> 2, cc = (int)lane & 3;
    float a[2][2][8], b[2][4][2][8];
    for (int k = 0; k < 8; ++k) {
        const uint32_t* from = s + (g * 4 + (k & 3)) * EMU_MMA_SLOT;
        for (int h = 0; h < 2; ++h) {
            a[0][h][k] = emu_tf32(from[h + 2 * (k >> 2)]);
            a[1][h][k] = emu_tf32(from[4 + h + 2 * (k >> 2)]);
        }
        for (int h = 0; h < 2; ++h) {
            const uint32_t* col = s + ((2 * cc + h) * 4 + (k & 3)) * EMU_MMA_SLOT;
            for (int t = 0; t < 4; ++t) {
                b[0][t][h][k] = emu_tf32(col[8 + 2 * t + (k >> 2)]);
                b[1][t][h][k] = emu_tf32(col[16 + 2 * t + (k >> 2)]);
            }
        }
    }
    // The three products in order: lo·hi, hi·lo, hi·hi.
    const int lo_a[3] = {1, 0, 0}, lo_b[3] = {0, 1, 0};
    for (int t = 0; t < 4; ++t)
        for (int m = 0; m < 3; ++m)
            for (int e = 0; e < 4; ++e) {
                const float* x = a[lo_a[m]][e >> 1];
                const float* y = b[lo_b[m]][t][e & 1];
                float sum = 0.0f;
                for (int k = 0; k < 8; ++k) sum += x[k] * y[k];
                acc[t][e] += sum;
            }
}
