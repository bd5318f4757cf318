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
// it supplies these itself (the tensor-core products as exchanges among the warp's fibers).
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

// Four warp-wide tf32 tensor-core products sharing A, each as three (3xTF32): for t < 4,
// acc[t] += lo(A) hi(B_t) + hi(A) lo(B_t) + hi(A) hi(B_t), in that order, with
// mma.m16n8k8 (A 16x8 row-major: a[0] = (g, c), a[1] = (g+8, c), a[2] = (g, c+4),
// a[3] = (g+8, c+4); B_t 8x8: b[t][0] = (k c, n g), b[t][1] = (k c+4, n g); C as in
// mma_bf16_16816; g = lane / 4, c = lane % 4). The registers hold f32 bit patterns of which
// the tensor core reads the top 19 (sign, exponent, 10 fraction bits).
__device__ __forceinline__ void mma_tf32_1688(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma3_tf32_x4(float (&acc)[4][4], const u32 (&ah)[4], const u32 (&al)[4],
                                             const u32 (&bh)[4][2], const u32 (&bl)[4][2]) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        mma_tf32_1688(acc[t], al[0], al[1], al[2], al[3], bh[t][0], bh[t][1]);
        mma_tf32_1688(acc[t], ah[0], ah[1], ah[2], ah[3], bl[t][0], bl[t][1]);
        mma_tf32_1688(acc[t], ah[0], ah[1], ah[2], ah[3], bh[t][0], bh[t][1]);
    }
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
#define E_F16 5
#define E_FP8T 6

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

// ---------------------------------------------------------------- IEEE half (src/kv/f16.rs)

// Round to nearest even, subnormals kept, 65520 and up to infinity (the `half` crate's rule).
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        u32 m = a + 0x0fffu + ((a >> 13) & 1u);
        return (u16)(sign | ((m - 0x38000000u) >> 13));
    }
    // Below 2^-14: a · 2^24 is exact, and adding 2^23 rounds it to the subnormal code.
    float t = __fadd_rn(__fmul_rn(__uint_as_float(a), 16777216.0f), 8388608.0f);
    return (u16)(sign | (__float_as_uint(t) - 0x4B000000u));
}

__device__ __forceinline__ float f16_to_f32(u32 h) {
    u32 sign = (h & 0x8000u) << 16;
    u32 e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0u) {
        float v = __fmul_rn((float)m, 5.9604644775390625e-8f);  // m · 2^-24, exact
        return __uint_as_float(__float_as_uint(v) | sign);
    }
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
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
    return __fmul_rn((float)q, scale);
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
    return __fmul_rn(e4m3_to_f32(code), scale);
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

__device__ __forceinline__ float nvfp4_decode(u32 code, float block_scale) {
    return __fmul_rn(e2m1_to_f32(code), block_scale);
}

// ---------------------------------------------------------------- Hadamard (src/kv/hadamard.rs)

// 1/sqrt(D) for D = 2^l, as the f32 the host computes: 2^-(l/2), times fl(1/sqrt(2)) for odd l.
__device__ __forceinline__ float hadamard_norm(int D) {
    int l = 0;
    while ((1 << l) < D) ++l;
    float p = __uint_as_float((u32)(127 - l / 2) << 23);
    return (l & 1) ? __fmul_rn(p, __uint_as_float(0x3F3504F3u)) : p;
}

__device__ __forceinline__ bool hadamard_applies(int D) {
    return D >= 2 && (D & (D - 1)) == 0;
}

// The normalized Hadamard rotation of one vector held by a warp (lane l holds element
// l + 32k in v[k]; D a power of two, D <= 32 * NK): the CPU's butterfly, strides 1, 2, 4, ...
// in order (below 32 across lanes, from 32 up across registers), each pair (i, i + s)
// becoming (x_i + x_{i+s}, x_i - x_{i+s}), then one multiplication by hadamard_norm(D).
// Every lane must call it (warp shuffles).
template <int NK>
__device__ __forceinline__ void hadamard_warp(float (&v)[NK], int D) {
    int lane = threadIdx.x & 31;
    for (int s = 1; s < 32 && s < D; s <<= 1) {
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            float o = __shfl_xor_sync(FULL_MASK, v[k], s);
            v[k] = (lane & s) ? __fsub_rn(o, v[k]) : __fadd_rn(v[k], o);
        }
    }
#pragma unroll
    for (int t = 1; t < NK; t <<= 1) {
        if (32 * t < D) {
#pragma unroll
            for (int k = 0; k < NK; ++k) {
                if ((k & t) == 0) {
                    float a = v[k], b = v[k + t];
                    v[k] = __fadd_rn(a, b);
                    v[k + t] = __fsub_rn(a, b);
                }
            }
        }
    }
    float c = hadamard_norm(D);
