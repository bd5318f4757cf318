// Shared device code for every kernel module: fixed-width types, bfloat16 conversion,
// warp and block reductions, and the Main KV element codecs.
//
// The host prepends this file to each kernels/*.cu before NVRTC compiles it, so the
// modules need no include path and no CUDA headers: NVRTC runs on a machine with only
// libnvrtc. Compiled with --ftz=false --prec-div=true --prec-sqrt=true: every operation
// that decides a stored KV bit uses the explicitly rounded intrinsics (__fdiv_rn,
// __fmul_rn, __fadd_rn), which are never contracted into FMAs, so the codecs reproduce the
// CPU specification in src/kv/ bit for bit.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

// The one place the emulated device (kernels/emu.h, which defines NINFER_EMU) differs:
// it supplies these two itself, for C++.
#ifndef NINFER_EMU
// The block's dynamic shared memory (the size is a launch parameter).
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]

// One warp-wide bf16 tensor-core product, D = A·B + C (fragment layouts: kernels/attention.cu).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

#define FULL_MASK 0xffffffffu
#define F32_MAX 3.4028234663852886e38f
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ bool is_finite_f32(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// Element formats of one stored KV tensor (the values of `Elem` in src/kv/mod.rs).
#define E_F32 0
#define E_BF16 1
#define E_INT8 2
#define E_FP8 3
#define E_NVFP4 4

// ---------------------------------------------------------------- bfloat16

// Round to nearest even (the `half` crate's rule for finite values; NaN stays NaN).
__device__ __forceinline__ u16 f32_to_bf16(float v) {
    u32 x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x40u);
    }
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Two floats as a packed bf16 pair, `lo` in the low half (the order mma fragments use).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ float clamp_finite(float v) {
    return fminf(fmaxf(v, -F32_MAX), F32_MAX);
}

// ---------------------------------------------------------------- reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Maximum over each aligned group of 16 lanes.
__device__ __forceinline__ u32 half_warp_max_u32(u32 v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide sum in f64; `scratch` holds at least 32 doubles. Every thread gets the result.
__device__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < nw; ++i) t += scratch[i];
    return t;
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = NEG_INF;
    for (int i = 0; i < nw; ++i) t = fmaxf(t, scratch[i]);
    return t;
}

__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; ++i) t += scratch[i];
    return t;
}

// ---------------------------------------------------------------- int8 (src/kv/int8.rs)

// clamp(round_half_even(v), -127, 127).
__device__ __forceinline__ i8 int8_round_clamp(float v) {
    v = fminf(fmaxf(v, -127.0f), 127.0f);
    return (i8)__float2int_rn(v);
}

__device__ __forceinline__ float int8_decode(i8 q, float scale) {
    return clamp_finite(__fmul_rn((float)q, scale));
}

// ---------------------------------------------------------------- e4m3fn (src/kv/fp8.rs)

__device__ __forceinline__ float e4m3_to_f32(u32 b) {
    u32 sign = (b & 0x80u) << 24;
    u32 e = (b >> 3) & 0xFu;
    u32 m = b & 7u;
    u32 bits;
    if (e == 15u && m == 7u) {
        bits = 0x7FC00000u;
    } else if (e == 0u) {
        if (m == 0u) {
            bits = 0u;
        } else {
            u32 k = 31u - (u32)__clz((int)m);
            u32 frac = (m << (23u - k)) & 0x7FFFFFu;
            bits = ((127u + k - 9u) << 23) | frac;
        }
    } else {
        bits = ((e + 120u) << 23) | (m << 20);
    }
    return __uint_as_float(sign | bits);
}

// Round to nearest even, saturating at 448; the same integer steps as the CPU encoder.
__device__ __forceinline__ u32 e4m3_from_f32(float v) {
    u32 bits = __float_as_uint(v);
    u32 sign = (bits >> 24) & 0x80u;
    u32 abs = bits & 0x7FFFFFFFu;
    u32 normal = ((abs + 0x7FFFFu + ((abs >> 20) & 1u)) >> 20) - 960u;
    float t = __fadd_rn(__fmul_rn(__uint_as_float(abs), 512.0f), 8388608.0f);
    u32 sub = __float_as_uint(t) - 0x4B000000u;
    u32 mag = abs >= 0x43E00000u ? 0x7Eu : (abs < 0x3C800000u ? sub : normal);
    if (abs > 0x7F800000u) mag = 0x7Fu;
    return (sign | mag) & 0xFFu;
}

