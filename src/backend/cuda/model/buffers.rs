//! The CUDA model's per-pass device buffers: activations for up to a planned number of
//! packed rows (`plan::plan_memory`, sized from free device memory), the stored K/V, the
//! head's running sums, and the RoPE tables. Allocated once and grown only when a longer
//! window needs it. (The CPU model allocates per window: `backend/cpu/model/layer.rs`'s
//! `Bufs`.)

use super::moe::MoeBufs;
use super::CudaModel;
use crate::backend::cpu::rope::RopeTable;
use crate::backend::cuda::device::DevBuf;
use crate::backend::cuda::launch::KvArg;
use crate::backend::cuda::plan::{self, HeadKind, MemPlan};
use crate::kv::KvDtype;
use anyhow::Result;

/// A stored K or V tensor: payload, f32 scales, u8 block scales.
pub(super) struct KvBufs {
    data: DevBuf,
    scale: DevBuf,
    bscale: DevBuf,
}

impl KvBufs {
    /// The tensor as a kernel argument, with its per-tensor scale for this layer
    /// ([`KvDtype::layer_scales`]).
    pub(super) fn arg(&self, tscale: f32) -> KvArg {
        KvArg {
            data: self.data.ptr,
            scale: self.scale.ptr,
            bscale: self.bscale.ptr,
            tscale,
        }
    }
}

/// Activation buffers for up to `plan.max_rows` packed rows.
pub(super) struct Buffers {
    pub(super) plan: MemPlan,
    /// The residual stream `[rows, d]` f32.
    pub(super) x: DevBuf,
    /// The last layer's rows of `x`, compacted (`PassPlan::last_layer`): its MLP and the
    /// head run on them only.
    pub(super) x_last: DevBuf,
    pub(super) h: DevBuf,
    /// qkv GEMM output, later the gate/up GEMM output (never alive together).
    pub(super) scratch: DevBuf,
    pub(super) q: DevBuf,
    pub(super) k: KvBufs,
    pub(super) v: KvBufs,
    pub(super) attn: DevBuf,
    pub(super) act: DevBuf,
    pub(super) logits: DevBuf,
    pub(super) run_max: DevBuf,
    pub(super) run_sum: DevBuf,
    pub(super) run_target: DevBuf,
    pub(super) out: DevBuf,
    /// [2] u64: the first non-finite K/V record, then the first Gated DeltaNet one.
    pub(super) err: DevBuf,
    /// A Gated DeltaNet's conv output `c[rows, conv_dim]` and gates `beta, g [rows, Hv]`.
    pub(super) conv: DevBuf,
    pub(super) gates: DevBuf,
    /// A sparse MoE block's buffers (models with one).
    pub(super) moe: Option<MoeBufs>,
    /// A paired head's buffers (`--kld-base`; planned with [`HeadKind::Paired`]).
    pub(super) pair: Option<PairBufs>,
}

/// What a paired head adds: the saved reference's final-normed rows `h_ref[rows, d]`
/// (precision), its logits chunk `[head_rows, vocab_chunk]` f32, one running record per
/// scored row and its eight finished fields.
pub(super) struct PairBufs {
    pub(super) h_ref: DevBuf,
    pub(super) logits_ref: DevBuf,
    pub(super) state: DevBuf,
    pub(super) out: DevBuf,
}

pub(super) struct Rope {
    positions: usize,
    pub(super) cos: DevBuf,
    pub(super) sin: DevBuf,
}

/// The buffers of the last pass, kept for the next one (reallocated only to grow).
#[derive(Default)]
pub(super) struct State {
    pub(super) bufs: Option<Buffers>,
    pub(super) rope: Option<Rope>,
}

impl CudaModel {
    /// Buffers for passes of at least `longest` rows with a `head` of that kind, planned
    /// from free device memory (a paired plan serves plain passes too).
    pub(super) fn ensure_buffers(
        &self,
        st: &mut State,
        longest: usize,
        head: HeadKind,
    ) -> Result<()> {
        if let Some(b) = &st.bufs {
            if b.plan.max_rows >= longest && (head == HeadKind::Plain || b.plan.head == head) {
                return Ok(());
            }
        }
        st.bufs = None; // free before planning again
        let (free, _) = self.gpu.mem_info()?;
        // Stored K/V buffers are sized for the widest representation (f32), so one
        // allocation serves every KV dtype.
        let p = plan::plan_memory(
            &self.config,
            KvDtype::F32,
            self.precision,
            free,
            longest,
            head,
        )?;
        let z = plan::buffer_sizes(
            &self.config,
            self.precision,
            p.max_rows,
            p.head_rows,
            p.vocab_chunk,
            p.head,
        );
        let g = &self.gpu;
        let kvbufs = || -> Result<KvBufs> {
            Ok(KvBufs {
                data: g.alloc(z.kv_data)?,
                scale: g.alloc(z.kv_scale)?,
                bscale: g.alloc(z.kv_bscale)?,
            })
        };
        let bufs = Buffers {
            x: g.alloc(z.x)?,
            x_last: g.alloc(z.x_last)?,
            h: g.alloc(z.h)?,
            scratch: g.alloc(z.scratch)?,
            q: g.alloc(z.q)?,
            k: kvbufs()?,
            v: kvbufs()?,
            attn: g.alloc(z.attn)?,
            act: g.alloc(z.act)?,
            logits: g.alloc(z.logits)?,
            run_max: g.alloc(z.run_max)?,
            run_sum: g.alloc(z.run_sum)?,
            run_target: g.alloc(z.run_target)?,
            out: g.alloc(z.out)?,
            err: g.alloc(z.err)?,
            conv: g.alloc(z.conv)?,
            gates: g.alloc(z.gates)?,
            moe: match self.config.moe {
                Some(_) => Some(MoeBufs {
                    router: g.alloc(z.router)?,
                    input: g.alloc(z.moe_in)?,
                    out: g.alloc(z.moe_out)?,
                    group: g.alloc(z.moe_group)?,
                }),
                None => None,
            },
            pair: match p.head {
                HeadKind::Paired => Some(PairBufs {
                    h_ref: g.alloc(z.h_ref)?,
                    logits_ref: g.alloc(z.logits_ref)?,
                    state: g.alloc(z.pair_state)?,
                    out: g.alloc(z.pair_out)?,
                }),
                HeadKind::Plain => None,
            },
            plan: p,
        };
        crate::ui::debug(format!(
            "CUDA buffers: {} rows per pass, head {} rows x {} vocab, {} MiB",
            bufs.plan.max_rows,
            bufs.plan.head_rows,
            bufs.plan.vocab_chunk,
            bufs.plan.planned_bytes >> 20
        ));
        st.bufs = Some(bufs);
        Ok(())
    }

    /// RoPE tables for positions `0..positions` (a power of two at least that).
    pub(super) fn ensure_rope(&self, st: &mut State, positions: usize) -> Result<()> {
        if st.rope.as_ref().is_some_and(|r| r.positions >= positions) {
            return Ok(());
        }
        let n = positions.max(1).next_power_of_two();
        let t = RopeTable::new(&self.inv_freq, n);
        st.rope = Some(Rope {
            positions: n,
            cos: self.gpu.upload(&t.cos)?,
            sin: self.gpu.upload(&t.sin)?,
        });
        Ok(())
    }
}
