//! The CPU reference forward pass, fused with the scoring head.
//!
//! One call processes one window: tokens `x[0..T)` at positions `0..T` with an empty KV
//! cache, and returns `log p(x[i] | x[0..i))` for the requested targets. Keys (after RoPE)
//! and values pass through the selected Main KV representation before attention reads
//! them. Only the rows that predict a target go through the final norm and output head,
//! and the head never holds more than one vocabulary chunk of logits per row block.
//!
//! A window may be split between two threads for its remaining layers when the engine has a
//! thread to spare (rows `..h` and `h..`, the second part taking the first part's keys and
//! values of each layer); the result has the same bits (see `Split`).
//!
//! Test-only fault switch: when the environment variable `NINFER_TEST_FAULT` is set as a
//! [`CpuModel`] is built, the model is deliberately perturbed so that the regression
//! harness can prove it catches drift (`tests/harness_gate.rs`). `rope-shift` rotates the
//! keys of layer 0 one position too far; `skip-final-norm` feeds the un-normalized residual
//! stream to the output head; `embed-scale=E` multiplies the embeddings by `1 + E`, a
//! perturbation far below float32 model noise, to measure how sensitive a KV format's score
//! is to harmless numerical changes (docs/accuracy.md). Unset (the normal case), nothing
//! changes.

use crate::backend::cpu::attention::{causal_attention, AttnShape, Q_BLOCK};
use crate::backend::cpu::head;
use crate::backend::cpu::matmul::{matmul_wt, Picker};
use crate::backend::cpu::norm::{rms_norm, rms_norm_inplace, rms_norm_row, swiglu};
use crate::backend::cpu::rope::{inv_freq, RopeTable};
use crate::kv::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::weights::Weights;
use rayon::prelude::*;
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use thiserror::Error;

/// A numerical failure inside a window (positions are relative to the window).
#[derive(Debug, Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} at window position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("non-finite {which} value at layer {layer}, window position {pos}, KV head {head}")]
    NonFiniteKv {
        which: &'static str,
        layer: usize,
        pos: usize,
        head: usize,
    },
}

/// Phases of the forward pass timed when `NINFER_PROFILE=1` (see [`Laps`]).
const PHASES: [&str; 9] = [
    "norms",
    "qkv",
    "embed/split/rope/kv",
    "attention",
    "o-proj",
    "gate/up",
    "swiglu",
    "down",
    "head",
];

/// Wall-clock time per phase of one window, printed to stderr when the environment variable
/// `NINFER_PROFILE` is `1` as the model is built: the profile of the real pipeline, buffers
/// and all, which `benches/ops.rs` (each op alone) cannot give. Off, it costs one branch per
/// phase.
struct Laps {
    on: bool,
    last: std::time::Instant,
    acc: [f64; PHASES.len()],
}

impl Laps {
    fn new(on: bool) -> Laps {
        Laps {
            on,
            last: std::time::Instant::now(),
            acc: [0.0; PHASES.len()],
        }
    }

    /// Charges the time since the previous lap to `phase`.
    fn lap(&mut self, phase: usize) {
        if self.on {
            let now = std::time::Instant::now();
            self.acc[phase] += (now - self.last).as_secs_f64();
            self.last = now;
        }
    }

    /// Prints the phases under `label` (what was timed).
    fn report(&self, label: &str) {
        if self.on {
            let total: f64 = self.acc.iter().sum();
            let parts: Vec<String> = PHASES
                .iter()
                .zip(&self.acc)
                .map(|(n, s)| format!("{n} {:.0} ms", s * 1e3))
                .collect();
            eprintln!(
                "profile: {label}, {:.0} ms: {}",
                total * 1e3,
                parts.join(", ")
            );
            eprintln!("profile: GEMM runs so far, {}", Picker::summary());
        }
    }
}

pub struct CpuModel {
    pub config: ModelConfig,
    pub weights: Weights,
    inv_freq: Vec<f64>,
    /// Test-only perturbation from `NINFER_TEST_FAULT` (see the module docs); `None` normally.
    fault: Option<Fault>,
    /// `NINFER_PROFILE=1`: print per-phase times of every window.
    profile: bool,
}

