//! Host-side planning for the CUDA scorer, free of any CUDA call so it is unit-tested on
//! every machine: how windows are packed into forward passes, how query tiles are cut for
//! the attention kernels, which kernel variant a shape takes, how device memory is split
//! between activations and the head, and how many FLOPs a window costs.

use crate::kv::{Elem, KvDtype};
use crate::model::config::ModelConfig;
use anyhow::{bail, Result};

pub use crate::backend::Precision;

/// Query rows per tile of the f32 attention kernel (`attn_f32_*`).
pub const ATTN_F32_ROWS: usize = 16;
/// Query rows per tile of the tensor-core attention kernel (`attn_mma_*`).
pub const ATTN_MMA_ROWS: usize = 64;
/// Keys per shared-memory tile of the f32 attention kernel.
pub const ATTN_F32_KEYS: usize = 32;
/// Largest head dim the kernels take (8 values per lane of a warp).
pub const MAX_HEAD_DIM: usize = 256;

/// Which attention kernel a shape and precision use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// `attn_mma_<fmt>_d<D>` with D = 64, 128 or 256.
    Mma { head_dim: usize },
    /// `attn_f32_<fmt>`.
    F32,
}

impl AttnKernel {
    pub fn choose(precision: Precision, head_dim: usize) -> AttnKernel {
        match (precision, head_dim) {
            (Precision::Bf16, 64 | 128 | 256) => AttnKernel::Mma { head_dim },
            _ => AttnKernel::F32,
        }
    }

    pub fn rows_per_tile(self) -> usize {
        match self {
            AttnKernel::Mma { .. } => ATTN_MMA_ROWS,
            AttnKernel::F32 => ATTN_F32_ROWS,
        }
    }

    /// The kernel's entry point for a KV representation.
    pub fn entry(self, kv: KvDtype) -> String {
        match self {
            AttnKernel::Mma { head_dim } => format!("attn_mma_{}_d{head_dim}", kv.ident()),
            AttnKernel::F32 => format!("attn_f32_{}", kv.ident()),
        }
    }

    /// Dynamic shared memory in bytes (the tensor-core kernel uses static memory only).
    pub fn dynamic_smem(self, head_dim: usize) -> usize {
        match self {
            AttnKernel::Mma { .. } => 0,
            AttnKernel::F32 => {
                4 * (ATTN_F32_KEYS * (head_dim + 1)
                    + ATTN_F32_KEYS * head_dim
                    + ATTN_F32_ROWS * head_dim)
            }
        }
    }
}

/// The fused q/k/v preparation entry point: the KV representation and the per-lane
/// register count (head dims up to 64, 128 or 256).
pub fn qkv_entry(kv: KvDtype, head_dim: usize) -> Result<String> {
    let nk = match head_dim {
        1..=64 => 2,
        65..=128 => 4,
        129..=MAX_HEAD_DIM => 8,
        _ => {
            bail!("head_dim {head_dim} is outside what the CUDA kernels take (1..={MAX_HEAD_DIM})")
        }
    };
    Ok(format!("qkv_prep_{}_nk{nk}", kv.ident()))
}

/// Warps per block of the q/k/v preparation kernel (one warp per vector).
pub const QKV_WARPS: usize = 8;

/// Grid size for `n` items of `per_block` each.
pub fn blocks_for(n: usize, per_block: usize) -> u32 {
    let b = n.div_ceil(per_block.max(1));
    assert!(b <= u32::MAX as usize, "grid too large");
    b as u32
}

/// One query tile of the attention kernels: `[q_row, q_row + rows)` of the packed batch,
/// inside the window whose first row is `seq_row`. Passed to the device as an int4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnTile {
    pub q_row: u32,
    pub rows: u32,
    pub seq_row: u32,
}

impl AttnTile {
    /// Keys this tile's last query row attends to, the tile's cost.
    pub fn keys(&self) -> u32 {
        self.q_row - self.seq_row + self.rows
    }

    pub fn to_int4(self) -> [i32; 4] {
        [self.q_row as i32, self.rows as i32, self.seq_row as i32, 0]
    }
}

/// Cuts every window (`(first row, length)` in the packed batch) into tiles of at most
/// `per_tile` query rows, longest first, so the blocks with the most keys start first and
/// the short ones fill the tail.
pub fn attention_tiles(windows: &[(usize, usize)], per_tile: usize) -> Vec<AttnTile> {
    let mut tiles = Vec::new();
    for &(row0, len) in windows {
        let mut r = 0;
        while r < len {
            let n = per_tile.min(len - r);
            tiles.push(AttnTile {
                q_row: (row0 + r) as u32,
                rows: n as u32,
                seq_row: row0 as u32,
            });
            r += n;
        }
    }
    // Stable: equal costs keep their order, so the launch is deterministic.
    tiles.sort_by_key(|t| std::cmp::Reverse(t.keys()));
    tiles
}

/// Groups consecutive windows (by length) into forward passes of at most `max_rows` packed
/// rows and at most `max_windows` windows. Every window must fit alone.
pub fn pack_batches(
    lens: &[usize],
    max_rows: usize,
    max_windows: usize,
) -> Result<Vec<std::ops::Range<usize>>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut rows = 0;
    for (i, &l) in lens.iter().enumerate() {
        if l > max_rows {
            bail!("a window of {l} tokens does not fit in one CUDA forward pass (at most {max_rows} rows fit in free device memory)");
        }
        if i > start && (rows + l > max_rows || i - start >= max_windows) {
            out.push(start..i);
            start = i;
            rows = 0;
        }
        rows += l;
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    Ok(out)
}

