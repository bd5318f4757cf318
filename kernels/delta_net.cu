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

// ---------------------------------------------------------------- the chunked (WY) form
//
// delta_rule_chunked computes the same function as delta_rule_recurrent (same inputs, same
// output, so the model can use either), DELTA_CHUNK tokens at a time in the WY form fast
// implementations use for prefill. CPU twin: src/backend/cpu/delta_rule.rs `chunked` (the
// same steps, the same chunk of 64; the two agree with the recurrence to f32 rounding, not
// bit for bit). Per chunk of n <= DELTA_CHUNK tokens of one value head, with q, k [n, Dk],
// v [n, Dv], beta, g [n] and the State S [Dk, Dv] carried in from the previous chunk:
//   gc_i    = g_0 + ... + g_i                                       cumulative log decay
//   L[i,j]  = -beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i         strictly lower [n, n]
//   A       = (I - L)^-1 = (I + strictly-lower(beta K K^T decay))^-1, forward substitution
//   u       = A (beta v),  w = A (beta k exp(gc))                    [n, Dv], [n, Dk]
//   v_new   = u - w S                                                [n, Dv]
//   o_i     = exp(gc_i) q_i S + sum_{j<=i} (q_i . k_j) exp(gc_i - gc_j) v_new_j
//   S       = exp(gc_last) S + sum_i k_i exp(gc_last - gc_i) v_new_i^T
// Every element is one thread's sum in a fixed order, with no atomics and no reduction
// across threads: the result is deterministic and independent of the block size. Only
// differences gc_i - gc_j (j <= i) and gc_last - gc_i are exponentiated besides exp(gc_i),
// so no factor exceeds 1 however negative g is.
//
// Dynamic shared memory (floats; ldk = Dk | 1, an odd row stride so that threads reading
// one column of K or Q see distinct banks; C = DELTA_CHUNK):
//   S    [Dk, Dv]      the State (only when `state` is null; else in global memory)
//   K    [C, ldk]      the chunk's k rows
//   QW   [C, ldk]      w, then the chunk's q rows
//   U    [C, Dv]       u, then v_new in place
//   A    [C, C]        the inverse A (lower triangle and diagonal)
//   P    [C, C]        L (strictly lower), then (Q K^T) o decay (lower triangle, diagonal)
//   gc, egc, ef, bk, bt [C]   gc, exp(gc), exp(gc_last - gc), beta exp(gc), beta
// = (S ? Dk*Dv : 0) + 2*C*ldk + C*Dv + 2*C*C + 5*C floats (launch.rs
// `delta_chunked_smem`): 193.75 KiB for Dk = Dv = 128 with S. With `state` non-null, S of
// block (w, j) is state[(j * windows + w) * Dk * Dv ..][Dk * Dv] (f32, global), which
// every Dk, Dv <= 256 fits without. Grid: (windows, Hv), block: any (256).
#define DELTA_CHUNK 64

