// The sparse mixture-of-experts block's own kernels: the router's softmax and top-k choice,
// the grouping of the routed rows by expert, the experts' matrix products over those groups,
// and the sum of the chosen experts' (and the shared expert's) outputs into the residual
// stream. Everything stays on the device: no routing decision comes back to the host.
// CPU twins: src/model/moe.rs, `route_row` (softmax, top-k, renormalisation) for
// `moe_route`, `add_expert` and `add_shared` (the sums of `moe_block`) for `moe_combine`;
// src/backend/cuda/model/moe.rs `Grouping::build` for the grouping kernels; the CPU GEMM
// (src/backend/cpu/sgemm16.rs) for `moe_gemm_f32`.

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

// ---------------------------------------------------------------- grouping by expert
//
// The routed rows are the (token, choice) pairs grouped by expert, tokens in order within
// an expert: expert e's rows are offsets[e] .. offsets[e + 1]. It is a stable counting sort
// done in three launches with no atomics, so the grouping is the same on every run:
// moe_count counts each expert's choices per chunk of MOE_GROUP_ROWS tokens, moe_offsets
// turns the counts into each (chunk, expert)'s first row and lists the GEMM tiles, and
// moe_place writes every pair at its row.
#define MOE_GROUP_ROWS 256
#define MOE_TILE_ROWS 64

// Copies the choices of the tokens r0 .. r0 + MOE_GROUP_ROWS (those that exist) from
// idx[rows, k] into ch, then waits for the whole block; returns how many choices that is.
__device__ __forceinline__ int stage_chunk(i32* ch, const i32* __restrict__ idx, i64 r0, i64 rows, int k) {
    int n = (int)min((i64)MOE_GROUP_ROWS, rows - r0) * k;
    for (int t = threadIdx.x; t < n; t += blockDim.x) ch[t] = idx[r0 * k + t];
    __syncthreads();
    return n;
}

// counts[chunk, e] = the choices of expert e among the chunk's tokens, from idx[rows, k].
// Dynamic shared memory: MOE_GROUP_ROWS * k ints. Grid: (ceil(rows / MOE_GROUP_ROWS)),
// block 256.
extern "C" __global__ void moe_count(const i32* __restrict__ idx, i64 rows, int k, int experts,
                                     i32* __restrict__ counts) {
    DYNAMIC_SHARED(i32, ch);
    const i64 r0 = (i64)blockIdx.x * MOE_GROUP_ROWS;
    const int n = stage_chunk(ch, idx, r0, rows, k);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int cnt = 0;
        for (int t = 0; t < n; ++t) cnt += ch[t] == e;
        counts[(i64)blockIdx.x * experts + e] = cnt;
    }
}

// In one block: counts[chunk, e] becomes the first routed row of expert e's pairs from that
// chunk (offsets[e] plus the earlier chunks' counts), offsets[E + 1] the experts' first rows,
// routed[e] += expert e's rows (the run's routing counts), and tiles[max_tiles] the GEMM
// tiles in expert order, (expert, first row, rows, 0) for up to MOE_TILE_ROWS rows each,
// then (-1, 0, 0, 0) up to max_tiles = ceil(rows * k / MOE_TILE_ROWS) + experts, which
// bounds the tile count whatever the grouping. Dynamic shared memory: 2 * experts + 1 ints.
// Grid: (1), block 256.
extern "C" __global__ void moe_offsets(i32* __restrict__ counts, int chunks, int experts,
                                       i32* __restrict__ offsets, int4* __restrict__ tiles, int max_tiles,
                                       u64* __restrict__ routed) {
    DYNAMIC_SHARED(i32, tot);  // [experts] rows per expert, [experts] first tile, [1] tiles
    i32* first_tile = tot + experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int run = 0;
        for (int c = 0; c < chunks; ++c) {
            int v = counts[(i64)c * experts + e];
            counts[(i64)c * experts + e] = run;
            run += v;
        }
        tot[e] = run;
        routed[e] += (u64)run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, t = 0;
        for (int e = 0; e < experts; ++e) {
            offsets[e] = o;
            first_tile[e] = t;
            o += tot[e];
            t += (tot[e] + MOE_TILE_ROWS - 1) / MOE_TILE_ROWS;
        }
        offsets[experts] = o;
        first_tile[experts] = t;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int o = offsets[e];
        for (int c = 0; c < chunks; ++c) counts[(i64)c * experts + e] += o;
        for (int t = 0; t * MOE_TILE_ROWS < tot[e]; ++t) {
            int4 v;
            v.x = e;
            v.y = o + t * MOE_TILE_ROWS;
            v.z = min(MOE_TILE_ROWS, tot[e] - t * MOE_TILE_ROWS);
            v.w = 0;
            tiles[first_tile[e] + t] = v;
        }
    }
    for (int t = first_tile[experts] + threadIdx.x; t < max_tiles; t += blockDim.x) {
        int4 v;
        v.x = -1;
        v.y = v.z = v.w = 0;
        tiles[t] = v;
    }
}