/// Bytes of every array a stored K or V tensor of `n` vectors needs, each rounded up to
/// 256 bytes: (payload, FP16 scales, e4m3 block scales).
pub fn kv_arrays(elem: Elem, n: usize, head_dim: usize) -> (usize, usize, usize) {
    let r = |b: usize| b.div_ceil(256) * 256;
    match elem {
        Elem::F32 => (r(4 * n * head_dim), 0, 0),
        Elem::Bf16 | Elem::F16 => (r(2 * n * head_dim), 0, 0),
        Elem::Int8 => (
            r(n * head_dim),
            r(2 * n * crate::kv::int8::groups(head_dim)),
            0,
        ),
        Elem::Fp8 => (r(n * head_dim), r(2 * n), 0),
        Elem::Fp8Tensor => (r(n * head_dim), 0, 0),
        Elem::Nvfp4 => (r(n * head_dim.div_ceil(2)), 0, r(n * head_dim.div_ceil(16))),
    }
}

/// Widths of the per-row activation buffers, in elements (shared by [`bytes_per_row`] and
/// [`buffer_sizes`] so the plan and the allocations cannot disagree).
struct Widths {
    /// The widest GEMM output held in `scratch` (f32): q|k|v(|gate), gate|up, or a Gated
    /// DeltaNet's q|k|v|z|b|a projection.
    scratch: usize,
    /// Rotated queries (f32), also a Gated DeltaNet's State read-out `o` (f32).
    q: usize,
    /// Attention output (precision), also the gated norm's output `y`.
    attn: usize,
    /// A Gated DeltaNet's conv output q|k|v (f32); 0 without such layers.
    conv: usize,
    /// Its beta and g gates (f32).
    gates: usize,
    /// The SwiGLU output (precision): a dense MLP's, the routed experts' `k` rows, or the
    /// shared expert's.
    act: usize,
    /// A sparse MoE block's router probabilities `[E]`, shared-expert gate `[1]`, choices
    /// and weights `[k]` each (f32 / i32); 0 without such layers.
    router: usize,
    /// Its `k` gathered input rows (precision).
    moe_in: usize,
    /// Its `k` expert output rows and the shared expert's (f32).
    moe_out: usize,
}

fn widths(c: &ModelConfig) -> Widths {
    let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
    let gate = if c.attention_output_gate() { qd } else { 0 };
    let mut w = Widths {
        scratch: (qd + 2 * kvd + gate).max(2 * f),
        q: qd,
        attn: qd,
        conv: 0,
        gates: 0,
        act: f,
        router: 0,
        moe_in: 0,
        moe_out: 0,
    };
    if let Some(m) = &c.moe {
        let (k, i, s) = (
            m.num_experts_per_tok,
            m.moe_intermediate_size,
            m.shared_expert_intermediate_size,
        );
        let d = c.hidden_size;
        w.scratch = w.scratch.max(k * 2 * i).max(2 * s);
        w.act = w.act.max(k * i).max(s);
        w.router = m.num_experts + 1 + 2 * k;
        w.moe_in = k * d;
        w.moe_out = (k + usize::from(s > 0)) * d;
    }
    if let Some(h) = &c.hybrid {
        let hv = h.linear_num_value_heads;
        w.scratch = w.scratch.max(h.conv_dim() + h.value_dim() + 2 * hv);
        w.q = w.q.max(h.value_dim());
        w.attn = w.attn.max(h.value_dim());
        w.conv = h.conv_dim();
        w.gates = 2 * hv;
    }
    w
}

/// Device bytes one packed row needs across the activation buffers of a forward pass.
pub fn bytes_per_row(c: &ModelConfig, kv: KvDtype, p: Precision) -> usize {
    let d = c.hidden_size;
    let e = p.elem_bytes();
    let w = widths(c);
    let kv_bytes = kv.bytes_per_token_per_layer(c.num_kv_heads, c.head_dim);
    4 * 7 // token, position, window, scored row, target, last-layer row, scored among those
        + 4 * d // residual stream x (f32)
        + 4 * d // the last layer's rows of x, compacted (f32)
        + e * d // normed input of a GEMM
        + 4 * w.scratch // qkv, gate/up or Gated DeltaNet projection (f32, one buffer)
        + 4 * w.q // rotated queries, or the State's read-out (f32)
        + kv_bytes + 64 // stored keys and values (+ rounding slack)
        + 2 * c.num_kv_heads * (4 + c.head_dim.div_ceil(16)) // their f32 scales and u8 block scales
        + e * w.attn // attention output, or the gated norm's output
        + e * w.act // SwiGLU output
        + 4 * (w.conv + w.gates) // Gated DeltaNet conv output and gates
        + 4 * w.router + e * w.moe_in + 4 * w.moe_out // a sparse MoE block's buffers
        + moe_group_per_row(c) // its grouping by expert
        + 8 // the per-window spans of the State kernels (at most one window per row)
}