/// A deliberate engine perturbation for the harness's drift test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    RopeShift,
    SkipFinalNorm,
    EmbedScale(f32),
}

impl Fault {
    fn from_env() -> Option<Fault> {
        let v = std::env::var("NINFER_TEST_FAULT").ok()?;
        match v.as_str() {
            "rope-shift" => return Some(Fault::RopeShift),
            "skip-final-norm" => return Some(Fault::SkipFinalNorm),
            _ => {}
        }
        if let Some(e) = v
            .strip_prefix("embed-scale=")
            .and_then(|e| e.parse::<f32>().ok())
        {
            return Some(Fault::EmbedScale(e));
        }
        eprintln!("warning: ignoring NINFER_TEST_FAULT=`{v}` (valid: rope-shift, skip-final-norm, embed-scale=E)");
        None
    }
}

impl CpuModel {
    pub fn new(config: ModelConfig, weights: Weights) -> CpuModel {
        let inv_freq = inv_freq(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling.as_ref(),
        );
        CpuModel {
            config,
            weights,
            inv_freq,
            fault: Fault::from_env(),
            profile: std::env::var("NINFER_PROFILE").is_ok_and(|v| v == "1"),
        }
    }

    /// Bytes of working memory one call of [`CpuModel::window_logprobs`] holds at its peak
    /// for a window of `tokens` tokens (activation buffers, the attention's packed keys and
    /// values, the RoPE table, the head's input rows), not counting the weights. The engine
    /// uses it to decide how many windows may be in flight at once.
    pub fn window_bytes(&self, tokens: usize) -> usize {
        let c = &self.config;
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let qkv_w = qd + 2 * kvd;
        // x, h, final-norm rows: 3d; qkv; q and attn: 2qd; k, v and their packed copies:
        // 4kvd; gu and act: 3f; cos and sin: head_dim.
        let per_token = 3 * d + qkv_w + 2 * qd + 4 * kvd + 3 * f + c.head_dim;
        tokens * per_token * std::mem::size_of::<f32>()
    }

    /// Log-probabilities of `tokens[first_target..]`, each given all earlier tokens of the
    /// window. `first_target >= 1`.
    pub fn window_logprobs(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward(tokens, first_target, kv, Split::Never)
    }

