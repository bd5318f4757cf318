//! Typed kernel arguments: one struct per `extern "C"` kernel signature in `kernels/`.
//!
//! A kernel launch passes its arguments by position, and the driver reads each one at the
//! size the kernel's signature says. Handing over a hand-ordered list of integers and
//! pointers would compile with two of them swapped and silently corrupt results. Here each
//! kernel signature is a struct whose fields are named and typed like the kernel's
//! parameters (pointers carry their element type), and the field order is the parameter
//! order; a test reads the `.cu` sources and checks every struct against its kernel's
//! parameter names and C types, so the two cannot drift apart.
//!
//! Compiled on every build (no CUDA needed), so the signature check runs everywhere.

use std::marker::PhantomData;

/// One kernel argument, by value, as the launch packs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    /// A `KvTensor` struct: payload, FP16 scales, u8 block scales, then the f32 tensor
    /// scale's bits.
    Kv([u64; 4]),
}

/// A device address holding elements of `T` (`Any` for a `void*` whose element type a flag
/// argument gives). Null is allowed where the kernel treats it as "absent".
pub struct Ptr<T>(u64, PhantomData<fn() -> T>);

impl<T> Clone for Ptr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Ptr<T> {}

impl<T> Ptr<T> {
    pub const NULL: Ptr<T> = Ptr(0, PhantomData);

    /// The device address `addr`, read as elements of `T`.
    pub fn new(addr: u64) -> Ptr<T> {
        Ptr(addr, PhantomData)
    }

    pub fn addr(self) -> u64 {
        self.0
    }
}

/// The element type of a `void*` parameter (bf16 or f32, chosen by a flag argument).
pub enum Any {}
/// CUDA's `int4` (four `i32`).
pub enum Int4 {}
/// CUDA's `int2` (two `i32`).
pub enum Int2 {}
/// A paired head's running record of one row (`PairRow` in `kernels/head.cu`, 232 bytes).
pub enum PairRow {}

/// A stored K or V tensor (`KvTensor` in `kernels/common.cuh`): payload, FP16 scales, u8
/// block scales, and the layer's f32 tensor scale (`fp8-tensor`; 1.0 and unused otherwise).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvArg {
    pub data: u64,
    pub scale: u64,
    pub bscale: u64,
    pub tscale: f32,
}

/// A Rust value that is one kernel parameter of a known C type.
pub trait KernelParam {
    /// The parameter's C type as the kernels spell it (without `const` / `__restrict__`).
    const C_TYPE: &'static str;
    fn arg(&self) -> Arg;
}

macro_rules! ptr_param {
    ($t:ty, $c:literal) => {
        impl KernelParam for Ptr<$t> {
            const C_TYPE: &'static str = $c;
            fn arg(&self) -> Arg {
                Arg::Ptr(self.0)
            }
        }
    };
}
ptr_param!(f32, "float*");
ptr_param!(f64, "double*");
ptr_param!(i32, "i32*");
ptr_param!(u8, "u8*");
ptr_param!(u16, "u16*");
ptr_param!(u64, "u64*");
ptr_param!(Int4, "int4*");
ptr_param!(Int2, "int2*");
ptr_param!(Any, "void*");
ptr_param!(PairRow, "PairRow*");

impl KernelParam for i32 {
    const C_TYPE: &'static str = "int";
    fn arg(&self) -> Arg {
        Arg::I32(*self)
    }
}
impl KernelParam for i64 {
    const C_TYPE: &'static str = "i64";
    fn arg(&self) -> Arg {
        Arg::I64(*self)
    }
}
impl KernelParam for f32 {
    const C_TYPE: &'static str = "float";
    fn arg(&self) -> Arg {
        Arg::F32(*self)
    }
}
impl KernelParam for f64 {
    const C_TYPE: &'static str = "double";
    fn arg(&self) -> Arg {
        Arg::F64(*self)
    }
}
impl KernelParam for KvArg {
    const C_TYPE: &'static str = "KvTensor";
    fn arg(&self) -> Arg {
        Arg::Kv([
            self.data,
            self.scale,
            self.bscale,
            self.tscale.to_bits() as u64,
        ])
    }
}

