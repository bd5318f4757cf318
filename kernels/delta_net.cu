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
// Every element is a sum in a fixed order (one thread's, or in the triangular solve one
// term per wavefront step, in step order), with no atomics: the result is deterministic. Only
// differences gc_i - gc_j (j <= i) and gc_last - gc_i are exponentiated besides exp(gc_i),
// so no factor exceeds 1 however negative g is.
//
// Dynamic shared memory (floats; ldk = Dk | 1, an odd row stride so that threads reading
// one column of K or Q see distinct banks, except in the tensor-core form for Dk a multiple
// of 32, which uses ldk = Dk and key_at's flips; C = DELTA_CHUNK). A and P are addressed
// through tri_at, and in the tensor-core form K, QW, U and S through key_at and row_at:
// each permutes columns within a row so that reads spread over the banks:
//   S    [Dk, Dv]      the State (only when `state` is null; else in global memory)
//   K    [C, ldk]      the chunk's k rows
//   QW   [C, ldk]      w, then the chunk's q rows
//   U    [C, Dv]       u, then v_new in place
//   A    [C, C]        the inverse A (lower triangle and diagonal)
//   P    [C, C]        L (strictly lower), then (Q K^T) o decay (lower triangle, diagonal)
//   gc, egc, ef, bk, bt [C]   gc, exp(gc), exp(gc_last - gc), beta exp(gc), beta
// = (S ? Dk*Dv : 0) + 2*C*ldk + C*Dv + 2*C*C + 5*C floats (launch.rs
// `delta_chunked_smem`, with ldk = Dk | 1): 193.75 KiB for Dk = Dv = 128 with S. With `state` non-null, S of
// block (w, j) is state[(j * windows + w) * Dk * Dv ..][Dk * Dv] (f32, global), which
// every Dk, Dv <= 256 fits without. Grid: (windows, Hv), block DELTA_THREADS.
//
// Work split: warp w owns the chunk's rows 8w .. 8w + 7 (C = 8 warps x 8 rows) in every
// [n, *] product, and lane l the columns l, l + 32, ... (the State's rows of the S update
// in passes of 64, 8 per warp). Each thread accumulates a register tile (8 rows x CPT
// columns, CPT = 4 for Dv <= 128 and 8 up to 256), so one shared load of a row element
// (the same address across the warp: a broadcast) serves CPT products and one load of a
// column element (consecutive lanes: distinct banks) serves 8; the old one-output-per-
// thread loops issued two loads per product. The triangular solve runs as a wavefront on
// every thread (one barrier per row), and beta v is staged in U, so no inner loop reads
// global memory. Each output's operations and their order are those of the one-thread-
// per-element form (the sums run over the reduction index from 0, products rounded as
// written), so the results are the same bits as that form and as a rerun.
#define DELTA_CHUNK 64
#define DELTA_THREADS 256

// Register-tile helpers of delta_rule_chunked: warp rows i0 .. i0 + 7, lane columns
// lane + 32 q (q < CPT); every sum runs over its index from 0, products rounded as written.

// Where element (i, m) of a chunk's [C, C] matrix (A, P) lives: row i, its column m with
// bits 2..4 flipped by i % 8. Rows are 64 floats, so without the swizzle the 8 rows one
// tensor-core fragment reads (and a column of the wavefront) fall in one bank; with it a
// fragment's 32 elements fall in 32 banks. It permutes columns within the row's own half
// (bits 2..4 only), and every access goes through it: addresses change, values do not.
__device__ __forceinline__ int tri_at(int i, int m) {
    return i * DELTA_CHUNK + (m ^ ((i & 7) << 2));
}

// Where element (row, col) of a [rows, ld] matrix of the chunk's values or State (U, S)
// lives: with `sw` = 24 (ld a multiple of 32), its column with bits 3..4 flipped by row % 4,
// so the four rows a tensor-core B fragment reads at one column fall in four banks instead
// of one; with `sw` = 0 (other widths, where the flip could leave the row) as stored. Only
// addresses change, not values.
__device__ __forceinline__ int row_at(int row, int col, int ld, int sw) {
    return row * ld + (col ^ (((row & 3) << 3) & sw));
}