/// Where the arrays of a MoE block's grouping by expert lie in the pass's group buffer, for
/// `rows` tokens (byte offsets). The routing counts come first so that every layer of a
/// pass, whatever its rows, adds to the same place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeGroupLayout {
    /// Tokens, and chunks of [`super::launch::MOE_GROUP_ROWS`] of them.
    pub rows: usize,
    pub chunks: usize,
    /// GEMM tiles listed (used ones first, the rest marked empty).
    pub max_tiles: usize,
    /// `u64 [E]`: routed rows per expert, summed over the pass's MoE layers.
    pub routed: usize,
    /// `int4 [max_tiles]`: (expert, first routed row, rows, 0).
    pub tiles: usize,
    /// `i32 [rows · k]`: each routed row's token.
    pub src: usize,
    /// `i32 [rows, k]` each: a token's routed rows and choices, its experts in index order.
    pub slot: usize,
    pub pick: usize,
    /// `i32 [chunks, E]`: counts per chunk, then each (chunk, expert)'s first routed row.
    pub base: usize,
    /// `i32 [E + 1]`: each expert's first routed row.
    pub offsets: usize,
    /// The whole buffer.
    pub bytes: usize,
}

impl MoeGroupLayout {
    pub fn new(rows: usize, k: usize, experts: usize) -> MoeGroupLayout {
        let routed_rows = rows * k;
        let chunks = rows.div_ceil(super::launch::MOE_GROUP_ROWS);
        let max_tiles = super::launch::moe_max_tiles(routed_rows, experts);
        let routed = 0;
        let tiles = (8 * experts).next_multiple_of(16);
        let src = tiles + 16 * max_tiles;
        let slot = src + 4 * routed_rows;
        let pick = slot + 4 * routed_rows;
        let base = pick + 4 * routed_rows;
        let offsets = base + 4 * chunks * experts;
        MoeGroupLayout {
            rows,
            chunks,
            max_tiles,
            routed,
            tiles,
            src,
            slot,
            pick,
            base,
            offsets,
            bytes: offsets + 4 * (experts + 1),
        }
    }
}

/// Bytes of a forward pass's MoE grouping buffer for `rows` tokens ([`MoeGroupLayout`]; 0
/// for a dense model).
pub fn moe_group_bytes(c: &ModelConfig, rows: usize) -> usize {
    c.moe.as_ref().map_or(0, |m| {
        MoeGroupLayout::new(rows, m.num_experts_per_tok, m.num_experts).bytes
    })
}

/// The most rows one pass may hold so that the expert GEMMs' tile list fits a grid's y
/// dimension (65,535): `usize::MAX` for a dense model.
pub fn moe_max_rows(c: &ModelConfig) -> usize {
    c.moe.as_ref().map_or(usize::MAX, |m| {
        65_535usize.saturating_sub(m.num_experts + 1) * super::launch::MOE_TILE_ROWS
            / m.num_experts_per_tok.max(1)
    })
}

/// The per-row part of a bound on [`moe_group_bytes`]: `rows · this + moe_group_fixed`
/// is at least `moe_group_bytes(rows)` for every `rows`.
fn moe_group_per_row(c: &ModelConfig) -> usize {
    c.moe.as_ref().map_or(0, |m| {
        let (e, k) = (m.num_experts, m.num_experts_per_tok);
        (16 * k).div_ceil(super::launch::MOE_TILE_ROWS)
            + 4 * 3 * k
            + 4 * e.div_ceil(super::launch::MOE_GROUP_ROWS)
    })
}

/// The fixed part of that bound (the `+ 1`s of the divisions rounded up, and the
/// per-expert arrays).
pub fn moe_group_fixed(c: &ModelConfig) -> usize {
    c.moe.as_ref().map_or(0, |m| 32 * m.num_experts + 32)
}

/// What the head computes per pass, which decides its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadKind {
    /// The run's log-probabilities (and, when asked, its final-normed rows read back).
    Plain,
    /// Also a saved reference's rows through the same head, compared position by position
    /// (`--kld-base`): a second logits chunk, the reference's rows and a running
    /// [`PAIR_ROW_BYTES`] record per scored row.
    Paired,
}

/// Bytes of one row's running record in a paired head (`PairRow` in `kernels/head.cu`).
pub const PAIR_ROW_BYTES: usize = 232;
/// Bytes of one row's finished comparison (twelve 4-byte fields, `head_pair_finish`).
pub const PAIR_OUT_BYTES: usize = 48;

/// How a batch uses device memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemPlan {
    /// What the head computes (its buffers are planned for it).
    pub head: HeadKind,
    /// Packed rows one forward pass may hold.
    pub max_rows: usize,
    /// Scored rows per head GEMM.
    pub head_rows: usize,
    /// Vocabulary entries per head GEMM (the logits chunk is head_rows x vocab_chunk f32).
    pub vocab_chunk: usize,
    /// Bytes the plan allocates per forward pass at max_rows.
    pub planned_bytes: usize,
}

/// Rows past which a bigger batch gains nothing (every GEMM already fills the device).
pub const MAX_ROWS_CAP: usize = 65_536;
/// Most windows in one forward pass.
pub const MAX_WINDOWS: usize = 4096;
/// Scored rows per head GEMM, at most.
pub const HEAD_ROWS_CAP: usize = 16_384;
/// Device memory kept free for cuBLAS workspaces, the driver and fragmentation.
pub const RESERVE_BYTES: usize = 1 << 30;