// Every (token r, choice i) pair to its routed row: src[row] = r; for the token's experts in
// index order (the j-th smallest), slot[r, j] = the row and pick[r, j] = i. Expert e's pairs
// of this chunk take rows base[chunk, e] on, in token order. Dynamic shared memory:
// MOE_GROUP_ROWS * k ints. Grid: (ceil(rows / MOE_GROUP_ROWS)), block 256.
extern "C" __global__ void moe_place(const i32* __restrict__ idx, i64 rows, int k, int experts,
                                     const i32* __restrict__ base, i32* __restrict__ src, i32* __restrict__ slot,
                                     i32* __restrict__ pick) {
    DYNAMIC_SHARED(i32, ch);
    const i64 r0 = (i64)blockIdx.x * MOE_GROUP_ROWS;
    const int n = stage_chunk(ch, idx, r0, rows, k);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int pos = base[(i64)blockIdx.x * experts + e];
        for (int t = 0; t < n; ++t) {
            if (ch[t] != e) continue;
            int r = t / k, i = t - r * k;
            int j = 0;  // experts of this token below e
            for (int q = 0; q < k; ++q) j += ch[r * k + q] < e;
            i64 tok = r0 + r;
            src[pos] = (i32)tok;
            slot[tok * k + j] = pos;
            pick[tok * k + j] = i;
            ++pos;
        }
    }
}

// ---------------------------------------------------------------- the experts' products
//
// y[row, n] = sum_k x[row, k] w_e[n, k] for the routed rows of each tile, e the tile's expert:
// x [routed rows, K] (row stride K), w [experts][N, K] (the Hugging Face [out, in] layout,
// expert e at e * N * K), y f32 [routed rows, ldy]. One launch covers every expert; tiles
// past the grouping's count (expert -1) return at once. Each row's result depends only on
// that row, so packing more windows into a pass changes no bit.

#define MG_ROWS 64  // routed rows per block (= MOE_TILE_ROWS)
#define MG_COLS 64  // output columns per block
#define MG_K 32     // depth per staged slice

// bf16 x and w on tensor cores (mma.m16n8k16, f32 accumulation): 4 warps, warp w the tile's
// rows 16w .. 16w + 15 across the block's 64 columns. Grid: (ceil(N / 64), max_tiles),
// block 128. (The bounds' "1" lets ptxas take the ~100 registers the 32 accumulators and
// fragments need: without it, it stopped at 64 and spilled.)
extern "C" __global__ void __launch_bounds__(128, 1)
moe_gemm_bf16(const u16* __restrict__ x, const u16* __restrict__ w, const int4* __restrict__ tiles, int N,
              int K, float* __restrict__ y, int ldy) {
    const int XS = MG_K + 8;  // staged row stride (u16): conflict-free fragment reads
    __shared__ __align__(16) u16 Xs[MG_ROWS * (MG_K + 8)];
    __shared__ __align__(16) u16 Ws[MG_COLS * (MG_K + 8)];
    int4 tile = tiles[blockIdx.y];
    if (tile.x < 0) return;  // block-uniform
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const i64 row0 = tile.y;
    const int nrows = tile.z, n0 = blockIdx.x * MG_COLS;
    const u16* we = w + (i64)tile.x * N * K;
    float acc[MG_COLS / 8][4];
#pragma unroll
    for (int nb = 0; nb < MG_COLS / 8; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += MG_K) {
        __syncthreads();  // the previous slice's fragments are read
        for (int t = threadIdx.x; t < MG_ROWS * MG_K; t += blockDim.x) {
            int r = t / MG_K, kk = t - r * MG_K;
            bool in = r < nrows && k0 + kk < K;
            Xs[r * XS + kk] = in ? x[(row0 + r) * K + k0 + kk] : (u16)0;
        }
        for (int t = threadIdx.x; t < MG_COLS * MG_K; t += blockDim.x) {
            int r = t / MG_K, kk = t - r * MG_K;
            bool in = n0 + r < N && k0 + kk < K;
            Ws[r * XS + kk] = in ? we[(i64)(n0 + r) * K + k0 + kk] : (u16)0;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < MG_K; ks += 16) {
            const u16* xa = Xs + (warp * 16 + g) * XS + ks + 2 * c;
            u32 a0 = *(const u32*)xa, a1 = *(const u32*)(xa + 8 * XS);
            u32 a2 = *(const u32*)(xa + 8), a3 = *(const u32*)(xa + 8 * XS + 8);
#pragma unroll
            for (int nb = 0; nb < MG_COLS / 8; ++nb) {
                const u16* wb = Ws + (nb * 8 + g) * XS + ks + 2 * c;
                mma_bf16_16816(acc[nb], a0, a1, a2, a3, *(const u32*)wb, *(const u32*)(wb + 8));
            }
        }
    }
#pragma unroll
    for (int nb = 0; nb < MG_COLS / 8; ++nb) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = warp * 16 + g + 8 * h;
            if (r >= nrows) continue;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                int col = n0 + nb * 8 + 2 * c + q;
                if (col < N) y[(row0 + r) * ldy + col] = acc[nb][2 * h + q];
            }
        }
    }
}