    /// [`CpuModel::window_logprobs`], with the option of splitting the window's rows between
    /// two threads: `may_split` is asked at each layer boundary until it says yes (and then
    /// never again); a yes means a worker thread is free to take the later rows. The result
    /// has the same bits either way (see `Split` in this module).
    pub fn window_logprobs_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        may_split: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward(tokens, first_target, kv, Split::Ask(may_split))
    }

    fn forward(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        split: Split,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let t_len = tokens.len();
        let mut laps = Laps::new(self.profile);
        assert!(
            first_target >= 1 && first_target <= t_len,
            "first_target out of range"
        );
        let (d, layers) = (c.hidden_size, self.weights.layers.len());
        let w = &self.weights;

        // x[T, d]: the residual stream.
        let mut x = vec![0.0f32; t_len * d];
        for (pos, (&id, row)) in tokens.iter().zip(x.chunks_mut(d)).enumerate() {
            let id_us = id as usize;
            if id_us >= c.vocab_size {
                return Err(ForwardError::TokenOutOfRange {
                    id,
                    pos,
                    vocab: c.vocab_size,
                });
            }
            row.copy_from_slice(&w.embed[id_us * d..(id_us + 1) * d]);
        }
        if let Some(Fault::EmbedScale(e)) = self.fault {
            x.iter_mut().for_each(|v| *v *= 1.0 + e); // test-only perturbation
        }
        let rope = RopeTable::new(&self.inv_freq, t_len);
        // Test-only fault: layer 0's keys rotated for position t + 1.
        let shifted = (self.fault == Some(Fault::RopeShift)).then(|| {
            let t = RopeTable::new(&self.inv_freq, t_len + 1);
            RopeTable {
                half: t.half,
                cos: t.cos[t.half..].to_vec(),
                sin: t.sin[t.half..].to_vec(),
            }
        });
        let pass = Pass {
            first_target,
            kv,
            rope: &rope,
            shifted_rope: shifted.as_ref(),
        };

        // The whole window, layer by layer, until (if ever) it is split.
        let mut cut = None;
        {
            let mut bufs = Bufs::new(c, 0, t_len);
            for li in 0..layers {
                if let Some(h) = self.split_here(&split, li, t_len, first_target) {
                    cut = Some((li, h));
                    break;
                }
                self.layer(
                    li,
                    0..t_len,
                    &mut x,
                    &mut bufs,
                    &pass,
                    &Link::Alone,
                    &mut laps,
                )
                .map_err(Stop::into_error)?;
            }
        }
        if let Some((from, h)) = cut {
            laps.report(&format!("window {t_len} tokens, layers 0..{from}"));
            self.split_layers(from, h, &mut x, &pass)?;
            laps = Laps::new(self.profile);
        }

        // Row i predicts token i + 1: rows first_target-1 .. T-1.
        let rows = t_len - first_target;
        let mut hn = vec![0.0f32; rows * d];
        hn.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            let i = first_target - 1 + r;
            if self.fault == Some(Fault::SkipFinalNorm) {
                o.copy_from_slice(&x[i * d..(i + 1) * d]); // test-only fault
                return;
            }
            rms_norm_row(&x[i * d..(i + 1) * d], &w.final_norm, c.rms_norm_eps, o);
        });
        let mut out = vec![0.0f32; rows];
        head::logprobs(
            &hn,
            d,
            w.head(),
            c.vocab_size,
            &tokens[first_target..],
            &mut out,
        );
        laps.lap(8);
        let after_split = if cut.is_some() {
            " (after the split)"
        } else {
            ""
        };
        laps.report(&format!(
            "window {t_len} tokens, {rows} scored{after_split}"
        ));
        Ok(out)
    }

    /// Whether to split the window before layer `li`, and where: `Some(h)` gives rows `..h`
    /// to this thread and rows `h..` to another one.
    fn split_here(
        &self,
        split: &Split,
        li: usize,
        t_len: usize,
        first_target: usize,
    ) -> Option<usize> {
        match *split {
            Split::Never => None,
            Split::At { layer, rows } => (layer == li).then_some(rows),
            // Asked only when a cut exists: a yes reserves a thread.
            Split::Ask(ask) if t_len >= MIN_SPLIT_ROWS => {
                let h = self.split_point(li, t_len, first_target)?;
                ask().then_some(h)
            }
            Split::Ask(_) => None,
        }
    }

    /// The row at which to cut a window split before layer `from`: the multiple of the
    /// attention's query block that comes closest to giving both parts the same FLOPs per
    /// layer without the first part's being larger (the second part waits for the first at
    /// every layer, so the first should finish first; its thread then helps the second
    /// through work stealing). `None` when the window is too short to cut.
    fn split_point(&self, from: usize, t_len: usize, first_target: usize) -> Option<usize> {
        let c = &self.config;
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let lin = (2 * (d * (qd + 2 * kvd) + qd * d + 3 * d * f)) as f64; // per row
        let kv_only = (2 * d * (qd + 2 * kvd)) as f64; // per row skipped after the last layer
        let att = (4 * c.num_heads * c.head_dim) as f64; // per (row, visible key)
        let pairs = |a: usize, b: usize| ((b * (b + 1) - a * (a + 1)) / 2) as f64;
        let layers = self.weights.layers.len();
        let r0 = first_target - 1;
        // FLOPs of rows a..b over layers from.. (the last layer only for rows from r0 on).
        let cost = |a: usize, b: usize| {
            let full = (layers - from - 1) as f64 * (lin * (b - a) as f64 + att * pairs(a, b));
            let s = r0.clamp(a, b);
            full + kv_only * (s - a) as f64 + lin * (b - s) as f64 + att * pairs(s, b)
        };
        (Q_BLOCK..t_len)
            .step_by(Q_BLOCK)
            .take_while(|&h| cost(0, h) <= cost(h, t_len))
            .last()
    }

    /// Layers `from..` of a window split at row `h`: rows `..h` on this thread, rows `h..`
    /// on whichever worker takes them (or this thread afterwards, when none is free). The
    /// second part's attention needs the first part's keys and values of the same layer,
    /// which a [`Handoff`] passes along; the first part needs nothing from the second.
    fn split_layers(
        &self,
        from: usize,
        h: usize,
        x: &mut [f32],
        pass: &Pass,
    ) -> Result<(), ForwardError> {
        let c = &self.config;
        let t_len = x.len() / c.hidden_size;
        let layers = self.weights.layers.len();
        let (xa, xb) = x.split_at_mut(h * c.hidden_size);
        let handoff = Handoff::default();
        // One part: rows `rows` of the residual stream (`x`) through layers `from..`.
        let part = |rows: std::ops::Range<usize>, x: &mut [f32], link: Link| {
            let mut laps = Laps::new(self.profile);
            let mut bufs = Bufs::new(c, rows.start, rows.end);
            for li in from..layers {
                self.layer(li, rows.clone(), x, &mut bufs, pass, &link, &mut laps)?;
            }
            let (lo, hi) = (rows.start, rows.end);
            laps.report(&format!(
                "window {t_len} tokens, rows {lo}..{hi}, layers {from}.."
            ));
            Ok(())
        };
        let (a, b) = rayon::join(
            || {
                let _close = CloseOnDrop(&handoff);
                part(0..h, xa, Link::Give(&handoff))
            },
            || part(h..t_len, xb, Link::Take(&handoff)),
        );
        match (a, b) {
            (Ok(()), Ok(())) => Ok(()),
            // Both failed: the error the whole window would have met first.
            (Err(Stop::Failed(ea)), Err(Stop::Failed(eb))) => {
                Err(if eb.order() < ea.order() { eb } else { ea })
            }
            (Err(Stop::Failed(e)), _) | (_, Err(Stop::Failed(e))) => Err(e),
            // The second part gives up only when the first stopped early, i.e. failed.
            (_, Err(Stop::Abandoned)) | (Err(Stop::Abandoned), _) => {
                unreachable!("the second part of a window was abandoned without an error")
            }
        }
    }

    /// One decoder layer for rows `rows` of a window (`x` holds exactly those rows of the
    /// residual stream). After the last layer only the rows that predict a target are read,
    /// so there attention output, o-projection and MLP run for rows `first_target - 1..`
    /// only (every row still contributes its key and value); the same bits as for all rows.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        li: usize,
        rows: std::ops::Range<usize>,
        x: &mut [f32],
        b: &mut Bufs,
        pass: &Pass,
        link: &Link,
        laps: &mut Laps,
    ) -> Result<(), Stop> {
        let c = &self.config;
        let l = &self.weights.layers[li];
        let (d, hd, hq, hkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let qkv_w = qd + 2 * kvd;
        let eps = c.rms_norm_eps;
        let (lo, hi) = (rows.start, rows.end);
        let m = hi - lo;

        // Attention block.
        laps.lap(2);
        rms_norm(x, &l.attn_norm, eps, &mut b.h[..m * d]);
        laps.lap(0);
        matmul_wt(&b.h[..m * d], m, d, &l.wqkv, qkv_w, &mut b.qkv, false);
        laps.lap(1);
        if let Some(bias) = &l.bqkv {
            b.qkv
                .par_chunks_mut(qkv_w)
                .for_each(|r| r.iter_mut().zip(bias).for_each(|(a, b)| *a += b));
        }
        // Split qkv[m, q+2kv] into rows lo..hi of q[hi, Hq, D], k[hi, Hkv, D], v[hi, Hkv, D].
        let (q, k, v) = (
            &mut b.q[lo * qd..hi * qd],
            &mut b.k[lo * kvd..hi * kvd],
            &mut b.v[lo * kvd..hi * kvd],
        );
        for (t, r) in b.qkv.chunks(qkv_w).enumerate() {
            q[t * qd..(t + 1) * qd].copy_from_slice(&r[..qd]);
            k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd..qd + kvd]);
            v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd + kvd..]);
        }
        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
            rms_norm_inplace(q, qn, eps);
            rms_norm_inplace(k, kn, eps);
        }
        pass.rope.apply_from(q, hq, lo);
        match pass.shifted_rope {
            Some(shifted) if li == 0 => shifted.apply_from(k, hkv, lo), // test-only fault
            _ => pass.rope.apply_from(k, hkv, lo),
        }
        store_kv(k, hkv, hd, pass.kv, li, "key", lo).map_err(Stop::Failed)?;
        store_kv(v, hkv, hd, pass.kv, li, "value", lo).map_err(Stop::Failed)?;
        match link {
            Link::Alone => {}
            Link::Give(to) => to.give(li, &b.k, &b.v),
            Link::Take(from) => from.take(li, &mut b.k[..lo * kvd], &mut b.v[..lo * kvd])?,
        }
        let r0 = if li + 1 == self.weights.layers.len() {
            (pass.first_target - 1).max(lo)
        } else {
            lo
        };
        laps.lap(2);
        if r0 >= hi {
            return Ok(());
        }
        let n = hi - r0;
        let shape = AttnShape {
            tokens: hi,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: hd,
        };
        causal_attention(&b.q, &b.k, &b.v, &shape, r0, &mut b.attn);
        laps.lap(3);
        let x = &mut x[(r0 - lo) * d..];
        matmul_wt(&b.attn[r0 * qd..], n, qd, &l.wo, d, x, true);
        laps.lap(4);

        // MLP block.
        let (h, gu, act) = (
            &mut b.h[..n * d],
            &mut b.gu[..n * 2 * f],
            &mut b.act[..n * f],
        );
        rms_norm(x, &l.mlp_norm, eps, h);
        laps.lap(0);
        matmul_wt(h, n, d, &l.wgu, 2 * f, gu, false);
        laps.lap(5);
        swiglu(gu, f, act);
        laps.lap(6);
        matmul_wt(act, n, f, &l.wdown, d, x, true);
        laps.lap(7);
        Ok(())
    }
}

