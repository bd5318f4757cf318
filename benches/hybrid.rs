//! Hybrid (Qwen3.5) scoring speed: this engine vs transformers float32 on the same windows of
//! a random-weight Qwen3.5-shaped model, and a Gated DeltaNet layer against a full-attention
//! layer of the same model, per token.
//!
//! `cargo bench --bench hybrid [-- --context 1024 --stride 512 --tokens 4096 --threads 2 --rounds 2 --layers 12]`
//!
//! Needs `bash ci/prepare.sh` (the corpus and the Qwen3 tokenizer) and `bash
//! eval/generators/setup-python.sh` (the peer and the model's generator): the model is made once by
//! `eval/results/bench/make_hybrid_bench_model.py` under `eval/.cache/` (transformers' initialisation,
//! fixed seed; geometry in that script) and packed with bf16 weights, as the engine runs it;
//! transformers runs the same checkpoint in float32 on the same token windows (its pure-PyTorch
//! Gated DeltaNet path: no flash-linear-attention or causal-conv1d is installed).
//!
//! The engines run alternately for `--rounds` rounds and each keeps its fastest. Then a model
//! of one Gated DeltaNet layer and one of one full-attention layer (same geometry, random
//! weights in memory, a 260-entry vocabulary so the head costs nothing) each score one window
//! of `--layer-context` tokens (default 4096), every token scored: the time per token of each
//! kind of layer, MLP included.

use ninfer_perplexity::artifact::{write_artifact, WeightFormat};
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::model::config::LayerKind;
use ninfer_perplexity::pack::hf::read_hf_dir;
use ninfer_perplexity::pack::random::{write_random_artifact, RandomSpec};
use ninfer_perplexity::score::{windows, Protocol, Window};
mod common;

use common::arg;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

fn load(path: &Path, threads: usize) -> Engine {
    Engine::load(
        path,
        &LoadOptions {
            threads,
            ..Default::default()
        },
        &mut |_, _| {},
    )
    .unwrap()
}