// f32 x and w on CUDA cores, with the CPU GEMM's bits (src/backend/cpu/sgemm16.rs): the
// depth in blocks of 768 from 0, one fused multiply-add chain from zero per block, the
// blocks' chains added in order. 256 threads, each 4 x 4 outputs (rows ty + 16 i, columns
// tx + 16 j). Grid: (ceil(N / 64), max_tiles), block 256.
#define MG_KC 768
static_assert(MG_KC % MG_K == 0, "a depth block ends where a staged slice does");
extern "C" __global__ void __launch_bounds__(256)
moe_gemm_f32(const float* __restrict__ x, const float* __restrict__ w, const int4* __restrict__ tiles, int N,
             int K, float* __restrict__ y, int ldy) {
    const int XS = MG_K + 1;  // odd row stride: a column read hits distinct banks
    __shared__ float Xs[MG_ROWS * (MG_K + 1)];
    __shared__ float Ws[MG_COLS * (MG_K + 1)];
    int4 tile = tiles[blockIdx.y];
    if (tile.x < 0) return;  // block-uniform
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const i64 row0 = tile.y;
    const int nrows = tile.z, n0 = blockIdx.x * MG_COLS;
    const float* we = w + (i64)tile.x * N * K;
    float chain[4][4], total[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            chain[i][j] = 0.0f;
            total[i][j] = -0.0f;  // -0 + v = v for every v: the first block's chain as it is
        }
    for (int k0 = 0; k0 < K; k0 += MG_K) {
        if (k0 > 0 && k0 % MG_KC == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    total[i][j] = __fadd_rn(total[i][j], chain[i][j]);
                    chain[i][j] = 0.0f;
                }
        }
        __syncthreads();  // the previous slice is read
        for (int t = threadIdx.x; t < MG_ROWS * MG_K; t += blockDim.x) {
            int r = t / MG_K, kk = t - r * MG_K;
            Xs[r * XS + kk] = r < nrows && k0 + kk < K ? x[(row0 + r) * K + k0 + kk] : 0.0f;
        }
        for (int t = threadIdx.x; t < MG_COLS * MG_K; t += blockDim.x) {
            int r = t / MG_K, kk = t - r * MG_K;
            Ws[r * XS + kk] = n0 + r < N && k0 + kk < K ? we[(i64)(n0 + r) * K + k0 + kk] : 0.0f;
        }
        __syncthreads();
        const int kn = min(MG_K, K - k0);  // the chain stops at K: no padded terms
        for (int kk = 0; kk < kn; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = Xs[(ty + 16 * i) * XS + kk];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Ws[(tx + 16 * j) * XS + kk];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) chain[i][j] = fmaf(a[i], b[j], chain[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int r = ty + 16 * i;
        if (r >= nrows) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int col = n0 + tx + 16 * j;
            if (col < N) y[(row0 + r) * ldy + col] = __fadd_rn(total[i][j], chain[i][j]);
        }
    }
}