/// Splits `free` device bytes (measured after the weights are resident) between the head's
/// logits chunk and the activation buffers. `longest` is the longest window to score; a
/// batch always holds at least one.
pub fn plan_memory(
    c: &ModelConfig,
    kv: KvDtype,
    p: Precision,
    free: usize,
    longest: usize,
    head: HeadKind,
) -> Result<MemPlan> {
    let per_row = bytes_per_row(c, kv, p);
    // Bytes that do not grow with the rows: the RoPE tables and the MoE grouping's fixed part.
    let fixed = rope_bytes(c, longest) + moe_group_fixed(c);
    let budget = free
        .saturating_sub(RESERVE_BYTES.min(free / 8))
        .saturating_sub(fixed);
    // Head: up to an eighth of the budget, at most 2 GiB, at least one row x 1024 entries.
    let head_budget = (budget / 8).clamp(4 * 1024, 2 << 30);
    let vocab = c.vocab_size;
    let paired = head == HeadKind::Paired;
    let per_head_row = 4 + 8 + 4 + 4 // running max, sum, target logit, output
        + if paired {
            // The reference's rows, the running record and the finished comparison.
            p.elem_bytes() * c.hidden_size + PAIR_ROW_BYTES + PAIR_OUT_BYTES
        } else {
            0
        };
    // Logits chunks alive at once: the run's, and the reference's in a paired head.
    let chunks = if paired { 2 } else { 1 };
    let act_budget = budget.saturating_sub(head_budget);
    let max_rows = (act_budget / (per_row + per_head_row))
        .min(MAX_ROWS_CAP)
        .min(moe_max_rows(c));
    if longest > moe_max_rows(c) {
        bail!(
            "a window of {longest} tokens is more than one pass's expert GEMMs take for this MoE model ({} tokens at most: the tile list must fit a grid's 65,535 blocks)",
            moe_max_rows(c)
        );
    }
    if max_rows < longest.max(1) {
        bail!(
            "not enough free device memory: a window of {longest} tokens needs about {} MiB of activations, {} MiB are free after the weights",
            ((longest * (per_row + per_head_row) + head_budget + RESERVE_BYTES.min(free / 8)) >> 20),
            free >> 20
        );
    }
    // As many rows per head GEMM as leave each logits chunk 256 entries within the head's
    // budget (a floor on the chunk alone would overrun it on a small device).
    let head_rows = max_rows
        .min(HEAD_ROWS_CAP)
        .min((head_budget / (4 * chunks * 256)).max(1));
    let chunk = (head_budget / (4 * chunks * head_rows)).max(256);
    let vocab_chunk = if chunk >= vocab {
        vocab
    } else {
        (chunk / 256 * 256).max(256)
    };
    let planned =
        max_rows * (per_row + per_head_row) + 4 * chunks * head_rows * vocab_chunk + fixed;
    Ok(MemPlan {
        head,
        max_rows,
        head_rows,
        vocab_chunk,
        planned_bytes: planned,
    })
}

/// Device bytes of the RoPE cos/sin tables for windows of up to `longest` tokens (the model
/// keeps `next_power_of_two(longest)` positions of `rotary_dim / 2` f32 each, twice).
pub fn rope_bytes(c: &ModelConfig, longest: usize) -> usize {
    2 * 4 * longest.max(1).next_power_of_two() * (c.rotary_dim() / 2)
}

/// Bytes of each activation buffer the CUDA model allocates for a plan (the model allocates
/// exactly these; [`plan_memory`] budgets at least their sum). Stored K/V arrays are sized
/// for the widest representation, so one allocation serves every KV dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferSizes {
    pub x: usize,
    /// The last layer's rows of `x`, compacted (`model::pass::PassPlan::last_layer`).
    pub x_last: usize,
    pub h: usize,
    pub scratch: usize,
    pub q: usize,
    /// Each of K and V: payload, f32 scales, u8 block scales.
    pub kv_data: usize,
    pub kv_scale: usize,
    pub kv_bscale: usize,
    pub attn: usize,
    pub act: usize,
    pub logits: usize,
    pub run_max: usize,
    pub run_sum: usize,
    pub run_target: usize,
    pub out: usize,
    pub err: usize,
    /// Gated DeltaNet conv output and gates (0 without such layers).
    pub conv: usize,
    pub gates: usize,
    /// A sparse MoE block's router, gathered inputs and expert outputs (0 without one).
    pub router: usize,
    pub moe_in: usize,
    pub moe_out: usize,
    /// Its grouping of the routed rows by expert ([`moe_group_bytes`]).
    pub moe_group: usize,
    /// A paired head's reference rows (precision), its logits chunk, running records and
    /// finished comparisons (0 in a plain head).
    pub h_ref: usize,
    pub logits_ref: usize,
    pub pair_state: usize,
    pub pair_out: usize,
}

pub fn buffer_sizes(
    c: &ModelConfig,
    p: Precision,
    rows: usize,
    head_rows: usize,
    vocab_chunk: usize,
    head: HeadKind,
) -> BufferSizes {
    let paired = usize::from(head == HeadKind::Paired);
    let d = c.hidden_size;
    let e = p.elem_bytes();
    let w = widths(c);
    let n = rows * c.num_kv_heads;
    let (kv_data, _, _) = kv_arrays(Elem::F32, n, c.head_dim);
    let (_, kv_scale, _) = kv_arrays(Elem::Int8, n, c.head_dim);
    let (_, _, kv_bscale) = kv_arrays(Elem::Nvfp4, n, c.head_dim);
    BufferSizes {
        x: rows * d * 4,
        x_last: rows * d * 4,
        h: rows * d * e,
        scratch: rows * w.scratch * 4,
        q: rows * w.q * 4,
        kv_data,
        kv_scale,
        kv_bscale,
        attn: rows * w.attn * e,
        act: rows * w.act * e,
        logits: head_rows * vocab_chunk * 4,
        run_max: rows * 4,
        run_sum: rows * 8,
        run_target: rows * 4,
        out: rows * 4,
        // The first non-finite K/V record, then the first non-finite Gated DeltaNet record.
        err: 16,
        conv: rows * w.conv * 4,
        gates: rows * w.gates * 4,
        router: rows * w.router * 4,
        moe_in: rows * w.moe_in * e,
        moe_out: rows * w.moe_out * 4,
        moe_group: moe_group_bytes(c, rows),
        h_ref: paired * rows * d * e,
        logits_ref: paired * head_rows * vocab_chunk * 4,
        pair_state: paired * rows * PAIR_ROW_BYTES,
        pair_out: paired * rows * PAIR_OUT_BYTES,
    }
}

