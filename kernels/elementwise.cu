// Row-wise and element-wise kernels of the forward pass: embedding gather, RMSNorm,
// SwiGLU, residual add and casts. CPU twins: src/model/forward.rs (embedding gather),
// src/backend/cpu/norm.rs (rms_norm, rms_norm_row, swiglu).
//
// Activations between kernels are f32; a kernel whose output feeds a cuBLAS GEMM writes
// either bf16 (`out_bf16 != 0`, the default precision) or f32 (the f32 precision mode).

// x[m, :] = embed[tokens[m], :] widened to f32. Token ids were range-checked on the host.
// Grid: (rows), block: 256.
extern "C" __global__ void embed_gather(const i32* __restrict__ tokens, const void* __restrict__ embed,
                                        int embed_bf16, float* __restrict__ x, int d) {
    i64 m = blockIdx.x;
    i64 id = tokens[m];
    float* out = x + m * d;
    if (embed_bf16) {
        const u16* row = (const u16*)embed + id * d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) out[j] = bf16_to_f32(row[j]);
    } else {
        const float* row = (const float*)embed + id * d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) out[j] = row[j];
    }
}

__device__ __forceinline__ void store_act(void* out, i64 idx, float v, int out_bf16) {
    if (out_bf16) {
        ((u16*)out)[idx] = f32_to_bf16(v);
    } else {
        ((float*)out)[idx] = v;
    }
}

// out[r, :] = x[src, :] / sqrt(mean(x[src, :]^2) + eps) * w, src = rows ? rows[r] : r.
// The mean of squares is accumulated in f64, the scaling done in f32 as on the CPU:
// inv = (float)(1 / sqrt(ss / d + eps)); out = w * (x * inv).
// Grid: (out rows), block: 256 (any multiple of 32 up to 1024).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const i32* __restrict__ rows,
                                    const float* __restrict__ w, void* __restrict__ out, int out_bf16,
                                    int d, double eps) {
    __shared__ double scratch[32];
    i64 r = blockIdx.x;
    i64 src = rows ? (i64)rows[r] : r;
    const float* xr = x + src * d;
    double ss = 0.0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        double v = (double)xr[j];
        ss += v * v;
    }
    ss = block_sum_f64(ss, scratch);
    float inv = (float)(1.0 / sqrt(ss / (double)d + eps));
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float v = __fmul_rn(w[j], __fmul_rn(xr[j], inv));
        store_act(out, r * d + j, v, out_bf16);
    }
}

// act[t, j] = silu(gu[t, j]) * gu[t, f + j] for a fused gate/up GEMM output gu[T, 2f].
// Grid: (ceil(rows * f / 256)), block: 256.
extern "C" __global__ void swiglu(const float* __restrict__ gu, void* __restrict__ act, int out_bf16,
                                  i64 rows, int f) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * f) return;
    i64 t = idx / f;
    int j = (int)(idx - t * f);
    float x = gu[t * 2 * f + j];
    float u = gu[t * 2 * f + f + j];
    float s = __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
    store_act(act, idx, __fmul_rn(s, u), out_bf16);
}

// x += y, element-wise (the residual add when a GEMM cannot accumulate in place).
// Grid: (ceil(n / 256)), block: 256.
extern "C" __global__ void residual_add(float* __restrict__ x, const float* __restrict__ y, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}

// out = bf16(in), element-wise (weights uploaded as f32 and narrowed on the device).
// Grid: (ceil(n / 256)), block: 256.
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ in, u16* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(in[i]);
}

// The gated attention's output gate (qwen3_5): attn[r, i] *= sigmoid(qkv[r * row_stride +
// gate_off + i]) for i < qd, the gate being the projection's columns after q, k and v.
// CPU twin: the gated branch of the attention block in src/model/forward.rs.
// Grid: (ceil(rows * qd / 256)), block 256.
extern "C" __global__ void attn_output_gate(void* __restrict__ attn, int attn_bf16, const float* __restrict__ qkv,
                                            int row_stride, int gate_off, i64 rows, int qd) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * qd) return;
    i64 r = idx / qd;
    int i = (int)(idx - r * qd);
    float gv = qkv[r * row_stride + gate_off + i];
    float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gv)));
    if (attn_bf16) {
        u16* a = (u16*)attn;
        a[idx] = f32_to_bf16(__fmul_rn(bf16_to_f32(a[idx]), sg));
    } else {
        float* a = (float*)attn;
        a[idx] = __fmul_rn(a[idx], sg);
    }
}

// Rotates each vector of D values of x[n, D] (f32, or bf16 when x_bf16) in place by the
// normalized Hadamard matrix: the attention output, back from values stored rotated
// (nvfp4, k8v4). D is a power of two, at most 256. CPU twin: kv::hadamard::rotate (the CPU
// rotates in f32; in bf16 mode the output is rounded to bf16 before and after).
// Grid: (ceil(n / 8)), block 256 (one warp per vector).
extern "C" __global__ void hadamard_rows(void* __restrict__ x, int x_bf16, i64 n, int D) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 i = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
    if (i >= n) return;  // uniform per warp
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int j = lane + 32 * k;
        v[k] = j < D ? (x_bf16 ? bf16_to_f32(((const u16*)x)[i * D + j]) : ((const float*)x)[i * D + j]) : 0.0f;
    }
    hadamard_warp<8>(v, D);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int j = lane + 32 * k;
        if (j < D) {
            if (x_bf16) {
                ((u16*)x)[i * D + j] = f32_to_bf16(v[k]);
            } else {
                ((float*)x)[i * D + j] = v[k];
            }
        }
    }
}

// Records the first non-finite value of x[rows, cols] (packed rows; row r is position pos[r]
// of window win[r]) into `err` as window << 48 | layer << 40 | part << 37 | (pos * cols +
// col): the smallest record is the one the CPU meets first (by window, layer, the part's
// order in the layer, position, column). The caller keeps pos * cols below 2^37.
// Grid: (ceil(rows * cols / 256)), block 256.
extern "C" __global__ void nonfinite_scan(const float* __restrict__ x, i64 rows, int cols, const i32* __restrict__ pos,
                                          const i32* __restrict__ win, int layer, int part, u64* __restrict__ err) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool bad = idx < rows * cols && !is_finite_f32(x[idx]);
    u64 key = 0;
    if (bad) {
        i64 r = idx / cols;
        u64 col = (u64)(idx - r * cols);
        u64 flat = (u64)pos[r] * (u64)cols + col;
        key = ((u64)win[r] << 48) | ((u64)(layer & 0xFF) << 40) | ((u64)(part & 7) << 37) | flat;
    }
    warp_record_min(err, bad, key);
}
