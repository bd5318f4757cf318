// The Main KV codecs on their own, for tests: the same device functions the forward pass
// stores and reads K/V with (kv_store_warp in qkv_prep, kv_load in attention), so tests
// can compare stored bytes and decoded values with the CPU specification in src/kv/.
// CPU twins: encode / decode of src/kv/{int8,fp8,nvfp4}.rs and {bf16,f16}::roundtrip.

// Standalone codecs over n vectors of D values: the same device functions as the fused
// path, exposed so tests can compare stored bytes and decoded values with the CPU. One
// encoder per register count of qkv_prep (NK values per lane: D <= 32 * NK).
// Encode grid: (ceil(n / 8)), block 256 (one warp per vector). Decode grid:
// (ceil(n * D / 256)), block 256.
template <int E, int NK>
__device__ void kv_encode(const float* __restrict__ x, i64 n, int D, KvTensor t) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 i = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
    if (i >= n) return;
    float v[NK];
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        int j = lane + 32 * k;
        v[k] = j < D ? x[i * D + j] : 0.0f;
    }
    kv_store_warp<E, NK>(t, i, D, v);
}

template <int E>
__device__ void kv_decode(KvTensor t, i64 n, int D, float* __restrict__ out) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * D) return;
    i64 i = idx / D;
    int j = (int)(idx - i * D);
    out[idx] = kv_load<E>(t, i, j, D);
}

#define CODEC_ENTRIES(NAME, E)                                                                          \
    extern "C" __global__ void kv_encode_##NAME##_nk2(const float* x, i64 n, int D, KvTensor t) {       \
        kv_encode<E, 2>(x, n, D, t);                                                                    \
    }                                                                                                   \
    extern "C" __global__ void kv_encode_##NAME##_nk4(const float* x, i64 n, int D, KvTensor t) {       \
        kv_encode<E, 4>(x, n, D, t);                                                                    \
    }                                                                                                   \
    extern "C" __global__ void kv_encode_##NAME##_nk8(const float* x, i64 n, int D, KvTensor t) {       \
        kv_encode<E, 8>(x, n, D, t);                                                                    \
    }                                                                                                   \
    extern "C" __global__ void kv_decode_##NAME(KvTensor t, i64 n, int D, float* out) {                 \
        kv_decode<E>(t, n, D, out);                                                                     \
    }

CODEC_ENTRIES(f32, E_F32)
CODEC_ENTRIES(bf16, E_BF16)
CODEC_ENTRIES(f16, E_F16)
CODEC_ENTRIES(int8, E_INT8)
CODEC_ENTRIES(fp8, E_FP8)
CODEC_ENTRIES(nvfp4, E_NVFP4)
CODEC_ENTRIES(fp8tensor, E_FP8T)

// Element codecs on their own: e4m3fn and e2m1 codes of n values (one thread each).
// Grid: (ceil(n / 256)), block 256.
extern "C" __global__ void e4m3_encode(const float* __restrict__ x, u8* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (u8)e4m3_from_f32(x[i]);
}

extern "C" __global__ void e2m1_encode(const float* __restrict__ x, u8* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (u8)e2m1_from_f32(x[i]);
}
