//! Scoring speed: this engine vs transformers float32 on exactly the same windows, and vs
//! llama.cpp's `llama-perplexity` on the same tokens and its own chunk windows.
//!
//! `cargo bench --bench score [-- --context 1024 --stride 512 --tokens 4096 --threads 2 --rounds 2 --no-llama]`
//!
//! Needs `bash ci/prepare.sh` (artifact and corpus) and `bash eval/generators/setup-python.sh` (the
//! peer); builds `llama-perplexity` on first use (`eval/peers/llama-cpp.sh`, several minutes;
//! `--no-llama` leaves that peer out). Prints processed and scored tokens/s for both, their
//! ratio, the FLOPs per processed token, the rate in GFLOP/s against the machine's measured
//! f32 GEMM rate, peak RSS, whether each of the speed targets (docs/performance.md) is met,
//! and then the llama.cpp table ([`llama`]): processed tokens/s of this engine with
//! `--window-plan kld-chunks` and of `llama-perplexity` on the Q4_1 GGUF as published and on
//! a float32 GGUF of its dequantized weights, with the ratios beside transformers'.
//!
//! FLOPs are counted two ways. The forward pass (`Work::ForwardPass`: every layer
//! and the output head for every processed token, causal attention) is what a model forward
//! costs and what the targets are stated in: both engines are credited with the same work
//! for the same windows, so the logits this engine does not compute show up as speed. The
//! work this engine actually does (`Work::CpuScoring`) is printed beside
//! it, as the measure of how well its kernels use the machine.
//!
//! The two engines run alternately for `--rounds` rounds (ours, peer, ours, peer, ...) and
//! each keeps its fastest round: on a shared machine a neighbour's load comes and goes, and
//! alternating gives both sides the same chances.
//!
//! The GEMM rate is the fastest of five 2048³ products, through the engine's own GEMM path
//! just before (from round 2: see the peak RSS note in `main`) and just after each of our
//! rounds, and through torch just before our round
//! (a GEMM-only peer call, or the previous peer run as it finished) and just after it (the
//! next peer run before it starts scoring). Two fractions are printed: the best round's rate
//! against the highest GEMM rate seen anywhere in the run (strict: a reference that caught a
//! fast minute of the host counts against a run that did not), and each round's rate against
//! the rates measured around it (four, three for round 1; the same minutes of the host), both
//! their highest and their median (each is already a best of five, and on a shared host one of
//! them often catches a moment that the fifteen seconds between them did not have).

use ninfer_perplexity::backend::cpu::matmul::matmul_wt;
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::model::flops::{window_flops, Work};
use ninfer_perplexity::score::{windows, Protocol, WindowPlan};
mod common;
#[path = "score/llama.rs"]
mod llama;

use common::arg;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

fn gemm_gflops(threads: usize) -> f64 {
    let n = 2048;
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut c = vec![0.0f32; n * n];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| matmul_wt(&a, n, n, &b, n, &mut c, false));
    // The fastest of several single products: the machine's rate when a neighbour is not
    // in the way, which is the fair ceiling to compare against (and the harder one to reach).
    let best = (0..5)
        .map(|_| {
            let t0 = Instant::now();
            pool.install(|| matmul_wt(&a, n, n, &b, n, &mut c, false));
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    2.0 * (n as f64).powi(3) / best / 1e9
}

/// One round's timings and the GEMM rates measured around our run of it:
/// `[engine path before, engine path after, torch before, torch after]` in GFLOP/s (NaN:
/// not measured, the engine path before round 1).
struct Round {
    ours_s: f64,
    peer_s: f64,
    gemm: [f64; 4],
}

/// The middle value of the measured ones (NaN marks one not taken; the mean of the two
/// middle ones for an even count).
fn median(xs: &[f64]) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (v[(n - 1) / 2] + v[n / 2]) / 2.0
}

