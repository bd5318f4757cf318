//! CUDA against the CPU reference: per-token log-probabilities and per-stream mean NLL for
//! every Main KV representation, in both CUDA precisions, on
//! - SmolLM2-135M (bf16 artifact; head_dim 64: the tensor-core attention in bf16 mode),
//! - the tiny qwen3 fixture (q/k norm, head_dim 8: the f32 attention kernel),
//! - a small random-weight qwen3 with head_dim 128 (the d128 tensor-core kernel),
//!
//! each on the corpus's four quick streams cut to their first `NINFER_PARITY_TOKENS` tokens
//! (1024) with context 512 / stride 256. Also: a rerun gives the same bits, one window per
//! pass gives what packed passes give, and a bad token fails with the CPU's message.
//!
//! Bounds on the per-stream |Δ mean NLL|: f32 precision with the f32 KV differs from the
//! CPU by summation order only (1e-5 relative); every other combination rounds somewhere
//! (bf16 activations, quantized K/V), and a rounding decision that flips on a 1e-7 change
//! moves later layers, so those bounds are measured (see [`Bounds`]). Every number is
//! printed, and appended as JSON lines to `$NINFER_PARITY_OUT` when set (ci/gpu-check.sh
//! builds its table from them).
//!
//! Each case runs on the emulated device (`<case>::emu`: the CUDA model with its kernels
//! compiled for the host, small models and short streams, in every `cargo test`) and on a
//! CUDA GPU (`<case>::cuda`: reported ignored where there is none; `ci/gpu-check.sh` runs
//! them).

use crate::Dev;
use ninfer_perplexity::artifact::{write_artifact, Artifact, WeightFormat};
use ninfer_perplexity::backend::cuda::plan::{AttnKernel, Precision};
use ninfer_perplexity::backend::cuda::{CudaModel, Target};
use ninfer_perplexity::backend::DeviceRequest;
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::model::config::ModelConfig;
use ninfer_perplexity::model::presets::preset;
use ninfer_perplexity::pack::hf::read_hf_dir;
use ninfer_perplexity::pack::random::{write_random_artifact, RandomSpec};
use ninfer_perplexity::score::{windows, Protocol};
use std::path::{Path, PathBuf};

/// Per-stream |Δ mean NLL| bounds of one case, by precision.
#[derive(Clone, Copy)]
struct Bounds {
    /// f32 precision, every KV representation: absolute (GPU) or relative (emulated).
    f32_abs: Option<f64>,
    f32_rel: Option<f64>,
    /// f32 precision with a quantized Main KV (int8, fp8, nvfp4, k8v4), relative, where
    /// it differs from `f32_rel`.
    f32_quant_rel: Option<f64>,
    /// bf16 precision, every KV representation: relative to the CPU's mean NLL.
    bf16_rel: f64,
}

/// bf16 precision on the emulated device: worst per-stream relative |Δ mean NLL| over the
/// emulated cases below, every KV representation, on the two quick streams of 160 tokens
/// the tests use: measured 1.87e-3 (tiny-qwen3_5, nvfp4: bf16 activations on a model of
/// width 16; the non-hybrid cases stay below 1.2e-3); bound twice that. A first figure for
/// the GPU too, until `ci/gpu-check.sh` measures one there.
const BF16_REL: f64 = 3.8e-3;

/// On a GPU: the project's parity target in f32 precision, the measured bf16 bound.
const GPU_BOUNDS: Bounds = Bounds {
    f32_abs: Some(1e-3),
    f32_rel: None,
    f32_quant_rel: None,
    bf16_rel: BF16_REL,
};

/// On the emulated device: in f32 precision the CUDA model differs from the CPU by
/// summation order and `expf` only (worst measured 9.2e-7 relative with f32 or bf16 K/V,
/// random-hybrid bf16):
/// held to 1e-5 relative. A quantized K/V turns those last bits into rounding decisions
/// that flip, and a flipped code moves every later layer: worst measured EMU_QUANT_WORST
/// (random-hybrid, nvfp4), bound twice that.
const EMU_QUANT_WORST: f64 = 1.6e-5;
const EMU_BOUNDS: Bounds = Bounds {
    f32_abs: None,
    f32_rel: Some(1e-5),
    f32_quant_rel: Some(2.0 * EMU_QUANT_WORST),
    bf16_rel: BF16_REL,
};

/// Where a case runs, and what it is held to.
#[derive(Clone, Copy)]
struct Run {
    target: Target,
    bounds: Bounds,
    protocol: Protocol,
    tokens: usize,
    /// The first this many of the four quick streams.
    streams: usize,
}