/// Windows shorter than this are never split between threads.
const MIN_SPLIT_ROWS: usize = 4 * Q_BLOCK;

/// Whether a window may be split between two threads, and when.
///
/// Why split: when fewer windows than worker threads are left (the end of a stream, or a
/// text of one window), the alternative is to share every op of a window between threads,
/// a fork-join per op, which on a busy 2-core machine is 5-15% slower than two windows side
/// by side (docs/performance.md). Split, rows `..h` run through the remaining layers on one
/// thread and rows `h..` on another, which waits only for the first part's keys and values
/// of each layer.
///
/// Why the bits do not change: every op computes a row from that row alone (matrix
/// products, norms, RoPE, the KV representation), except attention, whose row results do
/// not depend on which query rows are computed with them as long as the query blocks are
/// the same, and `h` is a multiple of the query block (tested below and in
/// tests/determinism.rs).
enum Split<'a> {
    Never,
    /// Ask at each layer boundary (the engine: "is a worker thread free?").
    Ask(&'a (dyn Fn() -> bool + Sync)),
    /// Split before `layer` at row `rows` (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    At {
        layer: usize,
        rows: usize,
    },
}

/// What one layer needs besides its rows.
struct Pass<'a> {
    first_target: usize,
    kv: KvDtype,
    rope: &'a RopeTable,
    /// The test-only `rope-shift` fault's table for layer 0's keys.
    shifted_rope: Option<&'a RopeTable>,
}

