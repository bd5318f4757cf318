// Kernels that exist only in the emulated device, to test the emulation itself: warp
// operations against their definitions, and barriers used wrongly (which must fail the
// launch, not hang it). Never compiled by NVRTC.

// out[i] for thread i of a 64-thread block: the shuffles and ballot of its warp.
// out[6 * i .. 6 * i + 6] = {xor 5, from lane 3, down 1, ballot(lane odd), block sum, warp max}
extern "C" __global__ void emu_selftest_warp_ops(const float* __restrict__ x, float* __restrict__ out) {
    __shared__ float scratch[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    float* o = out + 6 * i;
    o[0] = __shfl_xor_sync(FULL_MASK, v, 5);
    o[1] = __shfl_sync(FULL_MASK, v, 3);
    o[2] = __shfl_down_sync(FULL_MASK, v, 1);
    o[3] = (float)__ballot_sync(FULL_MASK, (threadIdx.x & 1) == 1);
    o[4] = block_sum(v, scratch);
    o[5] = warp_max(v);
}

// Threads below `split` wait at one __syncthreads, the others at another.
extern "C" __global__ void emu_selftest_divergent_barrier(float* __restrict__ out, int split) {
    if ((int)threadIdx.x < split) {
        __syncthreads();
        out[threadIdx.x] = 1.0f;
    } else {
        __syncthreads();
        out[threadIdx.x] = 2.0f;
    }
}

// Threads at or above `split` return before a __syncthreads the others wait at.
extern "C" __global__ void emu_selftest_early_exit(float* __restrict__ out, int split) {
    if ((int)threadIdx.x >= split) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// One mma.m16n8k16 of a warp: A [16, 16] row-major and B [16, 8] (k-major: B[k * 8 + n])
// as bf16 bits, C [16, 8] f32 accumulated in place, loaded into fragments as the
// tensor-core attention does.
extern "C" __global__ void emu_selftest_mma(const u16* __restrict__ a, const u16* __restrict__ b, float* __restrict__ cm) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    auto pa = [&](int row, int k) { return (u32)a[row * 16 + k] | ((u32)a[row * 16 + k + 1] << 16); };
    auto pb = [&](int k, int n) { return (u32)b[k * 8 + n] | ((u32)b[(k + 1) * 8 + n] << 16); };
    float acc[4] = {cm[g * 8 + 2 * c], cm[g * 8 + 2 * c + 1], cm[(g + 8) * 8 + 2 * c], cm[(g + 8) * 8 + 2 * c + 1]};
    mma_bf16_16816(acc, pa(g, 2 * c), pa(g + 8, 2 * c), pa(g, 2 * c + 8), pa(g + 8, 2 * c + 8), pb(2 * c, g),
                   pb(2 * c + 8, g));
    __syncwarp();
    cm[g * 8 + 2 * c] = acc[0];
    cm[g * 8 + 2 * c + 1] = acc[1];
    cm[(g + 8) * 8 + 2 * c] = acc[2];
    cm[(g + 8) * 8 + 2 * c + 1] = acc[3];
}

// A race on purpose: thread 0 writes a shared value that every thread reads with no barrier
// between. Resumed in thread order (the default) every thread sees it; in strict mode
// (NINFER_EMU_STRICT=1: reverse order, shared memory poisoned per block) the others read
// before it is written, and get the poison.
extern "C" __global__ void emu_selftest_race(float* __restrict__ out) {
    __shared__ float value;
    if (threadIdx.x == 0) value = 7.0f;
    out[threadIdx.x] = value;
}

// A function template's static shared array, read by one thread before its block writes
// it: a GPU gives garbage there. In the default mode the emulator gives the previous
// block's value; in strict mode the poison, as for every other static (GCC puts the
// statics of templates outside the `emu_shared` section, so the host lists them).
template <int N>
__device__ void selftest_held(float* out) {
    __shared__ float held[N];
    out[blockIdx.x] = held[0];
    held[0] = 5.0f;
}
extern "C" __global__ void emu_selftest_template_shared(float* __restrict__ out) {
    selftest_held<4>(out);
}