/// A GEMM rate for the table, `-` when not measured.
fn rate(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.1}")
    }
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let context = arg("--context", 1024);
    let stride = arg("--stride", 512);
    let n_tokens = arg("--tokens", 4096);
    let threads = arg("--threads", 2);
    let art = root.join("models/smollm2-135m-bf16.ninfer");
    let gguf = root.join("models/cache/SmolLM2-135M-Instruct.Q4_1.gguf");
    let stream = root.join("eval/corpora/perplexity-1m/streams/en-long-1.txt");
    for p in [&art, &gguf, &stream] {
        assert!(
            p.exists(),
            "{} missing: run `bash ci/prepare.sh`",
            p.display()
        );
    }

    let engine = Engine::load(
        &art,
        &LoadOptions {
            threads,
            ..Default::default()
        },
        &mut |_, _| {},
    )
    .unwrap();
    let text = std::fs::read_to_string(&stream).unwrap();
    let tokens: Vec<u32> = engine
        .tokenizer
        .encode(&text)
        .unwrap()
        .into_iter()
        .take(n_tokens)
        .collect();
    let p = Protocol::new(context, stride).unwrap();
    let ws = windows(tokens.len(), p).unwrap();
    let processed: usize = ws.iter().map(|w| w.len()).sum();
    let scored: usize = ws.iter().map(|w| w.scored()).sum();
    let config = &engine.artifact.config;
    // The work actually done by this engine (head for scored rows only, the last layer for
    // rows that predict a target) and the model's forward pass over the same windows (every
    // layer and the head for every processed token): the target is stated in the latter.
    let flops: f64 = ws
        .iter()
        .map(|w| window_flops(config, Work::CpuScoring, w.len(), w.scored()))
        .sum();
    let fwd_flops: f64 = ws
        .iter()
        .map(|w| window_flops(config, Work::ForwardPass, w.len(), w.scored()))
        .sum();

    // Warm-up on the first window, then time the whole stream.
    engine
        .score(
            &tokens[..ws[0].end.min(256)],
            Protocol::new(context, stride).unwrap(),
            KvDtype::Bf16,
            false,
            &mut |_, _| {},
        )
        .unwrap();
    let rounds = arg("--rounds", 2).max(1);
    let work = serde_json::json!({
        "gguf": gguf, "threads": threads, "tokens": tokens,
        "windows": ws.iter().map(|w| [w.begin, w.first_target, w.end]).collect::<Vec<_>>(),
    });
    let work_path = std::env::temp_dir().join(format!("ninfer-bench-{}.json", std::process::id()));
    std::fs::write(&work_path, work.to_string()).unwrap();
    let py = root.join("eval/.venv/bin/python");
    let run_peer = |extra: &[&str]| -> serde_json::Value {
        let out = Command::new(&py)
            .arg(root.join("eval/results/bench/peer_transformers.py"))
            .arg(&work_path)
            .args(extra)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (run `bash eval/generators/setup-python.sh`)",
                    py.display()
                )
            });
        assert!(
            out.status.success(),
            "peer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap()
    };
    let (mut ours_s, mut peer_s) = (f64::INFINITY, f64::INFINITY);
    let mut ours = None;
    let mut rss = 0;
    let mut pj = serde_json::Value::Null;
    // torch's rate just before our next round: a GEMM-only peer call before round 1, then
    // the rate the previous peer measured as it finished.
    let mut torch_before = run_peer(&["--gemm-only"])["gemm_gflops"].as_f64().unwrap();
    let mut per_round: Vec<Round> = Vec::new();
    for round in 1..=rounds {
        // Not before round 1: the reference's three 16 MiB buffers, freed just before the
        // engine's first run, would change how the allocator serves the engine and so the
        // peak RSS reported for it (the next rounds come after that reading).
        let engine_before = if round == 1 {
            f64::NAN
        } else {
            gemm_gflops(threads)
        };
        let t0 = Instant::now();
        let score = engine
            .score(&tokens, p, KvDtype::Bf16, false, &mut |_, _| {})
            .unwrap();
        let s = t0.elapsed().as_secs_f64();
        if round == 1 {
            // High-water mark of the process so far: model load plus scoring.
            rss = ninfer_perplexity::report::peak_rss_bytes().unwrap_or(0);
        }
        let engine_after = gemm_gflops(threads);
        eprintln!("round {round}: ours {s:.2} s");
        ours_s = ours_s.min(s);
        ours = Some(score);

        pj = run_peer(&[]);
        let peer_round_s = pj["seconds"].as_f64().unwrap();
        eprintln!("round {round}: peer {peer_round_s:.2} s");
        peer_s = peer_s.min(peer_round_s);
        per_round.push(Round {
            ours_s: s,
            peer_s: peer_round_s,
            gemm: [
                engine_before,
                engine_after,
                torch_before,
                pj["gemm_before_gflops"].as_f64().unwrap(),
            ],
        });
        torch_before = pj["gemm_gflops"].as_f64().unwrap();
    }
    let engine_gemm = per_round
        .iter()
        .flat_map(|r| [r.gemm[0], r.gemm[1]])
        .fold(0.0f64, f64::max);
    let torch_gemm = per_round
        .iter()
        .flat_map(|r| [r.gemm[2], r.gemm[3]])
        .chain([torch_before])
        .fold(0.0f64, f64::max);
    // Every GEMM rate seen in the run, including the peer's last one.
    let all_gemm = engine_gemm.max(torch_gemm);
    let _ = std::fs::remove_file(&work_path);
    let ours = ours.unwrap();

    println!("SmolLM2-135M, {} tokens of en-long-1, context {context} stride {stride}, {threads} threads, best of {rounds} alternating rounds", tokens.len());
    println!(
        "{} windows, {processed} processed tokens, {scored} scored tokens",
        ws.len()
    );
    println!();
    println!("| engine | seconds | processed tok/s | scored tok/s | mean NLL |");
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| ninfer-perplexity (bf16 artifact, f32 compute, KV bf16) | {ours_s:.2} | {:.1} | {:.1} | {:.5} |",
        processed as f64 / ours_s,
        scored as f64 / ours_s,
        ours.totals.mean_nll()
    );
    println!(
        "| {} | {peer_s:.2} | {:.1} | {:.1} | {:.5} |",
        pj["peer"].as_str().unwrap(),
        processed as f64 / peer_s,
        scored as f64 / peer_s,
        pj["nll_sum"].as_f64().unwrap() / scored as f64
    );
    println!();
    println!(
        "speed ratio (scored tokens/s, ours / peer): {:.2}x",
        peer_s / ours_s
    );
    println!(
        "FLOPs per processed token: forward pass {:.3} GFLOP (every layer and the output head \
         for every token, causal attention: the count the target is stated in); done by this \
         engine {:.3} GFLOP (head for scored rows only, last layer for rows that predict a target)",
        fwd_flops / processed as f64 / 1e9,
        flops / processed as f64 / 1e9,
    );
    println!(
        "f32 GEMM rate (2048^3, fastest of five products, measured before and after each of our rounds): \
         best engine path {engine_gemm:.1} GFLOP/s, best torch {torch_gemm:.1} GFLOP/s"
    );
    let fwd_rate = fwd_flops / ours_s / 1e9;
    let done_rate = flops / ours_s / 1e9;
    let fraction = fwd_rate / all_gemm;
    println!(
        "ours: forward pass at {fwd_rate:.1} GFLOP/s = {:.0}% of the best GEMM rate anywhere in the run \
         (work done: {done_rate:.1} GFLOP/s = {:.0}%)",
        100.0 * fraction,
        100.0 * done_rate / all_gemm,
    );
    let peer_rate = fwd_flops / peer_s / 1e9;
    println!(
        "peer: forward pass at {peer_rate:.1} GFLOP/s = {:.0}%",
        100.0 * peer_rate / all_gemm,
    );
    println!();
    println!("| round | ours s | forward-pass GFLOP/s | GEMM around it: engine before / after, torch before / after | fraction of their highest | of their median | work done, of their highest | peer s |");
    println!("|---:|---:|---:|---|---:|---:|---:|---:|");
    let (mut vs_highest, mut vs_median) = (Vec::new(), Vec::new());
    for (i, r) in per_round.iter().enumerate() {
        let fwd = fwd_flops / r.ours_s / 1e9;
        let highest = r.gemm.iter().copied().fold(0.0f64, f64::max);
        vs_highest.push(fwd / highest);
        vs_median.push(fwd / median(&r.gemm));
        println!(
            "| {} | {:.2} | {fwd:.1} | {} / {}, {} / {} | {:.0}% | {:.0}% | {:.0}% | {:.2} |",
            i + 1,
            r.ours_s,
            rate(r.gemm[0]),
            rate(r.gemm[1]),
            rate(r.gemm[2]),
            rate(r.gemm[3]),
            100.0 * vs_highest[i],
            100.0 * vs_median[i],
            100.0 * flops / r.ours_s / 1e9 / highest,
            r.peer_s
        );
    }
    println!(
        "forward-pass rate / GEMM rates around the same round: against their highest, median round {:.0}% (lowest {:.0}%); against their median, median round {:.0}% (lowest {:.0}%)",
        100.0 * median(&vs_highest),
        100.0 * vs_highest.iter().copied().fold(f64::INFINITY, f64::min),
        100.0 * median(&vs_median),
        100.0 * vs_median.iter().copied().fold(f64::INFINITY, f64::min),
    );
    println!("engine peak RSS: {:.0} MB", rss as f64 / 1e6);
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let ratio = peer_s / ours_s;
    println!(
        "targets: speed ratio {ratio:.2}x >= 1.3x {}; forward-pass rate {:.0}% >= 85% of the best GEMM rate {}; peak RSS {:.0} MB <= 1500 MB {}",
        verdict(ratio >= 1.3),
        100.0 * fraction,
        verdict(fraction >= 0.85),
        rss as f64 / 1e6,
        verdict(rss as f64 <= 1.5e9),
    );
    if !std::env::args().any(|a| a == "--no-llama") {
        llama_peer(
            &engine, &root, &text, n_tokens, context, threads, rounds, &py, ratio,
        );
    }
}

