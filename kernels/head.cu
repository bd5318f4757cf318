// The output head fused with log-softmax and the target gather. CPU twin:
// src/backend/cpu/head.rs.
//
// The host multiplies the final-normed scored rows by one vocabulary chunk of the head at a
// time (cuBLAS, logits[rows, vc] f32, at most one chunk alive), then head_reduce folds the
// chunk into a running (max, sum of exp, target logit) per row. Chunks are visited in
// vocabulary order, so the reduction order is fixed. head_finish turns the running state
// into log p(target) = (target - max) - ln(sum), as the CPU combines its chunks.

// Grid: (rows), block: 256.
extern "C" __global__ void head_reduce(const float* __restrict__ logits, int vc, int v0, const i32* __restrict__ targets,
                                       float* __restrict__ run_max, double* __restrict__ run_sum,
                                       float* __restrict__ run_target) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    i64 r = blockIdx.x;
    const float* row = logits + r * (i64)vc;
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < vc; j += blockDim.x) mx = fmaxf(mx, row[j]);
    mx = block_max(mx, scratch);
    double sum = 0.0;
    for (int j = threadIdx.x; j < vc; j += blockDim.x) sum += (double)expf(row[j] - mx);
    sum = block_sum_f64(sum, dscratch);
    if (threadIdx.x == 0) {
        int t = targets[r];
        if (t >= v0 && t < v0 + vc) run_target[r] = row[t - v0];
        if (v0 == 0) {
            run_max[r] = mx;
            run_sum[r] = sum;
        } else {
            float m = fmaxf(run_max[r], mx);
            run_sum[r] = run_sum[r] * exp((double)(run_max[r] - m)) + sum * exp((double)(mx - m));
            run_max[r] = m;
        }
    }
}

// Grid: (ceil(rows / 256)), block: 256.
extern "C" __global__ void head_finish(const float* __restrict__ run_max, const double* __restrict__ run_sum,
                                       const float* __restrict__ run_target, float* __restrict__ out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    out[r] = (float)((double)__fsub_rn(run_target[r], run_max[r]) - log(run_sum[r]));
}

// ---------------------------------------------------------------- a paired head (--kld-base)
//
// The run's rows and a saved reference's rows go through the same head, one vocabulary
// chunk of each at a time (two logits chunks from two GEMMs); head_pair_reduce folds both
// into one running record per row, from which head_pair_finish gives what the CPU twin
// (src/backend/cpu/head_pair.rs) gives: the run's entropy and top-1, the reference's
// target log-probability and top-1, and KL in both directions from the cross sums
//   u     = sum exp(l_ref - max_ref) * (l_ref - l_run)   ->  KL(ref||run) = u/S_ref - lse_ref + lse_run
//   u_rev = sum exp(l_run - max_run) * (l_run - l_ref)   ->  KL(run||ref) = u_rev/S_run - lse_run + lse_ref
// rescaled like the sums whenever a chunk raises a maximum. Identical rows give exactly 0.
// A second sweep over the same chunks (head_pair_js, once a row block's first sweep has
// finished, so both normalizers are known) adds the Jensen-Shannon divergence and each
// side's ten largest logits, from which head_pair_finish counts the top-5 / top-10 overlap.

#define TOP_K 10
#define NO_ID 0x7fffffff

// One row's running record: 232 bytes (plan.rs PAIR_ROW_BYTES).
struct PairRow {
    double sum_run, wsum_run, sum_ref, u, u_rev, js;
    float max_run, max_ref, target_ref;
    int top_run, top_ref, pad;
    // Each side's TOP_K largest logits so far, largest first, ties to the lower id.
    float topv_run[TOP_K], topv_ref[TOP_K];
    int topi_run[TOP_K], topi_ref[TOP_K];
};

// The lowest index any thread holds (`none` where a thread holds none).
__device__ int block_min_int(int v, int* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int t = scratch[0];
    for (int i = 1; i < nw; ++i) t = min(t, scratch[i]);
    return t;
}

