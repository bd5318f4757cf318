//! Where the CPU forward pass spends its time: every operation of one window, timed alone
//! on the shapes the engine uses, so a change can be judged op by op before and after.
//!
//! `cargo bench --bench ops [-- --context 1024 --scored 512 --threads 2 --kv bf16]`
//!
//! Shapes are SmolLM2-135M's (30 layers, d 576, 9 query / 3 KV heads of 64, MLP 1536,
//! vocabulary 49,152) with synthetic weights, so no artifact is needed. Per-layer ops are
//! timed once per call and multiplied by the layer count; the table gives seconds per
//! window, the share of the total, and GFLOP/s where the op is a matrix product.

use ninfer_perplexity::backend::cpu::attention::{causal_attention, AttnShape};
use ninfer_perplexity::backend::cpu::head;
use ninfer_perplexity::backend::cpu::matmul::matmul_wt;
use ninfer_perplexity::backend::cpu::norm::{rms_norm, swiglu};
use ninfer_perplexity::backend::cpu::rope::{inv_freq, RopeTable};
use ninfer_perplexity::kv::KvDtype;
use rayon::prelude::*;
use std::time::Instant;

mod common;

use common::arg;

const LAYERS: usize = 30;
const D: usize = 576;
const HQ: usize = 9;
const HKV: usize = 3;
const HD: usize = 64;
const F: usize = 1536;
const VOCAB: usize = 49_152;

