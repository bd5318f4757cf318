// The sparse mixture-of-experts block's own kernels: the router's softmax and top-k choice,
// and the sum of the chosen experts' (and the shared expert's) outputs into the residual
// stream. The experts' matrix products are cuBLAS GEMMs over the tokens grouped by expert;
// the grouping is built on the host from `moe_route`'s choices (src/backend/cuda/moe.rs).
// CPU twins: src/model/moe.rs, `route_row` (softmax, top-k, renormalisation) for
// `moe_route`, `add_expert` and `add_shared` (the sums of `moe_block`) for `moe_combine`.

// A float as an integer that orders like Rust's `f32::total_cmp` (a NaN above every number):
// the CPU's top-k compares probabilities that way.
__device__ __forceinline__ i32 total_order_key(float v) {
    i32 b = __float_as_int(v);
    return b ^ (i32)(((u32)(b >> 31)) >> 1);
}

// For each row of router logits `logits[rows, experts]`: the softmax in place (max in f32,
// exponentials and their sum in f64, each probability rounded to f32, as on the CPU), then
// the `k` experts first in the order "higher probability, ties to the lower expert" into
// `idx[rows, k]`, and their probabilities into `wts[rows, k]`, divided by their f32 sum
// (in choice order) when `renorm`. One thread per row; k <= experts (the config checks it).
// Grid: (ceil(rows / 128)), block 128.
extern "C" __global__ void moe_route(float* __restrict__ logits, i64 rows, int experts, int k, int renorm,
                                     i32* __restrict__ idx, float* __restrict__ wts) {
    i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float* p = logits + r * experts;
    float mx = NEG_INF;
    for (int e = 0; e < experts; e++) mx = fmaxf(mx, p[e]);
    double m = (double)mx;
    double sum = 0.0;
    for (int e = 0; e < experts; e++) sum += exp((double)p[e] - m);
    for (int e = 0; e < experts; e++) p[e] = (float)(exp((double)p[e] - m) / sum);
    // Each pick is the first expert, in that order, strictly after the previous pick.
    int prev = -1;
    i32 prev_key = 0;
    i32* out_i = idx + r * k;
    float* out_w = wts + r * k;
    for (int i = 0; i < k; i++) {
        int best = -1;
        i32 best_key = 0;
        for (int e = 0; e < experts; e++) {
            i32 key = total_order_key(p[e]);
            if (prev >= 0 && !(key < prev_key || (key == prev_key && e > prev))) continue;
            if (best < 0 || key > best_key) {
                best = e;
                best_key = key;
            }
        }
        if (best < 0) best = 0;  // unreachable with k <= experts; keeps the index in range
        out_i[i] = best;
        out_w[i] = p[best];
        prev = best;
        prev_key = best_key;
    }
    if (renorm) {
        float s = -0.0f;
        for (int i = 0; i < k; i++) s = __fadd_rn(s, out_w[i]);
        for (int i = 0; i < k; i++) out_w[i] = __fdiv_rn(out_w[i], s);
    }
}

// x[xr, c] += Σ_i y[slot[r, i], c] · wts[r, pick[r, i]] (the row's experts in expert-index
// order, summed from zero in f32), + sigmoid(gate[r]) · shared[r, c] when `shared` is not
// null, where xr = xrows ? xrows[r] : r (the block may run on a subset of the rows). `y[routed rows, d]` holds the experts' outputs for the tokens grouped by expert;
// slot/pick say where row r's i-th expert (in index order) put its output and which of the
// row's choices it was.
// Grid: (ceil(rows * d / 256)), block 256.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const i32* __restrict__ slot,
                                       const i32* __restrict__ pick, const float* __restrict__ wts, int k,
                                       const float* __restrict__ shared, const float* __restrict__ gate,
                                       float* __restrict__ x, const i32* __restrict__ xrows, i64 rows, int d) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * d) return;
    i64 r = idx / d;
    int c = (int)(idx - r * d);
    float acc = 0.0f;
    for (int i = 0; i < k; i++) {
        i64 j = slot[r * k + i];
        acc = __fadd_rn(acc, __fmul_rn(y[j * d + c], wts[r * k + pick[r * k + i]]));
    }
    if (shared) {
        float z = gate[r];
        float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z)));
        acc = __fadd_rn(acc, __fmul_rn(sg, shared[idx]));
    }
    i64 xi = (xrows ? (i64)xrows[r] : r) * d + c;
    x[xi] = __fadd_rn(x[xi], acc);
}
