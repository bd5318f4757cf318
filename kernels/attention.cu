// Causal grouped-query attention over packed windows, reading keys and values through
// their stored Main KV representation. CPU twin: src/backend/cpu/attention.rs.
//
// Rows of several windows are packed one after another. The host cuts every window into
// query tiles and passes one int4 per tile: {first query row (global), query rows in the
// tile, first row of the window (global), unused}. A query at window position p attends
// keys at positions 0..=p of its own window. Scores never leave the multiprocessor: each
// block streams key/value tiles through shared memory with an online softmax, so no score
// matrix exists in global memory. Grid: (tiles, query heads). Query head h reads KV head
// h / (Hq / Hkv).
//
// attn_f32_*: f32 arithmetic throughout (the f32 precision mode and head dims the tensor
// core kernel does not take); any D <= 256.
// attn_mma_*: bf16 tensor cores (mma.sync m16n8k16, f32 accumulation) for D = 64, 128 and
// 256; the dequantized K/V and the probabilities are rounded to bf16 for the products. At
// D = 256 (the Qwen3.5 family's gated attention) key tiles are 32 keys, not 64, so the key
// and transposed value tiles (37,376 B) stay under the 48 KiB of static shared memory.

// ------------------------------------------------------------------ f32 kernel

#define AF_ROWS 16   // query rows per block (4 per warp)
#define AF_KEYS 32   // keys per tile (one per lane)