/// The packed bench model (made and packed on first use).
fn bench_model(root: &Path, layers: usize) -> (PathBuf, PathBuf) {
    let dir = root.join(format!("eval/.cache/hybrid-bench-{layers}"));
    let art = root.join(format!("eval/.cache/hybrid-bench-{layers}.ninfer"));
    let py = root.join("eval/.venv/bin/python");
    assert!(
        py.exists(),
        "run `bash eval/generators/setup-python.sh` first"
    );
    if !dir.join("model.safetensors").exists() {
        let ok = Command::new(&py)
            .arg(root.join("eval/results/bench/make_hybrid_bench_model.py"))
            .arg(&dir)
            .args(["--layers", &layers.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "make_hybrid_bench_model.py failed");
    }
    if !art.exists() {
        let tok = root.join("models/cache/qwen3-tokenizer.json");
        let src = read_hf_dir(&dir, Some(&tok)).unwrap();
        write_artifact(&src, WeightFormat::Bf16, &art).unwrap();
    }
    (dir, art)
}

/// Seconds of one pass over the windows, and its NLL sum.
fn ours(e: &Engine, tokens: &[u32], ws: &[Window]) -> (f64, f64) {
    let t = Instant::now();
    let s = e
        .score_windows(tokens, ws, KvDtype::Bf16, false, &mut |_, _| {})
        .unwrap();
    (t.elapsed().as_secs_f64(), s.totals.nll_sum)
}

fn peer(root: &Path, work: &Path) -> serde_json::Value {
    let out = Command::new(root.join("eval/.venv/bin/python"))
        .arg(root.join("eval/results/bench/peer_transformers.py"))
        .arg(work)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "peer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.lines().last().unwrap()).unwrap()
}

/// Seconds per token of one layer of `kind`: a one-layer model of the bench geometry scores
/// one window of `t` tokens, every token (the last layer skips its output projection and MLP
/// for rows that predict nothing, so all rows must predict; the head has 260 logits a row).
fn layer_seconds_per_token(root: &Path, kind: LayerKind, t: usize, threads: usize) -> f64 {
    let (dir, _) = bench_model(root, 12);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut c = ninfer_perplexity::pack::hf::parse_config(&cfg).unwrap();
    c.num_layers = 1;
    c.vocab_size = 260;
    c.tie_word_embeddings = true;
    c.max_position_embeddings = c.max_position_embeddings.max(t);
    c.hybrid.as_mut().unwrap().layer_types = vec![kind];
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("one.ninfer");
    let spec = RandomSpec {
        config: c,
        seed: 5,
        tokenizer_json: None,
        quantize: None,
    };
    write_random_artifact(&spec, &p, &mut |_, _| {}).unwrap();
    let e = load(&p, threads);
    let tokens: Vec<u32> = (0..t).map(|i| ((i * 7919) % 250) as u32).collect();
    let w = [Window {
        begin: 0,
        first_target: 1,
        end: t,
    }];
    e.score_windows(&tokens, &w, KvDtype::Bf16, false, &mut |_, _| {})
        .unwrap(); // warm-up
    let best = (0..3)
        .map(|_| {
            let s = Instant::now();
            e.score_windows(&tokens, &w, KvDtype::Bf16, false, &mut |_, _| {})
                .unwrap();
            s.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    best / t as f64
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let context = arg("--context", 1024);
    let stride = arg("--stride", 512);
    let n_tokens = arg("--tokens", 4096);
    let threads = arg("--threads", 2);
    let rounds = arg("--rounds", 2);
    let layers = arg("--layers", 12);
    let layer_context = arg("--layer-context", 4096);
    let stream = root.join("eval/corpora/perplexity-1m/streams/en-long-1.txt");
    assert!(stream.exists(), "run `bash ci/prepare.sh` first");
    let (dir, art) = bench_model(&root, layers);
    let e = load(&art, threads);
    let text = std::fs::read_to_string(&stream).unwrap();
    let tokens: Vec<u32> = e
        .tokenizer
        .encode(&text)
        .unwrap()
        .into_iter()
        .take(n_tokens)
        .collect();
    let ws = windows(tokens.len(), Protocol::new(context, stride).unwrap()).unwrap();
    let processed: usize = ws.iter().map(|w| w.len()).sum();
    let scored: usize = ws.iter().map(|w| w.scored()).sum();
    let work = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        work.path(),
        serde_json::json!({
            "model_dir": dir,
            "threads": threads,
            "tokens": tokens,
            "windows": ws.iter().map(|w| [w.begin, w.first_target, w.end]).collect::<Vec<_>>(),
        })
        .to_string(),
    )
    .unwrap();
    let c = &e.artifact.config;
    println!(
        "hybrid bench: {} ({:.2}B params, {} Gated DeltaNet + {} full-attention layers), {} windows of context {context} / stride {stride}, {processed} processed and {scored} scored tokens, {threads} threads, {rounds} rounds",
        art.display(),
        c.num_params() as f64 / 1e9,
        c.state_layers(),
        c.kv_layers(),
        ws.len()
    );
    if rounds > 0 {
        end_to_end(&root, &e, &tokens, &ws, work.path(), rounds);
    }
    let gdn = layer_seconds_per_token(&root, LayerKind::LinearAttention, layer_context, threads);
    let full = layer_seconds_per_token(&root, LayerKind::FullAttention, layer_context, threads);
    println!(
        "one layer at context {layer_context}: Gated DeltaNet {:.1} µs/token, full attention {:.1} µs/token ({:.2}x; target: Gated DeltaNet no slower: {})",
        gdn * 1e6,
        full * 1e6,
        gdn / full,
        if gdn <= full { "met" } else { "NOT met" }
    );
}

/// Both engines on the same windows, alternately, each keeping its fastest round.
fn end_to_end(root: &Path, e: &Engine, tokens: &[u32], ws: &[Window], work: &Path, rounds: usize) {
    let processed: usize = ws.iter().map(|w| w.len()).sum();
    let scored: usize = ws.iter().map(|w| w.scored()).sum();
    let (mut best_ours, mut best_peer) = (f64::INFINITY, f64::INFINITY);
    let (mut nll_ours, mut peer_json) = (0.0, serde_json::Value::Null);
    for r in 0..rounds {
        let (s, nll) = ours(e, tokens, ws);
        let pj = peer(root, work);
        let ps = pj["seconds"].as_f64().unwrap();
        println!("round {}: ninfer {s:.2} s, transformers {ps:.2} s", r + 1);
        best_ours = best_ours.min(s);
        if ps < best_peer {
            best_peer = ps;
        }
        nll_ours = nll;
        peer_json = pj;
    }
    let row = |name: &str, s: f64, nll: f64| {
        println!(
            "| {name} | {s:.2} | {:.1} | {:.1} | {:.5} |",
            processed as f64 / s,
            scored as f64 / s,
            nll / scored as f64
        )
    };
    println!("| engine | seconds | processed tok/s | scored tok/s | mean NLL |");
    println!("|---|---:|---:|---:|---:|");
    row(
        "ninfer-perplexity (bf16 artifact, f32 compute, KV bf16)",
        best_ours,
        nll_ours,
    );
    row(
        peer_json["peer"].as_str().unwrap_or("transformers"),
        best_peer,
        peer_json["nll_sum"].as_f64().unwrap(),
    );
    let ratio = best_peer / best_ours;
    println!(
        "ratio: {ratio:.2}x transformers in scored tokens per second (target 1.5x: {})",
        if ratio >= 1.5 { "met" } else { "NOT met" }
    );
}