__device__ __forceinline__ float fp8_decode(u32 code, float scale) {
    return clamp_finite(__fmul_rn(e4m3_to_f32(code), scale));
}

// ---------------------------------------------------------------- e2m1 / nvfp4 (src/kv/nvfp4.rs)

// {0, 0.5, 1, 1.5, 2, 3, 4, 6} by magnitude code, built from exponent and mantissa bits.
__device__ __forceinline__ float e2m1_to_f32(u32 c) {
    u32 m = c & 7u;
    float mag = m < 2u ? 0.5f * (float)m : __uint_as_float(((126u + (m >> 1)) << 23) | ((m & 1u) << 22));
    return (c & 8u) ? -mag : mag;
}

__device__ __forceinline__ u32 e2m1_from_f32(float v) {
    u32 sign = (__float_as_uint(v) >> 28) & 8u;
    float a = fabsf(v);
    u32 c = (u32)(a > 0.25f) + (u32)(a >= 0.75f) + (u32)(a > 1.25f) + (u32)(a >= 1.75f) +
            (u32)(a > 2.5f) + (u32)(a >= 3.5f) + (u32)(a > 5.0f);
    return sign | c;
}

__device__ __forceinline__ float nvfp4_decode(u32 code, float block_scale, float g) {
    return clamp_finite(__fmul_rn(__fmul_rn(e2m1_to_f32(code), block_scale), g));
}

// ---------------------------------------------------------------- stored KV tensors

// One stored K or V tensor of `n` vectors of `D` values. Vector `i` is (row, kv head) =
// (i / Hkv, i % Hkv). Layout per format (the CPU `Encoded` fields, one array each):
//   f32    data: float[n*D]
//   bf16   data: u16[n*D]
//   int8   data: i8[n*D],            scale: float[n]
//   fp8    data: u8[n*D] (e4m3fn),   scale: float[n]
//   nvfp4  data: u8[n*ceil(D/2)] (element 2j in the low nibble of byte j),
//          bscale: u8[n*ceil(D/16)] (e4m3fn), scale: float[n] (the global scale g)
struct KvTensor {
    void* data;
    float* scale;
    u8* bscale;
};

// Dequantized value of element `j` of vector `i`; exactly the CPU decoder.
template <int E>
__device__ __forceinline__ float kv_load(const KvTensor& t, i64 i, int j, int D) {
    if (E == E_F32) {
        return ((const float*)t.data)[i * D + j];
    } else if (E == E_BF16) {
        return bf16_to_f32(((const u16*)t.data)[i * D + j]);
    } else if (E == E_INT8) {
        return int8_decode(((const i8*)t.data)[i * D + j], t.scale[i]);
    } else if (E == E_FP8) {
        return fp8_decode(((const u8*)t.data)[i * D + j], t.scale[i]);
    } else {
        int half = (D + 1) >> 1, nb = (D + 15) >> 4;
        u32 byte = ((const u8*)t.data)[i * half + (j >> 1)];
        u32 code = (j & 1) ? (byte >> 4) : (byte & 15u);
        float bs = e4m3_to_f32(((const u8*)t.bscale)[i * nb + (j >> 4)]);
        return nvfp4_decode(code, bs, t.scale[i]);
    }
}