#pragma unroll
    for (int k = 0; k < NK; ++k) v[k] = __fmul_rn(v[k], c);
}

// ---------------------------------------------------------------- stored KV tensors

// One stored K or V tensor of `n` vectors of `D` values. Vector `i` is (row, kv head) =
// (i / Hkv, i % Hkv). Layout per format (the CPU `Encoded` fields, one array each):
//   f32    data: float[n*D]
//   bf16   data: u16[n*D]  (bfloat16)
//   f16    data: u16[n*D]  (IEEE half)
//   int8   data: i8[n*D],            scale: u16[n*ceil(D/64)] (FP16, one per 64 elements)
//   fp8    data: u8[n*D] (e4m3fn),   scale: u16[n] (FP16, one per vector)
//   nvfp4  data: u8[n*ceil(D/2)] (element 2j in the low nibble of byte j),
//          bscale: u8[n*ceil(D/16)] (e4m3fn, one per 16 elements)
//   fp8tensor data: u8[n*D] (e4m3fn) under `tscale`, this tensor's f32 scale for the layer
//          (vLLM's per-tensor FP8: divide, convert saturating; decode multiplies)
struct KvTensor {
    void* data;
    u16* scale;
    u8* bscale;
    float tscale;
};

// Dequantized value of element `j` of vector `i`; exactly the CPU decoder.
template <int E>
__device__ __forceinline__ float kv_load(const KvTensor& t, i64 i, int j, int D) {
    if (E == E_F32) {
        return ((const float*)t.data)[i * D + j];
    } else if (E == E_BF16) {
        return bf16_to_f32(((const u16*)t.data)[i * D + j]);
    } else if (E == E_F16) {
        return f16_to_f32(((const u16*)t.data)[i * D + j]);
    } else if (E == E_INT8) {
        int ng = (D + 63) >> 6;
        return int8_decode(((const i8*)t.data)[i * D + j], f16_to_f32(t.scale[i * ng + (j >> 6)]));
    } else if (E == E_FP8) {
        return fp8_decode(((const u8*)t.data)[i * D + j], f16_to_f32(t.scale[i]));
    } else if (E == E_FP8T) {
        return fp8_decode(((const u8*)t.data)[i * D + j], t.tscale);
    } else {
        int half = (D + 1) >> 1, nb = (D + 15) >> 4;
        u32 byte = ((const u8*)t.data)[i * half + (j >> 1)];
        u32 code = (j & 1) ? (byte >> 4) : (byte & 15u);
        float bs = e4m3_to_f32(((const u8*)t.bscale)[i * nb + (j >> 4)]);
        return nvfp4_decode(code, bs);
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
    } else if (E == E_F16) {
        const u16* p = (const u16*)t.data + i * D + j;
        r.x = f16_to_f32(p[0]);
        r.y = f16_to_f32(p[1]);
    } else if (E == E_INT8) {
        const i8* p = (const i8*)t.data + i * D + j;
        int ng = (D + 63) >> 6;
        float s = f16_to_f32(t.scale[i * ng + (j >> 6)]);
        r.x = int8_decode(p[0], s);
        r.y = int8_decode(p[1], s);
    } else if (E == E_FP8) {
        const u8* p = (const u8*)t.data + i * D + j;
        float s = f16_to_f32(t.scale[i]);
        r.x = fp8_decode(p[0], s);
        r.y = fp8_decode(p[1], s);
    } else if (E == E_FP8T) {
        const u8* p = (const u8*)t.data + i * D + j;
        r.x = fp8_decode(p[0], t.tscale);
        r.y = fp8_decode(p[1], t.tscale);
    } else {
        int half = (D + 1) >> 1, nb = (D + 15) >> 4;
        u32 byte = ((const u8*)t.data)[i * half + (j >> 1)];
        float bs = e4m3_to_f32(((const u8*)t.bscale)[i * nb + (j >> 4)]);
        r.x = nvfp4_decode(byte & 15u, bs);
        r.y = nvfp4_decode(byte >> 4, bs);
    }
    return r;
}