impl Run {
    /// A GPU runs the project's parity protocol; the emulated device short streams and
    /// windows (it runs at tens of tokens per second on a SmolLM2-sized layer).
    fn on(dev: Dev) -> Run {
        match dev {
            Dev::Cuda => Run {
                target: Target::Cuda(0),
                bounds: GPU_BOUNDS,
                protocol: Protocol::new(512, 256).unwrap(),
                tokens: parity_tokens(),
                streams: 4,
            },
            Dev::Emu => Run {
                target: Target::Emulated,
                bounds: EMU_BOUNDS,
                protocol: Protocol::new(96, 48).unwrap(),
                tokens: 160,
                streams: 2,
            },
        }
    }
}

fn repo() -> PathBuf {
    crate::common::repo()
}

fn parity_tokens() -> usize {
    std::env::var("NINFER_PARITY_TOKENS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024)
}

/// The corpus's quick streams (one per domain), tokenized and cut.
fn quick_streams(tok: &dyn Fn(&str) -> Vec<u32>, max: usize) -> Vec<(String, Vec<u32>)> {
    let c = ninfer_perplexity::corpus::Corpus::open(
        &repo().join("eval/corpora/perplexity-1m/manifest.json"),
        None,
    )
    .unwrap();
    let mut out = Vec::new();
    for s in c.select(true, &[]).unwrap() {
        let id = s.id.clone();
        let p = c.file_of(s);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (build the corpus: bash ci/prepare.sh)",
                p.display()
            )
        });
        let mut ids = tok(&text);
        ids.truncate(max);
        out.push((id, ids));
    }
    assert_eq!(out.len(), 4, "four quick streams");
    out
}

#[derive(Default, Debug)]
struct Cmp {
    max_abs_lp: f64,
    max_stream_dmean: f64,
    tokens: usize,
}

fn emit(line: serde_json::Value) {
    eprintln!("{line}");
    if let Ok(p) = std::env::var("NINFER_PARITY_OUT") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }
}