fn filled(n: usize, seed: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((((i + seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
        .collect()
}

/// Best of `reps` timings of `f`, in seconds (after one warm-up call).
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let t: usize = arg("--context", 1024);
    let scored: usize = arg("--scored", t / 2);
    let threads: usize = arg("--threads", 2);
    let kv = KvDtype::parse(&arg("--kv", "bf16".to_string())).expect("--kv");
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("rayon pool");
    let reps = 5;
    let (qd, kvd) = (HQ * HD, HKV * HD);
    let qkv_w = qd + 2 * kvd;

    let x = filled(t * D, 1, 1.0);
    let norm_w = filled(D, 2, 1.0);
    let wqkv = filled(qkv_w * D, 3, 0.05);
    let wo = filled(D * qd, 4, 0.05);
    let wgu = filled(2 * F * D, 5, 0.05);
    let wdown = filled(D * F, 6, 0.05);
    let emb = filled(VOCAB * D, 7, 0.05);
    let mut h = vec![0.0f32; t * D];
    let mut qkv = vec![0.0f32; t * qkv_w];
    let mut q = filled(t * qd, 8, 1.0);
    let mut k = filled(t * kvd, 9, 1.0);
    let v = filled(t * kvd, 10, 1.0);
    let mut attn = vec![0.0f32; t * qd];
    let mut out = vec![0.0f32; t * D];
    let gu = filled(t * 2 * F, 11, 1.0);
    let mut g = vec![0.0f32; t * 2 * F];
    let mut act = vec![0.0f32; t * F];
    let rope = RopeTable::new(&inv_freq(HD, 100_000.0, None), t);
    let shape = AttnShape {
        tokens: t,
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: HD,
    };
    let targets: Vec<u32> = (0..scored).map(|i| ((i * 7919) % VOCAB) as u32).collect();
    let mut lp = vec![0.0f32; scored];
    let hn = filled(scored * D, 12, 1.0);

    let pairs = (t * (t + 1) / 2) as f64;
    let gemm = |m: usize, k: usize, n: usize| 2.0 * (m * k * n) as f64;
    // (name, seconds per window, flops per window)
    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    let per_layer = LAYERS as f64;
    // `--only NAME` times just the ops whose name contains NAME (for profiling one op).
    let only = arg("--only", String::new());
    let want = |name: &str| name.contains(only.as_str());
    if want("rms_norm x2") {
        rows.push((
            "rms_norm x2",
            2.0 * per_layer * time(reps, || rms_norm(&x, &norm_w, 1e-5, &mut h)),
            0.0,
        ));
    }
    if want("qkv projection") {
        rows.push((
            "qkv projection",
            per_layer * time(reps, || matmul_wt(&x, t, D, &wqkv, qkv_w, &mut qkv, false)),
            per_layer * gemm(t, D, qkv_w),
        ));
    }
    if want("rope q+k") {
        rows.push((
            "rope q+k",
            per_layer
                * time(reps, || {
                    rope.apply(&mut q, HQ);
                    rope.apply(&mut k, HKV);
                }),
            0.0,
        ));
    }
    let mut kk = k.clone();
    let mut vv = v.clone();
    if want("kv roundtrip") {
        rows.push((
            "kv roundtrip",
            per_layer
                * time(reps, || {
                    kk.par_chunks_mut(HD).for_each(|c| kv.roundtrip_k(0, c));
                    vv.par_chunks_mut(HD).for_each(|c| kv.roundtrip_v(0, c));
                }),
            0.0,
        ));
    }
    if want("attention") {
        rows.push((
            "attention",
            per_layer * time(reps, || causal_attention(&q, &k, &v, &shape, 0, &mut attn)),
            per_layer * 4.0 * pairs * qd as f64,
        ));
    }
    if want("o projection") {
        rows.push((
            "o projection",
            per_layer * time(reps, || matmul_wt(&attn, t, qd, &wo, D, &mut out, true)),
            per_layer * gemm(t, qd, D),
        ));
    }
    if want("gate/up projection") {
        rows.push((
            "gate/up projection",
            per_layer * time(reps, || matmul_wt(&x, t, D, &wgu, 2 * F, &mut g, false)),
            per_layer * gemm(t, D, 2 * F),
        ));
    }
    if want("swiglu") {
        rows.push((
            "swiglu",
            per_layer * time(reps, || swiglu(&gu, F, &mut act)),
            0.0,
        ));
    }
    if want("down projection") {
        rows.push((
            "down projection",
            per_layer * time(reps, || matmul_wt(&act, t, F, &wdown, D, &mut out, true)),
            per_layer * gemm(t, F, D),
        ));
    }
    if want("head + log-softmax") {
        rows.push((
            "head + log-softmax",
            time(reps, || {
                head::logprobs(&hn, D, &emb, VOCAB, &targets, &mut lp).expect("finite logits")
            }),
            gemm(scored, D, VOCAB),
        ));
    }
    if want("head + calibration") {
        // The same with the entropy and top-1 the reports carry (what the CLI runs).
        let mut rs = vec![head::RowScore::default(); scored];
        rows.push((
            "head + calibration",
            time(reps, || {
                head::score_rows(&hn, D, &emb, VOCAB, &targets, &mut rs).expect("finite logits")
            }),
            gemm(scored, D, VOCAB),
        ));
    }

    let total: f64 = rows.iter().map(|r| r.1).sum();
    let flops: f64 = rows.iter().map(|r| r.2).sum();
    println!(
        "SmolLM2-135M shapes, window {t} tokens, {scored} scored, KV {}, {threads} threads",
        kv.name()
    );
    println!();
    println!("| op | ms / window | share | GFLOP/s |");
    println!("|---|---:|---:|---:|");
    for (name, s, f) in &rows {
        let rate = if *f > 0.0 {
            format!("{:.1}", f / s / 1e9)
        } else {
            "-".into()
        };
        println!(
            "| {name} | {:.1} | {:.1}% | {rate} |",
            s * 1e3,
            100.0 * s / total
        );
    }
    println!(
        "| total | {:.1} | 100% | {:.1} |",
        total * 1e3,
        flops / total / 1e9
    );
    let square = 2048;
    let a = filled(square * square, 13, 1.0);
    let b = filled(square * square, 14, 1.0);
    let mut c = vec![0.0f32; square * square];
    let s = time(3, || {
        matmul_wt(&a, square, square, &b, square, &mut c, false)
    });
    println!();
    println!(
        "f32 GEMM {square}^3 through the same path: {:.1} GFLOP/s",
        gemm(square, square, square) / s / 1e9
    );
}
