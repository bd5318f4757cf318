//! Throughput at real scale: a random-weight artifact of Qwen3-8B's shape (or any preset),
//! context 4096 / stride 2048, against the device's measured bf16 matrix-product rate.
//!
//! Processed tokens per second and achieved TFLOP/s are reported, the FLOPs counted by
//! `model::flops::Work::CudaScoring` (projections, MLP, causal attention, the head on scored rows, the
//! last layer's MLP on the rows the head reads).
//! Target (issue 6): at least 40% of the measured bf16 dense rate. For a hybrid preset it
//! also times the chunked delta rule's two forms on the model's head shapes and the same
//! windows: `delta_rule_chunked` (CUDA cores) against `delta_rule_chunked_tc` (tensor
//! cores, what bf16 mode runs). The numbers are printed and written as JSON to
//! `$NINFER_BENCH_OUT` when set.
//!
//! Settings (environment): NINFER_BENCH_ARTIFACT (an existing artifact to use; else random
//! weights of the preset's shape are generated in memory), NINFER_BENCH_PRESET
//! (qwen3-8b), NINFER_BENCH_LAYERS (the preset's), NINFER_BENCH_WINDOWS (16),
//! NINFER_BENCH_KV (bf16), NINFER_BENCH_CONTEXT (4096), NINFER_BENCH_STRIDE (2048).
//!
//! Needs a CUDA GPU: `cargo bench --bench cuda` (what `ci/gpu-check.sh` runs); without one
//! it says why and exits 1.

use ninfer_perplexity::artifact::Artifact;
use ninfer_perplexity::backend::cuda::plan::Precision;
use ninfer_perplexity::backend::cuda::{bench, CudaModel, Target};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::model::flops::{window_flops, Work};
use ninfer_perplexity::model::presets::preset;
use ninfer_perplexity::score::{windows, Protocol};
use std::time::Instant;

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(d)
}

fn main() {
    if let Err(e) = ninfer_perplexity::backend::cuda::probe(0) {
        eprintln!("bench cuda: needs a CUDA GPU ({e})");
        std::process::exit(1);
    }
    random_model_throughput_against_the_gemm_rate();
}

/// The throughput of the configured model against the device's GEMM rate.
fn random_model_throughput_against_the_gemm_rate() {
    let preset_name = std::env::var("NINFER_BENCH_PRESET").unwrap_or_else(|_| "qwen3-8b".into());
    let config = preset(&preset_name).unwrap();
    let config = config.with_layers(env_or("NINFER_BENCH_LAYERS", config.num_layers));
    let kv = KvDtype::parse(&std::env::var("NINFER_BENCH_KV").unwrap_or_else(|_| "bf16".into()))
        .unwrap();
    let p = Protocol::new(
        env_or("NINFER_BENCH_CONTEXT", 4096),
        env_or("NINFER_BENCH_STRIDE", 2048),
    )
    .unwrap();
    let n_windows: usize = env_or("NINFER_BENCH_WINDOWS", 16);

    // NINFER_BENCH_ARTIFACT: an existing artifact; else random weights of the preset's
    // shape, generated in memory one tensor at a time (nothing written to disk).
    let t = Instant::now();
    let m = match std::env::var("NINFER_BENCH_ARTIFACT") {
        Ok(p) => {
            let a = Artifact::open(std::path::Path::new(&p)).unwrap();
            CudaModel::load(&a, Target::Cuda(0), Precision::Bf16, &mut |_, _| {}).unwrap()
        }
        Err(_) => CudaModel::load_random(&config, 1, Target::Cuda(0), Precision::Bf16).unwrap(),
    };
    let c = m.config().clone();
    let load_s = t.elapsed().as_secs_f64();
    let gemm_tflops = bench::gemm_rate(m.gpu(), 8192, 3, 10).unwrap();

    // Random token ids: the speed does not depend on the text.
    let n_tokens = p.context + p.stride * (n_windows.max(1) - 1);
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let ids: Vec<u32> = (0..n_tokens)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % c.vocab_size as u64) as u32
        })
        .collect();
    let ws = windows(ids.len(), p).unwrap();
    // Warm-up: compiles the kernels and allocates the buffers.
    let t = Instant::now();
    m.score_batches(&ids, &ws[..1], kv, &mut |_, _| Ok(()))
        .unwrap();
    let warm_s = t.elapsed().as_secs_f64();
    let mut finite = true;
    let t = Instant::now();
    m.score_batches(&ids, &ws, kv, &mut |_, b| {
        finite &= b.iter().flatten().all(|v| v.is_finite());
        Ok(())
    })
    .unwrap();
    let score_s = t.elapsed().as_secs_f64();
    assert!(finite, "non-finite log-probabilities");
    let processed: usize = ws.iter().map(|w| w.len()).sum();
    let flops: f64 = ws
        .iter()
        .map(|w| window_flops(&c, Work::CudaScoring, w.len(), w.scored()))
        .sum();
    let tflops = flops / score_s / 1e12;
    let mem = m.memory_report();
    let out = serde_json::json!({
        "artifact": std::env::var("NINFER_BENCH_ARTIFACT").unwrap_or_else(|_| "random weights in memory".into()), "preset": preset_name, "layers": c.num_layers,
        "params": c.num_params(), "kv": kv.name(), "context": p.context, "stride": p.stride,
        "windows": ws.len(), "processed_tokens": processed, "load_s": load_s, "warmup_s": warm_s,
        "score_s": score_s, "tokens_per_s": processed as f64 / score_s, "tflops": tflops,
        "gemm_bf16_tflops": gemm_tflops, "fraction_of_gemm": tflops / gemm_tflops,
        "peak_allocated_bytes": mem.peak_allocated_bytes, "peak_used_bytes": mem.peak_used_bytes,
        "gpu": m.gpu().info.name,
    });
    let mut out = out;
    // Hybrid models: the chunked rule's CUDA-core form (f32 mode's) against its tensor-core
    // form (bf16 mode's, the one timed above) on the same inputs, at the model's head shapes.
    if let Some(h) = c.hybrid.as_ref() {
        let (hk, dk, hv, dv) = (
            h.linear_num_key_heads,
            h.linear_key_head_dim,
            h.linear_num_value_heads,
            h.linear_value_head_dim,
        );
        let d = bench::delta_rule_times(m.gpu(), ws.len(), p.context, hk, dk, hv, dv, 5).unwrap();
        eprintln!(
            "delta_rule_chunked ({} windows x {} rows, Hk {hk}, Hv {hv}, {dk} x {dv}): CUDA cores {:.3} ms, \
             tensor cores {:.3} ms ({:.2}x), outputs within {:.1e}",
            ws.len(),
            p.context,
            d.cuda_cores_s * 1e3,
            d.tensor_cores_s * 1e3,
            d.cuda_cores_s / d.tensor_cores_s,
            d.max_rel_diff
        );
        out["delta_rule_cuda_cores_ms"] = (d.cuda_cores_s * 1e3).into();
        out["delta_rule_tensor_cores_ms"] = (d.tensor_cores_s * 1e3).into();
        out["delta_rule_max_rel_diff"] = d.max_rel_diff.into();
    }
    eprintln!("{out}");
    if let Ok(path) = std::env::var("NINFER_BENCH_OUT") {
        std::fs::write(path, out.to_string()).unwrap();
    }
}
