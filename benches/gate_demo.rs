//! The paired gate on real trials with an artificial noise source: the measured false-alarm
//! rate on pure noise and the detection rate of a planted drift of θ (docs/harness.md).
//!
//! The tiny Qwen3.5 hybrid scores the first `TOKENS` tokens of `en-long-1` (context 128,
//! stride 64) with `NINFER_TEST_FAULT=embed-jitter=A`: every call perturbs the embeddings
//! differently, as a GPU's run-to-run noise would. As on a new GPU, the baseline is one
//! noisy run; `CALIBRATION` more runs paired with it give the spread and θ exactly as
//! `--measure-spread` proposes it (α 0.05, β 0.1, margin 2). Then `TRIALS` fresh runs are
//! judged against the baseline as they are (pure noise: every failure a false alarm) and with
//! a drift of θ added to every window (every pass a miss).
//!
//! Minutes of CPU time: `cargo bench --bench gate_demo` (after `bash ci/prepare.sh`).

use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::gate::{self, GateSpec};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::score::paired::{paired, WindowPair};
use ninfer_perplexity::score::Protocol;
use std::path::PathBuf;

const TOKENS: usize = 4096;
const JITTER: &str = "embed-jitter=1e-3";
const CALIBRATION: usize = 5;
const TRIALS: usize = 60;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn main() {
    the_gate_passes_noise_and_catches_a_drift_of_theta_at_the_stated_rates();
}

fn the_gate_passes_noise_and_catches_a_drift_of_theta_at_the_stated_rates() {
    let art = repo().join("models/tiny-qwen3_5-f32.ninfer");
    assert!(
        art.exists(),
        "{} is missing: run `bash ci/prepare.sh`",
        art.display()
    );
    // The fault switch is read when the model is built (this binary holds one test).
    std::env::set_var("NINFER_TEST_FAULT", JITTER);
    let e = Engine::load(&art, &LoadOptions::default(), &mut |_, _| {}).unwrap();
    assert!(e.faults.active().is_some(), "a fault-injection build");
    let text =
        std::fs::read_to_string(repo().join("eval/corpora/perplexity-1m/streams/en-long-1.txt"))
            .expect("the corpus (bash ci/prepare.sh)");
    let mut ids = e.tokenizer.encode(&text).unwrap();
    ids.truncate(TOKENS);
    let p = Protocol::new(128, 64).unwrap();
    let (kv, (alpha, beta, margin)) = (KvDtype::Fp8, (0.05, 0.1, 2.0));
    let run = || -> Vec<(u64, f64)> {
        let s = e.score(&ids, p, kv, false, &mut |_, _| {}).unwrap();
        s.windows.iter().map(|w| (w.scored, w.nll_sum)).collect()
    };
    let pairs = |base: &[(u64, f64)], new: &[(u64, f64)], shift: f64| -> Vec<WindowPair> {
        base.iter()
            .zip(new)
            .map(|(&(n, b), &(_, x))| WindowPair {
                scored: n,
                base: b,
                new: x + shift * n as f64,
            })
            .collect()
    };
    let base = run();
    let g = base.len();
    let ses: Vec<f64> = (0..CALIBRATION)
        .map(|_| {
            paired(&pairs(&base, &run(), 0.0))
                .unwrap()
                .delta_nll_std_err
                .unwrap()
        })
        .collect();
    let theta = gate::propose_theta(&ses, g, alpha, beta, margin).unwrap();
    let spec = GateSpec { theta, alpha, beta };
    let (mut false_alarms, mut misses) = (0usize, 0usize);
    for _ in 0..TRIALS {
        let new = run();
        false_alarms += !gate::decide(&pairs(&base, &new, 0.0), spec)
            .unwrap()
            .passed() as usize;
        misses += gate::decide(&pairs(&base, &new, theta), spec)
            .unwrap()
            .passed() as usize;
    }
    let (fa, power) = (
        false_alarms as f64 / TRIALS as f64,
        1.0 - misses as f64 / TRIALS as f64,
    );
    eprintln!(
        "gate demo: {g} windows, {JITTER}, KV {}: max se {:.3e} over {CALIBRATION} runs, θ {theta:.3e}; {TRIALS} noisy runs: {false_alarms} false alarms ({:.1}%, α {alpha}), drift of θ caught in {} ({:.1}%, 1 − β {})",
        kv.name(),
        ses.iter().copied().fold(0.0, f64::max),
        100.0 * fa,
        TRIALS - misses,
        100.0 * power,
        1.0 - beta
    );
    // Binomial sampling error of 60 runs: about 3 points at 5%, 4 at 90%.
    assert!(fa <= alpha + 0.06, "false alarms {fa}");
    assert!(power >= 1.0 - beta - 0.08, "power {power}");
}