/// Work buffers for rows `lo..hi` of a window.
struct Bufs {
    /// h[hi-lo, d]: normed rows.
    h: Vec<f32>,
    /// qkv[hi-lo, Hq·D + 2·Hkv·D]
    qkv: Vec<f32>,
    /// q[hi, Hq, D]: rows lo.. are this part's (the rest are never read).
    q: Vec<f32>,
    /// k[hi, Hkv, D], v[hi, Hkv, D]: rows ..lo come from the first part of a split window.
    k: Vec<f32>,
    v: Vec<f32>,
    /// attn[hi, Hq, D]: attention output, rows lo.. written.
    attn: Vec<f32>,
    /// gu[hi-lo, 2F], act[hi-lo, F]
    gu: Vec<f32>,
    act: Vec<f32>,
}

impl Bufs {
    fn new(c: &ModelConfig, lo: usize, hi: usize) -> Bufs {
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let m = hi - lo;
        Bufs {
            h: vec![0.0; m * d],
            qkv: vec![0.0; m * (qd + 2 * kvd)],
            q: vec![0.0; hi * qd],
            k: vec![0.0; hi * kvd],
            v: vec![0.0; hi * kvd],
            attn: vec![0.0; hi * qd],
            gu: vec![0.0; m * 2 * f],
            act: vec![0.0; m * f],
        }
    }
}

