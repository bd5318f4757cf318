//! The CUDA forward pass over a batch of windows, fused with the scoring head. The twin of
//! `CpuModel::window_logprobs` (src/model/forward.rs): the same steps in the same order,
//! with several independent windows packed row after row into one pass.
//!
//! Per layer: RMSNorm → qkv GEMM → `qkv_prep` (bias, q/k norm, RoPE, K/V quantize-and-store
//! in the Main KV representation) → causal attention reading the stored K/V → o-proj GEMM
//! accumulating into the residual → RMSNorm → gate/up GEMM → SwiGLU → down GEMM
//! accumulating into the residual. Then only the rows that predict a target go through
//! the final norm and the head, one vocabulary chunk at a time.

use super::device::{DevBuf, Gpu, Target};
use super::gemm::{Blas, Mat};
use super::kernels::Program;
use super::launch::{self, Any, KvArg, Ptr};
use super::moe::{self, MoeBufs};
use super::plan::{self, AttnKernel, MemPlan, Precision};
use super::weights::{self, DeltaNet, DevWeights, Source};
use super::MemoryReport;
use crate::artifact::Artifact;
use crate::backend::cpu::rope::{inv_freq, RopeTable};
use crate::kv::KvDtype;
use crate::model::config::{ModelConfig, OutputGate};
use crate::model::layout::{Ffn, Mixer};
use crate::model::{ForwardError, Part};
use crate::score::Window;
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Why scoring stopped.
#[derive(Debug)]
pub enum ScoreError {
    /// A window failed the way the CPU reference fails (index into the windows given).
    Window { index: usize, error: ForwardError },
    /// The device failed (allocation, launch, execution).
    Device(anyhow::Error),
}

impl From<anyhow::Error> for ScoreError {
    fn from(e: anyhow::Error) -> Self {
        ScoreError::Device(e)
    }
}

/// A stored K or V tensor: payload, f32 scales, u8 block scales.
struct KvBufs {
    data: DevBuf,
    scale: DevBuf,
    bscale: DevBuf,
}

impl KvBufs {
    fn arg(&self) -> KvArg {
        KvArg {
            data: self.data.ptr,
            scale: self.scale.ptr,
            bscale: self.bscale.ptr,
        }
    }
}

/// Activation buffers for up to `plan.max_rows` packed rows.
struct Buffers {
    plan: MemPlan,
    x: DevBuf,
    h: DevBuf,
    /// qkv GEMM output, later the gate/up GEMM output (never alive together).
    scratch: DevBuf,
    q: DevBuf,
    k: KvBufs,
    v: KvBufs,
    attn: DevBuf,
    act: DevBuf,
    logits: DevBuf,
    run_max: DevBuf,
    run_sum: DevBuf,
    run_target: DevBuf,
    out: DevBuf,
    /// [2] u64: the first non-finite K/V record, then the first Gated DeltaNet one.
    err: DevBuf,
    /// A Gated DeltaNet's conv output `c[rows, conv_dim]` and gates `beta, g [rows, Hv]`.
    conv: DevBuf,
    gates: DevBuf,
    /// A sparse MoE block's buffers (models with one).
    moe: Option<MoeBufs>,
}

struct Rope {
    positions: usize,
    cos: DevBuf,
    sin: DevBuf,
}

#[derive(Default)]
struct State {
    bufs: Option<Buffers>,
    rope: Option<Rope>,
}

pub struct CudaModel {
    pub config: ModelConfig,
    pub precision: Precision,
    inv_freq: Vec<f64>,
    state: Mutex<State>,
    weights: DevWeights,
    weights_bytes: usize,
    peak_used: AtomicUsize,
    /// Most windows per forward pass (tests lower it to check batching changes nothing).
    max_windows: AtomicUsize,
    /// Routed rows per expert since the last `take_routing` (MoE models).
    routing: Option<Mutex<Vec<u64>>>,
    blas: Blas,
    gpu: Gpu,
}

