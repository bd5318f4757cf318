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