// Where element (row, e) of the chunk's [C, ldk] key or query rows (K, QW) lives. With
// `sw` (the tensor-core form, Dk a multiple of 32, ldk = Dk) column e is flipped by a 5-bit
// function of the row: a fragment's 8 rows x 4 columns then fall in 32 banks (4 ways on one
// bank with the odd stride), the 4 rows x 8 columns of a B fragment of row-major keys in
// 16 banks, and a column of any 32 consecutive rows in 32. Without it, rows of ldk = Dk | 1
// (odd) floats and no flip. Only addresses change, not values.
__device__ __forceinline__ int key_at(int row, int e, int ldk, bool sw) {
    return row * ldk + (sw ? e ^ (((row & 7) << 2) | ((row >> 3) & 3)) : e);
}

// The swizzle of row_at for rows of `ld` floats.
__device__ __forceinline__ int row_swizzle(int ld) {
    return (ld & 31) == 0 ? 24 : 0;
}

// acc[r][q] = sum_e X[i0 + r, e] S[e, lane + 32 q] (X: [C, ldk] in shared memory, S: [Dk, Dv]
// at row_at with swizzle sw).
template <int CPT>
__device__ __forceinline__ void rows_times_state(float (&acc)[8][CPT], const float* X, int ldk, bool ksw, int i0,
                                                 const float* S, int dk, int dv, int sw, int lane) {
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int q = 0; q < CPT; ++q) acc[r][q] = 0.0f;
    for (int e = 0; e < dk; ++e) {
        float b[CPT];
#pragma unroll
        for (int q = 0; q < CPT; ++q) b[q] = S[row_at(e, min(lane + 32 * q, dv - 1), dv, sw)];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            float a = X[key_at(i0 + r, e, ldk, ksw)];
#pragma unroll
            for (int q = 0; q < CPT; ++q) acc[r][q] = __fadd_rn(acc[r][q], __fmul_rn(a, b[q]));
        }
    }
}

// acc[r][q] += sum_{m <= i0 + r, m <= i_last} T[i0 + r, m] (scale[m] B(m, lane + 32 q))
// (T: [C, C] lower triangle and diagonal; B(m, col), `cols` columns, read through `b`;
// without SCALED, no scale and no product).
template <bool SCALED, int CPT, typename FB>
__device__ __forceinline__ void add_lower_times(float (&acc)[8][CPT], const float* T, int i0, int i_last, FB b,
                                                int cols, const float* scale, int lane) {
    for (int m = 0; m <= i_last; ++m) {
        float bm[CPT];
#pragma unroll
        for (int q = 0; q < CPT; ++q) {
            float v = b(m, min(lane + 32 * q, cols - 1));
            bm[q] = SCALED ? __fmul_rn(scale[m], v) : v;
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            if (m > i0 + r) continue;
            float a = T[tri_at(i0 + r, m)];
#pragma unroll
            for (int q = 0; q < CPT; ++q) acc[r][q] = __fadd_rn(acc[r][q], __fmul_rn(a, bm[q]));
        }
    }
}

// acc[r] = X[i0 + r] . K[m] over Dk (X, K: [C, ldk]; m clamped to the chunk's rows).
__device__ __forceinline__ void rows_dot_key(float (&acc)[8], const float* X, const float* K, int ldk, bool ksw, int i0,
                                             int m, int n, int dk) {
    const int km = min(m, n - 1);
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.0f;
    for (int e = 0; e < dk; ++e) {
        float b = K[key_at(km, e, ldk, ksw)];
#pragma unroll
        for (int r = 0; r < 8; ++r) acc[r] = __fadd_rn(acc[r], __fmul_rn(X[key_at(i0 + r, e, ldk, ksw)], b));
    }
}

