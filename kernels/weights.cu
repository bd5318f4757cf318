// Quantized weights dequantized on the device at load, into the GEMM input precision (bf16
// or f32), so a quantized artifact crosses the bus in its stored size. CPU twins: the
// `dequantize` of src/quant/nvfp4.rs and src/quant/fp8.rs (the host rounds to bf16 after).
// Both record the first flat index whose value is not finite in `err` (one atomicMin per
// warp), which the host turns into the CPU loader's error.

// out[i] = v in the GEMM input precision (bf16 when out_bf16, else f32).
__device__ __forceinline__ void store_weight(void* out, int out_bf16, i64 i, float v) {
    if (out_bf16) {
        ((u16*)out)[i] = f32_to_bf16(v);
    } else {
        ((float*)out)[i] = v;
    }
}

// nvfp4 `[rows, cols]` (cols a multiple of 16): byte i holds flat elements 2i (low nibble)
// and 2i + 1; block scale flat / 16 (e4m3); then times the global scale, or divided by it.
// Grid: (ceil(n / 256)), block 256.
extern "C" __global__ void dequant_nvfp4(const u8* __restrict__ packed, const u8* __restrict__ bscale, float g,
                                         int divide, i64 n, void* __restrict__ out, int out_bf16,
                                         u64* __restrict__ err) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool bad = false;
    if (i < n) {
        u32 byte = packed[i >> 1];
        u32 code = (i & 1) ? (byte >> 4) : (byte & 15u);
        float v = __fmul_rn(e2m1_to_f32(code), e4m3_to_f32(bscale[i >> 4]));  // exact
        v = divide ? __fdiv_rn(v, g) : __fmul_rn(v, g);
        bad = !is_finite_f32(v);
        store_weight(out, out_bf16, i, v);
    }
    warp_record_min(err, bad, (u64)i);
}

// fp8 e4m3fn `[rows, cols]` times its scale: `kind` 0 one per tensor, 1 one per row, 2 one
// per 128 x 128 block (`[ceil(rows/128), ceil(cols/128)]`). Grid: (ceil(rows * cols / 256)),
// block 256.
extern "C" __global__ void dequant_fp8(const u8* __restrict__ codes, const float* __restrict__ scale, int kind,
                                       i64 rows, int cols, void* __restrict__ out, int out_bf16,
                                       u64* __restrict__ err) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool bad = false;
    if (i < rows * cols) {
        i64 r = i / cols;
        int c = (int)(i - r * cols);
        float s = kind == 0 ? scale[0] : (kind == 1 ? scale[r] : scale[(r >> 7) * ((cols + 127) >> 7) + (c >> 7)]);
        float v = __fmul_rn(e4m3_to_f32(codes[i]), s);
        bad = !is_finite_f32(v);
        store_weight(out, out_bf16, i, v);
    }
    warp_record_min(err, bad, (u64)i);
}