// Dynamic shared memory: Ks[AF_KEYS][D+1], Vs[AF_KEYS][D], Qs[AF_ROWS][D] floats.
template <int KF, int VF>
__device__ void attn_f32(const float* __restrict__ q, KvTensor kt, KvTensor vt, const int4* __restrict__ tiles,
                         void* __restrict__ out, int out_bf16, int hq, int hkv, int D, float scale) {
    DYNAMIC_SHARED(float, smem);
    float* Ks = smem;
    float* Vs = Ks + AF_KEYS * (D + 1);
    float* Qs = Vs + AF_KEYS * D;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int4 tile = tiles[blockIdx.x];
    int h = blockIdx.y;
    int kvh = h / (hq / hkv);
    i64 q_row0 = tile.x, seq_row0 = tile.z;
    int n_q = tile.y;
    int q_pos0 = (int)(q_row0 - seq_row0);
    int last_pos = q_pos0 + n_q - 1;

    for (int e = threadIdx.x; e < AF_ROWS * D; e += blockDim.x) {
        int r = e / D, j = e - r * D;
        Qs[e] = r < n_q ? q[((q_row0 + r) * hq + h) * D + j] : 0.0f;
    }

    float m[4], l[4], o[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int t = 0; t < 8; ++t) o[r][t] = 0.0f;
    }

    for (int kt0 = 0; kt0 <= last_pos; kt0 += AF_KEYS) {
        __syncthreads();
        for (int e = threadIdx.x; e < AF_KEYS * D; e += blockDim.x) {
            int kk = e / D, j = e - kk * D;
            int kpos = kt0 + kk;
            float kvv = 0.0f, vvv = 0.0f;
            if (kpos <= last_pos) {
                i64 vec = (seq_row0 + kpos) * hkv + kvh;
                kvv = kv_load<KF>(kt, vec, j, D);
                vvv = kv_load<VF>(vt, vec, j, D);
            }
            Ks[kk * (D + 1) + j] = kvv;
            Vs[kk * D + j] = vvv;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            int row = warp * 4 + r;
            if (row >= n_q) continue;  // uniform per warp
            int qpos = q_pos0 + row;
            if (kt0 > qpos) continue;
            int kpos = kt0 + lane;
            float s = NEG_INF;
            if (kpos <= qpos) {
                const float* qr = Qs + row * D;
                const float* kr = Ks + lane * (D + 1);
                float acc = 0.0f;
                for (int j = 0; j < D; ++j) acc = fmaf(qr[j], kr[j], acc);
                s = acc * scale;
            }
            float mt = warp_max(s);
            float mn = fmaxf(m[r], mt);
            float p = (kpos <= qpos) ? expf(s - mn) : 0.0f;
            float alpha = expf(m[r] - mn);  // 0 on the first tile (m = -inf)
            l[r] = l[r] * alpha + warp_sum(p);
            m[r] = mn;
#pragma unroll
            for (int t = 0; t < 8; ++t) o[r][t] *= alpha;
            int nk = min(AF_KEYS, qpos - kt0 + 1);
            for (int kk = 0; kk < nk; ++kk) {
                float pk = __shfl_sync(FULL_MASK, p, kk);
                const float* vr = Vs + kk * D;
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    int j = lane + 32 * t;
                    if (j < D) o[r][t] = fmaf(pk, vr[j], o[r][t]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 4; ++r) {
        int row = warp * 4 + r;
        if (row >= n_q) continue;
        float inv = 1.0f / l[r];
        i64 base = ((q_row0 + row) * hq + h) * D;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            int j = lane + 32 * t;
            if (j < D) {
                float v = o[r][t] * inv;
                if (out_bf16) {
                    ((u16*)out)[base + j] = f32_to_bf16(v);
                } else {
                    ((float*)out)[base + j] = v;
                }
            }
        }
    }
}

// ------------------------------------------------------------------ tensor-core kernel

#define AM_ROWS 64  // query rows per block (16 per warp)

// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): g = lane / 4, c = lane % 4.
//   A (16x16, row major): reg0 = (g, 2c..2c+1), reg1 = (g+8, 2c..), reg2 = (g, 2c+8..),
//                         reg3 = (g+8, 2c+8..).
//   B (16x8, column major): reg0 = (k 2c..2c+1, n g), reg1 = (k 2c+8.., n g).
//   C (16x8 f32): c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..2c+1).
// So B fragments of K^T are two consecutive dims of key g (row g of Ks[key][dim]) and
// B fragments of V are two consecutive keys of dim g (row g of Vt[dim][key]); the C
// fragments of two adjacent key blocks of S are exactly the A fragment of P.
// AM_KEYS: keys per tile (a multiple of 16).
template <int KF, int VF, int D, int AM_KEYS>
__device__ void attn_mma(const u16* __restrict__ q, KvTensor kt, KvTensor vt, const int4* __restrict__ tiles,
                         u16* __restrict__ out, int hq, int hkv, float scale_log2) {
    const int KS = D + 8;         // Ks row stride (u16): conflict-free fragment reads
    const int VS = AM_KEYS + 8;   // Vt row stride (u16)
    __shared__ __align__(16) u16 Ks[AM_KEYS * (D + 8)];
    __shared__ __align__(16) u16 Vt[D * (AM_KEYS + 8)];

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, c = lane & 3;
    int4 tile = tiles[blockIdx.x];
    int h = blockIdx.y;
    int kvh = h / (hq / hkv);
    i64 q_row0 = tile.x, seq_row0 = tile.z;
    int n_q = tile.y;
    int q_pos0 = (int)(q_row0 - seq_row0);
    int last_pos = q_pos0 + n_q - 1;
    int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's two query rows in the tile
    // Last query position of this warp; -1 when the warp holds no query row of the tile.
    int warp_last = warp * 16 < n_q ? q_pos0 + min(warp * 16 + 15, n_q - 1) : -1;

    // Q fragments, straight from global memory (bf16 [rows, hq, D]): held in registers up to
    // D = 128; at D = 256 they would take 64 of the registers the output accumulators need
    // (ptxas spilled), so they are read again (from cache) for each key tile.
    const bool q_in_regs = D <= 128;
    const u32* q0 = (const u32*)(q + ((q_row0 + r0) * hq + h) * D);
    const u32* q1 = (const u32*)(q + ((q_row0 + r1) * hq + h) * D);
    const bool v0 = r0 < n_q, v1 = r1 < n_q;
    u32 qf[q_in_regs ? D / 16 : 1][4];
    if (q_in_regs) {
#pragma unroll
        for (int kk = 0; kk < (q_in_regs ? D / 16 : 1); ++kk) {
            qf[kk][0] = v0 ? q0[kk * 8 + c] : 0u;
            qf[kk][1] = v1 ? q1[kk * 8 + c] : 0u;
            qf[kk][2] = v0 ? q0[kk * 8 + 4 + c] : 0u;
            qf[kk][3] = v1 ? q1[kk * 8 + 4 + c] : 0u;
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;

    for (int kt0 = 0; kt0 <= last_pos; kt0 += AM_KEYS) {
        __syncthreads();
        // Keys: one dim pair per thread step, coalesced along dims.
        for (int e = threadIdx.x; e < AM_KEYS * (D / 2); e += blockDim.x) {
            int kk = e / (D / 2), jp = (e - kk * (D / 2)) * 2;
            int kpos = kt0 + kk;
            float2 kv = make_float2(0.0f, 0.0f);
            if (kpos <= last_pos) kv = kv_load2<KF>(kt, (seq_row0 + kpos) * hkv + kvh, jp, D);
            *(u32*)&Ks[kk * KS + jp] = pack_bf16x2(kv.x, kv.y);
        }
        // Values, transposed: two keys x two dims per step, stored as key pairs.
        for (int e = threadIdx.x; e < (AM_KEYS / 2) * (D / 2); e += blockDim.x) {
            int kp = (e / (D / 2)) * 2, jp = (e - (e / (D / 2)) * (D / 2)) * 2;
            int kpos = kt0 + kp;
            float2 va = make_float2(0.0f, 0.0f), vb = make_float2(0.0f, 0.0f);
            if (kpos <= last_pos) va = kv_load2<VF>(vt, (seq_row0 + kpos) * hkv + kvh, jp, D);
            if (kpos + 1 <= last_pos) vb = kv_load2<VF>(vt, (seq_row0 + kpos + 1) * hkv + kvh, jp, D);
            *(u32*)&Vt[jp * VS + kp] = pack_bf16x2(va.x, vb.x);
            *(u32*)&Vt[(jp + 1) * VS + kp] = pack_bf16x2(va.y, vb.y);
        }
        __syncthreads();
        if (kt0 > warp_last) continue;  // every key of this tile is in this warp's future

        float s[AM_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < AM_KEYS / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a0, a1, a2, a3;
            if (q_in_regs) {
                const int i = q_in_regs ? kk : 0;
                a0 = qf[i][0];
                a1 = qf[i][1];
                a2 = qf[i][2];
                a3 = qf[i][3];
            } else {
                a0 = v0 ? q0[kk * 8 + c] : 0u;
                a1 = v1 ? q1[kk * 8 + c] : 0u;
                a2 = v0 ? q0[kk * 8 + 4 + c] : 0u;
                a3 = v1 ? q1[kk * 8 + 4 + c] : 0u;
            }
#pragma unroll
            for (int nt = 0; nt < AM_KEYS / 8; ++nt) {
                const u16* kr = Ks + (nt * 8 + g) * KS + kk * 16 + 2 * c;
                u32 b0 = *(const u32*)kr;
                u32 b1 = *(const u32*)(kr + 8);
                mma_bf16_16816(s[nt], a0, a1, a2, a3, b0, b1);
            }
        }

        // Causal mask, scale (log2 domain), row maxima over the quad that shares a row.
        int qp0 = q_pos0 + r0, qp1 = q_pos0 + r1;
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < AM_KEYS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int kpos = kt0 + nt * 8 + 2 * c + (e & 1);
                int qp = e < 2 ? qp0 : qp1;
                float v = kpos <= qp ? s[nt][e] * scale_log2 : NEG_INF;
                s[nt][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A row with every key masked so far keeps m = -inf; subtract 0 then (all p are 0).
        float base0 = mn0 == NEG_INF ? 0.0f : mn0;
        float base1 = mn1 == NEG_INF ? 0.0f : mn1;
        float a0 = exp2f(m0 - base0), a1 = exp2f(m1 - base1);
        m0 = mn0;
        m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < AM_KEYS / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - base0);
            s[nt][1] = exp2f(s[nt][1] - base0);
            s[nt][2] = exp2f(s[nt][2] - base1);
            s[nt][3] = exp2f(s[nt][3] - base1);
            ps0 += s[nt][0] + s[nt][1];
            ps1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * a0 + ps0;
        l1 = l1 * a1 + ps1;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            o[dn][0] *= a0;
            o[dn][1] *= a0;
            o[dn][2] *= a1;
            o[dn][3] *= a1;
        }
#pragma unroll
        for (int kc = 0; kc < AM_KEYS / 16; ++kc) {
            u32 pa0 = pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
            u32 pa1 = pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
            u32 pa2 = pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            u32 pa3 = pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                const u16* vr = Vt + (dn * 8 + g) * VS + kc * 16 + 2 * c;
                u32 b0 = *(const u32*)vr;
                u32 b1 = *(const u32*)(vr + 8);
                mma_bf16_16816(o[dn], pa0, pa1, pa2, pa3, b0, b1);
            }
        }
    }

    // Row sums are spread over the quad; reduce, normalize, store bf16 pairs.
    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    float i0 = 1.0f / l0, i1 = 1.0f / l1;
    if (r0 < n_q) {
        u32* dst = (u32*)(out + ((q_row0 + r0) * hq + h) * D);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) dst[dn * 4 + c] = pack_bf16x2(o[dn][0] * i0, o[dn][1] * i0);
    }
    if (r1 < n_q) {
        u32* dst = (u32*)(out + ((q_row0 + r1) * hq + h) * D);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) dst[dn * 4 + c] = pack_bf16x2(o[dn][2] * i1, o[dn][3] * i1);
    }
}