impl BufferSizes {
    pub fn total(&self) -> usize {
        self.x
            + self.x_last
            + self.h
            + self.scratch
            + self.q
            + 2 * (self.kv_data + self.kv_scale + self.kv_bscale)
            + self.attn
            + self.act
            + self.logits
            + self.run_max
            + self.run_sum
            + self.run_target
            + self.out
            + self.err
            + self.conv
            + self.gates
            + self.router
            + self.moe_in
            + self.moe_out
            + self.moe_group
            + self.h_ref
            + self.logits_ref
            + self.pair_state
            + self.pair_out
    }
}

/// Device bytes of the weights in a precision: matrices in the GEMM element type, the
/// embedding too (the head reads it when tied), norm vectors and biases in f32.
pub fn weight_bytes(c: &ModelConfig, p: Precision) -> usize {
    let e = p.elem_bytes();
    c.expected_tensors()
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            if stored_f32(name, shape) {
                4 * n
            } else {
                e * n
            }
        })
        .sum()
}

/// Most dynamic shared memory a kernel may take (sm_90: 227 KiB per block).
pub const MAX_DYNAMIC_SMEM: usize = 227 << 10;

/// Refuses Gated DeltaNet shapes the model's kernels cannot take on a device whose blocks
/// may opt in to `device_smem` bytes of dynamic shared memory: the chunked rule holds each
/// window's State `S[Dk, Dv]` in shared memory with the chunk's work arrays (Dk = Dv = 128,
/// every released Qwen3.5 / Qwen3-Next, takes 194 KiB: an sm_90 GPU, not an A100's 163 KiB
/// or an sm_89's 99 KiB), and the gated norm one warp per head. Also keeps the non-finite
/// records' flat index (`pos · width`, at most [`MAX_ROWS_CAP`] positions) inside its 37
/// bits.
pub fn check_delta_net(h: &crate::model::config::HybridConfig, device_smem: usize) -> Result<()> {
    let (dk, dv) = (h.linear_key_head_dim, h.linear_value_head_dim);
    let max = super::launch::DELTA_CHUNKED_MAX_DIM;
    if dk > max || dv > max {
        bail!("Gated DeltaNet heads of {dk} x {dv}: the CUDA kernels take key and value head dims up to {max}");
    }
    let need = super::launch::delta_chunked_smem_with(dk, dv, true) as usize;
    if !super::launch::delta_chunked_state_in_shared(dk, dv) {
        bail!(
            "Gated DeltaNet heads of {dk} x {dv}: the State and the chunk's work arrays need {} KiB of shared memory, more than the CUDA kernels take ({} KiB)",
            need >> 10,
            MAX_DYNAMIC_SMEM >> 10
        );
    }
    if need > device_smem {
        bail!(
            "Gated DeltaNet heads of {dk} x {dv}: the State and the chunk's work arrays need {} KiB of shared memory per block, more than this GPU allows ({} KiB; sm_90 allows 227)",
            need >> 10,
            device_smem >> 10
        );
    }
    let width = h.conv_dim() + h.value_dim() + 2 * h.linear_num_value_heads;
    if (MAX_ROWS_CAP as u64) * (width as u64) >= 1 << 37 {
        bail!("Gated DeltaNet projections of {width} channels are wider than the CUDA path takes");
    }
    Ok(())
}