// Tensor-core helpers of delta_rule_chunked_tc. 3xTF32: each f32 operand x is split into
// hi = tf32(x) and lo = tf32(x - hi) (round to nearest, ties away, by bits, so the GPU and
// the emulator split alike), and a product is lo·hi + hi·lo + hi·hi on mma.m16n8k8. Each
// operand keeps about 22 of its 24 significant bits and lo·lo (about 2^-22 relative) is
// dropped: products about 2^-22 relative, a little under f32's 2^-24, and the tensor
// core's summation order is its own (the check's bounds hold either way).

// x rounded to tf32 by its bits. Inf and NaN pass as they are (rounding a NaN's bits could
// carry into the sign and make it zero), and a finite x that would round up to infinity is
// truncated instead, so a finite operand never turns into inf - inf.
__device__ __forceinline__ float tf32_round(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return x;
    u32 r = (u + 0x1000u) & 0xffffe000u;
    if ((r & 0x7fffffffu) == 0x7f800000u) r = u & 0xffffe000u;
    return __uint_as_float(r);
}

__device__ __forceinline__ void tf32_split(float x, u32& hi, u32& lo) {
    float h = tf32_round(x);
    hi = __float_as_uint(h);
    lo = __float_as_uint(tf32_round(__fsub_rn(x, h)));  // x - h is exact (NaN for inf, NaN)
}

// acc += X[r0 .. r0 + 15, 0 .. kdim) · Y[0 .. kdim, c0 .. c0 + 31) for this lane's elements
// of the 16 x 32 output tile (four n8 blocks; element (t, e) at row r0 + g + 8 (e / 2),
// column c0 + 8 t + 2 c + e % 2). x(row, k) and y(k, col) return 0 outside their matrices,
// so a tile may overhang the chunk's rows, the columns and the depth. Warp-uniform.
template <typename FX, typename FY>
__device__ __forceinline__ void tc_tile(float (&acc)[4][4], int r0, int c0, int kdim, FX x, FY y, int lane) {
    const int g = lane >> 2, c = lane & 3;
    for (int k0 = 0; k0 < kdim; k0 += 8) {
        u32 ah[4], al[4];
        tf32_split(x(r0 + g, k0 + c), ah[0], al[0]);
        tf32_split(x(r0 + g + 8, k0 + c), ah[1], al[1]);
        tf32_split(x(r0 + g, k0 + c + 4), ah[2], al[2]);
        tf32_split(x(r0 + g + 8, k0 + c + 4), ah[3], al[3]);
        u32 bh[4][2], bl[4][2];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            tf32_split(y(k0 + c, c0 + 8 * t + g), bh[t][0], bl[t][0]);
            tf32_split(y(k0 + c + 4, c0 + 8 * t + g), bh[t][1], bl[t][1]);
        }
        mma3_tf32_x4(acc, ah, al, bh, bl);
    }
}

// f(row, col, element) for each of this lane's elements of the tile at (r0, c0).
template <typename F>
__device__ __forceinline__ void tc_each(float (&acc)[4][4], int r0, int c0, int lane, F f) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(r0 + g + 8 * (e >> 1), c0 + 8 * t + 2 * c + (e & 1), acc[t][e]);
}

__device__ __forceinline__ void tc_zero(float (&acc)[4][4]) {
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;
}

// Tile tt of a [rows, cols] output in 16 x 32 tiles, row-major: its corner (r0, c0).
__device__ __forceinline__ int2 tc_corner(int tt, int cols) {
    const int nc = (cols + 31) / 32;
    int2 r;
    r.x = tt / nc * 16;
    r.y = tt % nc * 32;
    return r;
}

__device__ __forceinline__ int tc_tiles(int rows, int cols) {
    return ((rows + 15) / 16) * ((cols + 31) / 32);
}