#define ATTN_ENTRIES(FMT, KF, VF)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) attn_f32_##FMT(                                         \
        const float* q, KvTensor kt, KvTensor vt, const int4* tiles, void* out, int out_bf16, int hq, int hkv, \
        int D, float scale) {                                                                                  \
        attn_f32<KF, VF>(q, kt, vt, tiles, out, out_bf16, hq, hkv, D, scale);                                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_mma_##FMT##_d64(                                   \
        const u16* q, KvTensor kt, KvTensor vt, const int4* tiles, u16* out, int hq, int hkv, float sl2) {     \
        attn_mma<KF, VF, 64, 64>(q, kt, vt, tiles, out, hq, hkv, sl2);                                         \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_mma_##FMT##_d128(                                  \
        const u16* q, KvTensor kt, KvTensor vt, const int4* tiles, u16* out, int hq, int hkv, float sl2) {     \
        attn_mma<KF, VF, 128, 64>(q, kt, vt, tiles, out, hq, hkv, sl2);                                        \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_mma_##FMT##_d256(                                  \
        const u16* q, KvTensor kt, KvTensor vt, const int4* tiles, u16* out, int hq, int hkv, float sl2) {     \
        attn_mma<KF, VF, 256, 32>(q, kt, vt, tiles, out, hq, hkv, sl2);                                        \
    }

// One variant per KV representation (KV_ONLY_<name>, or KV_ALL), as in qkv.cu.
#if defined(KV_ALL) || defined(KV_ONLY_f32)
ATTN_ENTRIES(f32, E_F32, E_F32)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_bf16)
ATTN_ENTRIES(bf16, E_BF16, E_F16)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_int8)
ATTN_ENTRIES(int8, E_INT8, E_INT8)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_fp8)
ATTN_ENTRIES(fp8, E_FP8, E_FP8)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_nvfp4)
ATTN_ENTRIES(nvfp4, E_NVFP4, E_NVFP4)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_k8v4)
ATTN_ENTRIES(k8v4, E_FP8, E_NVFP4)
#endif
#if defined(KV_ALL) || defined(KV_ONLY_fp8tensor)
ATTN_ENTRIES(fp8tensor, E_FP8T, E_FP8T)
#endif
