// The Gated DeltaNet token mixer of hybrid (qwen3_5) layers, over packed windows. CPU
// twins: src/model/delta_net.rs (conv_silu_row, l2_normalize, the beta/g gates, the gated
// output norm) and src/backend/cpu/delta_rule.rs `recurrent` (the State's token recurrence).
//
// Rows of several windows are packed one after another; `pos[row]` is the row's position in
// its window (the causal conv reads only rows of the same window). The projection `proj` is
// `[rows, width]` with channels q|k|v (conv_dim), z (Hv*Dv), b (Hv), a (Hv).

// c[row, ch] = silu(sum_j conv[j, ch] * proj[row - (K - 1) + j, ch]) over the q|k|v channels,
// rows before the window's start reading zero; taps summed in order from 0 as on the CPU.
// Grid: (ceil(rows * conv_dim / 256)), block 256.
extern "C" __global__ void delta_conv_silu(const float* __restrict__ proj, int width, const float* __restrict__ conv,
                                           int kw, const i32* __restrict__ pos, i64 rows, int conv_dim,
                                           float* __restrict__ c) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * conv_dim) return;
    i64 row = idx / conv_dim;
    int ch = (int)(idx - row * conv_dim);
    int p = pos[row];
    float acc = 0.0f;
    for (int j = 0; j < kw; ++j) {
        int back = kw - 1 - j;  // tap j reads the token `back` rows earlier
        if (p < back) continue;
        acc = __fadd_rn(acc, __fmul_rn(conv[j * conv_dim + ch], proj[(row - back) * width + ch]));
    }
    float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-acc)));
    c[idx] = __fmul_rn(acc, s);
}

// Per row: q and k heads L2-normalised in place in c (`x * scale / sqrt(sum x^2 + 1e-6)`, q
// with scale Dk^-1/2), and the gates beta = sigmoid(b), g = -exp(A_log) * softplus(a +
// dt_bias). One warp per (row, key head) for q and for k, then the gates. Grid:
// (ceil(rows * (2 Hk + 1) / 8)), block 256.
extern "C" __global__ void delta_prep(float* __restrict__ c, int conv_dim, const float* __restrict__ proj, int width,
                                      const float* __restrict__ a_log, const float* __restrict__ dt_bias, i64 rows,
                                      int hk, int dk, int hv, int dv, float q_scale, float* __restrict__ beta,
                                      float* __restrict__ g) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 gw = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
    int per_row = 2 * hk + 1;
    if (gw >= rows * per_row) return;  // uniform per warp
    i64 row = gw / per_row;
    int h = (int)(gw - row * per_row);
    if (h < 2 * hk) {
        float* x = c + row * conv_dim + (i64)h * dk;  // q heads, then k heads
        // Sum of squares in f32 over the lanes' strided elements, then the warp tree.
        float ss = 0.0f;
        for (int j = lane; j < dk; j += 32) ss = __fadd_rn(ss, __fmul_rn(x[j], x[j]));
        ss = warp_sum(ss);
        float f = __fdiv_rn(h < hk ? q_scale : 1.0f, sqrtf(__fadd_rn(ss, 1e-6f)));
        for (int j = lane; j < dk; j += 32) x[j] = __fmul_rn(x[j], f);
        return;
    }
    const float* ba = proj + row * width + conv_dim + (i64)hv * dv;
    for (int j = lane; j < hv; j += 32) {
        float b = ba[j], a = __fadd_rn(ba[hv + j], dt_bias[j]);
        beta[row * hv + j] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-b)));
        float sp = a > 20.0f ? a : log1pf(expf(a));
        g[row * hv + j] = -__fmul_rn(expf(a_log[j]), sp);
    }
}