// Tiles of a chunk's [C, Dv] output one warp holds at once in delta_rule_chunked_tc (u,
// until every thread has read beta v): 4 x ceil(Dv / 32) tiles over 8 warps.
#define TC_HELD(CPT) ((CPT) == 4 ? 2 : 4)

// store(i, m, X[i] . K[m]) for the chunk's rows i < n and m < i (m <= i with DIAG), the dot
// over Dk (X, K: [C, ldk] at key_at): the products of L (X = K) and of P (X = Q). The
// tensor-core form takes the 16 x 32 tiles with an element on or below the diagonal in turn
// over the warps; the CUDA-core form gives warp w its rows i0 .. i0 + 7 and lane l the
// columns l and l + 32, up to the warp's last row i_last. Warp-uniform.
template <bool TC, bool DIAG, typename F>
__device__ __forceinline__ void lower_key_products(const float* X, const float* K, int ldk, bool ksw, int n, int dk,
                                                   int i0, int i_last, int lane, F store) {
    if (TC) {
        auto x_rows = [&](int i, int e) { return i < n && e < dk ? X[key_at(i, e, ldk, ksw)] : 0.0f; };
        auto key_cols = [&](int e, int m) { return m < n && e < dk ? K[key_at(m, e, ldk, ksw)] : 0.0f; };
        for (int tt = i0 / 8; tt < tc_tiles(n, n); tt += 8) {
            const int2 o0 = tc_corner(tt, n);
            if (DIAG ? o0.y > o0.x + 15 : o0.y >= o0.x + 15) continue;
            float acc[4][4];
            tc_zero(acc);
            tc_tile(acc, o0.x, o0.y, dk, x_rows, key_cols, lane);
            tc_each(acc, o0.x, o0.y, lane, [&](int i, int m, float& v) {
                if (i < n && (DIAG ? m <= i : m < i)) store(i, m, v);
            });
        }
    } else {
        for (int m0 = 0; m0 < DELTA_CHUNK; m0 += 32) {
            if (DIAG ? m0 > i_last : m0 >= i_last) break;  // no column of this block is below a row
            const int m = m0 + lane;
            float acc[8];
            rows_dot_key(acc, X, K, ldk, ksw, i0, m, n, dk);
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                int i = i0 + r;
                if (i < n && (DIAG ? m <= i : m < i)) store(i, m, acc[r]);
            }
        }
    }
}