template <bool S_SHARED>
__device__ __forceinline__ void delta_chunked_head(float* smem, const float* __restrict__ c, int conv_dim,
                                                   const float* __restrict__ beta, const float* __restrict__ g,
                                                   int2 span, int hk, int dk, int hv, int dv,
                                                   float* __restrict__ state, float* __restrict__ o) {
    const int C = DELTA_CHUNK;
    const int ldk = dk | 1;
    int tid = threadIdx.x, nt = blockDim.x;
    int j = blockIdx.y;
    int kh = j / (hv / hk);
    float* S;  // [Dk, Dv]
    float* K;  // [C, ldk]
    if (S_SHARED) {
        S = smem;
        K = S + dk * dv;
    } else {
        S = state + ((i64)blockIdx.y * gridDim.x + blockIdx.x) * dk * dv;
        K = smem;
    }
    float* QW = K + C * ldk;   // [C, ldk]
    float* U = QW + C * ldk;   // [C, Dv]
    float* A = U + C * dv;     // [C, C]
    float* P = A + C * C;      // [C, C]
    float* gc = P + C * C;     // [C]
    float* egc = gc + C;       // [C]
    float* ef = egc + C;       // [C]
    float* bk = ef + C;        // [C]
    float* bt = bk + C;        // [C]
    const int q_off = kh * dk, k_off = hk * dk + kh * dk, v_off = 2 * hk * dk + j * dv;
    for (int idx = tid; idx < dk * dv; idx += nt) S[idx] = 0.0f;
    for (int c0 = 0; c0 < span.y; c0 += C) {
        int n = min(C, span.y - c0);
        i64 row0 = (i64)span.x + c0;
        __syncthreads();  // the previous chunk's State update is done with K and U
        // k rows, beta; gc by one thread in token order (the CPU's sum).
        for (int idx = tid; idx < n * dk; idx += nt) {
            int i = idx / dk, e = idx - i * dk;
            K[i * ldk + e] = c[(row0 + i) * conv_dim + k_off + e];
        }
        for (int i = tid; i < n; i += nt) bt[i] = beta[(row0 + i) * hv + j];
        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < n; ++i) {
                acc = __fadd_rn(acc, g[(row0 + i) * hv + j]);
                gc[i] = acc;
            }
        }
        __syncthreads();
        // The decay factors, and L = -beta_i (k_i . k_j) exp(gc_i - gc_j) below the diagonal.
        for (int i = tid; i < n; i += nt) {
            float e = expf(gc[i]);
            egc[i] = e;
            ef[i] = expf(__fsub_rn(gc[n - 1], gc[i]));
            bk[i] = __fmul_rn(bt[i], e);
        }
        for (int idx = tid; idx < n * n; idx += nt) {
            int i = idx / n, m = idx - i * n;
            if (m >= i) continue;
            float dot = 0.0f;
            for (int e = 0; e < dk; ++e) dot = __fadd_rn(dot, __fmul_rn(K[i * ldk + e], K[m * ldk + e]));
            float decay = expf(__fsub_rn(gc[i], gc[m]));
            P[i * C + m] = __fmul_rn(__fmul_rn(-bt[i], dot), decay);
        }
        __syncthreads();
        // A = (I - L)^-1 by forward substitution, one column per thread (the columns are
        // independent): A[i, m] = L[i, m] + sum_{m < r < i} L[i, r] A[r, m], A[m, m] = 1.
        for (int m = tid; m < n; m += nt) {
            A[m * C + m] = 1.0f;
            for (int i = m + 1; i < n; ++i) {
                float add = 0.0f;
                for (int r = m + 1; r < i; ++r) add = __fadd_rn(add, __fmul_rn(P[i * C + r], A[r * C + m]));
                A[i * C + m] = __fadd_rn(P[i * C + m], add);
            }
        }
        __syncthreads();
        // w = A (beta exp(gc) k), u = A (beta v) (v read from its rows in c).
        for (int idx = tid; idx < n * dk; idx += nt) {
            int i = idx / dk, e = idx - i * dk;
            float acc = 0.0f;
            for (int m = 0; m <= i; ++m) {
                acc = __fadd_rn(acc, __fmul_rn(A[i * C + m], __fmul_rn(bk[m], K[m * ldk + e])));
            }
            QW[i * ldk + e] = acc;
        }
        for (int idx = tid; idx < n * dv; idx += nt) {
            int i = idx / dv, d = idx - i * dv;
            float acc = 0.0f;
            for (int m = 0; m <= i; ++m) {
                float bv = __fmul_rn(bt[m], c[(row0 + m) * conv_dim + v_off + d]);
                acc = __fadd_rn(acc, __fmul_rn(A[i * C + m], bv));
            }
            U[i * dv + d] = acc;
        }
        __syncthreads();
        // v_new = u - w S, in place.
        for (int idx = tid; idx < n * dv; idx += nt) {
            int i = idx / dv, d = idx - i * dv;
            float ws = 0.0f;
            for (int e = 0; e < dk; ++e) ws = __fadd_rn(ws, __fmul_rn(QW[i * ldk + e], S[e * dv + d]));
            U[i * dv + d] = __fsub_rn(U[i * dv + d], ws);
        }
        __syncthreads();
        // q rows over w.
        for (int idx = tid; idx < n * dk; idx += nt) {
            int i = idx / dk, e = idx - i * dk;
            QW[i * ldk + e] = c[(row0 + i) * conv_dim + q_off + e];
        }
        __syncthreads();
        // P = (q_i . k_m) exp(gc_i - gc_m) for m <= i.
        for (int idx = tid; idx < n * n; idx += nt) {
            int i = idx / n, m = idx - i * n;
            if (m > i) continue;
            float dot = 0.0f;
            for (int e = 0; e < dk; ++e) dot = __fadd_rn(dot, __fmul_rn(QW[i * ldk + e], K[m * ldk + e]));
            P[i * C + m] = __fmul_rn(dot, expf(__fsub_rn(gc[i], gc[m])));
        }
        __syncthreads();
        // o_i = exp(gc_i) (q_i S) + sum_{m <= i} P[i, m] v_new_m.
        for (int idx = tid; idx < n * dv; idx += nt) {
            int i = idx / dv, d = idx - i * dv;
            float qs = 0.0f;
            for (int e = 0; e < dk; ++e) qs = __fadd_rn(qs, __fmul_rn(QW[i * ldk + e], S[e * dv + d]));
            float acc = __fmul_rn(egc[i], qs);
            for (int m = 0; m <= i; ++m) acc = __fadd_rn(acc, __fmul_rn(P[i * C + m], U[m * dv + d]));
            o[((row0 + i) * hv + j) * dv + d] = acc;
        }
        __syncthreads();  // every read of the chunk's incoming State is done
        // S = exp(gc_last) S + sum_i (exp(gc_last - gc_i) k_i) v_new_i^T.
        float carry = egc[n - 1];
        for (int idx = tid; idx < dk * dv; idx += nt) {
            int e = idx / dv, d = idx - e * dv;
            float acc = __fmul_rn(S[idx], carry);
            for (int i = 0; i < n; ++i) {
                acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(ef[i], K[i * ldk + e]), U[i * dv + d]));
            }
            S[idx] = acc;
        }
    }
}

// The gated delta rule in the chunked form above, one block per (window, value head); the
// parameters are delta_rule_recurrent's, plus `state`: null to keep the State in shared
// memory, else global scratch for it (Dk * Dv floats per block, see above).
extern "C" __global__ void delta_rule_chunked(const float* __restrict__ c, int conv_dim,
                                              const float* __restrict__ beta, const float* __restrict__ g,
                                              const int2* __restrict__ spans, int hk, int dk, int hv, int dv,
                                              float* __restrict__ state, float* __restrict__ o) {
    DYNAMIC_SHARED(float, smem);
    int2 span = spans[blockIdx.x];
    if (state == nullptr) {
        delta_chunked_head<true>(smem, c, conv_dim, beta, g, span, hk, dk, hv, dv, state, o);
    } else {
        delta_chunked_head<false>(smem, c, conv_dim, beta, g, span, hk, dk, hv, dv, state, o);
    }
}