/// The arguments of one kernel signature, in parameter order.
pub trait Launch {
    /// The kernel's source file (`kernels/<module>.cu`) and how its name is spelled where
    /// it is declared (macro-generated kernels: with their `##` tokens), for the check.
    const SOURCE: (&'static str, &'static [&'static str]);
    /// `(parameter name, C type)` in order.
    fn signature() -> Vec<(&'static str, &'static str)>;
    fn args(&self) -> Vec<Arg>;
}

/// Declares a kernel's argument struct; the fields are the kernel's parameters, in order.
macro_rules! kernel_args {
    ($(#[$m:meta])* $name:ident = ($module:literal, [$($src:literal),+]) {
        $($(#[$fm:meta])* $field:ident : $ty:ty),* $(,)?
    }) => {
        $(#[$m])*
        #[allow(non_snake_case)]
        pub struct $name {
            $($(#[$fm])* pub $field: $ty),*
        }
        impl Launch for $name {
            const SOURCE: (&'static str, &'static [&'static str]) = ($module, &[$($src),+]);
            fn signature() -> Vec<(&'static str, &'static str)> {
                vec![$((stringify!($field), <$ty as KernelParam>::C_TYPE)),*]
            }
            fn args(&self) -> Vec<Arg> {
                vec![$(self.$field.arg()),*]
            }
        }
    };
}

kernel_args! {
    /// `embed_gather`: `x[m, d]` = the embedding rows of `tokens[m]`. Grid (m), block 256.
    EmbedGather = ("elementwise", ["embed_gather"]) {
        tokens: Ptr<i32>,
        embed: Ptr<Any>,
        /// 1: the embedding is bf16, 0: f32.
        embed_bf16: i32,
        x: Ptr<f32>,
        d: i32,
    }
}

kernel_args! {
    /// `rms_norm`: one row per block; `rows` (optional) gathers the input rows.
    RmsNorm = ("elementwise", ["rms_norm"]) {
        x: Ptr<f32>,
        /// Null: row r is input row r.
        rows: Ptr<i32>,
        w: Ptr<f32>,
        out: Ptr<Any>,
        out_bf16: i32,
        d: i32,
        eps: f64,
    }
}

kernel_args! {
    /// `swiglu`: `act[rows, f] = silu(gu[:, :f]) * gu[:, f:]`.
    Swiglu = ("elementwise", ["swiglu"]) {
        gu: Ptr<f32>,
        act: Ptr<Any>,
        out_bf16: i32,
        rows: i64,
        f: i32,
    }
}

kernel_args! {
    /// `head_reduce`: folds one vocabulary chunk of logits into each row's running
    /// max / sum / target logit. Grid (rows), block 256.
    HeadReduce = ("head", ["head_reduce"]) {
        logits: Ptr<f32>,
        vc: i32,
        v0: i32,
        targets: Ptr<i32>,
        run_max: Ptr<f32>,
        run_sum: Ptr<f64>,
        run_target: Ptr<f32>,
    }
}

kernel_args! {
    /// `head_finish`: `out[r] = target - max - log(sum)`.
    HeadFinish = ("head", ["head_finish"]) {
        run_max: Ptr<f32>,
        run_sum: Ptr<f64>,
        run_target: Ptr<f32>,
        out: Ptr<f32>,
        rows: i32,
    }
}

kernel_args! {
    /// `head_pair_reduce`: folds one vocabulary chunk of the run's and of a saved
    /// reference's logits into each row's running record. Grid (rows), block 256.
    HeadPairReduce = ("head", ["head_pair_reduce"]) {
        logits: Ptr<f32>,
        logits_ref: Ptr<f32>,
        vc: i32,
        v0: i32,
        targets: Ptr<i32>,
        state: Ptr<PairRow>,
    }
}

kernel_args! {
    /// `head_pair_js`: the second sweep over one vocabulary chunk of both heads, with each
    /// row's first sweep finished: Jensen–Shannon divergence and each side's top ten.
    /// Grid (rows), block 256.
    HeadPairJs = ("head", ["head_pair_js"]) {
        logits: Ptr<f32>,
        logits_ref: Ptr<f32>,
        vc: i32,
        v0: i32,
        state: Ptr<PairRow>,
    }
}

kernel_args! {
    /// `head_pair_finish`: each row's record -> its twelve comparison fields.
    HeadPairFinish = ("head", ["head_pair_finish"]) {
        state: Ptr<PairRow>,
        out: Ptr<f32>,
        rows: i32,
    }
}

kernel_args! {
    /// `qkv_prep_<kv>_nk<N>`: bias, q/k norm, RoPE, q out and K/V stored in the Main KV
    /// representation; the first non-finite K/V value is recorded in `err`.
    QkvPrep = ("qkv", ["NAME"]) {
        qkv: Ptr<f32>,
        /// Null: no bias.
        bias: Ptr<f32>,
        /// Null: no q/k norm.
        q_norm: Ptr<f32>,
        k_norm: Ptr<f32>,
        rope_cos: Ptr<f32>,
        rope_sin: Ptr<f32>,
        pos: Ptr<i32>,
        win: Ptr<i32>,
        q_out: Ptr<Any>,
        q_bf16: i32,
        kt: KvArg,
        vt: KvArg,
        err: Ptr<u64>,
        layer: i32,
        rows: i64,
        hq: i32,
        hkv: i32,
        D: i32,
        /// Values per qkv row (at least (hq + 2 hkv) D; more when a gate follows).
        row_stride: i32,
        /// Rotary dims (D, or fewer: partial RoPE); the tables hold rot / 2 per position.
        rot: i32,
        eps: f64,
    }
}

kernel_args! {
    /// `attn_f32_<kv>`: causal attention in f32 over query tiles.
    AttnF32 = ("attention", ["attn_f32_##FMT"]) {
        q: Ptr<f32>,
        kt: KvArg,
        vt: KvArg,
        tiles: Ptr<Int4>,
        out: Ptr<Any>,
        out_bf16: i32,
        hq: i32,
        hkv: i32,
        D: i32,
        scale: f32,
    }
}

kernel_args! {
    /// `attn_mma_<kv>_d64` / `_d128` / `_d256`: tensor-core causal attention (bf16 q and
    /// output); `sl2` is the score scale times log2(e).
    AttnMma = ("attention", ["attn_mma_##FMT##_d64", "attn_mma_##FMT##_d128", "attn_mma_##FMT##_d256"]) {
        q: Ptr<u16>,
        kt: KvArg,
        vt: KvArg,
        tiles: Ptr<Int4>,
        out: Ptr<u16>,
        hq: i32,
        hkv: i32,
        sl2: f32,
    }
}

kernel_args! {
    /// `kv_encode_<elem>_nk<N>`: stores `n` vectors of `D <= 32 N` values.
    KvEncode = ("codec", ["kv_encode_##NAME##_nk2", "kv_encode_##NAME##_nk4", "kv_encode_##NAME##_nk8"]) {
        x: Ptr<f32>,
        n: i64,
        D: i32,
        t: KvArg,
    }
}

kernel_args! {
    /// `kv_decode_<elem>`: reads `n` stored vectors back through the attention's loader.
    KvDecode = ("codec", ["kv_decode_##NAME"]) {
        t: KvArg,
        n: i64,
        D: i32,
        out: Ptr<f32>,
    }
}

kernel_args! {
    /// `e4m3_encode` / `e2m1_encode`: the element code of each of `n` values.
    ElementEncode = ("codec", ["e4m3_encode", "e2m1_encode"]) {
        x: Ptr<f32>,
        out: Ptr<u8>,
        n: i64,
    }
}

kernel_args! {
    /// `dequant_nvfp4`: `n` nvfp4 weights to bf16 or f32; the first non-finite index to `err`.
    DequantNvfp4 = ("weights", ["dequant_nvfp4"]) {
        packed: Ptr<u8>,
        bscale: Ptr<u8>,
        g: f32,
        /// 1: divide by `g` (`_global_scale`), 0: multiply (`_scale_2`).
        divide: i32,
        n: i64,
        out: Ptr<Any>,
        out_bf16: i32,
        err: Ptr<u64>,
    }
}

kernel_args! {
    /// `dequant_fp8`: `[rows, cols]` e4m3 weights times their scales (`kind` 0 tensor,
    /// 1 row, 2 128 x 128 block) to bf16 or f32; the first non-finite index to `err`.
    DequantFp8 = ("weights", ["dequant_fp8"]) {
        codes: Ptr<u8>,
        scale: Ptr<f32>,
        kind: i32,
        rows: i64,
        cols: i32,
        out: Ptr<Any>,
        out_bf16: i32,
        err: Ptr<u64>,
    }
}

kernel_args! {
    /// `delta_conv_silu`: the causal depthwise conv of q|k|v and SiLU, packed windows.
    DeltaConvSilu = ("delta_net", ["delta_conv_silu"]) {
        proj: Ptr<f32>,
        width: i32,
        /// `[K, conv_dim]`, tap-major.
        conv: Ptr<f32>,
        kw: i32,
        pos: Ptr<i32>,
        rows: i64,
        conv_dim: i32,
        c: Ptr<f32>,
    }
}

kernel_args! {
    /// `delta_prep`: q/k L2 norms in place, beta and g per (row, value head).
    DeltaPrep = ("delta_net", ["delta_prep"]) {
        c: Ptr<f32>,
        conv_dim: i32,
        proj: Ptr<f32>,
        width: i32,
        a_log: Ptr<f32>,
        dt_bias: Ptr<f32>,
        rows: i64,
        hk: i32,
        dk: i32,
        hv: i32,
        dv: i32,
        q_scale: f32,
        beta: Ptr<f32>,
        g: Ptr<f32>,
    }
}

kernel_args! {
    /// `delta_rule_recurrent`: the gated delta rule's token recurrence, one block per
    /// (window, value head); `spans` are `(first row, rows)` per window.
    DeltaRule = ("delta_net", ["delta_rule_recurrent"]) {
        c: Ptr<f32>,
        conv_dim: i32,
        beta: Ptr<f32>,
        g: Ptr<f32>,
        spans: Ptr<Int2>,
        hk: i32,
        dk: i32,
        hv: i32,
        dv: i32,
        o: Ptr<f32>,
    }
}

kernel_args! {
    /// `delta_rule_chunked`: the same function as [`DeltaRule`] (the same inputs, output and
    /// grid (windows, Hv)), computed [`DELTA_CHUNK`] tokens at a time in the WY form (CPU
    /// twin: `cpu::delta_rule::chunked`); equal to the recurrence to f32 rounding, not bit
    /// for bit. Block: [`DELTA_CHUNKED_THREADS`]; dynamic shared memory: [`delta_chunked_smem`]. Takes
    /// every Dk, Dv up to [`DELTA_CHUNKED_MAX_DIM`] ([`delta_chunked_fits`]).
    /// `delta_rule_chunked_tc` is the same kernel with its matrix products on tf32 tensor
    /// cores, three products each (3xTF32: as accurate as f32); [`delta_chunked_entry`]
    /// picks one by precision.
    DeltaRuleChunked = ("delta_net", ["delta_rule_chunked", "delta_rule_chunked_tc"]) {
        c: Ptr<f32>,
        conv_dim: i32,
        beta: Ptr<f32>,
        g: Ptr<f32>,
        spans: Ptr<Int2>,
        hk: i32,
        dk: i32,
        hv: i32,
        dv: i32,
        /// Null when [`delta_chunked_state_in_shared`] (the State lives in shared memory);
        /// else global scratch of [`delta_chunked_state_bytes`] per block, block (w, j) at
        /// float offset `(j · windows + w) · Dk · Dv` (no need to clear it).
        state: Ptr<f32>,
        o: Ptr<f32>,
    }
}

/// The chunked rule's entry point for a precision: in bf16 mode the tensor-core form
/// (`delta_rule_chunked_tc`), in f32 mode the CUDA-core form, whose every element is one
/// fixed chain of rounded f32 operations. Both are within f32 rounding of the recurrence
/// (tests/parity/kernels.rs `the_chunked_delta_rule_kernel_computes_the_recurrence`).
pub fn delta_chunked_entry(precision: super::plan::Precision) -> &'static str {
    match precision {
        super::plan::Precision::Bf16 => "delta_rule_chunked_tc",
        super::plan::Precision::F32 => "delta_rule_chunked",
    }
}

/// Tokens per chunk of `delta_rule_chunked` (`DELTA_CHUNK` in kernels/delta_net.cu), the
/// CPU `chunked`'s too.
pub const DELTA_CHUNK: usize = 64;

/// Largest Dk and Dv `delta_rule_chunked` is guaranteed to take: for every pair up to it the
/// block's shared memory fits in [`MAX_DYNAMIC_SMEM`](super::plan::MAX_DYNAMIC_SMEM) (the
/// State moving to global memory where it does not fit; Dk = Dv = 256 needs 225.75 KiB
/// without it). Past it, a pair whose [`delta_chunked_smem`] exceeds the limit is refused
/// ([`delta_chunked_fits`] false; a launch would fail).
pub const DELTA_CHUNKED_MAX_DIM: usize = 256;

/// Dynamic shared memory of `delta_rule_chunked` in bytes, with the State `S[Dk, Dv]` in
/// shared memory or not: `(S ? Dk·Dv : 0) + 2·C·ldk + C·Dv + 2·C² + 5·C` floats, C =
/// [`DELTA_CHUNK`], ldk = `Dk | 1` (the layout is in kernels/delta_net.cu).
pub fn delta_chunked_smem_with(dk: usize, dv: usize, state_in_shared: bool) -> u32 {
    let (c, ldk) = (DELTA_CHUNK, dk | 1);
    let s = if state_in_shared { dk * dv } else { 0 };
    (4 * (s + 2 * c * ldk + c * dv + 2 * c * c + 5 * c)) as u32
}

/// Whether `delta_rule_chunked` keeps the State in shared memory for (dk, dv) (pass `state`
/// null): it does when all of it fits (193.75 KiB at Dk = Dv = 128).
pub fn delta_chunked_state_in_shared(dk: usize, dv: usize) -> bool {
    delta_chunked_smem_with(dk, dv, true) as usize <= super::plan::MAX_DYNAMIC_SMEM
}

/// The dynamic shared memory to launch `delta_rule_chunked` with for (dk, dv), the State
/// placed by [`delta_chunked_state_in_shared`].
pub fn delta_chunked_smem(dk: usize, dv: usize) -> u32 {
    delta_chunked_smem_with(dk, dv, delta_chunked_state_in_shared(dk, dv))
}

/// Global scratch bytes per block (window, value head) for the State: 0 when it lives in
/// shared memory (`state` null), else `4·Dk·Dv`.
pub fn delta_chunked_state_bytes(dk: usize, dv: usize) -> usize {
    if delta_chunked_state_in_shared(dk, dv) {
        0
    } else {
        4 * dk * dv
    }
}

/// Whether `delta_rule_chunked` takes (dk, dv): both from 1 to [`DELTA_CHUNKED_MAX_DIM`] (a
/// thread's register tile covers at most 256 State columns) and [`delta_chunked_smem`]
/// within the limit (true for every such pair).
pub fn delta_chunked_fits(dk: usize, dv: usize) -> bool {
    (1..=DELTA_CHUNKED_MAX_DIM).contains(&dk)
        && (1..=DELTA_CHUNKED_MAX_DIM).contains(&dv)
        && delta_chunked_smem(dk, dv) as usize <= super::plan::MAX_DYNAMIC_SMEM
}

/// Threads of a `delta_rule_chunked` block (`DELTA_THREADS`): exactly 8 warps, each owning 8
/// of a chunk's 64 rows.
pub const DELTA_CHUNKED_THREADS: u32 = 256;

kernel_args! {
    /// `delta_gated_norm`: `rmsnorm(o) · w · act(z)` per value head.
    DeltaGatedNorm = ("delta_net", ["delta_gated_norm"]) {
        o: Ptr<f32>,
        proj: Ptr<f32>,
        width: i32,
        conv_dim: i32,
        w: Ptr<f32>,
        n: i64,
        hv: i32,
        dv: i32,
        eps: f64,
        sigmoid_gate: i32,
        y: Ptr<Any>,
        out_bf16: i32,
    }
}

kernel_args! {
    /// `attn_output_gate`: `attn[r, i] *= sigmoid(qkv[r, gate_off + i])` (gated attention).
    AttnOutputGate = ("elementwise", ["attn_output_gate"]) {
        attn: Ptr<Any>,
        attn_bf16: i32,
        qkv: Ptr<f32>,
        row_stride: i32,
        gate_off: i32,
        rows: i64,
        qd: i32,
    }
}

kernel_args! {
    /// `hadamard_rows`: each vector of `D` values of `x[n, D]` rotated in place by the
    /// normalized Hadamard matrix (the attention output back from rotated values).
    HadamardRows = ("elementwise", ["hadamard_rows"]) {
        x: Ptr<Any>,
        x_bf16: i32,
        n: i64,
        D: i32,
    }
}

kernel_args! {
    /// `nonfinite_scan`: the first non-finite value of `x[rows, cols]` as a record in `err`
    /// (see `model::decode_state_nonfinite`).
    NonfiniteScan = ("elementwise", ["nonfinite_scan"]) {
        x: Ptr<f32>,
        rows: i64,
        cols: i32,
        pos: Ptr<i32>,
        win: Ptr<i32>,
        layer: i32,
        part: i32,
        err: Ptr<u64>,
    }
}

kernel_args! {
    /// `moe_route`: the router's softmax over `logits[rows, experts]` (in place) and each
    /// row's `k` experts into `idx[rows, k]` with their weights `wts[rows, k]`.
    /// Grid (ceil(rows / 128)), block 128.
    MoeRoute = ("moe", ["moe_route"]) {
        logits: Ptr<f32>,
        rows: i64,
        experts: i32,
        k: i32,
        renorm: i32,
        idx: Ptr<i32>,
        wts: Ptr<f32>,
    }
}

kernel_args! {
    /// `moe_combine`: `x[rows, d] +=` the weighted expert outputs `y[slot]` in expert-index
    /// order, then `sigmoid(gate) · shared` when `shared` is not null.
    /// Grid (ceil(rows · d / 256)), block 256.
    MoeCombine = ("moe", ["moe_combine"]) {
        y: Ptr<f32>,
        slot: Ptr<i32>,
        pick: Ptr<i32>,
        wts: Ptr<f32>,
        k: i32,
        shared: Ptr<f32>,
        gate: Ptr<f32>,
        x: Ptr<f32>,
        xrows: Ptr<i32>,
        rows: i64,
        d: i32,
    }
}

kernel_args! {
    /// `moe_count`: each expert's choices per chunk of [`MOE_GROUP_ROWS`] tokens.
    /// Grid (chunks), block 256, dynamic shared memory [`moe_group_smem`].
    MoeCount = ("moe", ["moe_count"]) {
        idx: Ptr<i32>,
        rows: i64,
        k: i32,
        experts: i32,
        counts: Ptr<i32>,
    }
}

kernel_args! {
    /// `moe_offsets`: the counts become each (chunk, expert)'s first routed row; the
    /// experts' offsets, the GEMM tiles and the run's routing counts. Grid (1), block 256,
    /// dynamic shared memory `4 · (2 · experts + 1)`.
    MoeOffsets = ("moe", ["moe_offsets"]) {
        counts: Ptr<i32>,
        chunks: i32,
        experts: i32,
        offsets: Ptr<i32>,
        tiles: Ptr<Int4>,
        max_tiles: i32,
        routed: Ptr<u64>,
    }
}

kernel_args! {
    /// `moe_place`: every (token, choice) pair at its routed row (`src`), and each token's
    /// rows and choices in expert order (`slot`, `pick`). Grid (chunks), block 256, dynamic
    /// shared memory [`moe_group_smem`].
    MoePlace = ("moe", ["moe_place"]) {
        idx: Ptr<i32>,
        rows: i64,
        k: i32,
        experts: i32,
        base: Ptr<i32>,
        src: Ptr<i32>,
        slot: Ptr<i32>,
        pick: Ptr<i32>,
    }
}

kernel_args! {
    /// `moe_gemm_bf16`: every expert's `y = x · w_eᵀ` over its routed rows on tensor cores.
    /// Grid (ceil(N / 64), max tiles), block 128.
    MoeGemmBf16 = ("moe", ["moe_gemm_bf16"]) {
        x: Ptr<u16>,
        w: Ptr<u16>,
        tiles: Ptr<Int4>,
        N: i32,
        K: i32,
        y: Ptr<f32>,
        ldy: i32,
    }
}

kernel_args! {
    /// `moe_gemm_f32`: the same in f32 with the CPU GEMM's bits. Grid (ceil(N / 64), max
    /// tiles), block 256.
    MoeGemmF32 = ("moe", ["moe_gemm_f32"]) {
        x: Ptr<f32>,
        w: Ptr<f32>,
        tiles: Ptr<Int4>,
        N: i32,
        K: i32,
        y: Ptr<f32>,
        ldy: i32,
    }
}

/// Tokens per chunk of the MoE grouping kernels (`MOE_GROUP_ROWS` in kernels/moe.cu).
pub const MOE_GROUP_ROWS: usize = 256;
/// Routed rows per tile of the expert GEMMs (`MOE_TILE_ROWS` in kernels/moe.cu).
pub const MOE_TILE_ROWS: usize = 64;
/// Output columns per block of the expert GEMMs (`MG_COLS`).
pub const MOE_TILE_COLS: usize = 64;

/// Dynamic shared memory of `moe_count` and `moe_place`: one chunk's choices.
pub fn moe_group_smem(k: usize) -> u32 {
    (4 * MOE_GROUP_ROWS * k) as u32
}

/// The most GEMM tiles any grouping of `routed` rows over `experts` experts needs.
pub fn moe_max_tiles(routed: usize, experts: usize) -> usize {
    routed.div_ceil(MOE_TILE_ROWS) + experts
}

/// Every launcher's `(SOURCE, signature)`, for the check against the sources.
type Signature = (
    (&'static str, &'static [&'static str]),
    Vec<(&'static str, &'static str)>,
);

pub fn all_signatures() -> Vec<Signature> {
    fn one<L: Launch>() -> Signature {
        (L::SOURCE, L::signature())
    }
    vec![
        one::<EmbedGather>(),
        one::<RmsNorm>(),
        one::<Swiglu>(),
        one::<HeadReduce>(),
        one::<HeadFinish>(),
        one::<HeadPairReduce>(),
        one::<HeadPairJs>(),
        one::<HeadPairFinish>(),
        one::<QkvPrep>(),
        one::<AttnF32>(),
        one::<AttnMma>(),
        one::<KvEncode>(),
        one::<KvDecode>(),
        one::<ElementEncode>(),
        one::<AttnOutputGate>(),
        one::<HadamardRows>(),
        one::<NonfiniteScan>(),
        one::<DequantNvfp4>(),
        one::<DequantFp8>(),
        one::<DeltaConvSilu>(),
        one::<DeltaPrep>(),
        one::<DeltaRule>(),
        one::<DeltaRuleChunked>(),
        one::<DeltaGatedNorm>(),
        one::<MoeRoute>(),
        one::<MoeCombine>(),
        one::<MoeCount>(),
        one::<MoeOffsets>(),
        one::<MoePlace>(),
        one::<MoeGemmBf16>(),
        one::<MoeGemmF32>(),
    ]
}

/// The `(name, C type)` parameters of the kernel declared as `name` in `source`, read from
/// its `extern "C" __global__ void [__launch_bounds__(..)] name(...)` declaration.
pub fn parse_params(source: &str, name: &str) -> Option<Vec<(String, String)>> {
    let text = source.replace("\\\n", " ");
    let mut from = 0;
    while let Some(i) = text[from..].find("extern \"C\" __global__ void") {
        let decl = &text[from + i..];
        from += i + 1;
        let open = decl.find('(')?;
        let mut head = decl[..open].trim_end().to_string();
        let mut rest = &decl[open..];
        if head.ends_with("__launch_bounds__") {
            // Skip the bounds' parentheses; the name follows them.
            let close = rest.find(')')?;
            rest = &rest[close + 1..];
            let open2 = rest.find('(')?;
            head = rest[..open2].trim().to_string();
            rest = &rest[open2..];
        }
        let declared = head.rsplit(' ').next()?.trim();
        if declared != name {
            continue;
        }
        let close = rest.find(')')?;
        let params = rest[1..close]
            .split(',')
            .map(|p| {
                let p = p
                    .replace("const ", " ")
                    .replace("__restrict__", " ")
                    .replace('*', " * ");
                let words: Vec<&str> = p.split_whitespace().collect();
                let (n, ty) = words.split_last().expect("a parameter");
                (n.to_string(), ty.concat())
            })
            .collect();
        return Some(params);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::MODULES;

    #[test]
    fn every_launcher_matches_its_kernel_signature() {
        for ((module, names), sig) in all_signatures() {
            let m = MODULES
                .iter()
                .find(|m| m.name == module)
                .unwrap_or_else(|| panic!("no module {module}"));
            let want: Vec<(String, String)> = sig
                .iter()
                .map(|(n, t)| (n.to_string(), t.to_string()))
                .collect();
            for name in names {
                let params = parse_params(m.source, name)
                    .unwrap_or_else(|| panic!("kernels/{module}.cu declares no kernel `{name}`"));
                assert_eq!(params, want, "kernels/{module}.cu `{name}`");
            }
        }
    }

    #[test]
    fn the_check_sees_a_swapped_parameter() {
        // The parser reads what the check compares: a declaration with two parameters
        // swapped gives a different list, and a missing kernel gives none.
        let src = "extern \"C\" __global__ void __launch_bounds__(128) k(const float* __restrict__ x, int n, i64 m) {}";
        assert_eq!(
            parse_params(src, "k").unwrap(),
            [("x", "float*"), ("n", "int"), ("m", "i64")]
                .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        let swapped = src.replace("int n, i64 m", "i64 m, int n");
        assert_ne!(parse_params(&swapped, "k"), parse_params(src, "k"));
        assert_eq!(parse_params(src, "other"), None);
    }

    #[test]
    fn args_follow_the_field_order() {
        let a = Swiglu {
            gu: Ptr::new(16),
            act: Ptr::new(32),
            out_bf16: 1,
            rows: 7,
            f: 9,
        };
        assert_eq!(
            a.args(),
            vec![
                Arg::Ptr(16),
                Arg::Ptr(32),
                Arg::I32(1),
                Arg::I64(7),
                Arg::I32(9)
            ]
        );
    }
}