template <bool TC, bool S_SHARED, int CPT>
__device__ __forceinline__ void delta_chunked_head(float* smem, const float* __restrict__ c, int conv_dim,
                                                   const float* __restrict__ beta, const float* __restrict__ g,
                                                   int2 span, int hk, int dk, int hv, int dv,
                                                   float* __restrict__ state, float* __restrict__ o) {
    const int C = DELTA_CHUNK;
    // The bank-spreading layouts (key_at, row_at) serve the tensor-core fragments; the
    // CUDA-core form keeps plain rows (its reads are conflict-free with an odd ldk, and the
    // flips' address arithmetic would cost it registers).
    const bool ksw = TC && (dk & 31) == 0;
    const int ldk = ksw ? dk : dk | 1;
    const int tid = threadIdx.x, nt = DELTA_THREADS;
    const int lane = tid & 31, warp = tid >> 5;
    const int i0 = warp * 8;  // this warp's rows of the chunk: i0 .. i0 + 7 (CUDA-core form)
    const int j = blockIdx.y;
    const int kh = j / (hv / hk);
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
    const int vsw = TC ? row_swizzle(dv) : 0;  // U and S: element (row, d) at row_at(row, d, dv, vsw)
    for (int idx = tid; idx < dk * dv; idx += nt) S[idx] = 0.0f;
    for (int c0 = 0; c0 < span.y; c0 += C) {
        const int n = min(C, span.y - c0);
        const i64 row0 = (i64)span.x + c0;
        // The last of this warp's rows in the chunk (-1: none), the bound of its triangular sums.
        const int i_last = i0 < n ? min(i0 + 7, n - 1) : -1;
        __syncthreads();  // the previous chunk's State update is done with K and U
        // k rows, beta; gc by one thread in token order (the CPU's sum).
        for (int idx = tid; idx < n * dk; idx += nt) {
            int i = idx / dk, e = idx - i * dk;
            K[key_at(i, e, ldk, ksw)] = c[(row0 + i) * conv_dim + k_off + e];
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
        // The decay factors, and L = -beta_i (k_i . k_m) exp(gc_i - gc_m) below the diagonal.
        for (int i = tid; i < n; i += nt) {
            float e = expf(gc[i]);
            egc[i] = e;
            ef[i] = expf(__fsub_rn(gc[n - 1], gc[i]));
            bk[i] = __fmul_rn(bt[i], e);
        }
        lower_key_products<TC, false>(K, K, ldk, ksw, n, dk, i0, i_last, lane, [&](int i, int m, float v) {
            P[tri_at(i, m)] = __fmul_rn(__fmul_rn(-bt[i], v), expf(__fsub_rn(gc[i], gc[m])));
        });
        // A = (I - L)^-1 by forward substitution, A[i, m] = L[i, m] + sum_{m < r < i} L[i, r]
        // A[r, m] (the sum from 0 in r order), A[m, m] = 1: as a wavefront over r. A[i, m]
        // below the diagonal holds the running sum until its row is final; at step r every
        // thread adds the terms L[i, r] A[r, m] (i > r, m < r) with A[r, m] = L[r, m] + its
        // sum, and row r - 1 (read by no one at step r) is made final.
        for (int idx = tid; idx < n * n; idx += nt) {
            int i = idx / n, m = idx - i * n;
            if (m <= i) A[tri_at(i, m)] = m == i ? 1.0f : 0.0f;
        }
        for (int r = 1; r < n; ++r) {
            __syncthreads();  // step r - 1's sums are done
            const int below = n - 1 - r;  // rows r + 1 .. n - 1
            for (int idx = tid; idx < below * r; idx += nt) {
                int i = r + 1 + idx / r, m = idx % r;
                float arm = __fadd_rn(P[tri_at(r, m)], A[tri_at(r, m)]);
                A[tri_at(i, m)] = __fadd_rn(A[tri_at(i, m)], __fmul_rn(P[tri_at(i, r)], arm));
            }
            for (int m = tid; m < r - 1; m += nt) A[tri_at(r - 1, m)] = __fadd_rn(P[tri_at(r - 1, m)], A[tri_at(r - 1, m)]);
        }
        __syncthreads();
        for (int m = tid; m < n - 1; m += nt) A[tri_at(n - 1, m)] = __fadd_rn(P[tri_at(n - 1, m)], A[tri_at(n - 1, m)]);
        // beta v staged in U (v read from its rows in c once).
        for (int idx = tid; idx < n * dv; idx += nt) {
            int i = idx / dv, d = idx - i * dv;
            U[row_at(i, d, dv, vsw)] = __fmul_rn(bt[i], c[(row0 + i) * conv_dim + v_off + d]);
        }
        __syncthreads();
        auto lower_a = [&](int i, int m) { return i < n && m <= i ? A[tri_at(i, m)] : 0.0f; };
        auto value_at = [&](int m, int d) { return U[row_at(m, d, dv, vsw)]; };
        auto value_rows = [&](int m, int d) { return m < n && d < dv ? value_at(m, d) : 0.0f; };
        auto state = [&](int e, int d) { return e < dk && d < dv ? S[row_at(e, d, dv, vsw)] : 0.0f; };
        // u = A (beta v), this thread's tile held in registers until every thread has read
        // beta v, then stored over it (tensor cores: the warp's tiles warp + 8 t of [n, Dv]).
        float u[8][CPT];
        float ut[TC_HELD(CPT)][4][4];
        if (TC) {
            // w = A (beta exp(gc) k).
            for (int tt = warp; tt < tc_tiles(n, dk); tt += 8) {
                const int2 o0 = tc_corner(tt, dk);
                float acc[4][4];
                tc_zero(acc);
                tc_tile(acc, o0.x, o0.y, min(n, o0.x + 16), lower_a,
                        [&](int m, int e) { return m < n && e < dk ? __fmul_rn(bk[m], K[key_at(m, e, ldk, ksw)]) : 0.0f; }, lane);
                tc_each(acc, o0.x, o0.y, lane, [&](int i, int e, float& v) {
                    if (i < n && e < dk) QW[key_at(i, e, ldk, ksw)] = v;
                });
            }
#pragma unroll
            for (int t = 0; t < TC_HELD(CPT); ++t) {
                const int tt = warp + 8 * t;
                tc_zero(ut[t]);
                if (tt < tc_tiles(n, dv)) {
                    const int2 o0 = tc_corner(tt, dv);
                    tc_tile(ut[t], o0.x, o0.y, min(n, o0.x + 16), lower_a, value_rows, lane);
                }
            }
        } else {
            // w = A (beta exp(gc) k) over Dk in passes of 32 CPT columns.
            for (int e0 = 0; e0 < dk; e0 += 32 * CPT) {
                float acc[8][CPT];
#pragma unroll
                for (int r = 0; r < 8; ++r)
#pragma unroll
                    for (int q = 0; q < CPT; ++q) acc[r][q] = 0.0f;
                add_lower_times<true>(acc, A, i0, i_last, [&](int m, int e) { return K[key_at(m, e0 + e, ldk, ksw)]; },
                                      dk - e0, bk, lane);
#pragma unroll
                for (int r = 0; r < 8; ++r)
#pragma unroll
                    for (int q = 0; q < CPT; ++q) {
                        int i = i0 + r, e = e0 + lane + 32 * q;
                        if (i < n && e < dk) QW[key_at(i, e, ldk, ksw)] = acc[r][q];
                    }
            }
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int q = 0; q < CPT; ++q) u[r][q] = 0.0f;
            add_lower_times<false>(u, A, i0, i_last, value_at, dv, nullptr, lane);
        }
        __syncthreads();  // beta v and w are complete
        if (TC) {
            // v_new = u + (-w) S, accumulated onto the held u, stored over beta v.
#pragma unroll
            for (int t = 0; t < TC_HELD(CPT); ++t) {
                const int tt = warp + 8 * t;
                if (tt < tc_tiles(n, dv)) {
                    const int2 o0 = tc_corner(tt, dv);
                    tc_tile(ut[t], o0.x, o0.y, dk,
                            [&](int i, int e) { return i < n && e < dk ? -QW[key_at(i, e, ldk, ksw)] : 0.0f; }, state, lane);
                    tc_each(ut[t], o0.x, o0.y, lane, [&](int i, int d, float& v) {
                        if (i < n && d < dv) U[row_at(i, d, dv, vsw)] = v;
                    });
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int q = 0; q < CPT; ++q) {
                    int i = i0 + r, d = lane + 32 * q;
                    if (i < n && d < dv) U[row_at(i, d, dv, vsw)] = u[r][q];
                }
            // v_new = u - w S, in place (each thread its own elements of U).
            float ws[8][CPT];
            rows_times_state(ws, QW, ldk, ksw, i0, S, dk, dv, vsw, lane);
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int q = 0; q < CPT; ++q) {
                    int i = i0 + r, d = lane + 32 * q;
                    if (i < n && d < dv) U[row_at(i, d, dv, vsw)] = __fsub_rn(U[row_at(i, d, dv, vsw)], ws[r][q]);
                }
        }
        __syncthreads();
        // q rows over w.
        for (int idx = tid; idx < n * dk; idx += nt) {
            int i = idx / dk, e = idx - i * dk;
            QW[key_at(i, e, ldk, ksw)] = c[(row0 + i) * conv_dim + q_off + e];
        }
        __syncthreads();
        // P = (q_i . k_m) exp(gc_i - gc_m) for m <= i, as L above.
        lower_key_products<TC, true>(QW, K, ldk, ksw, n, dk, i0, i_last, lane, [&](int i, int m, float v) {
            P[tri_at(i, m)] = __fmul_rn(v, expf(__fsub_rn(gc[i], gc[m])));
        });
        auto query_rows = [&](int i, int e) { return i < n && e < dk ? QW[key_at(i, e, ldk, ksw)] : 0.0f; };
        __syncthreads();
        // o_i = exp(gc_i) (q_i S) + sum_{m <= i} P[i, m] v_new_m.
        if (TC) {
            for (int tt = warp; tt < tc_tiles(n, dv); tt += 8) {
                const int2 o0 = tc_corner(tt, dv);
                float acc[4][4];
                tc_zero(acc);
                tc_tile(acc, o0.x, o0.y, dk, query_rows, state, lane);
                tc_each(acc, o0.x, o0.y, lane, [&](int i, int, float& v) { v = __fmul_rn(egc[min(i, n - 1)], v); });
                tc_tile(acc, o0.x, o0.y, min(n, o0.x + 16),
                        [&](int i, int m) { return i < n && m <= i ? P[tri_at(i, m)] : 0.0f; },
                        value_rows, lane);
                tc_each(acc, o0.x, o0.y, lane, [&](int i, int d, float& v) {
                    if (i < n && d < dv) o[((row0 + i) * hv + j) * dv + d] = v;
                });
            }
        } else {
            float acc[8][CPT];
            rows_times_state(acc, QW, ldk, ksw, i0, S, dk, dv, vsw, lane);
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                float f = egc[min(i0 + r, n - 1)];
#pragma unroll
                for (int q = 0; q < CPT; ++q) acc[r][q] = __fmul_rn(f, acc[r][q]);
            }
            add_lower_times<false>(acc, P, i0, i_last, value_at, dv, nullptr, lane);
#pragma unroll
            for (int r = 0; r < 8; ++r)
#pragma unroll
                for (int q = 0; q < CPT; ++q) {
                    int i = i0 + r, d = lane + 32 * q;
                    if (i < n && d < dv) o[((row0 + i) * hv + j) * dv + d] = acc[r][q];
                }
        }
        __syncthreads();  // every read of the chunk's incoming State is done
        // S = exp(gc_last) S + sum_i (exp(gc_last - gc_i) k_i) v_new_i^T, warp w updating
        // State rows 8w .. 8w + 7 of each pass of 64.
        const float carry = egc[n - 1];
        if (TC) {
            // The warp's tiles of [Dk, Dv]: each thread scales and replaces its own elements.
            for (int tt = warp; tt < tc_tiles(dk, dv); tt += 8) {
                const int2 o0 = tc_corner(tt, dv);
                float acc[4][4];
                tc_each(acc, o0.x, o0.y, lane,
                        [&](int e, int d, float& v) { v = e < dk && d < dv ? __fmul_rn(S[row_at(e, d, dv, vsw)], carry) : 0.0f; });
                tc_tile(acc, o0.x, o0.y, n,
                        [&](int e, int i) { return e < dk && i < n ? __fmul_rn(ef[i], K[key_at(i, e, ldk, ksw)]) : 0.0f; },
                        value_rows, lane);
                tc_each(acc, o0.x, o0.y, lane, [&](int e, int d, float& v) {
                    if (e < dk && d < dv) S[row_at(e, d, dv, vsw)] = v;
                });
            }
        } else {
            for (int e0 = 0; e0 < dk; e0 += 64) {
                const int er = e0 + i0;  // this warp's first State row of the pass
                if (er >= dk) continue;  // warp-uniform
                float acc[8][CPT];
#pragma unroll
                for (int r = 0; r < 8; ++r)
#pragma unroll
                    for (int q = 0; q < CPT; ++q) {
                        // Only this thread's own elements: another thread writes the rest.
                        int e = er + r, d = lane + 32 * q;
                        acc[r][q] = e < dk && d < dv ? __fmul_rn(S[row_at(e, d, dv, vsw)], carry) : 0.0f;
                    }
                for (int i = 0; i < n; ++i) {
                    float b[CPT];
#pragma unroll
                    for (int q = 0; q < CPT; ++q) b[q] = U[row_at(i, min(lane + 32 * q, dv - 1), dv, vsw)];
                    const float f = ef[i];
#pragma unroll
                    for (int r = 0; r < 8; ++r) {
                        float a = __fmul_rn(f, K[key_at(i, min(er + r, dk - 1), ldk, ksw)]);
#pragma unroll
                        for (int q = 0; q < CPT; ++q) acc[r][q] = __fadd_rn(acc[r][q], __fmul_rn(a, b[q]));
                    }
                }
#pragma unroll
                for (int r = 0; r < 8; ++r)
#pragma unroll
                    for (int q = 0; q < CPT; ++q) {
                        int e = er + r, d = lane + 32 * q;
                        if (e < dk && d < dv) S[row_at(e, d, dv, vsw)] = acc[r][q];
                    }
            }
        }
    }
}