// The gated delta rule, one block per (window, value head), one thread per State column
// (Dv threads): S[Dk, Dv] f32 in shared memory, zero at the window's start; per token, in
// the CPU's operation order: S = exp(g) S; delta = beta (v - S^T k); S += k delta^T;
// o = S^T q. Value head j reads key head j / (Hv / Hk). `spans[w]` = (first row, rows).
// q, k and v are rows of `c` (stride conv_dim) at offsets 0, Hk*Dk, 2*Hk*Dk.
// Dynamic shared memory: (Dk * Dv + 2 * Dk) floats. Grid: (windows, Hv), block Dv.
extern "C" __global__ void delta_rule_recurrent(const float* __restrict__ c, int conv_dim,
                                                const float* __restrict__ beta, const float* __restrict__ g,
                                                const int2* __restrict__ spans, int hk, int dk, int hv, int dv,
                                                float* __restrict__ o) {
    DYNAMIC_SHARED(float, smem);
    float* S = smem;
    float* ks = S + dk * dv;
    float* qs = ks + dk;
    int d = threadIdx.x;
    int j = blockIdx.y;
    int kh = j / (hv / hk);
    int2 span = spans[blockIdx.x];
    for (int i = 0; i < dk; ++i) S[i * dv + d] = 0.0f;
    for (int t = 0; t < span.y; ++t) {
        i64 row = (i64)span.x + t;
        const float* cr = c + row * conv_dim;
        __syncthreads();  // the previous token's reads of ks and qs are done
        for (int e = d; e < dk; e += blockDim.x) {
            qs[e] = cr[kh * dk + e];
            ks[e] = cr[hk * dk + kh * dk + e];
        }
        __syncthreads();
        float alpha = expf(g[row * hv + j]);
        float delta = cr[2 * hk * dk + j * dv + d];
        for (int i = 0; i < dk; ++i) {
            float s = __fmul_rn(S[i * dv + d], alpha);
            S[i * dv + d] = s;
            delta = __fsub_rn(delta, __fmul_rn(ks[i], s));
        }
        delta = __fmul_rn(delta, beta[row * hv + j]);
        float out = 0.0f;
        for (int i = 0; i < dk; ++i) {
            float s = __fadd_rn(S[i * dv + d], __fmul_rn(ks[i], delta));
            S[i * dv + d] = s;
            out = __fadd_rn(out, __fmul_rn(qs[i], s));
        }
        o[(row * hv + j) * dv + d] = out;
    }
}

// y[row, j, :] = rmsnorm(o[row, j, :]) * w * act(z[row, j, :]) per value head over Dv
// (act: silu, or sigmoid when `sigmoid_gate`), for rows listed in `rows_idx` (null: all).
// The mean of squares in f64 as the CPU's rms_norm_row. One warp per (row, value head).
// Writes bf16 (`out_bf16`) or f32: the out-projection GEMM's input.
// Grid: (ceil(n * Hv / 8)), block 256.
extern "C" __global__ void delta_gated_norm(const float* __restrict__ o, const float* __restrict__ proj, int width,
                                            int conv_dim, const float* __restrict__ w, i64 n, int hv, int dv,
                                            double eps, int sigmoid_gate, void* __restrict__ y, int out_bf16) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 gw = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
    if (gw >= n * hv) return;  // uniform per warp
    i64 row = gw / hv;
    int j = (int)(gw - row * hv);
    const float* x = o + (row * hv + j) * dv;
    const float* z = proj + row * width + conv_dim + (i64)j * dv;
    double ss = 0.0;
    for (int e = lane; e < dv; e += 32) ss += (double)x[e] * (double)x[e];
    ss = warp_sum_f64(ss);
    float inv = (float)(1.0 / sqrt(ss / (double)dv + eps));
    for (int e = lane; e < dv; e += 32) {
        float v = __fmul_rn(w[e], __fmul_rn(x[e], inv));
        float zv = z[e];
        float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-zv)));
        float act = sigmoid_gate ? sg : __fmul_rn(zv, sg);
        v = __fmul_rn(v, act);
        i64 at = (row * hv + j) * dv + e;
        if (out_bf16) {
            ((u16*)y)[at] = f32_to_bf16(v);
        } else {
            ((float*)y)[at] = v;
        }
    }
}