// Encodes one vector held by a warp and writes its stored form. Lane `l` holds elements
// l + 32*k in v[k] for k < NK (NK*32 >= D); lanes past D hold 0. Every lane must call it
// (warp shuffles). Any rotation has been applied before (qkv_prep).
template <int E, int NK>
__device__ __forceinline__ void kv_store_warp(const KvTensor& t, i64 i, int D, const float (&v)[NK]) {
    int lane = threadIdx.x & 31;
    if (E == E_F32 || E == E_BF16 || E == E_F16) {
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (E == E_F32) {
                if (j < D) ((float*)t.data)[i * D + j] = v[k];
            } else if (E == E_BF16) {
                if (j < D) ((u16*)t.data)[i * D + j] = f32_to_bf16(v[k]);
            } else {
                if (j < D) ((u16*)t.data)[i * D + j] = f32_to_f16(v[k]);
            }
        }
        return;
    }
    if (E == E_INT8) {
        // Groups of 64: element l + 32k lies in group k / 2 (k = 2g and 2g + 1, every lane).
        int ng = (D + 63) >> 6;
#pragma unroll
        for (int g = 0; 2 * g < NK; ++g) {
            u32 am = __float_as_uint(v[2 * g]) & 0x7FFFFFFFu;
            if (2 * g + 1 < NK) am = max(am, __float_as_uint(v[2 * g + 1]) & 0x7FFFFFFFu);
            am = warp_max_u32(am);
            if (64 * g >= D) continue;  // uniform: a group past the vector
            u16 sh = f32_to_f16(__fdiv_rn(__uint_as_float(am), 127.0f));
            float s = f16_to_f32(sh);
            float r = __fdiv_rn(1.0f, s);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int k = 2 * g + h;
                if (k >= NK) continue;
                int j = lane + 32 * k;
                if (j < D) ((i8*)t.data)[i * D + j] = s != 0.0f ? int8_round_clamp(__fmul_rn(v[k], r)) : (i8)0;
            }
            if (lane == 0) t.scale[i * ng + g] = sh;
        }
        return;
    }
    if (E == E_FP8) {
        u32 am = 0u;
#pragma unroll
        for (int k = 0; k < NK; ++k) am = max(am, __float_as_uint(v[k]) & 0x7FFFFFFFu);
        am = warp_max_u32(am);
        float amax = __uint_as_float(am);
        u16 sh = amax == 0.0f
                     ? (u16)0
                     : f32_to_f16(fminf(fmaxf(__fdiv_rn(amax, 448.0f), 5.9604644775390625e-8f), 65504.0f));
        float s = f16_to_f32(sh);
        float r = __fdiv_rn(1.0f, s);
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) ((u8*)t.data)[i * D + j] = (u8)(s != 0.0f ? e4m3_from_f32(__fmul_rn(v[k], r)) : 0u);
        }
        if (lane == 0) t.scale[i] = sh;
        return;
    }
    if (E == E_FP8T) {
        // One f32 division, then the saturating conversion (src/kv/fp8_tensor.rs).
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) ((u8*)t.data)[i * D + j] = (u8)e4m3_from_f32(__fdiv_rn(v[k], t.tscale));
        }
        return;
    }
    // nvfp4: blocks of 16 elements, no vector scale. Element l + 32k lies in block
    // 2k + (l >> 4), whose lanes are one aligned half-warp.
    int half = (D + 1) >> 1, nb = (D + 15) >> 4;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        int j = lane + 32 * k;
        float bam = __uint_as_float(half_warp_max_u32(__float_as_uint(v[k]) & 0x7FFFFFFFu));
        u32 s = bam == 0.0f ? 0u : e4m3_from_f32(fminf(fmaxf(__fdiv_rn(bam, 6.0f), 0.001953125f), 448.0f));
        float d = e4m3_to_f32(s);
        u32 code = (s != 0u && j < D) ? e2m1_from_f32(__fdiv_rn(v[k], d)) : 0u;
        u32 hi = __shfl_down_sync(FULL_MASK, code, 1);
        if (j < D && (j & 1) == 0) {
            ((u8*)t.data)[i * half + (j >> 1)] = (u8)(code | ((j + 1 < D ? hi : 0u) << 4));
        }
        if (j < D && (j & 15) == 0) t.bscale[i * nb + (j >> 4)] = (u8)s;
    }
}

// Records the first non-finite K or V value: the smallest key wins.
__device__ __forceinline__ void report_nonfinite(u64* err, u64 key) {
    atomicMin(err, key);
}

// The smallest `key` among the lanes of this warp with `bad`, recorded with one atomicMin
// per warp rather than one per element (a tensor of NaNs would otherwise queue millions of
// atomics on one address). Every lane of the warp must call it: none may have returned.
__device__ __forceinline__ void warp_record_min(u64* err, bool bad, u64 key) {
    if (__ballot_sync(FULL_MASK, bad) == 0u) return;
    u64 k = bad ? key : ~(u64)0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 other = __shfl_xor_sync(FULL_MASK, k, o);
        k = other < k ? other : k;
    }
    if ((threadIdx.x & 31) == 0) atomicMin(err, k);
}