// The gated delta rule in the chunked form above, one block per (window, value head); the
// parameters are delta_rule_recurrent's, plus `state`: null to keep the State in shared
// memory, else global scratch for it (Dk * Dv floats per block, see above). TC picks the
// products' form: CUDA cores (delta_rule_chunked), or tf32 tensor cores three products
// each (delta_rule_chunked_tc); the scalar steps (loads, decays, the triangular solve) are
// the same code.
template <bool TC>
__device__ __forceinline__ void delta_chunked(const float* __restrict__ c, int conv_dim, const float* __restrict__ beta,
                                              const float* __restrict__ g, const int2* __restrict__ spans, int hk,
                                              int dk, int hv, int dv, float* __restrict__ state,
                                              float* __restrict__ o) {
    DYNAMIC_SHARED(float, smem);
    int2 span = spans[blockIdx.x];
    if (dv <= 128) {
        if (state == nullptr) {
            delta_chunked_head<TC, true, 4>(smem, c, conv_dim, beta, g, span, hk, dk, hv, dv, state, o);
        } else {
            delta_chunked_head<TC, false, 4>(smem, c, conv_dim, beta, g, span, hk, dk, hv, dv, state, o);
        }
    } else if (state == nullptr) {
        delta_chunked_head<TC, true, 8>(smem, c, conv_dim, beta, g, span, hk, dk, hv, dv, state, o);
    } else {
        delta_chunked_head<TC, false, 8>(smem, c, conv_dim, beta, g, span, hk, dk, hv, dv, state, o);
    }
}

// One block per SM is what the shared memory allows anyway; saying so lets the register
// tiles use up to 255 registers instead of spilling at 128.
extern "C" __global__ void __launch_bounds__(DELTA_THREADS, 1)
delta_rule_chunked(const float* __restrict__ c, int conv_dim, const float* __restrict__ beta,
                   const float* __restrict__ g, const int2* __restrict__ spans, int hk, int dk, int hv, int dv,
                   float* __restrict__ state, float* __restrict__ o) {
    delta_chunked<false>(c, conv_dim, beta, g, spans, hk, dk, hv, dv, state, o);
}

extern "C" __global__ void __launch_bounds__(DELTA_THREADS, 1)
delta_rule_chunked_tc(const float* __restrict__ c, int conv_dim, const float* __restrict__ beta,
                      const float* __restrict__ g, const int2* __restrict__ spans, int hk, int dk, int hv, int dv,
                      float* __restrict__ state, float* __restrict__ o) {
    delta_chunked<true>(c, conv_dim, beta, g, spans, hk, dk, hv, dv, state, o);
}
