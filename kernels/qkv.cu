// Q/K/V preparation and Main KV storage. CPU twins: the attention block of
// src/model/forward.rs (bias, per-head q/k RMSNorm, rope.apply, store_kv),
// src/backend/cpu/rope.rs and the codecs of src/kv/.
//
// One warp per (row, head) vector of head_dim D values, heads ordered q (Hq), k (Hkv),
// v (Hkv) as the fused qkv GEMM lays them out, each row `row_stride` values long (more than
// (Hq + 2 Hkv) D when the GEMM also emits an attention gate after them). Lane l holds
// elements l + 32k. RoPE rotates the first `rot` dims (D, or fewer: partial RoPE), pairing
// j with j + rot/2; the rest pass through. Then, in the representations that rotate
// (src/kv/mod.rs, KvDtype::rotation), queries and keys, and values when they are NVFP4, are
// multiplied by the normalized Hadamard matrix (hadamard_warp) when D is a power of two.

#define QKV_WARPS 8

// Cos/sin tables are computed on the host exactly as RopeTable does: [positions, rot/2].
template <int KF, int VF, int NK>
__device__ void qkv_prep(const float* __restrict__ qkv, const float* __restrict__ bias,
                         const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                         const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
                         const i32* __restrict__ pos, const i32* __restrict__ win, void* __restrict__ q_out,
                         int q_bf16, KvTensor kt, KvTensor vt, u64* err, int layer, i64 rows, int hq, int hkv,
                         int D, int row_stride, int rot, double eps) {
    __shared__ float stage[QKV_WARPS][NK * 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int nh = hq + 2 * hkv;
    i64 gw = (i64)blockIdx.x * QKV_WARPS + warp;
    if (gw >= rows * nh) return;  // uniform per warp
    i64 row = gw / nh;
    int h = (int)(gw - row * nh);
    int kind = h < hq ? 0 : (h < hq + hkv ? 1 : 2);
    int hh = kind == 0 ? h : (kind == 1 ? h - hq : h - hq - hkv);
    const float* src = qkv + row * (i64)row_stride + (i64)h * D;

    float v[NK];
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        int j = lane + 32 * k;
        float x = 0.0f;
        if (j < D) {
            x = src[j];
            if (bias) x = __fadd_rn(x, bias[h * D + j]);
        }
        v[k] = x;
    }

    if (kind < 2) {
        const float* nw = kind == 0 ? q_norm : k_norm;
        if (nw) {
            double ss = 0.0;
#pragma unroll
            for (int k = 0; k < NK; ++k) ss += (double)v[k] * (double)v[k];
            ss = warp_sum_f64(ss);
            float inv = (float)(1.0 / sqrt(ss / (double)D + eps));
#pragma unroll
            for (int k = 0; k < NK; ++k) {
                int j = lane + 32 * k;
                if (j < D) v[k] = __fmul_rn(nw[j], __fmul_rn(v[k], inv));
            }
        }
        // Rotate-half RoPE through a per-warp staging row: j pairs with j + rot/2.
        float* s = stage[warp];
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) s[j] = v[k];
        }
        __syncwarp();
        int half = rot >> 1;
        i64 p = pos[row];
        const float* c = rope_cos + p * half;
        const float* sn = rope_sin + p * half;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < rot) {
                int jj = j < half ? j : j - half;
                float x1 = s[jj], x2 = s[jj + half];
                float cj = c[jj], sj = sn[jj];
                v[k] = j < half ? __fsub_rn(__fmul_rn(x1, cj), __fmul_rn(x2, sj))
                                : __fadd_rn(__fmul_rn(x2, cj), __fmul_rn(x1, sj));
            }
        }
    }

    // The Hadamard rotation (src/kv/hadamard.rs): keys and queries in every quantized
    // representation, values in those whose values are NVFP4.
    const bool rotate_k = KF == E_INT8 || KF == E_FP8 || KF == E_NVFP4;
    const bool rotate_v = VF == E_NVFP4;
    if (hadamard_applies(D) && (kind < 2 ? rotate_k : rotate_v)) hadamard_warp<NK>(v, D);

    if (kind == 0) {
        i64 base = (row * hq + hh) * D;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D) {
                if (q_bf16) {
                    ((u16*)q_out)[base + j] = f32_to_bf16(v[k]);
                } else {
                    ((float*)q_out)[base + j] = v[k];
                }
            }
        }
        return;
    }

    // Keys and values: refuse non-finite input (recorded, checked by the host after the batch).
    bool bad = false;
#pragma unroll
    for (int k = 0; k < NK; ++k) {
        int j = lane + 32 * k;
        if (j < D && !is_finite_f32(v[k])) bad = true;
    }
    u32 ballot = __ballot_sync(FULL_MASK, bad);
    if (ballot) {
        // First bad element in this vector: smallest j over lanes and slots.
        int first = 1 << 30;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            int j = lane + 32 * k;
            if (j < D && !is_finite_f32(v[k])) first = min(first, j);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(FULL_MASK, first, o));
        if (lane == 0) {
            u64 flat = ((u64)pos[row] * (u64)hkv + (u64)hh) * (u64)D + (u64)first;
            u64 key = ((u64)win[row] << 48) | ((u64)layer << 40) | ((u64)(kind == 2) << 39) | flat;
            report_nonfinite(err, key);
        }
#pragma unroll
        for (int k = 0; k < NK; ++k) v[k] = 0.0f;
    }
    i64 vec = row * hkv + hh;
    if (kind == 1) {
        kv_store_warp<KF, NK>(kt, vec, D, v);
    } else {
        kv_store_warp<VF, NK>(vt, vec, D, v);
    }
}

#define QKV_ENTRY(NAME, KF, VF, NK)                                                                          \
    extern "C" __global__ void __launch_bounds__(QKV_WARPS * 32) NAME(                                       \
        const float* qkv, const float* bias, const float* q_norm, const float* k_norm, const float* rope_cos, \
        const float* rope_sin, const i32* pos, const i32* win, void* q_out, int q_bf16, KvTensor kt,         \
        KvTensor vt, u64* err, int layer, i64 rows, int hq, int hkv, int D, int row_stride, int rot,          \
        double eps) {                                                                                         \
        qkv_prep<KF, VF, NK>(qkv, bias, q_norm, k_norm, rope_cos, rope_sin, pos, win, q_out, q_bf16, kt, vt, \
                             err, layer, rows, hq, hkv, D, row_stride, rot, eps);                             \
    }

#define QKV_ENTRIES(FMT, KF, VF)                      \
    QKV_ENTRY(qkv_prep_##FMT##_nk2, KF, VF, 2)        \
    QKV_ENTRY(qkv_prep_##FMT##_nk4, KF, VF, 4)        \
    QKV_ENTRY(qkv_prep_##FMT##_nk8, KF, VF, 8)

// The host compiles this module once per KV representation, defining KV_ONLY_<name>
// (or KV_ALL), so a run compiles only the variants it launches.
#if defined(KV_ALL) || defined(KV_ONLY_f32)
QKV_ENTRIES(f32, E_F32, E_F32)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_bf16)
QKV_ENTRIES(bf16, E_BF16, E_F16)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_int8)
QKV_ENTRIES(int8, E_INT8, E_INT8)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_fp8)
QKV_ENTRIES(fp8, E_FP8, E_FP8)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_nvfp4)
QKV_ENTRIES(nvfp4, E_NVFP4, E_NVFP4)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_k8v4)
QKV_ENTRIES(k8v4, E_FP8, E_NVFP4)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_fp8tensor)
QKV_ENTRIES(fp8tensor, E_FP8T, E_FP8T)
#endif