/// llama.cpp's `llama-perplexity` and this engine on the same tokens and chunk windows,
/// alternating for `rounds` rounds, each keeping its fastest; `tf_ratio` is transformers'
/// ratio from the table above, printed beside.
#[allow(clippy::too_many_arguments)]
fn llama_peer(
    engine: &Engine,
    root: &std::path::Path,
    text: &str,
    n_tokens: usize,
    context: usize,
    threads: usize,
    rounds: usize,
    py: &std::path::Path,
    tf_ratio: f64,
) {
    let gguf = root.join("models/cache/SmolLM2-135M-Instruct.Q4_1.gguf");
    let prose = llama::prose(text);
    let ids = engine.tokenizer.encode(&prose).unwrap();
    let chunks = ids.len().min(n_tokens) / context;
    assert!(
        chunks >= 2,
        "--tokens {n_tokens}: fewer than two chunks of {context}"
    );
    let tokens = &ids[..chunks * context];
    let p = Protocol::with_plan(WindowPlan::KldChunks, context, None).unwrap();
    let processed: usize = windows(tokens.len(), p)
        .unwrap()
        .iter()
        .map(|w| w.len())
        .sum();
    let dir = std::env::temp_dir().join(format!("ninfer-bench-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text_file = dir.join("prose.txt");
    std::fs::write(&text_file, &prose).unwrap();
    let bin = llama::binary(root);
    let f32_gguf = dir.join("f32.gguf");
    llama::f32_gguf(root, py, &gguf, &f32_gguf);
    let (mut ours_s, mut q41_s, mut f32_s) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let (mut ours_nll, mut q41_nll, mut f32_nll) = (0.0, 0.0, 0.0);
    for round in 1..=rounds {
        let t0 = Instant::now();
        let s = engine
            .score(tokens, p, KvDtype::Bf16, false, &mut |_, _| {})
            .unwrap();
        let t = t0.elapsed().as_secs_f64();
        ours_s = ours_s.min(t);
        ours_nll = s.totals.mean_nll();
        let q = llama::run(&bin, &gguf, &text_file, context, chunks, threads);
        let f = llama::run(&bin, &f32_gguf, &text_file, context, chunks, threads);
        eprintln!(
            "llama round {round}: ours {t:.2} s, llama.cpp Q4_1 {:.2} s, F32 {:.2} s",
            q.seconds, f.seconds
        );
        (q41_s, q41_nll) = (q41_s.min(q.seconds), q.mean_nll);
        (f32_s, f32_nll) = (f32_s.min(f.seconds), f.mean_nll);
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!();
    println!(
        "llama.cpp: the same {} tokens of en-long-1 with whitespace runs made one space, {chunks} chunks of {context} \
         (llama-perplexity's windows: each scores its last {}), {threads} threads, best of {rounds} alternating rounds; \
         16-bit KV cache on both sides",
        tokens.len(),
        context - 1 - context / 2
    );
    println!();
    println!("| engine | seconds | processed tok/s | mean NLL | speed ratio, ours / peer |");
    println!("|---|---:|---:|---:|---:|");
    let rate = |s: f64| processed as f64 / s;
    println!(
        "| ninfer-perplexity `--window-plan kld-chunks` (bf16 artifact, f32 compute, KV bf16) | {ours_s:.2} | {:.1} | {ours_nll:.5} | - |",
        rate(ours_s)
    );
    println!(
        "| llama-perplexity, Q4_1 GGUF as published (Q4_1 x Q8 dot products, KV f16) | {q41_s:.2} | {:.1} | {q41_nll:.5} | {:.2}x |",
        rate(q41_s),
        q41_s / ours_s
    );
    println!(
        "| llama-perplexity, F32 GGUF of the same weights (f32, KV f16) | {f32_s:.2} | {:.1} | {f32_nll:.5} | {:.2}x |",
        rate(f32_s),
        f32_s / ours_s
    );
    println!("| transformers float32 (the table above, sliding windows) | | | | {tf_ratio:.2}x |");
}
