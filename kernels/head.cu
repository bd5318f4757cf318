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

// One row's running record: 64 bytes (plan.rs PAIR_ROW_BYTES).
struct PairRow {
    double sum_run, wsum_run, sum_ref, u, u_rev;
    float max_run, max_ref, target_ref;
    int top_run, top_ref, pad;
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

// Grid: (ceil(rows / 256)), block: 256. out[r] = {entropy, top1, top1_logprob, ref_logprob,
// kld, kld_reverse, ref_top1, ref_top1_logprob}: eight 4-byte fields (indices as int bits).
extern "C" __global__ void head_pair_finish(const PairRow* __restrict__ state, float* __restrict__ out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    PairRow s = state[r];
    double ln_run = log(s.sum_run), ln_ref = log(s.sum_ref);
    double lse_run = (double)s.max_run + ln_run, lse_ref = (double)s.max_ref + ln_ref;
    float* o = out + 8 * (i64)r;
    o[0] = (float)(ln_run - s.wsum_run / s.sum_run);
    o[1] = __int_as_float(s.top_run);
    o[2] = (float)(-ln_run);
    o[3] = (float)((double)__fsub_rn(s.target_ref, s.max_ref) - ln_ref);
    o[4] = (float)(s.u / s.sum_ref - lse_ref + lse_run);
    o[5] = (float)(s.u_rev / s.sum_run - lse_run + lse_ref);
    o[6] = __int_as_float(s.top_ref);
    o[7] = (float)(-ln_ref);
}