// Dequantized elements `j` and `j + 1` of vector `i` (j even, j + 1 < D).
template <int E>
__device__ __forceinline__ float2 kv_load2(const KvTensor& t, i64 i, int j, int D) {
    float2 r;
    if (E == E_F32) {
        const float* p = (const float*)t.data + i * D + j;
        r.x = p[0];
        r.y = p[1];
    } else if (E == E_BF16) {
        const u16* p = (const u16*)t.data + i * D + j;
        r.x = bf16_to_f32(p[0]);
        r.y = bf16_to_f32(p[1]);
    } else if (E == E_INT8) {
        const i8* p = (const i8*)t.data + i * D + j;
        float s = t.scale[i];
        r.x = int8_decode(p[0], s);
        r.y = int8_decode(p[1], s);
    } else if (E == E_FP8) {
        const u8* p = (const u8*)t.data + i * D + j;
        float s = t.scale[i];
        r.x = fp8_decode(p[0], s);
        r.y = fp8_decode(p[1], s);
    } else {
        int half = (D + 1) >> 1, nb = (D + 15) >> 4;
        u32 byte = ((const u8*)t.data)[i * half + (j >> 1)];
        float bs = e4m3_to_f32(((const u8*)t.bscale)[i * nb + (j >> 4)]);
        float g = t.scale[i];
        r.x = nvfp4_decode(byte & 15u, bs, g);
        r.y = nvfp4_decode(byte >> 4, bs, g);
    }
    return r;
}

// Encodes one vector held by a warp and writes its stored form. Lane `l` holds elements
// l + 32*k in v[k] for k < NK (NK*32 >= D); lanes past D hold 0. Returns nothing; every
// lane must call it (warp shuffles).
template <int E, int NK>
__device__ __forceinline__ void kv_store_warp(const KvTensor& t, i64 i, int D, const float (&v)[NK]) {
    int lane = threadIdx.x & 31;
    if (E == E_F32) {
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) ((float*)t.data)[i * D + j] = v[k];
        }
        return;
    }
    if (E == E_BF16) {
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) ((u16*)t.data)[i * D + j] = f32_to_bf16(v[k]);
        }
        return;
    }
    // amax over the whole vector, exact: the magnitude bits compared as integers.
    u32 am = 0u;
#pragma unroll
    for (int k = 0; k < NK; ++k) am = max(am, __float_as_uint(v[k]) & 0x7FFFFFFFu);
    am = warp_max_u32(am);
    float amax = __uint_as_float(am);
    if (E == E_INT8) {
        float scale = __fdiv_rn(amax, 127.0f);
        bool nz = scale != 0.0f;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) ((i8*)t.data)[i * D + j] = nz ? int8_round_clamp(__fdiv_rn(v[k], scale)) : (i8)0;
        }
        if (lane == 0) t.scale[i] = scale;
        return;
    }
    if (E == E_FP8) {
        float scale = __fdiv_rn(amax, 448.0f);
        bool nz = scale != 0.0f;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) ((u8*)t.data)[i * D + j] = (u8)(nz ? e4m3_from_f32(__fdiv_rn(v[k], scale)) : 0u);
        }
        if (lane == 0) t.scale[i] = scale;
        return;
    }
    // nvfp4: blocks of 16 elements. Element l + 32k lies in block 2k + (l >> 4), whose
    // lanes are one aligned half-warp.
    float g = __fdiv_rn(amax, 2688.0f);
    int half = (D + 1) >> 1, nb = (D + 15) >> 4;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        int j = lane + 32 * k;
        u32 bam = half_warp_max_u32(__float_as_uint(v[k]) & 0x7FFFFFFFu);
        u32 s = (g != 0.0f) ? e4m3_from_f32(__fdiv_rn(__uint_as_float(bam), __fmul_rn(6.0f, g))) : 0u;
        float d = __fmul_rn(e4m3_to_f32(s), g);
        u32 code = (d != 0.0f && j < D) ? e2m1_from_f32(__fdiv_rn(v[k], d)) : 0u;
        u32 hi = __shfl_down_sync(FULL_MASK, code, 1);
        if (j < D && (j & 1) == 0) {
            ((u8*)t.data)[i * half + (j >> 1)] = (u8)(code | ((j + 1 < D ? hi : 0u) << 4));
        }
        if (j < D && (j & 15) == 0) t.bscale[i * nb + (j >> 4)] = (u8)s;
    }
    if (lane == 0) t.scale[i] = g;
}

// Records the first non-finite K or V value: the smallest key wins.
__device__ __forceinline__ void report_nonfinite(u64* err, u64 key) {
    atomicMin(err, key);
}