impl CudaModel {
    /// Uploads the artifact's weights to device `target`, one tensor at a time (host memory
    /// holds at most one widened tensor). `progress` sees (tensors done, tensors total).
    pub fn load(
        a: &Artifact,
        target: Target,
        precision: Precision,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel> {
        Self::load_from(&Source::Artifact(a), target, precision, progress)
    }

    /// A model of `config` with the random weights `write_random_artifact` would store for
    /// `seed`, generated in memory one tensor at a time (for benchmarks of large shapes).
    pub fn load_random(
        config: &ModelConfig,
        seed: u64,
        target: Target,
        precision: Precision,
    ) -> Result<CudaModel> {
        use anyhow::Context;
        config.validate().context("random model")?;
        Self::load_from(
            &Source::random(config, seed),
            target,
            precision,
            &mut |_, _| {},
        )
    }

    fn load_from(
        a: &Source,
        target: Target,
        precision: Precision,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel> {
        let c = a.config().clone();
        if let Some(h) = &c.hybrid {
            plan::check_delta_net(h)?;
        }
        let gpu = Gpu::open_target(target)?;
        if c.head_dim > plan::MAX_HEAD_DIM {
            bail!(
                "head_dim {} is larger than the CUDA kernels take ({})",
                c.head_dim,
                plan::MAX_HEAD_DIM
            );
        }
        let need = plan::weight_bytes(&c, precision);
        let (free, _) = gpu.mem_info()?;
        if need + plan::RESERVE_BYTES.min(free / 8) > free {
            bail!(
                "{}: the weights need {} MiB in {} on the device, {} MiB are free",
                gpu.info.name,
                need >> 20,
                precision.name(),
                free >> 20
            );
        }
        let weights = weights::upload(a, &gpu, precision, progress)?;
        let weights_bytes = gpu.stats.current.load(Ordering::Relaxed);
        let blas = Blas::new(&gpu, precision)?;
        let inv_freq = inv_freq(c.rotary_dim(), c.rope_theta, c.rope_scaling.as_ref());
        let routing = c.moe.as_ref().map(|m| Mutex::new(vec![0; m.num_experts]));
        Ok(CudaModel {
            config: c,
            precision,
            inv_freq,
            state: Mutex::new(State::default()),
            weights,
            weights_bytes,
            peak_used: AtomicUsize::new(0),
            max_windows: AtomicUsize::new(plan::MAX_WINDOWS),
            routing,
            blas,
            gpu,
        })
    }

    /// Token-to-expert assignments per expert since the last call (summed over the sparse
    /// layers), zeroing them; `None` for a dense model. The same counts as the CPU's.
    pub fn take_routing(&self) -> Option<Vec<u64>> {
        self.routing
            .as_ref()
            .map(|r| r.lock().unwrap().iter_mut().map(std::mem::take).collect())
    }

    /// Limits the windows packed into one forward pass (at least 1).
    pub fn set_max_windows_per_pass(&self, n: usize) {
        self.max_windows.store(n.max(1), Ordering::Relaxed);
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn attention_kernel(&self) -> AttnKernel {
        AttnKernel::choose(self.precision, self.config.head_dim)
    }

    pub fn memory_report(&self) -> MemoryReport {
        MemoryReport {
            peak_allocated_bytes: self.gpu.stats.peak.load(Ordering::Relaxed) as u64,
            peak_used_bytes: self.peak_used.load(Ordering::Relaxed) as u64,
            weights_bytes: self.weights_bytes as u64,
            total_bytes: self.gpu.info.memory_bytes,
        }
    }

    /// Scores windows of one stream, batching consecutive windows into forward passes sized
    /// from free device memory. `on_batch(first, results)` receives each batch's per-window
    /// log-probabilities in window order; when a window fails, the windows before it are
    /// delivered first.
    pub fn score_windows(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        on_batch: &mut dyn FnMut(usize, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<(), ScoreError> {
        if windows.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap();
        let kvn = kv.name();
        self.gpu.prepare(&[
            Program {
                module: "attention",
                kv: Some(kvn),
            },
            Program {
                module: "qkv",
                kv: Some(kvn),
            },
            Program {
                module: "elementwise",
                kv: None,
            },
            Program {
                module: "head",
                kv: None,
            },
        ])?;
        if self.config.hybrid.is_some() {
            self.gpu.prepare(&[Program {
                module: "delta_net",
                kv: None,
            }])?;
        }
        if self.config.moe.is_some() {
            self.gpu.prepare(&[Program {
                module: "moe",
                kv: None,
            }])?;
        }
        let longest = windows.iter().map(|w| w.len()).max().unwrap_or(0);
        self.ensure_buffers(&mut st, longest)?;
        self.ensure_rope(&mut st, longest)?;
        let plan = st.bufs.as_ref().expect("allocated").plan.clone();
        let lens: Vec<usize> = windows.iter().map(|w| w.len()).collect();
        for batch in plan::pack_batches(
            &lens,
            plan.max_rows,
            self.max_windows.load(Ordering::Relaxed),
        )? {
            let wins: Vec<(&[u32], usize)> = windows[batch.clone()]
                .iter()
                .map(|w| (&tokens[w.begin..w.end], w.first_target - w.begin))
                .collect();
            match self.forward_batch(&st, &wins, kv) {
                Ok(lps) => on_batch(batch.start, lps)?,
                Err(ScoreError::Window { index, error }) => {
                    // As on the CPU, the windows before the failing one are delivered
                    // first: windows are independent, so a pass over just those gives them.
                    if index > 0 {
                        match self.forward_batch(&st, &wins[..index], kv) {
                            Ok(lps) => on_batch(batch.start, lps)?,
                            Err(ScoreError::Window { index: i, error }) => {
                                return Err(ScoreError::Window {
                                    index: batch.start + i,
                                    error,
                                })
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    return Err(ScoreError::Window {
                        index: batch.start + index,
                        error,
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn ensure_buffers(&self, st: &mut State, longest: usize) -> Result<()> {
        if let Some(b) = &st.bufs {
            if b.plan.max_rows >= longest {
                return Ok(());
            }
        }
        st.bufs = None; // free before planning again
        let (free, _) = self.gpu.mem_info()?;
        // Stored K/V buffers are sized for the widest representation (f32), so one
        // allocation serves every KV dtype.
        let p = plan::plan_memory(&self.config, KvDtype::F32, self.precision, free, longest)?;
        let z = plan::buffer_sizes(
            &self.config,
            self.precision,
            p.max_rows,
            p.head_rows,
            p.vocab_chunk,
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
                }),
                None => None,
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

    fn ensure_rope(&self, st: &mut State, positions: usize) -> Result<()> {
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

    fn launch_attention(
        &self,
        b: &Buffers,
        kv: KvDtype,
        tiles: &DevBuf,
        n_tiles: usize,
    ) -> Result<()> {
        let c = &self.config;
        let k = self.attention_kernel();
        let entry = k.entry(kv);
        let scale = 1.0f32 / (c.head_dim as f32).sqrt();
        let grid = (n_tiles as u32, c.num_heads as u32, 1);
        match k {
            AttnKernel::Mma { .. } => self.gpu.launch(
                &entry,
                grid,
                128,
                0,
                &launch::AttnMma {
                    q: Ptr::new(b.q.ptr),
                    kt: b.k.arg(),
                    vt: b.v.arg(),
                    tiles: Ptr::new(tiles.ptr),
                    out: Ptr::new(b.attn.ptr),
                    hq: c.num_heads as i32,
                    hkv: c.num_kv_heads as i32,
                    sl2: scale * std::f32::consts::LOG2_E,
                },
            ),
            AttnKernel::F32 => {
                let smem = k.dynamic_smem(c.head_dim);
                self.gpu.launch(
                    &entry,
                    grid,
                    128,
                    smem,
                    &launch::AttnF32 {
                        q: Ptr::new(b.q.ptr),
                        kt: b.k.arg(),
                        vt: b.v.arg(),
                        tiles: Ptr::new(tiles.ptr),
                        out: Ptr::new(b.attn.ptr),
                        out_bf16: (self.precision == Precision::Bf16) as i32,
                        hq: c.num_heads as i32,
                        hkv: c.num_kv_heads as i32,
                        D: c.head_dim as i32,
                        scale,
                    },
                )
            }
        }
    }

    /// A Gated DeltaNet layer over the packed rows: from the normed rows in `h`, adds
    /// `out_proj(rmsnorm(o) · act(z))` to `x` (the CPU twin: `model::delta_net::Mix::run`).
    /// Each window's State starts at zero inside the rule's kernel and never leaves it.
    #[allow(clippy::too_many_arguments)]
    fn delta_net_block(
        &self,
        b: &Buffers,
        dn: &DeltaNet,
        li: usize,
        m: usize,
        ints: &DevBuf,
        o_pos: usize,
        o_win: usize,
        spans: &DevBuf,
        windows: usize,
    ) -> Result<()> {
        let c = &self.config;
        let h = c.hybrid.as_ref().expect("a Gated DeltaNet layer is hybrid");
        let g = &self.gpu;
        let d = c.hidden_size;
        let (hk, hv, dk, dv) = (
            h.linear_num_key_heads,
            h.linear_num_value_heads,
            h.linear_key_head_dim,
            h.linear_value_head_dim,
        );
        let (conv_dim, vdim) = (h.conv_dim(), h.value_dim());
        let width = conv_dim + vdim + 2 * hv;
        let (pos, win) = (Ptr::new(ints.at(o_pos)), Ptr::new(ints.at(o_win)));
        let scan = |x: u64, cols: usize, part: StatePart| -> Result<()> {
            g.launch(
                "nonfinite_scan",
                (plan::blocks_for(m * cols, 256), 1, 1),
                256,
                0,
                &launch::NonfiniteScan {
                    x: Ptr::new(x),
                    rows: m as i64,
                    cols: cols as i32,
                    pos,
                    win,
                    layer: li as i32,
                    part: part as i32,
                    err: Ptr::new(b.err.at(8)),
                },
            )
        };
        // proj[m, width] = [q|k|v, z, b, a]
        self.blas.gemm(
            g,
            m,
            width,
            d,
            Mat::of(&b.h, 0, d),
            Mat::of(&dn.in_proj, 0, d),
            Mat::of(&b.scratch, 0, width),
            false,
        )?;
        scan(b.scratch.ptr, width, StatePart::Input)?;
        // c[m, conv_dim] = silu(conv(q|k|v)), then q and k normalised in place; gates.
        g.launch(
            "delta_conv_silu",
            (plan::blocks_for(m * conv_dim, 256), 1, 1),
            256,
            0,
            &launch::DeltaConvSilu {
                proj: Ptr::new(b.scratch.ptr),
                width: width as i32,
                conv: Ptr::new(dn.conv.ptr),
                kw: h.linear_conv_kernel_dim as i32,
                pos,
                rows: m as i64,
                conv_dim: conv_dim as i32,
                c: Ptr::new(b.conv.ptr),
            },
        )?;
        let (beta, gdecay) = (b.gates.ptr, b.gates.at(4 * m * hv));
        g.launch(
            "delta_prep",
            (plan::blocks_for(m * (2 * hk + 1), 8), 1, 1),
            256,
            0,
            &launch::DeltaPrep {
                c: Ptr::new(b.conv.ptr),
                conv_dim: conv_dim as i32,
                proj: Ptr::new(b.scratch.ptr),
                width: width as i32,
                a_log: Ptr::new(dn.a_log.ptr),
                dt_bias: Ptr::new(dn.dt_bias.ptr),
                rows: m as i64,
                hk: hk as i32,
                dk: dk as i32,
                hv: hv as i32,
                dv: dv as i32,
                q_scale: 1.0 / (dk as f32).sqrt(),
                beta: Ptr::new(beta),
                g: Ptr::new(gdecay),
            },
        )?;
        scan(gdecay, hv, StatePart::Decay)?;
        scan(beta, hv, StatePart::Beta)?;
        // o[m, Hv, Dv]: the State's read-out (in `q`, free in this layer), by the chunked
        // rule with each window's State in shared memory (`plan::check_delta_net`).
        g.launch(
            "delta_rule_chunked",
            (windows as u32, hv as u32, 1),
            256,
            launch::delta_chunked_smem(dk, dv) as usize,
            &launch::DeltaRuleChunked {
                c: Ptr::new(b.conv.ptr),
                conv_dim: conv_dim as i32,
                beta: Ptr::new(beta),
                g: Ptr::new(gdecay),
                spans: Ptr::new(spans.ptr),
                hk: hk as i32,
                dk: dk as i32,
                hv: hv as i32,
                dv: dv as i32,
                state: Ptr::NULL,
                o: Ptr::new(b.q.ptr),
            },
        )?;
        scan(b.q.ptr, vdim, StatePart::State)?;
        // y[m, Hv·Dv] = rmsnorm(o) · w · act(z) (in `attn`, the out-projection's input).
        g.launch(
            "delta_gated_norm",
            (plan::blocks_for(m * hv, 8), 1, 1),
            256,
            0,
            &launch::DeltaGatedNorm {
                o: Ptr::new(b.q.ptr),
                proj: Ptr::new(b.scratch.ptr),
                width: width as i32,
                conv_dim: conv_dim as i32,
                w: Ptr::new(dn.norm.ptr),
                n: m as i64,
                hv: hv as i32,
                dv: dv as i32,
                eps: c.rms_norm_eps,
                sigmoid_gate: (h.output_gate == OutputGate::Sigmoid) as i32,
                y: Ptr::new(b.attn.ptr),
                out_bf16: (self.precision == Precision::Bf16) as i32,
            },
        )?;
        self.blas.gemm(
            g,
            m,
            d,
            vdim,
            Mat::of(&b.attn, 0, vdim),
            Mat::of(&dn.out_proj, 0, vdim),
            Mat::of(&b.x, 0, d),
            true,
        )?;
        Ok(())
    }

    /// One forward pass over packed windows `(tokens, first_target)`; returns each window's
    /// target log-probabilities.
    fn forward_batch(
        &self,
        st: &State,
        wins: &[(&[u32], usize)],
        kv: KvDtype,
    ) -> Result<Vec<Vec<f32>>, ScoreError> {
        let c = &self.config;
        let (d, qd, kvd, f, hd, hq, hkv) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.head_dim,
            c.num_heads,
            c.num_kv_heads,
        );
        let eps = c.rms_norm_eps;
        let p = self.precision;
        let e = p.elem_bytes();
        let bf16_out = (p == Precision::Bf16) as i32;

        // Host side: packed rows, positions, window of each row, scored rows and targets.
        let total: usize = wins.iter().map(|w| w.0.len()).sum();
        let mut tokens: Vec<i32> = Vec::with_capacity(total);
        let mut pos: Vec<i32> = Vec::with_capacity(total);
        let mut win: Vec<i32> = Vec::with_capacity(total);
        let mut rows: Vec<i32> = Vec::new();
        let mut targets: Vec<i32> = Vec::new();
        // The rows the last layer's MLP must produce: from the first that predicts a target
        // to the window's end (the rows the CPU's last layer runs).
        let mut tail: Vec<i32> = Vec::new();
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(wins.len());
        for (wi, &(toks, first)) in wins.iter().enumerate() {
            assert!(
                first >= 1 && first <= toks.len(),
                "first_target out of range"
            );
            if let Some((p_, &id)) = toks
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= c.vocab_size)
            {
                return Err(ScoreError::Window {
                    index: wi,
                    error: ForwardError::TokenOutOfRange {
                        id,
                        pos: p_,
                        vocab: c.vocab_size,
                    },
                });
            }
            let row0 = tokens.len();
            spans.push((row0, toks.len()));
            tokens.extend(toks.iter().map(|&t| t as i32));
            pos.extend((0..toks.len()).map(|i| i as i32));
            win.extend(std::iter::repeat_n(wi as i32, toks.len()));
            for i in first - 1..toks.len() - 1 {
                rows.push((row0 + i) as i32);
                targets.push(toks[i + 1] as i32);
            }
            tail.extend((first - 1..toks.len()).map(|i| (row0 + i) as i32));
        }
        let m = total;
        let r_total = rows.len();
        let kernel = self.attention_kernel();
        let tiles: Vec<[i32; 4]> = plan::attention_tiles(&spans, kernel.rows_per_tile())
            .into_iter()
            .map(|t| t.to_int4())
            .collect();
        let g = &self.gpu;
        let ints = g.upload(&[&tokens[..], &pos, &win, &rows, &targets, &tail].concat())?;
        let (o_tok, o_pos, o_win, o_rows, o_tgt) = (0, 4 * m, 8 * m, 12 * m, 12 * m + 4 * r_total);
        let o_tail = o_tgt + 4 * r_total;
        let tiles_buf = g.upload(&tiles)?;

        let b = st.bufs.as_ref().expect("allocated");
        let rope = st.rope.as_ref().expect("allocated");
        let w = &self.weights;
        g.memset(&b.err, 0, 16, 0xFF)?;

        g.launch(
            "embed_gather",
            (m as u32, 1, 1),
            256,
            0,
            &launch::EmbedGather {
                tokens: Ptr::new(ints.at(o_tok)),
                embed: Ptr::new(w.embed.ptr),
                embed_bf16: bf16_out,
                x: Ptr::new(b.x.ptr),
                d: d as i32,
            },
        )?;
        let norm = |x: u64, rows: Ptr<i32>, weight: &DevBuf, out: u64, n: usize| -> Result<()> {
            g.launch(
                "rms_norm",
                (n as u32, 1, 1),
                256,
                0,
                &launch::RmsNorm {
                    x: Ptr::new(x),
                    rows,
                    w: Ptr::new(weight.ptr),
                    out: Ptr::<Any>::new(out),
                    out_bf16: bf16_out,
                    d: d as i32,
                    eps,
                },
            )
        };
        let qkv_entry = plan::qkv_entry(kv, hd)?;
        // The State kernels' windows: (first row, rows).
        let spans_buf = if c.hybrid.is_some() {
            let sp: Vec<[i32; 2]> = spans.iter().map(|&(r, n)| [r as i32, n as i32]).collect();
            Some(g.upload(&sp)?)
        } else {
            None
        };
        // Routed rows per expert in this pass, added to the model's counts when it succeeds.
        let mut routed = vec![0u64; c.moe.as_ref().map_or(0, |m| m.num_experts)];
        for (li, l) in w.layers.iter().enumerate() {
            norm(b.x.ptr, Ptr::NULL, &l.norm, b.h.ptr, m)?;
            match &l.mixer {
                Mixer::Attention(at) => {
                    // Attention block: [q | k | v (| gate)] rows, the gate left in scratch.
                    let gate_w = if at.gated { qd } else { 0 };
                    let qkv_w = qd + 2 * kvd + gate_w;
                    self.blas.gemm(
                        &self.gpu,
                        m,
                        qkv_w,
                        d,
                        Mat::of(&b.h, 0, d),
                        Mat::of(&at.qkv, 0, d),
                        Mat::of(&b.scratch, 0, qkv_w),
                        false,
                    )?;
                    g.launch(
                        &qkv_entry,
                        (plan::blocks_for(m * (hq + 2 * hkv), plan::QKV_WARPS), 1, 1),
                        (plan::QKV_WARPS * 32) as u32,
                        0,
                        &launch::QkvPrep {
                            qkv: Ptr::new(b.scratch.ptr),
                            bias: at.qkv_bias.as_ref().map_or(Ptr::NULL, |x| Ptr::new(x.ptr)),
                            q_norm: at.q_norm.as_ref().map_or(Ptr::NULL, |x| Ptr::new(x.ptr)),
                            k_norm: at.k_norm.as_ref().map_or(Ptr::NULL, |x| Ptr::new(x.ptr)),
                            rope_cos: Ptr::new(rope.cos.ptr),
                            rope_sin: Ptr::new(rope.sin.ptr),
                            pos: Ptr::new(ints.at(o_pos)),
                            win: Ptr::new(ints.at(o_win)),
                            q_out: Ptr::new(b.q.ptr),
                            q_bf16: matches!(kernel, AttnKernel::Mma { .. }) as i32,
                            kt: b.k.arg(),
                            vt: b.v.arg(),
                            err: Ptr::new(b.err.ptr),
                            layer: li as i32,
                            rows: m as i64,
                            hq: hq as i32,
                            hkv: hkv as i32,
                            D: hd as i32,
                            row_stride: qkv_w as i32,
                            rot: c.rotary_dim() as i32,
                            eps,
                        },
                    )?;
                    self.launch_attention(b, kv, &tiles_buf, tiles.len())?;
                    if at.gated {
                        g.launch(
                            "attn_output_gate",
                            (plan::blocks_for(m * qd, 256), 1, 1),
                            256,
                            0,
                            &launch::AttnOutputGate {
                                attn: Ptr::new(b.attn.ptr),
                                attn_bf16: bf16_out,
                                qkv: Ptr::new(b.scratch.ptr),
                                row_stride: qkv_w as i32,
                                gate_off: (qd + 2 * kvd) as i32,
                                rows: m as i64,
                                qd: qd as i32,
                            },
                        )?;
                    }
                    self.blas.gemm(
                        &self.gpu,
                        m,
                        d,
                        qd,
                        Mat::of(&b.attn, 0, qd),
                        Mat::of(&at.o_proj, 0, qd),
                        Mat::of(&b.x, 0, d),
                        true,
                    )?;
                }
                Mixer::DeltaNet(dn) => {
                    let spans_buf = spans_buf.as_ref().expect("uploaded for hybrid models");
                    self.delta_net_block(b, dn, li, m, &ints, o_pos, o_win, spans_buf, wins.len())?;
                }
            }
            // MLP block: dense, or a sparse mixture of experts. A sparse last layer routes
            // only the rows the head reads (and the last of each window), as on the CPU,
            // so both report the same routing.
            let last_moe = li + 1 == w.layers.len() && matches!(l.ffn, Ffn::Moe(_));
            if last_moe {
                norm(
                    b.x.ptr,
                    Ptr::new(ints.at(o_tail)),
                    &l.ffn_norm,
                    b.h.ptr,
                    tail.len(),
                )?;
            } else {
                norm(b.x.ptr, Ptr::NULL, &l.ffn_norm, b.h.ptr, m)?;
            }
            match &l.ffn {
                Ffn::Dense(mlp) => {
                    self.blas.gemm(
                        &self.gpu,
                        m,
                        2 * f,
                        d,
                        Mat::of(&b.h, 0, d),
                        Mat::of(&mlp.gate_up, 0, d),
                        Mat::of(&b.scratch, 0, 2 * f),
                        false,
                    )?;
                    g.launch(
                        "swiglu",
                        (plan::blocks_for(m * f, 256), 1, 1),
                        256,
                        0,
                        &launch::Swiglu {
                            gu: Ptr::new(b.scratch.ptr),
                            act: Ptr::new(b.act.ptr),
                            out_bf16: bf16_out,
                            rows: m as i64,
                            f: f as i32,
                        },
                    )?;
                    self.blas.gemm(
                        &self.gpu,
                        m,
                        d,
                        f,
                        Mat::of(&b.act, 0, f),
                        Mat::of(&mlp.down, 0, f),
                        Mat::of(&b.x, 0, d),
                        true,
                    )?;
                }
                Ffn::Moe(mw) => {
                    let cfg = c.moe.as_ref().expect("a MoE layer has a MoE config");
                    let bufs = b.moe.as_ref().expect("allocated for MoE models");
                    let io = moe::Io {
                        x: &b.x,
                        rows: last_moe.then(|| (&tail[..], Ptr::new(ints.at(o_tail)))),
                        h: &b.h,
                        norm: &l.ffn_norm,
                        scratch: &b.scratch,
                        act: &b.act,
                    };
                    moe::moe_block(
                        g,
                        &self.blas,
                        p,
                        cfg,
                        d,
                        eps,
                        mw,
                        bufs,
                        &io,
                        if last_moe { tail.len() } else { m },
                        &mut routed,
                    )?;
                }
            }
        }

        // Head over the scored rows only: final norm of the gathered rows into `h`, then
        // vocabulary chunks folded into a running log-sum-exp.
        norm(
            b.x.ptr,
            Ptr::new(ints.at(o_rows)),
            &w.final_norm,
            b.h.ptr,
            r_total,
        )?;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        let (hr, vc_max) = (b.plan.head_rows, b.plan.vocab_chunk);
        for r0 in (0..r_total).step_by(hr) {
            let rb = hr.min(r_total - r0);
            for v0 in (0..c.vocab_size).step_by(vc_max) {
                let vc = vc_max.min(c.vocab_size - v0);
                self.blas.gemm(
                    &self.gpu,
                    rb,
                    vc,
                    d,
                    Mat::of(&b.h, r0 * d * e, d),
                    Mat::of(head, v0 * d * e, d),
                    Mat::of(&b.logits, 0, vc),
                    false,
                )?;
                g.launch(
                    "head_reduce",
                    (rb as u32, 1, 1),
                    256,
                    0,
                    &launch::HeadReduce {
                        logits: Ptr::new(b.logits.ptr),
                        vc: vc as i32,
                        v0: v0 as i32,
                        targets: Ptr::new(ints.at(o_tgt + 4 * r0)),
                        run_max: Ptr::new(b.run_max.at(4 * r0)),
                        run_sum: Ptr::new(b.run_sum.at(8 * r0)),
                        run_target: Ptr::new(b.run_target.at(4 * r0)),
                    },
                )?;
            }
        }
        g.launch(
            "head_finish",
            (plan::blocks_for(r_total, 256), 1, 1),
            256,
            0,
            &launch::HeadFinish {
                run_max: Ptr::new(b.run_max.ptr),
                run_sum: Ptr::new(b.run_sum.ptr),
                run_target: Ptr::new(b.run_target.ptr),
                out: Ptr::new(b.out.ptr),
                rows: r_total as i32,
            },
        )?;
        let err: Vec<u64> = g.read(&b.err, 0, 2)?;
        let lps: Vec<f32> = g.read(&b.out, 0, r_total)?;
        if let Ok((free, total)) = g.mem_info() {
            self.peak_used.fetch_max(total - free, Ordering::Relaxed);
        }
        // The record of the earlier (window, layer) is what the CPU meets first; the two
        // slots never share a layer (a layer has a Main KV or a State, not both).
        if err[0] != u64::MAX || err[1] != u64::MAX {
            let (index, error) = if (err[0] >> 40) <= (err[1] >> 40) {
                decode_nonfinite(err[0], hkv, hd)
            } else {
                decode_state_nonfinite(err[1], c)
            };
            return Err(ScoreError::Window { index, error });
        }
        if let Some(r) = &self.routing {
            for (t, n) in r.lock().unwrap().iter_mut().zip(&routed) {
                *t += n;
            }
        }
        let mut out = Vec::with_capacity(wins.len());
        let mut at = 0;
        for &(toks, first) in wins {
            let n = toks.len() - first;
            out.push(lps[at..at + n].to_vec());
            at += n;
        }
        Ok(out)
    }
}

/// Decodes the first non-finite K/V record written by `qkv_prep`:
/// window << 48 | layer << 40 | (value ? 1 : 0) << 39 | flat index within the window's
/// [positions, Hkv, D] tensor.
pub fn decode_nonfinite(key: u64, hkv: usize, hd: usize) -> (usize, ForwardError) {
    let window = (key >> 48) as usize;
    let layer = ((key >> 40) & 0xFF) as usize;
    let part = if (key >> 39) & 1 == 1 {
        Part::Value
    } else {
        Part::Key
    };
    let flat = (key & ((1u64 << 39) - 1)) as usize;
    let vec = flat / hd;
    (
        window,
        ForwardError::NonFinite {
            part,
            layer,
            pos: vec / hkv,
            head: vec % hkv,
        },
    )
}

/// What a Gated DeltaNet non-finite record names, in the order a layer computes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum StatePart {
    /// The projections q|k|v, z, b, a (`[rows, width]`).
    Input = 0,
    /// The decay g (`[rows, Hv]`).
    Decay = 1,
    /// The write strength beta (`[rows, Hv]`).
    Beta = 2,
    /// The State's read-out o (`[rows, Hv, Dv]`).
    State = 3,
}

/// Decodes the first non-finite Gated DeltaNet record written by `nonfinite_scan`:
/// window << 48 | layer << 40 | part << 37 | flat index within the window's tensor, into
/// the error the CPU reports (`model::delta_net`'s checks).
pub fn decode_state_nonfinite(key: u64, c: &ModelConfig) -> (usize, ForwardError) {
    let h = c
        .hybrid
        .as_ref()
        .expect("State records come from hybrid models");
    let hv = h.linear_num_value_heads;
    let window = (key >> 48) as usize;
    let layer = ((key >> 40) & 0xFF) as usize;
    let flat = (key & ((1u64 << 37) - 1)) as usize;
    let (part, heads, dim) = match (key >> 37) & 7 {
        0 => (
            Part::DeltaNetInput,
            1,
            h.conv_dim() + h.value_dim() + 2 * hv,
        ),
        1 | 2 => (Part::DeltaNetGate, hv, 1),
        _ => (Part::State, hv, h.linear_value_head_dim),
    };
    let vec = flat / dim;
    (
        window,
        ForwardError::NonFinite {
            part,
            layer,
            pos: vec / heads,
            head: vec % heads,
        },
    )
}

/// Errors of a batch as one line for the engine.
pub fn describe(e: &ScoreError) -> String {
    match e {
        ScoreError::Window { index, error } => format!("window {index}: {error}"),
        ScoreError::Device(e) => format!("{e:#}"),
    }
}

impl std::fmt::Display for ScoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&describe(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonfinite_records_decode_like_the_cpu_error() {
        let (hkv, hd) = (3, 64);
        let flat = ((5 * hkv + 2) * hd + 17) as u64;
        let key = (7u64 << 48) | (12u64 << 40) | (1u64 << 39) | flat;
        let (w, e) = decode_nonfinite(key, hkv, hd);
        assert_eq!(w, 7);
        assert_eq!(
            e,
            ForwardError::NonFinite {
                part: Part::Value,
                layer: 12,
                pos: 5,
                head: 2
            }
        );
        let (w, e) = decode_nonfinite(flat, hkv, hd);
        assert_eq!(w, 0);
        assert_eq!(
            e,
            ForwardError::NonFinite {
                part: Part::Key,
                layer: 0,
                pos: 5,
                head: 2
            }
        );
    }
}