/// How a part of a window shares keys and values with the other part.
enum Link<'a> {
    /// The whole window: nothing to share.
    Alone,
    /// The first part: gives each layer's keys and values to the second.
    Give(&'a Handoff),
    /// The second part: takes rows `..lo` of each layer's keys and values from the first.
    Take(&'a Handoff),
}

/// Why a part of a window stopped early.
enum Stop {
    Failed(ForwardError),
    /// The first part stopped before giving a layer the second part needs (it failed).
    Abandoned,
}

impl Stop {
    /// For the whole window, which never waits on anything.
    fn into_error(self) -> ForwardError {
        match self {
            Stop::Failed(e) => e,
            Stop::Abandoned => unreachable!("a whole window never waits for keys"),
        }
    }
}

impl From<ForwardError> for Stop {
    fn from(e: ForwardError) -> Stop {
        Stop::Failed(e)
    }
}

impl ForwardError {
    /// The order in which an unsplit window would meet these errors: by layer, keys before
    /// values, then by position and head.
    fn order(&self) -> (usize, usize, usize, usize) {
        match *self {
            ForwardError::TokenOutOfRange { pos, .. } => (0, 0, pos, 0),
            ForwardError::NonFiniteKv {
                which,
                layer,
                pos,
                head,
            } => (1 + layer, usize::from(which != "key"), pos, head),
        }
    }
}

/// Keys and values passed from the first part of a split window to the second, one layer
/// at a time and in layer order. The first part never waits (buffers are reused once taken,
/// and new ones are made when none is free), so the second part, which may not start until
/// the first is done when no other thread is free, can never hold it up.
#[derive(Default)]
struct Handoff {
    state: Mutex<HandoffState>,
    ready: Condvar,
}

#[derive(Default)]
struct HandoffState {
    /// (layer, keys, values) given and not yet taken, oldest first.
    given: VecDeque<(usize, Vec<f32>, Vec<f32>)>,
    /// Buffers already taken, for reuse.
    spare: Vec<Vec<f32>>,
    /// The first part has stopped (done, failed or unwinding): nothing more will come.
    closed: bool,
}

impl Handoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandoffState> {
        // No code panics while holding the lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn give(&self, layer: usize, k: &[f32], v: &[f32]) {
        let (mut kb, mut vb) = {
            let mut s = self.lock();
            (
                s.spare.pop().unwrap_or_default(),
                s.spare.pop().unwrap_or_default(),
            )
        };
        kb.clear();
        kb.extend_from_slice(k);
        vb.clear();
        vb.extend_from_slice(v);
        self.lock().given.push_back((layer, kb, vb));
        self.ready.notify_all();
    }

    /// Copies the first part's keys and values of `layer` into `k` and `v`, waiting for
    /// them if needed.
    fn take(&self, layer: usize, k: &mut [f32], v: &mut [f32]) -> Result<(), Stop> {
        let mut s = self.lock();
        let (l, kb, vb) = loop {
            if let Some(next) = s.given.pop_front() {
                break next;
            }
            if s.closed {
                return Err(Stop::Abandoned);
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        };
        drop(s);
        assert_eq!(l, layer, "layers are handed over in order");
        k.copy_from_slice(&kb[..k.len()]);
        v.copy_from_slice(&vb[..v.len()]);
        let mut s = self.lock();
        s.spare.push(kb);
        s.spare.push(vb);
        Ok(())
    }
}

/// Closes a [`Handoff`] when the first part ends, however it ends, so that the second
/// part never waits for a layer that will not come.
struct CloseOnDrop<'a>(&'a Handoff);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.ready.notify_all();
    }
}