/// Per-window log-probabilities of one stream on the GPU.
fn gpu_logprobs(m: &CudaModel, tokens: &[u32], p: Protocol, kv: KvDtype) -> Vec<f32> {
    let ws = windows(tokens.len(), p).unwrap();
    let mut out = Vec::new();
    m.score_batches(tokens, &ws, kv, &mut |_, batch| {
        for lps in batch {
            out.extend(lps);
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("CUDA scoring failed: {e}"));
    out
}

fn mean_nll(lps: &[f32]) -> f64 {
    -lps.iter().map(|&v| v as f64).sum::<f64>() / lps.len() as f64
}

/// Compares CUDA with the CPU for every KV format and both precisions; returns failures.
fn run_case(run: &Run, case: &str, artifact: &Path, streams: &[(String, Vec<u32>)]) -> Vec<String> {
    let streams = &streams[..run.streams.min(streams.len())];
    let p = run.protocol;
    let b = run.bounds;
    let device = match run.target {
        Target::Emulated => "emu",
        Target::Cuda(_) => "cuda",
    };
    let cpu = Engine::load(
        artifact,
        &LoadOptions {
            device: DeviceRequest::Cpu,
            threads: 0,
            verify_digest: false,
            precision: None,
            ..LoadOptions::default()
        },
        &mut |_, _| {},
    )
    .unwrap();
    let t = std::time::Instant::now();
    let mut cpu_lps = Vec::new();
    let kvs = kv_matrix(cpu.artifact.config.num_layers);
    for &kv in &kvs {
        let per: Vec<Vec<f32>> = streams
            .iter()
            .map(|(_, ids)| {
                let s = cpu.score(ids, p, kv, true, &mut |_, _| {}).unwrap();
                s.windows
                    .into_iter()
                    .flat_map(|w| w.logprobs.unwrap())
                    .collect()
            })
            .collect();
        cpu_lps.push(per);
    }
    eprintln!("{case}: CPU reference in {:.1}s", t.elapsed().as_secs_f64());
    let a = Artifact::open(artifact).unwrap();
    let mut failures = Vec::new();
    for precision in [Precision::F32, Precision::Bf16] {
        let m = CudaModel::load(&a, run.target, precision, &mut |_, _| {}).unwrap();
        // On the emulated device, a bf16 run whose attention is the f32 kernel (head dims
        // other than 64 and 128) differs from the f32 run only in how activations round,
        // which one exact and one 4-bit KV format show: the other formats' code paths there
        // are the f32 run's (and every format's kernels are checked bit for bit in `kv` and
        // `kernels`). A GPU, and the tensor-core heads, run every format in both precisions.
        let every_kv = run.target != Target::Emulated
            || precision == Precision::F32
            || m.attention_kernel() != AttnKernel::F32;
        for (ki, &kv) in kvs.iter().enumerate() {
            if !every_kv && !matches!(kv, KvDtype::F32 | KvDtype::Nvfp4) {
                continue;
            }
            let t = std::time::Instant::now();
            let mut c = Cmp::default();
            let mut stream_d = Vec::new();
            let mut worst_rel = 0f64;
            for (si, (id, ids)) in streams.iter().enumerate() {
                let g = gpu_logprobs(&m, ids, p, kv);
                let want = &cpu_lps[ki][si];
                assert_eq!(g.len(), want.len(), "{case} {id}: scored tokens");
                for (x, y) in g.iter().zip(want) {
                    assert!(
                        x.is_finite(),
                        "{case} {id} {}: non-finite CUDA log-probability",
                        kv.name()
                    );
                    c.max_abs_lp = c.max_abs_lp.max((*x as f64 - *y as f64).abs());
                }
                c.tokens += g.len();
                let d = (mean_nll(&g) - mean_nll(want)).abs();
                c.max_stream_dmean = c.max_stream_dmean.max(d);
                worst_rel = worst_rel.max(d / mean_nll(want).abs());
                stream_d.push(serde_json::json!({"stream": id, "cpu_mean_nll": mean_nll(want), "cuda_mean_nll": mean_nll(&g)}));
            }
            emit(serde_json::json!({
                "case": case, "device": device, "precision": precision.name(), "kv": kv_label(kv),
                "attention": format!("{:?}", m.attention_kernel()),
                "max_abs_dlogprob": c.max_abs_lp, "max_stream_dmean_nll": c.max_stream_dmean,
                "max_stream_rel_dmean_nll": worst_rel,
                "tokens": c.tokens, "gpu_s": t.elapsed().as_secs_f64(), "streams": stream_d,
            }));
            let exact = precision == Precision::F32 && kv == KvDtype::F32;
            let mut check = |got: f64, bound: f64, what: &str| {
                if got > bound {
                    failures.push(format!(
                        "{case} on {device} {} {}: per-stream {what} |Δ mean NLL| {got:.3e} > {bound:e}",
                        precision.name(),
                        kv_label(kv),
                    ));
                }
            };
            if precision == Precision::F32 {
                if let Some(bound) = b.f32_abs {
                    check(c.max_stream_dmean, bound, "absolute");
                }
                let quantized = !matches!(kv, KvDtype::F32 | KvDtype::Bf16);
                let rel = match b.f32_quant_rel {
                    Some(q) if quantized => Some(q),
                    _ => b.f32_rel,
                };
                if let Some(bound) = rel {
                    check(worst_rel, bound, "relative");
                }
            } else {
                check(worst_rel, b.bf16_rel, "relative");
            }
            // The exact path in f32 arithmetic differs from the CPU by summation order only.
            if exact && c.max_abs_lp > 1e-3 {
                failures.push(format!(
                    "{case} on {device} f32 f32: max |Δ logprob| {:.3e} > 1e-3",
                    c.max_abs_lp
                ));
            }
        }
    }
    failures
}

fn assert_none(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} parity failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// SmolLM2-135M itself: on a GPU only (the emulated device would take hours).
mod smollm2_matches_the_cpu_for_every_kv_format {
    use super::*;

    #[test(gpu)]
    fn cuda() {
        smollm2_case()
    }
}

fn smollm2_case() {
    let run = Run::on(Dev::Cuda);
    let art = repo().join("models/smollm2-135m-bf16.ninfer");
    let e = Engine::load(&art, &LoadOptions::default(), &mut |_, _| {}).unwrap();
    let streams = quick_streams(&|t| e.tokenizer.encode(t).unwrap(), run.tokens);
    drop(e);
    assert_none(run_case(&run, "smollm2-135m-bf16", &art, &streams));
}

/// A tiny fixture checkpoint (`eval/fixtures/tiny-<family>`) packed in bf16.
fn tiny(dir: &Path, family: &str) -> PathBuf {
    let tok = repo().join("models/cache/qwen3-tokenizer.json");
    let src = read_hf_dir(
        &repo().join(format!("eval/fixtures/tiny-{family}")),
        Some(&tok),
    )
    .unwrap();
    let p = dir.join(format!("tiny-{family}-bf16.ninfer"));
    write_artifact(&src, WeightFormat::Bf16, &p).unwrap();
    p
}

fn tiny_qwen3(dir: &Path) -> PathBuf {
    tiny(dir, "qwen3")
}

fn tiny_case(run: &Run, family: &str) {
    let d = tempfile::tempdir().unwrap();
    let art = tiny(d.path(), family);
    let e = Engine::load(&art, &LoadOptions::default(), &mut |_, _| {}).unwrap();
    let streams = quick_streams(&|t| e.tokenizer.encode(t).unwrap(), run.tokens);
    drop(e);
    assert_none(run_case(run, &format!("tiny-{family}"), &art, &streams));
}

device_case!(tiny_qwen3_matches_the_cpu_for_every_kv_format, |dev| {
    tiny_case(&Run::on(dev), "qwen3")
});

/// qkv biases and an untied head.
#[test(gxx)]
fn tiny_qwen2_matches_the_cpu_on_the_emulated_device() {
    tiny_case(&Run::on(Dev::Emu), "qwen2");
}

device_case!(
    /// The tiny Qwen3.5 hybrid fixture (4 Gated DeltaNet + 2 gated attention layers,
    /// value/key heads 3:1, rotary dim half the head): windows of 96 cross the State
    /// kernels' chunks.
    tiny_qwen3_5_matches_the_cpu_for_every_kv_format,
    |dev| tiny_case(&Run::on(dev), "qwen3_5")
);

/// The tiny mixture-of-experts fixtures (8 experts, top-2; qwen3_5_moe and qwen3_next with a
/// gated shared expert, qwen3_next with dense layers too): the router, the tokens grouped
/// by expert, the per-expert GEMMs and the combination (src/backend/cuda/moe.rs).
///
/// In bf16 the router sees bf16-rounded rows, and on these width-16 models a rounded row
/// sometimes picks another expert, a whole expert's output for that token: worst measured
/// per-stream relative |Δ mean NLL| 4.17e-3 (tiny-qwen3_next, nvfp4 K/V), bound twice that.
/// In f32 the MoE cases stay within the dense bounds (worst 1.4e-6 relative).
const MOE_BF16_REL: f64 = 8.4e-3;

fn moe_run(run: Run) -> Run {
    Run {
        bounds: Bounds {
            bf16_rel: MOE_BF16_REL,
            ..run.bounds
        },
        ..run
    }
}

device_case!(tiny_moe_families_match_the_cpu_for_every_kv_format, |dev| {
    for family in ["qwen3_moe", "qwen3_5_moe", "qwen3_next"] {
        tiny_case(&moe_run(Run::on(dev)), family);
    }
});

/// The Qwen3.5 27B's layer pattern and head ratios at a small width: 3 Gated DeltaNet
/// layers then a gated attention layer of head_dim 64 (the tensor-core attention in bf16)
/// with a quarter rotated.
fn small_hybrid() -> ModelConfig {
    let mut c = preset("qwen3_5-27b").unwrap().with_layers(4);
    let h = c.hybrid.as_mut().unwrap();
    (
        h.rotary_dim,
        h.linear_num_key_heads,
        h.linear_num_value_heads,
    ) = (16, 2, 6);
    (h.linear_key_head_dim, h.linear_value_head_dim) = (32, 32);
    ModelConfig {
        hidden_size: 256,
        intermediate_size: 512,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        vocab_size: 4096,
        ..c
    }
}

device_case!(random_hybrid_matches_the_cpu_for_every_kv_format, |dev| {
    random_case(&Run::on(dev), "random-hybrid", small_hybrid(), 11)
});

/// The 27B's own head shapes at a small width: gated attention of head_dim 256 (the
/// tensor-core kernel's 32-key tiles in bf16) and Gated DeltaNet heads of 128 x 128 (the
/// chunked rule at its largest shared-memory plan).
fn small_hybrid_real_heads() -> ModelConfig {
    let mut c = small_hybrid();
    let h = c.hybrid.as_mut().unwrap();
    (
        h.rotary_dim,
        h.linear_num_key_heads,
        h.linear_num_value_heads,
    ) = (64, 1, 2);
    (h.linear_key_head_dim, h.linear_value_head_dim) = (128, 128);
    ModelConfig {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 256,
        ..c
    }
}

device_case!(
    random_hybrid_with_the_27b_head_shapes_matches_the_cpu,
    |dev| {
        random_case(
            &Run::on(dev),
            "random-hybrid-hd256",
            small_hybrid_real_heads(),
            13,
        )
    }
);

/// SmolLM2's shape (llama, 9/3 heads of 64, tied 49,152-entry head) with 2 layers of
/// random weights: the head_dim-64 tensor-core path, needing no files.
fn smollm2_shaped() -> ModelConfig {
    ModelConfig {
        num_layers: 2,
        ..preset("smollm2-135m").unwrap()
    }
}

/// A random-weight artifact of `config` written into `dir`.
fn random_artifact(dir: &Path, name: impl AsRef<str>, config: ModelConfig, seed: u64) -> PathBuf {
    let art = dir.join(name.as_ref());
    write_random_artifact(
        &RandomSpec {
            config,
            seed,
            tokenizer_json: None,
            quantize: None,
        },
        &art,
        &mut |_, _| {},
    )
    .unwrap();
    art
}

fn random_case(run: &Run, case: &str, config: ModelConfig, seed: u64) {
    let d = tempfile::tempdir().unwrap();
    let art = random_artifact(d.path(), format!("{case}.ninfer"), config, seed);
    let streams = quick_streams(&|t| t.bytes().map(u32::from).collect(), run.tokens);
    assert_none(run_case(run, case, &art, &streams));
}

device_case!(
    random_smollm2_shaped_matches_the_cpu_for_every_kv_format,
    |dev| { random_case(&Run::on(dev), "random-smollm2-2l", smollm2_shaped(), 7) }
);

device_case!(
    random_qwen3_hd128_matches_the_cpu_for_every_kv_format,
    |dev| { random_case(&Run::on(dev), "random-qwen3-hd128", small_hd128(), 3) }
);

fn small_hd128() -> ModelConfig {
    ModelConfig {
        num_layers: 2,
        hidden_size: 512,
        intermediate_size: 1024,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
        vocab_size: 4096,
        ..preset("qwen3-8b").unwrap()
    }
}

device_case!(
    /// A rerun gives the same bits, and one window per pass what packed passes give (a GPU
    /// runs 3000 tokens, the emulated device 400).
    reruns_are_bitwise_and_batching_changes_nothing,
    |dev| reruns_case(&Run::on(dev), if dev == Dev::Cuda { 3000 } else { 400 }, small_hd128())
);

device_case!(
    /// Packed windows share no State: one window per pass gives what packed passes give.
    hybrid_reruns_are_bitwise_and_batching_changes_nothing,
    |dev| reruns_case(&Run::on(dev), if dev == Dev::Cuda { 3000 } else { 300 }, small_hybrid())
);

/// The small hybrid with the 35B-A3B's sparse MLP at a small width: every layer 16 experts
/// of width 128, 4 chosen per token, and a gated shared expert.
fn small_moe() -> ModelConfig {
    let big = preset("qwen3_5-35b-a3b").unwrap().with_layers(4);
    let mut m = big.moe.clone().unwrap();
    (m.num_experts, m.num_experts_per_tok) = (16, 4);
    (m.moe_intermediate_size, m.shared_expert_intermediate_size) = (128, 128);
    ModelConfig {
        family: big.family,
        moe: Some(m),
        ..small_hybrid()
    }
}

device_case!(
    /// The experts' grouping and grouped GEMMs run on the device: a rerun gives the same
    /// bits, and one window per pass what packed passes give (each routed row's product
    /// depends only on that row).
    moe_reruns_are_bitwise_and_batching_changes_nothing,
    |dev| reruns_case(&Run::on(dev), if dev == Dev::Cuda { 3000 } else { 200 }, small_moe())
);

/// The last layer's MLP on the rows the head reads only (`PassPlan::last_layer`, the CPU's
/// policy) gives the bits of the MLP on every row, for a dense, a hybrid and a MoE model in
/// both precisions: the emulated GEMM computes each row alone, so any difference is a wrong
/// row. (On a GPU, cuBLAS may choose another algorithm for fewer rows: a speed change with
/// its own rounding, held by the parity bounds above.)
#[test(gxx)]
fn trimming_the_last_layer_changes_no_bits() {
    let d = tempfile::tempdir().unwrap();
    let models = [
        random_artifact(d.path(), "dense.ninfer", small_hd128(), 5),
        random_artifact(d.path(), "hybrid.ninfer", small_hybrid(), 5),
        tiny(d.path(), "qwen3_5_moe"),
    ];
    // Windows of 96 with stride 48: every window after the first scores its last 48 rows.
    let ids: Vec<u32> = (0..200u32).map(|i| i * 7 % 251).collect();
    let p = Protocol::new(96, 48).unwrap();
    for art in &models {
        let a = Artifact::open(art).unwrap();
        for precision in [Precision::F32, Precision::Bf16] {
            let m = CudaModel::load(&a, Target::Emulated, precision, &mut |_, _| {}).unwrap();
            let trimmed = gpu_logprobs(&m, &ids, p, KvDtype::Fp8);
            m.set_trim_last_layer(false);
            let whole = gpu_logprobs(&m, &ids, p, KvDtype::Fp8);
            assert!(!trimmed.is_empty());
            assert!(
                trimmed
                    .iter()
                    .zip(&whole)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{} {}: trimming the last layer changed bits",
                art.display(),
                precision.name()
            );
        }
    }
}

fn reruns_case(run: &Run, tokens: usize, config: ModelConfig) {
    let d = tempfile::tempdir().unwrap();
    let art = random_artifact(d.path(), "random.ninfer", config, 5);
    let a = Artifact::open(&art).unwrap();
    let text =
        std::fs::read_to_string(repo().join("eval/corpora/perplexity-1m/streams/en-ref-1.txt"))
            .unwrap();
    let ids: Vec<u32> = text.bytes().take(tokens).map(u32::from).collect();
    let p = run.protocol;
    // On a GPU, cuBLAS picks its GEMM algorithm by row count, so one window per pass rounds
    // differently from packed passes: the f32 bound there is the largest difference measured
    // on an H200 (6.1e-4, the small hybrid at 3000 tokens; 1.2e-4 dense) times about 3. The
    // emulated GEMM computes each row alone, so there the bound is tight, unless it imitates
    // the GPU (`NINFER_EMU_GEMM_ORDER=by-rows`: the GPU's bound, and see
    // `the_batching_bound_holds_when_the_gemm_order_follows_the_row_count`).
    let by_rows = std::env::var("NINFER_EMU_GEMM_ORDER").is_ok_and(|v| v == "by-rows");
    let f32_bound = match run.target {
        Target::Cuda(_) => 2e-3,
        Target::Emulated if by_rows => 2e-3,
        Target::Emulated => 1e-4,
    };
    for (precision, bound) in [(Precision::F32, f32_bound), (Precision::Bf16, 1e-2)] {
        let m = CudaModel::load(&a, run.target, precision, &mut |_, _| {}).unwrap();
        for kv in [KvDtype::Bf16, KvDtype::K8v4] {
            let first = gpu_logprobs(&m, &ids, p, kv);
            let again = gpu_logprobs(&m, &ids, p, kv);
            let same = first
                .iter()
                .zip(&again)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{} {}: a rerun changed bits (a race?)",
                precision.name(),
                kv.name()
            );
            m.set_max_windows_per_pass(1);
            let single = gpu_logprobs(&m, &ids, p, kv);
            m.set_max_windows_per_pass(usize::MAX);
            let d = first
                .iter()
                .zip(&single)
                // A NaN on either side counts as infinitely far (f64::max would drop it).
                .map(|(x, y)| (*x as f64 - *y as f64).abs())
                .map(|d| if d.is_finite() { d } else { f64::INFINITY })
                .fold(0.0, f64::max);
            emit(
                serde_json::json!({"check": "batching", "precision": precision.name(), "kv": kv.name(), "max_abs_dlogprob": d}),
            );
            assert!(
                d <= bound,
                "{} {}: one window per pass differs by {d:.3e} > {bound:e}",
                precision.name(),
                kv.name()
            );
        }
    }
}

device_case!(a_bad_token_fails_with_the_cpu_message, |dev| match dev {
    Dev::Cuda => bad_token_case(DeviceRequest::Cuda(0), "cuda-sm", GPU_BOUNDS),
    Dev::Emu => bad_token_case(DeviceRequest::Emu, "emu", EMU_BOUNDS),
});

/// The engine for `art` on `device` (digest not verified).
fn engine(art: &Path, device: DeviceRequest, precision: Option<Precision>) -> Engine {
    Engine::load(
        art,
        &LoadOptions {
            device,
            threads: 0,
            verify_digest: false,
            precision,
            ..LoadOptions::default()
        },
        &mut |_, _| {},
    )
    .unwrap()
}

fn bad_token_case(device: DeviceRequest, class: &str, bounds: Bounds) {
    let d = tempfile::tempdir().unwrap();
    let art = tiny_qwen3(d.path());
    let load = |device, precision| engine(&art, device, precision);
    // f32 precision: two scored tokens are not an average, so compare the parity mode.
    let (cpu, gpu) = (
        load(DeviceRequest::Cpu, None),
        load(device, Some(Precision::F32)),
    );
    assert!(
        gpu.device.class().starts_with(class),
        "{}",
        gpu.device.class()
    );
    let ids = [1u32, 2, 3, 200_000, 4];
    let p = Protocol::new(4, 2).unwrap();
    let e_cpu = cpu
        .score(&ids, p, KvDtype::Int8, false, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    let e_gpu = gpu
        .score(&ids, p, KvDtype::Int8, false, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert_eq!(e_gpu, e_cpu);
    // And the good prefix scores the same way through the engine on both.
    let s_cpu = cpu
        .score(&ids[..3], p, KvDtype::Int8, true, &mut |_, _| {})
        .unwrap();
    let s_gpu = gpu
        .score(&ids[..3], p, KvDtype::Int8, true, &mut |_, _| {})
        .unwrap();
    assert_eq!(s_cpu.totals.scored, s_gpu.totals.scored);
    let (a, b) = (s_cpu.totals.mean_nll(), s_gpu.totals.mean_nll());
    let bound = bounds
        .f32_abs
        .unwrap_or(0.0)
        .max(bounds.f32_rel.unwrap_or(0.0) * a.abs());
    assert!((a - b).abs() <= bound, "{a} vs {b}");
    let mem = gpu.cuda_memory().expect("a CUDA engine reports its memory");
    assert!(
        mem.peak_allocated_bytes >= mem.weights_bytes && mem.weights_bytes > 0,
        "{mem:?}"
    );
}

/// When a window of a pass fails, the windows before it are still delivered (as the CPU
/// backend delivers them), then the failing window's error, with its index.
#[test(gxx)]
fn windows_before_a_failing_one_are_delivered() {
    let d = tempfile::tempdir().unwrap();
    let art = random_artifact(d.path(), "random-hd128.ninfer", small_hd128(), 9);
    let a = Artifact::open(&art).unwrap();
    let m = CudaModel::load(&a, Target::Emulated, Precision::F32, &mut |_, _| {}).unwrap();
    let mut ids: Vec<u32> = (0..300u32).map(|i| i * 7 % 256).collect();
    ids[250] = 5000; // outside the 4,096-entry vocabulary
    let p = Protocol::new(96, 48).unwrap();
    let ws = windows(ids.len(), p).unwrap();
    let bad = ws
        .iter()
        .position(|w| w.begin <= 250 && 250 < w.end)
        .unwrap();
    assert!(bad >= 2, "the bad token must come after a few windows");
    let mut got = Vec::new();
    let e = m
        .score_batches(&ids, &ws, KvDtype::Int8, &mut |first, batch| {
            for (i, lps) in batch.into_iter().enumerate() {
                got.push((first + i, lps.len()));
            }
            Ok(())
        })
        .unwrap_err();
    let want: Vec<(usize, usize)> = (0..bad)
        .map(|i| (i, ws[i].end - ws[i].first_target))
        .collect();
    assert_eq!(got, want, "every window before the failing one, in order");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("window {bad}:")) && msg.contains("5000"),
        "{msg}"
    );
}

/// The benchmark's in-memory random weights are the very values `write_random_artifact`
/// stores: the same windows score to the same bits from either.
#[test(gxx)]
fn random_weights_in_memory_equal_the_written_artifact() {
    // A dense shape, and the 27B hybrid's preset cut to 4 layers and a small width (the
    // bench's `qwen3_5-27b` path: conv taps, gates and gated q rows from the generator).
    for (name, config) in [("hd128", small_hd128()), ("hybrid", small_hybrid())] {
        let d = tempfile::tempdir().unwrap();
        let art = random_artifact(d.path(), format!("random-{name}.ninfer"), config.clone(), 4);
        let a = Artifact::open(&art).unwrap();
        let from_disk =
            CudaModel::load(&a, Target::Emulated, Precision::Bf16, &mut |_, _| {}).unwrap();
        let in_memory =
            CudaModel::load_random(&config, 4, Target::Emulated, Precision::Bf16).unwrap();
        let ids: Vec<u32> = (0..150u32).map(|i| i * 13 % 251).collect();
        let p = Protocol::new(96, 48).unwrap();
        let x = gpu_logprobs(&from_disk, &ids, p, KvDtype::Fp8);
        let y = gpu_logprobs(&in_memory, &ids, p, KvDtype::Fp8);
        assert!(!x.is_empty());
        assert!(
            x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: in-memory weights differ"
        );
    }
}

/// A quantized artifact loads through the on-device dequantization and scores like the CPU
/// (f32 precision, f32 KV: the 1e-5 relative bound; one window of 96 tokens). nvfp4 only,
/// for time: the fp8 kernel is held bit for bit in tests/parity/kernels.rs (measured here
/// too: fp8 6.5e-8, nvfp4 2.7e-7 relative).
#[test(gxx)]
fn quantized_artifacts_score_like_the_cpu() {
    let name = "smollm2-135m-nvfp4";
    let art = repo().join(format!("models/{name}.ninfer"));
    let load = |device, precision| engine(&art, device, precision);
    let (cpu, emu) = (
        load(DeviceRequest::Cpu, None),
        load(DeviceRequest::Emu, Some(Precision::F32)),
    );
    let streams = quick_streams(&|t| cpu.tokenizer.encode(t).unwrap(), 96);
    let p = Protocol::new(96, 48).unwrap();
    let ids = &streams[0].1;
    let a = cpu
        .score(ids, p, KvDtype::F32, false, &mut |_, _| {})
        .unwrap()
        .totals
        .mean_nll();
    let b = emu
        .score(ids, p, KvDtype::F32, false, &mut |_, _| {})
        .unwrap()
        .totals
        .mean_nll();
    let rel = (a - b).abs() / a.abs();
    emit(
        serde_json::json!({"check": "quantized-load", "artifact": name, "cpu_mean_nll": a, "emu_mean_nll": b, "rel": rel}),
    );
    assert!(
        rel <= EMU_BOUNDS.f32_rel.unwrap(),
        "{name}: {a} vs {b} ({rel:e})"
    );
}

/// Sets element `index` of the f32 tensor `name` of the artifact at `path` to `value`, in
/// place (the header and every other byte unchanged; digests are not verified here).
fn set_f32(path: &Path, name: &str, index: usize, value: f32) {
    let mut b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let t = &header[name];
    assert_eq!(t["dtype"], "F32", "{name}");
    let at = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize + 4 * index;
    b[at..at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

/// A decay that overflows (A_log = 100: g = −inf) in value head 2 of the second Gated
/// DeltaNet layer fails the window as the CPU fails it, naming layer, position and head.
#[test(gxx)]
fn a_non_finite_state_gate_fails_with_the_cpu_message() {
    let d = tempfile::tempdir().unwrap();
    let art = random_artifact(d.path(), "hybrid.ninfer", small_hybrid(), 3);
    set_f32(&art, "model.layers.1.linear_attn.A_log", 2, 100.0);
    let load = |device, precision| engine(&art, device, precision);
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 256).collect();
    let p = Protocol::new(16, 8).unwrap();
    let cpu = load(DeviceRequest::Cpu, None);
    let e_cpu = cpu
        .score(&ids, p, KvDtype::Bf16, false, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e_cpu.contains("layer 1") && e_cpu.contains("head 2"),
        "{e_cpu}"
    );
    for precision in [Precision::F32, Precision::Bf16] {
        let gpu = load(DeviceRequest::Emu, Some(precision));
        let e_gpu = gpu
            .score(&ids, p, KvDtype::Bf16, false, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert_eq!(e_gpu, e_cpu, "{}", precision.name());
    }
}

/// Every KV representation, and `fp8-tensor` once more under calibrated-looking scales that
/// differ per layer (so the per-layer scale reaches each layer's store and load).
fn kv_matrix(layers: usize) -> Vec<KvDtype> {
    let mut v = KvDtype::ALL.to_vec();
    v.push(KvDtype::fp8_tensor_with(
        ninfer_perplexity::kv::fp8_tensor::TensorScales {
            source: Some("per-layer test scales".into()),
            k: (0..layers).map(|l| 0.125 * (l + 1) as f32).collect(),
            v: (0..layers).map(|l| 3.0 / (l + 2) as f32).collect(),
        },
    ));
    v
}

/// The representation's name, marking `fp8-tensor` with given scales.
fn kv_label(kv: KvDtype) -> String {
    match kv.tensor_scales() {
        Some(s) if s.source.is_some() => format!("{}(scaled)", kv.name()),
        _ => kv.name().to_string(),
    }
}