/// Whether a tensor lives on the device in f32 whatever the precision: vectors (norms,
/// biases, a Gated DeltaNet's gates) and the depthwise conv's taps.
pub fn stored_f32(name: &str, shape: &[usize]) -> bool {
    crate::artifact::is_vector_tensor(name, shape) || name.ends_with("conv1d.weight")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Family;

    fn cfg(
        layers: usize,
        d: usize,
        hq: usize,
        hkv: usize,
        hd: usize,
        f: usize,
        vocab: usize,
    ) -> ModelConfig {
        ModelConfig::for_test(Family::Qwen3, layers, d, hq, hkv, hd, f, vocab)
    }

    fn qwen3_8b() -> ModelConfig {
        cfg(36, 4096, 32, 8, 128, 12288, 151_936)
    }

    #[test]
    fn tiles_cover_every_row_once_and_start_with_the_longest() {
        let wins = [(0usize, 130usize), (130, 64), (194, 1), (195, 200)];
        for per in [16, 64] {
            let tiles = attention_tiles(&wins, per);
            let mut seen = vec![0u32; 395];
            for t in &tiles {
                assert!(t.rows >= 1 && t.rows as usize <= per);
                let w = wins
                    .iter()
                    .find(|w| w.0 as u32 == t.seq_row)
                    .expect("tile in a window");
                assert!(t.q_row >= t.seq_row && (t.q_row + t.rows) as usize <= w.0 + w.1);
                for r in t.q_row..t.q_row + t.rows {
                    seen[r as usize] += 1;
                }
            }
            assert!(
                seen.iter().all(|&s| s == 1),
                "every row in exactly one tile"
            );
            assert!(
                tiles.windows(2).all(|p| p[0].keys() >= p[1].keys()),
                "longest first"
            );
            assert_eq!(tiles[0].keys(), 200);
        }
        assert_eq!(
            AttnTile {
                q_row: 70,
                rows: 5,
                seq_row: 64
            }
            .to_int4(),
            [70, 5, 64, 0]
        );
    }

    #[test]
    fn batches_are_consecutive_and_bounded() {
        let lens = [4096, 4096, 4096, 1000, 4096, 17];
        let b = pack_batches(&lens, 9000, 100).unwrap();
        assert_eq!(b, vec![0..2, 2..4, 4..6]);
        let b = pack_batches(&lens, 100_000, 2).unwrap();
        assert_eq!(b, vec![0..2, 2..4, 4..6]);
        let b = pack_batches(&lens, 100_000, 100).unwrap();
        assert_eq!(b, vec![0..6]);
        assert!(pack_batches(&[], 10, 10).unwrap().is_empty());
        let e = pack_batches(&[5, 11], 10, 10).unwrap_err().to_string();
        assert!(e.contains("window of 11 tokens"), "{e}");
        // Every window lands in exactly one batch, in order.
        let lens: Vec<usize> = (0..50).map(|i| 1 + (i * 37) % 300).collect();
        let b = pack_batches(&lens, 700, 7).unwrap();
        let flat: Vec<usize> = b.iter().flat_map(|r| r.clone()).collect();
        assert_eq!(flat, (0..50).collect::<Vec<_>>());
        for r in &b {
            assert!(lens[r.clone()].iter().sum::<usize>() <= 700 && r.len() <= 7);
        }
    }

    #[test]
    fn kernel_choice_follows_precision_and_head_dim() {
        assert_eq!(
            AttnKernel::choose(Precision::Bf16, 128),
            AttnKernel::Mma { head_dim: 128 }
        );
        assert_eq!(
            AttnKernel::choose(Precision::Bf16, 64),
            AttnKernel::Mma { head_dim: 64 }
        );
        assert_eq!(
            AttnKernel::choose(Precision::Bf16, 256),
            AttnKernel::Mma { head_dim: 256 }
        );
        assert_eq!(AttnKernel::choose(Precision::Bf16, 8), AttnKernel::F32);
        assert_eq!(AttnKernel::choose(Precision::Bf16, 80), AttnKernel::F32);
        assert_eq!(AttnKernel::choose(Precision::F32, 128), AttnKernel::F32);
        assert_eq!(
            AttnKernel::Mma { head_dim: 64 }.entry(KvDtype::K8v4),
            "attn_mma_k8v4_d64"
        );
        assert_eq!(AttnKernel::F32.entry(KvDtype::Nvfp4), "attn_f32_nvfp4");
        assert_eq!(
            AttnKernel::F32.dynamic_smem(128),
            4 * (32 * 129 + 32 * 128 + 16 * 128)
        );
        assert_eq!(qkv_entry(KvDtype::Bf16, 64).unwrap(), "qkv_prep_bf16_nk2");
        assert_eq!(qkv_entry(KvDtype::Int8, 8).unwrap(), "qkv_prep_int8_nk2");
        assert_eq!(qkv_entry(KvDtype::Fp8, 128).unwrap(), "qkv_prep_fp8_nk4");
        assert_eq!(qkv_entry(KvDtype::F32, 256).unwrap(), "qkv_prep_f32_nk8");
        assert!(qkv_entry(KvDtype::F32, 257).is_err());
        assert!(qkv_entry(KvDtype::F32, 0).is_err());
        assert_eq!(blocks_for(0, 256), 0);
        assert_eq!(blocks_for(257, 256), 2);
    }

    #[test]
    fn kv_arrays_hold_the_cpu_byte_counts() {
        for elem in Elem::ALL {
            for hd in [8, 33, 64, 80, 128] {
                let n = 1000;
                let (a, b, c) = kv_arrays(elem, n, hd);
                assert!(a + b + c >= n * elem.bytes_per_vector(hd), "{elem:?} {hd}");
                assert!(a + b + c <= n * elem.bytes_per_vector(hd) + 3 * 256);
                assert!(a % 256 == 0 && b % 256 == 0 && c % 256 == 0);
            }
        }
    }

    #[test]
    fn memory_plan_fits_qwen3_8b_on_an_h200() {
        let c = qwen3_8b();
        let free = 139usize * (1 << 30) - weight_bytes(&c, Precision::Bf16);
        let p = plan_memory(
            &c,
            KvDtype::Bf16,
            Precision::Bf16,
            free,
            4096,
            HeadKind::Plain,
        )
        .unwrap();
        assert!(p.max_rows >= 4 * 4096, "{p:?}");
        assert!(p.max_rows <= MAX_ROWS_CAP);
        assert!(p.planned_bytes <= free, "{p:?}");
        assert!(p.vocab_chunk.is_multiple_of(256) && p.vocab_chunk <= c.vocab_size);
        assert!(4 * p.head_rows * p.vocab_chunk <= 2 << 30);
        // Weights: about 16.4 GB in bf16.
        let wb = weight_bytes(&c, Precision::Bf16) as f64;
        assert!((16.0e9..16.8e9).contains(&wb), "{wb}");
    }

    #[test]
    fn memory_plan_scales_down_and_refuses_what_cannot_fit() {
        let c = qwen3_8b();
        let p = plan_memory(
            &c,
            KvDtype::Nvfp4,
            Precision::Bf16,
            4 << 30,
            4096,
            HeadKind::Plain,
        )
        .unwrap();
        assert!(p.max_rows >= 4096 && p.max_rows < MAX_ROWS_CAP / 2, "{p:?}");
        assert!(p.planned_bytes <= 4 << 30);
        let e = plan_memory(
            &c,
            KvDtype::Bf16,
            Precision::Bf16,
            256 << 20,
            4096,
            HeadKind::Plain,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not enough free device memory"), "{e}");
        // A small model with a small vocabulary takes the whole vocabulary in one chunk.
        let small = cfg(2, 16, 4, 2, 8, 32, 1000);
        let p = plan_memory(
            &small,
            KvDtype::F32,
            Precision::F32,
            8 << 30,
            64,
            HeadKind::Plain,
        )
        .unwrap();
        assert_eq!(p.vocab_chunk, 1000);
        assert_eq!(p.max_rows, MAX_ROWS_CAP);
    }

    #[test]
    fn the_27b_hybrid_fits_an_h200_with_windows_of_4096() {
        let c = crate::model::presets::preset("qwen3_5-27b").unwrap();
        // bf16 matrices, f32 vectors and conv taps: about 53.8 GB.
        let wb = weight_bytes(&c, Precision::Bf16);
        assert!((53.0e9..54.5e9).contains(&(wb as f64)), "{wb}");
        let free = 139usize * (1 << 30) - wb;
        let p = plan_memory(
            &c,
            KvDtype::Bf16,
            Precision::Bf16,
            free,
            4096,
            HeadKind::Plain,
        )
        .unwrap();
        assert!(p.max_rows >= 4 * 4096, "{p:?}");
        // A row needs the Gated DeltaNet projection (16,480 f32) in the GEMM scratch.
        assert!(bytes_per_row(&c, KvDtype::Bf16, Precision::Bf16) > 4 * 16_480);
    }

    /// The spec's long-context profile (`--context 65536 --stride 32768`): on an H200 (139
    /// GiB) one window of 65536 tokens fits in one pass beside the weights of the 8B and of the
    /// 27B hybrid, in either arithmetic, and the allocations stay within the plan.
    #[test]
    fn the_long_context_profile_fits_an_h200() {
        let h200 = 139usize << 30;
        for (name, p, fits) in [
            ("qwen3-8b", Precision::Bf16, true),
            ("qwen3-8b", Precision::F32, true),
            ("qwen3_5-27b", Precision::Bf16, true),
            ("qwen3_5-27b", Precision::F32, true),
        ] {
            let c = crate::model::presets::preset(name).unwrap();
            let free = h200.saturating_sub(weight_bytes(&c, p));
            // The model plans its K/V buffers for f32, which serves every KV format.
            {
                let kv = KvDtype::F32;
                let plan = plan_memory(&c, kv, p, free, 65536, HeadKind::Plain);
                assert_eq!(plan.is_ok(), fits, "{name} {} {kv:?}: {plan:?}", p.name());
                if let Ok(plan) = plan {
                    assert_eq!(plan.max_rows, 65536, "{name}: one whole window per pass");
                    let used = buffer_sizes(
                        &c,
                        p,
                        plan.max_rows,
                        plan.head_rows,
                        plan.vocab_chunk,
                        plan.head,
                    )
                    .total()
                        + 4 * 7 * plan.max_rows
                        + rope_bytes(&c, 65536);
                    assert!(
                        used <= plan.planned_bytes && plan.planned_bytes <= free,
                        "{name} {} {kv:?}: used {used} planned {} free {free}",
                        p.name(),
                        plan.planned_bytes
                    );
                }
            }
        }
    }

    /// The MoE grouping buffer: the plan's per-row part plus its fixed part bound the bytes
    /// at every row count (the ceilings' worst cases included), the arrays do not overlap
    /// and the int4 / u64 arrays are aligned; the tile list fits a grid at the row cap, and
    /// a window past it is refused with its own message.
    #[test]
    fn the_moe_grouping_is_planned_and_bounded() {
        let c = crate::model::presets::preset("qwen3_5-35b-a3b").unwrap();
        let (per_row, fixed) = (moe_group_per_row(&c), moe_group_fixed(&c));
        for rows in [1, 2, 7, 63, 64, 65, 255, 256, 257, 4096, 32_768, 65_536] {
            let l = MoeGroupLayout::new(rows, 8, 256);
            assert_eq!(l.bytes, moe_group_bytes(&c, rows));
            assert!(l.bytes <= rows * per_row + fixed, "{rows} rows");
            let order = [
                l.routed, l.tiles, l.src, l.slot, l.pick, l.base, l.offsets, l.bytes,
            ];
            assert!(order.windows(2).all(|w| w[0] <= w[1]), "{rows}: {l:?}");
            assert_eq!(l.tiles - l.routed, 8 * 256);
            assert_eq!(l.tiles % 16, 0);
            assert_eq!(l.src - l.tiles, 16 * l.max_tiles);
        }
        assert_eq!(
            MoeGroupLayout::new(3, 2, 5).tiles,
            48,
            "u64 [5] rounded up to 16 bytes"
        );
        let cap = moe_max_rows(&c);
        assert!(
            cap >= MAX_ROWS_CAP,
            "the 35B-A3B at 8 of 256 experts: {cap}"
        );
        let mut wide = c.clone();
        wide.moe.as_mut().unwrap().num_experts_per_tok = 64;
        let cap = moe_max_rows(&wide);
        // At the cap the tile list fits whatever the rounding; a little past it, it would not.
        assert!(super::super::launch::moe_max_tiles(cap * 64, 256) <= 65_535);
        assert!(super::super::launch::moe_max_tiles((cap + 2) * 64, 256) > 65_535);
        let e = plan_memory(
            &wide,
            KvDtype::F32,
            Precision::Bf16,
            1 << 40,
            cap + 1,
            HeadKind::Plain,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("expert GEMMs") && e.contains(&format!("{cap} tokens")),
            "{e}"
        );
        assert!(plan_memory(
            &c,
            KvDtype::F32,
            Precision::Bf16,
            1 << 40,
            4096,
            HeadKind::Plain
        )
        .is_ok());
        assert_eq!(
            moe_group_bytes(&crate::model::presets::preset("qwen3-8b").unwrap(), 100),
            0
        );
    }

    #[test]
    fn delta_net_shapes_the_kernels_cannot_take_are_refused() {
        let mut h = crate::model::presets::preset("qwen3_5-27b")
            .unwrap()
            .hybrid
            .unwrap();
        check_delta_net(&h, MAX_DYNAMIC_SMEM).unwrap(); // 128 x 128 on an H200
                                                        // The same model on an A100 (163 KiB per block) or an sm_89 GPU (99 KiB): refused
                                                        // at load with the device's limit, not at the first launch.
        for kib in [163usize, 99] {
            let e = check_delta_net(&h, kib << 10).unwrap_err().to_string();
            assert!(
                e.contains("128 x 128") && e.contains(&format!("({kib} KiB")),
                "{e}"
            );
        }
        (h.linear_key_head_dim, h.linear_value_head_dim) = (256, 256);
        let e = check_delta_net(&h, MAX_DYNAMIC_SMEM)
            .unwrap_err()
            .to_string();
        assert!(e.contains("256 x 256") && e.contains("227 KiB"), "{e}");
        // Small enough for shared memory, wider than a thread's tile of State columns.
        (h.linear_key_head_dim, h.linear_value_head_dim) = (64, 300);
        let e = check_delta_net(&h, MAX_DYNAMIC_SMEM)
            .unwrap_err()
            .to_string();
        assert!(e.contains("64 x 300") && e.contains("up to 256"), "{e}");
    }

    #[test]
    fn precision_names_round_trip() {
        for p in [Precision::Bf16, Precision::F32] {
            assert_eq!(Precision::parse(p.name()).unwrap(), p);
        }
        assert!(Precision::parse("tf32")
            .unwrap_err()
            .to_string()
            .contains("bf16, f32"));
    }

    /// The plan covers every buffer the model allocates for it, the per-pass index arrays
    /// and the RoPE tables, for shapes with many KV heads (where the scale arrays weigh
    /// most) and long windows.
    #[test]
    fn the_plan_covers_every_allocation() {
        let mut small = crate::model::presets::preset("smollm2-135m").unwrap();
        small.num_layers = 2;
        let mut wide = crate::model::presets::preset("qwen3-8b").unwrap();
        wide.num_kv_heads = 32;
        wide.head_dim = 16;
        wide.num_heads = 32;
        // Many small KV heads and a narrow MLP: the scale arrays outweigh any slack.
        let mut narrow = crate::model::presets::preset("qwen3-8b").unwrap();
        (narrow.hidden_size, narrow.intermediate_size) = (64, 8);
        (narrow.num_heads, narrow.num_kv_heads, narrow.head_dim) = (16, 16, 4);
        // The 27B hybrid: Gated DeltaNet buffers wider than attention's, a gated q.
        let hybrid = crate::model::presets::preset("qwen3_5-27b").unwrap();
        // The 35B-A3B sparse hybrid: the router and the rows grouped by expert, k · 2I =
        // 8 · 1024 wide per token, four times the model width.
        let moe = crate::model::presets::preset("qwen3_5-35b-a3b").unwrap();
        for c in [
            small,
            wide,
            narrow,
            crate::model::presets::preset("llama3-8b").unwrap(),
            hybrid.with_layers(4),
            hybrid,
            moe.with_layers(4),
            moe,
        ] {
            // Each configuration must fit at least once, or it would check nothing.
            let mut planned = 0;
            for (p, head) in [Precision::Bf16, Precision::F32]
                .into_iter()
                .flat_map(|p| [(p, HeadKind::Plain), (p, HeadKind::Paired)])
            {
                for (free, longest) in [
                    (48usize << 20, 64usize),
                    (1 << 30, 4096),
                    (8 << 30, 1),
                    (80 << 30, 32768),
                    (120 << 30, 65536),
                ] {
                    let Ok(plan) = plan_memory(&c, KvDtype::F32, p, free, longest, head) else {
                        continue;
                    };
                    planned += 1;
                    let z = buffer_sizes(
                        &c,
                        p,
                        plan.max_rows,
                        plan.head_rows,
                        plan.vocab_chunk,
                        plan.head,
                    );
                    let ints = 4 * 7 * plan.max_rows;
                    let used = z.total() + ints + rope_bytes(&c, longest);
                    assert!(
                        used <= plan.planned_bytes,
                        "{:?} {} free {free} longest {longest}: allocates {used} > planned {}",
                        c.family,
                        p.name(),
                        plan.planned_bytes
                    );
                    assert!(plan.planned_bytes <= free, "plan exceeds free memory");
                }
            }
            assert!(planned > 0, "{:?} never fits", c.family);
        }
    }
}