/// Passes every (token, KV head) vector of `x[T, Hkv, D]` through the KV representation,
/// refusing non-finite values (a broken model must not be silently quantized). `first` is
/// the window position of the first row, for the error.
fn store_kv(
    x: &mut [f32],
    hkv: usize,
    hd: usize,
    kv: KvDtype,
    layer: usize,
    which: &'static str,
    first: usize,
) -> Result<(), ForwardError> {
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        let vec_idx = i / hd;
        return Err(ForwardError::NonFiniteKv {
            which,
            layer,
            pos: first + vec_idx / hkv,
            head: vec_idx % hkv,
        });
    }
    let is_key = which == "key";
    x.par_chunks_mut(hd).for_each(|vec| {
        if is_key {
            kv.roundtrip_k(vec)
        } else {
            kv.roundtrip_v(vec)
        }
    });
    Ok(())
}

/// A small llama-shaped model (vocabulary 300, 2 layers) with deterministic pseudo-random
/// weights, for unit tests here and in the engine.
#[cfg(test)]
pub(crate) fn synthetic_model() -> CpuModel {
    use crate::model::config::Family;
    use crate::model::weights::LayerWeights;
    let (vocab, d, f, layers, hq, hkv, hd) = (300, 32, 48, 2, 4, 2, 8);
    let mut seed = 1usize;
    let mut gen = |n: usize, scale: f32| -> Vec<f32> {
        seed += 1;
        (0..n)
            .map(|i| ((((i + 7 * seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
            .collect()
    };
    let layer = |gen: &mut dyn FnMut(usize, f32) -> Vec<f32>| LayerWeights {
        attn_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
        wqkv: gen((hq * hd + 2 * hkv * hd) * d, 0.3),
        bqkv: None,
        q_norm: None,
        k_norm: None,
        wo: gen(d * hq * hd, 0.3),
        mlp_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
        wgu: gen(2 * f * d, 0.3),
        wdown: gen(d * f, 0.3),
    };
    let weights = Weights {
        embed: gen(vocab * d, 1.0),
        layers: (0..layers).map(|_| layer(&mut gen)).collect(),
        final_norm: vec![1.0; d],
        lm_head: None,
    };
    let config = ModelConfig {
        tie_word_embeddings: true,
        ..ModelConfig::for_test(Family::Llama, layers, d, hq, hkv, hd, f, vocab)
    };
    CpuModel::new(config, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoring_fewer_targets_gives_the_same_bits_for_the_ones_scored() {
        // The last layer skips the rows that predict no target; whatever the first target,
        // the log-probabilities it does return must be bit-identical to a full run's.
        let m = synthetic_model();
        let tokens: Vec<u32> = (0..700).map(|i| ((i * 7919) % 300) as u32).collect();
        let all = m.window_logprobs(&tokens, 1, KvDtype::Bf16).unwrap();
        assert!(all.iter().all(|x| x.is_finite() && *x <= 0.0));
        for first in [2, 129, 200, 512, 699] {
            let part = m.window_logprobs(&tokens, first, KvDtype::Bf16).unwrap();
            assert_eq!(part.len(), tokens.len() - first);
            assert!(
                part.iter()
                    .zip(&all[first - 1..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "first target {first}"
            );
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn a_window_split_between_threads_gives_the_same_bits() {
        // Any layer, any cut at a multiple of the query block, any first target (including
        // ones that leave the first part without scored rows in the last layer), KV formats
        // with per-vector scales: the same bits as the whole window.
        let m = synthetic_model();
        let tokens: Vec<u32> = (0..700).map(|i| ((i * 7919) % 300) as u32).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for kv in [KvDtype::Bf16, KvDtype::Int8, KvDtype::Nvfp4] {
            for first in [1, 300, 690] {
                let whole = m.window_logprobs(&tokens, first, kv).unwrap();
                for layer in 0..2 {
                    for rows in [64, 320, 640] {
                        let split = Split::At { layer, rows };
                        let part = pool
                            .install(|| m.forward(&tokens, first, kv, split))
                            .unwrap();
                        assert!(
                            same_bits(&whole, &part),
                            "{kv:?}, first target {first}, split before layer {layer} at row {rows}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_engine_hint_is_asked_until_it_says_yes_and_then_never() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let m = synthetic_model();
        let tokens: Vec<u32> = (0..700).map(|i| ((i * 31) % 300) as u32).collect();
        let whole = m.window_logprobs(&tokens, 1, KvDtype::Fp8).unwrap();
        let asked = AtomicUsize::new(0);
        let yes_on_second = || asked.fetch_add(1, Ordering::SeqCst) == 1;
        let split = m
            .window_logprobs_with(&tokens, 1, KvDtype::Fp8, &yes_on_second)
            .unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        assert!(same_bits(&whole, &split));
        // Too short to split: never asked.
        let short = &tokens[..MIN_SPLIT_ROWS - 1];
        m.window_logprobs_with(short, 1, KvDtype::Fp8, &|| -> bool { unreachable!() })
            .unwrap();
    }

    #[test]
    fn a_split_window_reports_the_error_the_whole_window_would() {
        // Token 299's embedding is NaN, so its key is non-finite from layer 0 on. Cut at row
        // 256 before layer 0: a NaN in the first part only (the second part is abandoned),
        // in the second only, and in both (the earlier position wins, as unsplit).
        let mut m = synthetic_model();
        let d = m.config.hidden_size;
        m.weights.embed[299 * d..300 * d].fill(f32::NAN);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for bad in [vec![100], vec![500], vec![100, 500], vec![500, 600]] {
            let mut tokens: Vec<u32> = (0..700).map(|i| ((i * 7919) % 299) as u32).collect();
            bad.iter().for_each(|&p| tokens[p] = 299);
            let whole = m.window_logprobs(&tokens, 1, KvDtype::Bf16).unwrap_err();
            assert_eq!(
                whole,
                ForwardError::NonFiniteKv {
                    which: "key",
                    layer: 0,
                    pos: bad[0],
                    head: 0
                }
            );
            let split = Split::At {
                layer: 0,
                rows: 256,
            };
            let e = pool
                .install(|| m.forward(&tokens, 1, KvDtype::Bf16, split))
                .unwrap_err();
            assert_eq!(e, whole, "NaN at {bad:?}");
        }
    }

    #[test]
    fn the_cut_is_a_whole_query_block_and_puts_more_rows_first() {
        // Later rows see more keys, so the balanced cut lies past the middle.
        let m = synthetic_model();
        for (t_len, from) in [(700, 0), (4096, 1), (4096, 0)] {
            let h = m.split_point(from, t_len, 1).unwrap();
            assert!(
                h.is_multiple_of(Q_BLOCK) && h > t_len / 2 && h < t_len,
                "{t_len}: {h}"
            );
        }
        assert_eq!(m.split_point(0, Q_BLOCK, 1), None);
    }

    #[test]
    fn non_finite_kv_is_an_error_naming_layer_position_and_head() {
        // x[T=3, Hkv=2, D=4]: a NaN at position 2, head 1.
        let mut x = vec![0.5f32; 3 * 2 * 4];
        x[(2 * 2 + 1) * 4 + 3] = f32::NAN;
        let e = store_kv(&mut x, 2, 4, KvDtype::Int8, 7, "key", 0).unwrap_err();
        assert_eq!(
            e,
            ForwardError::NonFiniteKv {
                which: "key",
                layer: 7,
                pos: 2,
                head: 1
            }
        );
        assert_eq!(
            e.to_string(),
            "non-finite key value at layer 7, window position 2, KV head 1"
        );
        let mut y = vec![1.0f32; 8];
        y[0] = f32::INFINITY;
        assert!(store_kv(&mut y, 1, 8, KvDtype::Nvfp4, 0, "value", 0).is_err());
        let mut ok = vec![0.25f32; 8];
        assert!(store_kv(&mut ok, 1, 8, KvDtype::Fp8, 0, "value", 0).is_ok());
    }
}