// Grid: (rows), block: 256. `logits` is the run's chunk, `logits_ref` the reference's,
// both [rows, vc] f32; `state` has one PairRow per row.
extern "C" __global__ void head_pair_reduce(const float* __restrict__ logits, const float* __restrict__ logits_ref,
                                            int vc, int v0, const i32* __restrict__ targets, PairRow* __restrict__ state) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    __shared__ int iscratch[32];
    i64 r = blockIdx.x;
    const float* a = logits + r * (i64)vc;
    const float* b = logits_ref + r * (i64)vc;
    float ma = NEG_INF, mb = NEG_INF;
    for (int j = threadIdx.x; j < vc; j += blockDim.x) {
        ma = fmaxf(ma, a[j]);
        mb = fmaxf(mb, b[j]);
    }
    ma = block_max(ma, scratch);
    mb = block_max(mb, scratch);
    // The first index holding each maximum (the lowest id on ties, as the CPU's).
    int ia = vc, ib = vc;
    for (int j = threadIdx.x; j < vc; j += blockDim.x) {
        if (ia == vc && a[j] == ma) ia = j;
        if (ib == vc && b[j] == mb) ib = j;
    }
    ia = block_min_int(ia, iscratch);
    ib = block_min_int(ib, iscratch);
    double sa = 0.0, wa = 0.0, sb = 0.0, u = 0.0, ur = 0.0;
    for (int j = threadIdx.x; j < vc; j += blockDim.x) {
        float ea = expf(a[j] - ma), eb = expf(b[j] - mb);
        sa += (double)ea;
        wa += (double)(ea * (a[j] - ma));
        sb += (double)eb;
        u += (double)(eb * (b[j] - a[j]));
        ur += (double)(ea * (a[j] - b[j]));
    }
    sa = block_sum_f64(sa, dscratch);
    wa = block_sum_f64(wa, dscratch);
    sb = block_sum_f64(sb, dscratch);
    u = block_sum_f64(u, dscratch);
    ur = block_sum_f64(ur, dscratch);
    if (threadIdx.x != 0) return;
    int t = targets[r];
    float tb = (t >= v0 && t < v0 + vc) ? b[t - v0] : __int_as_float(0x7fc00000);
    PairRow s;
    if (v0 == 0) {
        s.sum_run = sa;
        s.wsum_run = wa;
        s.sum_ref = sb;
        s.u = u;
        s.u_rev = ur;
        s.max_run = ma;
        s.max_ref = mb;
        s.target_ref = tb;
        s.top_run = ia;
        s.top_ref = ib;
        s.pad = 0;
        s.js = 0.0;
    } else {
        s = state[r];
        // The run: its sum, its entropy's weighted sum (relative to the maximum, so it
        // shifts with it) and u_rev carry the run's exponentials.
        float na = fmaxf(s.max_run, ma);
        double da = (double)(s.max_run - na), dc = (double)(ma - na);
        double ka = exp(da), kc = exp(dc);
        s.wsum_run = ka * (s.wsum_run + da * s.sum_run) + kc * (wa + dc * sa);
        s.sum_run = ka * s.sum_run + kc * sa;
        s.u_rev = ka * s.u_rev + kc * ur;
        if (ma > s.max_run) s.top_run = v0 + ia;
        s.max_run = na;
        // The reference: its sum and u carry its exponentials.
        float nb = fmaxf(s.max_ref, mb);
        double kb = exp((double)(s.max_ref - nb)), kd = exp((double)(mb - nb));
        s.sum_ref = kb * s.sum_ref + kd * sb;
        s.u = kb * s.u + kd * u;
        if (mb > s.max_ref) s.top_ref = v0 + ib;
        s.max_ref = nb;
        if (t >= v0 && t < v0 + vc) s.target_ref = tb;
    }
    state[r] = s;
}

