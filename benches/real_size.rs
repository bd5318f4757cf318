//! Real sizes on the CPU: the spec's 27B-parameter Qwen3.5 hybrid with NVFP4 weights and
//! Qwen3-8B with bf16 weights (random weights of their published shapes), each scoring a few
//! windows, beside SmolLM2-135M in the same run. It prints the artifact's bytes, the run's
//! peak resident set (the process's, from its report), processed tokens per second and
//! GFLOP/s, against the GEMM rate this machine measures now on the 27B's widest product.
//!
//! `cargo bench --bench real_size [-- --context 512 --windows 1 --threads 2 --skip-8b]`
//!
//! The artifacts are packed once, with `ninfer-pack random`, under `eval/.cache/real/`
//! (about 19 GB and 16 GB; packing takes minutes). Each model is scored by the evaluator
//! binary in a process of its own, so its peak resident set is its own. Needs `bash
//! ci/prepare.sh` for SmolLM2.

mod common;

use common::arg;
use ninfer_perplexity::artifact::Artifact;
use ninfer_perplexity::backend::cpu::matmul::matmul_wt;
use ninfer_perplexity::model::flops::{window_flops, Work};
use ninfer_perplexity::model::presets::preset;
use ninfer_perplexity::score::{windows, Protocol};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bin(name: &str) -> PathBuf {
    root().join("target/release").join(name)
}

/// `ninfer-pack random` once, unless the file is there.
fn packed(preset_name: &str, weights: &str) -> PathBuf {
    let out = root().join(format!("eval/.cache/real/{preset_name}-{weights}.ninfer"));
    if !out.exists() {
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        eprintln!("real_size: packing {preset_name} ({weights}); this takes minutes, once");
        let t = Instant::now();
        let ok = Command::new(bin("ninfer-pack"))
            .args([
                "random",
                "--preset",
                preset_name,
                "--weights",
                weights,
                "-o",
            ])
            .arg(&out)
            .status()
            .unwrap()
            .success();
        assert!(ok, "ninfer-pack random failed");
        eprintln!("real_size: packed in {:.0} s", t.elapsed().as_secs_f64());
    }
    out
}

struct Row {
    name: String,
    artifact_bytes: u64,
    peak_rss: u64,
    tokens: usize,
    score_s: f64,
    gflop: f64,
}

/// Scores the first `windows` windows of `context` tokens (stride `context / 2`) of a text
/// with the evaluator; FLOPs as the CPU computes them (`Work::CpuScoring`).
fn score(name: &str, art: &Path, context: usize, n: usize, threads: usize) -> Row {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    let stream =
        std::fs::read_to_string(root().join("eval/corpora/perplexity-1m/streams/en-long-1.txt"))
            .expect("run bash ci/prepare.sh (the corpus)");
    std::fs::write(&text, &stream[..stream.len().min(64 * context * n)]).unwrap();
    let stride = context / 2;
    let max_tokens = context + stride * (n - 1);
    let out = dir.path().join("out");
    let o = Command::new(bin("ninfer-perplexity"))
        .arg(art)
        .arg("--text")
        .arg(&text)
        .args([
            "--device",
            "cpu",
            "--kv-dtype",
            "bf16",
            "--log-level",
            "warn",
        ])
        .args([
            "--context",
            &context.to_string(),
            "--stride",
            &stride.to_string(),
        ])
        .args([
            "--max-tokens",
            &max_tokens.to_string(),
            "--threads",
            &threads.to_string(),
        ])
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let s = &r["streams"][0];
    let tokens = s["input_tokens"].as_u64().unwrap() as usize;
    let config = Artifact::open(art).unwrap().config;
    let gflop: f64 = windows(tokens, Protocol::new(context, stride).unwrap())
        .unwrap()
        .iter()
        .map(|w| window_flops(&config, Work::CpuScoring, w.len(), w.scored()))
        .sum::<f64>()
        / 1e9;
    Row {
        name: name.into(),
        artifact_bytes: std::fs::metadata(art).unwrap().len(),
        peak_rss: r["peak_rss_bytes"].as_u64().unwrap(),
        tokens: s["processed_tokens"].as_u64().unwrap() as usize,
        score_s: r["timings"]["score_s"].as_f64().unwrap(),
        gflop,
    }
}

/// GFLOP/s of the crate's f32 GEMM on `[m, k] x [n, k]ᵀ` (the fastest of three runs).
fn gemm_rate(m: usize, k: usize, n: usize, threads: usize) -> f64 {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5)
        .collect();
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 104729) % 997) as f32 / 997.0 - 0.5)
        .collect();
    let mut out = vec![0f32; m * n];
    (0..3)
        .map(|_| {
            let t = Instant::now();
            pool.install(|| matmul_wt(&x, m, k, &w, n, &mut out, false));
            2.0 * (m * k * n) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    let context: usize = arg("--context", 512);
    let n: usize = arg("--windows", 1);
    let threads: usize = arg("--threads", 2);
    let skip_8b = std::env::args().any(|a| a == "--skip-8b");
    assert!(
        bin("ninfer-perplexity").exists(),
        "cargo build --release first"
    );
    let mut rows = vec![score(
        "smollm2-135m (bf16)",
        &root().join("models/smollm2-135m-bf16.ninfer"),
        context,
        n,
        threads,
    )];
    if !skip_8b {
        let a = packed("qwen3-8b", "bf16");
        rows.push(score("qwen3-8b (bf16)", &a, context, n, threads));
    }
    let a = packed("qwen3_5-27b", "nvfp4");
    rows.push(score("qwen3_5-27b (nvfp4)", &a, context, n, threads));
    // The 27B's widest product: the gate/up projection of `context` rows.
    let c = preset("qwen3_5-27b").unwrap();
    let rate = gemm_rate(
        context,
        c.hidden_size,
        2 * c.intermediate_size.min(8192),
        threads,
    );
    println!(
        "{:<22} {:>12} {:>12} {:>14} {:>8} {:>10} {:>9} {:>8}",
        "model",
        "artifact GB",
        "peak RSS GB",
        "RSS - artifact",
        "tokens",
        "tokens/s",
        "GFLOP/s",
        "of GEMM"
    );
    for r in &rows {
        let gflops = r.gflop / r.score_s;
        println!(
            "{:<22} {:>12.2} {:>12.2} {:>13.2}G {:>8} {:>10.1} {:>9.1} {:>7.0}%",
            r.name,
            r.artifact_bytes as f64 / 1e9,
            r.peak_rss as f64 / 1e9,
            (r.peak_rss as f64 - r.artifact_bytes as f64) / 1e9,
            r.tokens,
            r.tokens as f64 / r.score_s,
            gflops,
            100.0 * gflops / rate
        );
    }
    println!(
        "GEMM rate now: {rate:.1} GFLOP/s (f32, [{context}, {}] x [{}, {}]ᵀ, {threads} threads)",
        c.hidden_size,
        2 * c.intermediate_size.min(8192),
        c.hidden_size
    );
    let (small, big) = (&rows[0], rows.last().unwrap());
    println!(
        "27B GFLOP/s / SmolLM2 GFLOP/s: {:.2}",
        (big.gflop / big.score_s) / (small.gflop / small.score_s)
    );
}