// H(x) for x <= 0: p*ln(p/m) + q*ln(q/m) = max(p, q) * H(-|ln(q/p)|), m = (p + q) / 2. Near 0
// its Taylor series (the closed form cancels there), else the closed form with
// ln(1 + e^x) as 2*atanh(e / (2 + e)). CPU twin: js_weight (src/backend/cpu/head_pair_js.rs).
__device__ __forceinline__ float js_weight(float x) {
    if (x > -0.5f) {
        return x * x *
               (0.25f + x * (0.125f + x * (1.0f / 32.0f +
                                           x * (1.0f / 192.0f +
                                                x * (1.0f / 1152.0f + x * (1.0f / 5760.0f + x * (1.0f / 46080.0f)))))));
    }
    float e = expf(x);
    float s = e / (2.0f + e);
    float s2 = s * s;
    float atanh =
        s * (1.0f + s2 * (1.0f / 3.0f +
                          s2 * (1.0f / 5.0f +
                                s2 * (1.0f / 7.0f + s2 * (1.0f / 9.0f + s2 * (1.0f / 11.0f + s2 * (1.0f / 13.0f)))))));
    float g = 2.0f * atanh - 0.6931471805599453f;
    return -g + e * (x - g);
}

// (v, i) ranks before (w, j): the larger value, then the lower id.
__device__ __forceinline__ bool ranks_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// Inserts (v, i) into a list of TOP_K kept largest first.
__device__ __forceinline__ void top_insert(float* tv, int* ti, float v, int i) {
    if (!ranks_before(v, i, tv[TOP_K - 1], ti[TOP_K - 1])) return;
    int k = TOP_K - 1;
    while (k > 0 && ranks_before(v, i, tv[k - 1], ti[k - 1])) {
        tv[k] = tv[k - 1];
        ti[k] = ti[k - 1];
        --k;
    }
    tv[k] = v;
    ti[k] = i;
}

// The block's TOP_K best of every thread's list (each largest first) into out (every thread
// gets it): TOP_K rounds of a block-wide best among each thread's next entry.
__device__ void block_top(const float* tv, const int* ti, float* out_v, int* out_i, float* scratch, int* iscratch) {
    int k = 0;
    for (int round = 0; round < TOP_K; ++round) {
        float cv = k < TOP_K ? tv[k] : NEG_INF;
        int ci = k < TOP_K ? ti[k] : NO_ID;
        float bv = block_max(cv, scratch);
        int bi = block_min_int(cv == bv ? ci : NO_ID, iscratch);
        if (cv == bv && ci == bi && k < TOP_K) ++k;
        out_v[round] = bv;
        out_i[round] = bi;
    }
}

// Merges the sorted lists (av, ai) and (bv, bi) into (ov, oi), TOP_K entries.
__device__ void top_merge(const float* av, const int* ai, const float* bv, const int* bi, float* ov, int* oi) {
    int i = 0, j = 0;
    for (int k = 0; k < TOP_K; ++k) {
        if (ranks_before(bv[j], bi[j], av[i], ai[i])) {
            ov[k] = bv[j];
            oi[k] = bi[j];
            ++j;
        } else {
            ov[k] = av[i];
            oi[k] = ai[i];
            ++i;
        }
    }
}

// Grid: (rows), block: 256. The second sweep: the same chunk's logits as head_pair_reduce
// saw, with the row's finished first-sweep record in `state`.
extern "C" __global__ void head_pair_js(const float* __restrict__ logits, const float* __restrict__ logits_ref, int vc,
                                        int v0, PairRow* __restrict__ state) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    __shared__ int iscratch[32];
    i64 r = blockIdx.x;
    const float* a = logits + r * (i64)vc;
    const float* b = logits_ref + r * (i64)vc;
    const PairRow* s0 = state + r;
    double lse_a = (double)s0->max_run + log(s0->sum_run);
    double lse_b = (double)s0->max_ref + log(s0->sum_ref);
    float la = (float)lse_a, lb = (float)lse_b, c = (float)(lse_b - lse_a);
    float va[TOP_K], vb[TOP_K];
    int ia[TOP_K], ib[TOP_K];
    for (int k = 0; k < TOP_K; ++k) {
        va[k] = vb[k] = NEG_INF;
        ia[k] = ib[k] = NO_ID;
    }
    double js = 0.0;
    for (int j = threadIdx.x; j < vc; j += blockDim.x) {
        float x = a[j], y = b[j];
        float d = (y - x) - c;
        float base = expf(fmaxf(x - la, y - lb));
        js += (double)(base * js_weight(-fabsf(d)));
        top_insert(va, ia, x, v0 + j);
        top_insert(vb, ib, y, v0 + j);
    }
    js = block_sum_f64(js, dscratch);
    float ta[TOP_K], tb[TOP_K];
    int tia[TOP_K], tib[TOP_K];
    block_top(va, ia, ta, tia, scratch, iscratch);
    block_top(vb, ib, tb, tib, scratch, iscratch);
    if (threadIdx.x != 0) return;
    PairRow s = *s0;
    if (v0 == 0) {
        s.js = 0.5 * js;
        for (int k = 0; k < TOP_K; ++k) {
            s.topv_run[k] = ta[k];
            s.topi_run[k] = tia[k];
            s.topv_ref[k] = tb[k];
            s.topi_ref[k] = tib[k];
        }
    } else {
        s.js += 0.5 * js;
        float mv[TOP_K];
        int mi[TOP_K];
        top_merge(s0->topv_run, s0->topi_run, ta, tia, mv, mi);
        for (int k = 0; k < TOP_K; ++k) {
            s.topv_run[k] = mv[k];
            s.topi_run[k] = mi[k];
        }
        top_merge(s0->topv_ref, s0->topi_ref, tb, tib, mv, mi);
        for (int k = 0; k < TOP_K; ++k) {
            s.topv_ref[k] = mv[k];
            s.topi_ref[k] = mi[k];
        }
    }
    state[r] = s;
}

// How many of the first k ids of `a` are among the first k of `b`.
__device__ int top_overlap(const int* a, const int* b, int k) {
    int n = 0;
    for (int i = 0; i < k; ++i) {
        if (a[i] == NO_ID) continue;
        for (int j = 0; j < k; ++j) n += a[i] == b[j];
    }
    return n;
}

// Grid: (ceil(rows / 256)), block: 256. out[r] = {entropy, top1, top1_logprob, ref_logprob,
// kld, kld_reverse, ref_top1, ref_top1_logprob, js, top5, top10, 0}: twelve 4-byte fields
// (indices and counts as int bits).
extern "C" __global__ void head_pair_finish(const PairRow* __restrict__ state, float* __restrict__ out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const PairRow& s = state[r];
    double ln_run = log(s.sum_run), ln_ref = log(s.sum_ref);
    double lse_run = (double)s.max_run + ln_run, lse_ref = (double)s.max_ref + ln_ref;
    float* o = out + 12 * (i64)r;
    o[0] = (float)(ln_run - s.wsum_run / s.sum_run);
    o[1] = __int_as_float(s.top_run);
    o[2] = (float)(-ln_run);
    o[3] = (float)((double)__fsub_rn(s.target_ref, s.max_ref) - ln_ref);
    o[4] = (float)(s.u / s.sum_ref - lse_ref + lse_run);
    o[5] = (float)(s.u_rev / s.sum_run - lse_run + lse_ref);
    o[6] = __int_as_float(s.top_ref);
    o[7] = (float)(-ln_ref);
    o[8] = (float)s.js;
    o[9] = __int_as_float(top_overlap(s.topi_run, s.topi_ref, 5));
    o[10] = __int_as_float(top_overlap(s.topi_run, s.topi_ref, TOP_K));
    o[11] = 0.0f;
}
