//! The paired gate on real trials with an artificial noise source, over a family of trials:
//! the measured rate at which pure noise fails *any* trial of a run, and the rate at which a
//! drift of θ planted in one trial is caught (docs/harness.md).
//!
//! The family is the tiny Qwen3.5 hybrid on the first `TOKENS` tokens of each of the
//! corpus's 16 streams (context 128, stride 64, fp8 KV): 16 trials, as the CPU tier's matrix
//! has one per stream. `NINFER_TEST_FAULT=embed-jitter=A` perturbs the embeddings
//! differently at every call, as a GPU's run-to-run noise would. As on a new GPU, each
//! trial's baseline is one noisy run; `CALIBRATION` more runs paired with it give the
//! spread, and θ per trial is what `--measure-spread` proposes: margin 2, β 0.1, and α 0.05
//! shared by the family (α/16 per trial, `GateSpec::in_family`). Then `RUNS` fresh runs of
//! the whole family are judged as they are (a run with any failure is a false alarm) and
//! with a drift of θ added to every window of one trial (rotating; a pass is a miss). For
//! contrast the same runs are judged with θ derived at α per trial, no family control.
//!
//! Minutes of CPU time: `cargo bench --bench gate_demo` (after `bash ci/prepare.sh`).

use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::gate::{self, GateSpec};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::score::paired::{paired, WindowPair};
use ninfer_perplexity::score::Protocol;
use std::path::PathBuf;

const TOKENS: usize = 1024;
const JITTER: &str = "embed-jitter=1e-3";
const CALIBRATION: usize = 5;
const RUNS: usize = 40;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn main() {
    a_family_of_noisy_trials_fails_anywhere_at_most_alpha_of_the_time();
}

type Windows = Vec<(u64, f64)>;

fn pairs(base: &Windows, new: &Windows, shift: f64) -> Vec<WindowPair> {
    base.iter()
        .zip(new)
        .map(|(&(n, b), &(_, x))| WindowPair {
            scored: n,
            base: b,
            new: x + shift * n as f64,
        })
        .collect()
}

fn a_family_of_noisy_trials_fails_anywhere_at_most_alpha_of_the_time() {
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
    let manifest = repo().join("eval/corpora/perplexity-1m/manifest.json");
    let corpus = ninfer_perplexity::corpus::Corpus::open(&manifest, None).unwrap();
    let streams: Vec<Vec<u32>> = corpus
        .manifest
        .streams
        .iter()
        .map(|s| {
            let text = std::fs::read_to_string(corpus.file_of(s))
                .expect("the corpus (bash ci/prepare.sh)");
            let mut ids = e.tokenizer.encode(&text).unwrap();
            ids.truncate(TOKENS);
            ids
        })
        .collect();
    let m = streams.len();
    let p = Protocol::new(128, 64).unwrap();
    let (kv, (alpha, beta, margin)) = (KvDtype::Fp8, (0.05, 0.1, 2.0));
    let run = |ids: &[u32]| -> Windows {
        let s = e.score(ids, p, kv, false, &mut |_, _| {}).unwrap();
        s.windows.iter().map(|w| (w.scored, w.nll_sum)).collect()
    };
    let base: Vec<Windows> = streams.iter().map(|ids| run(ids)).collect();
    // Per trial: its θ for the family (α/m) and for one trial alone (α).
    let mut max_se = 0.0f64;
    let specs: Vec<(GateSpec, GateSpec)> = streams
        .iter()
        .zip(&base)
        .map(|(ids, b)| {
            let ses: Vec<f64> = (0..CALIBRATION)
                .map(|_| {
                    paired(&pairs(b, &run(ids), 0.0))
                        .unwrap()
                        .delta_nll_std_err
                        .unwrap()
                })
                .collect();
            max_se = ses.iter().copied().fold(max_se, f64::max);
            let g = b.len();
            let family_alpha = alpha / m as f64;
            let theta_f = gate::propose_theta(&ses, g, family_alpha, beta, margin).unwrap();
            let theta_1 = gate::propose_theta(&ses, g, alpha, beta, margin).unwrap();
            (
                GateSpec {
                    theta: theta_f,
                    alpha,
                    beta,
                }
                .in_family(m),
                GateSpec {
                    theta: theta_1,
                    alpha,
                    beta,
                },
            )
        })
        .collect();
    let (mut family_alarms, mut single_alarms, mut caught) = (0usize, 0usize, 0usize);
    for r in 0..RUNS {
        let planted = r % m;
        let (mut any_f, mut any_1) = (false, false);
        for (t, ids) in streams.iter().enumerate() {
            let new = run(ids);
            let (fam, one) = specs[t];
            any_f |= !gate::decide(&pairs(&base[t], &new, 0.0), fam)
                .unwrap()
                .passed();
            any_1 |= !gate::decide(&pairs(&base[t], &new, 0.0), one)
                .unwrap()
                .passed();
            if t == planted {
                caught += !gate::decide(&pairs(&base[t], &new, fam.theta), fam)
                    .unwrap()
                    .passed() as usize;
            }
        }
        family_alarms += any_f as usize;
        single_alarms += any_1 as usize;
    }
    let rate = |k: usize| k as f64 / RUNS as f64;
    let windows: Vec<usize> = base.iter().map(Vec::len).collect();
    eprintln!(
        "gate demo: a family of {m} trials ({}..{} windows each, {JITTER}, KV {}), max se {max_se:.3e} over {CALIBRATION} calibration runs; {RUNS} noisy runs of the family: some trial failed in {family_alarms} ({:.1}%, α {alpha} for the run) with θ for the family, in {single_alarms} ({:.1}%) with θ for one trial; a drift of θ in one trial caught in {caught} ({:.1}%, 1 − β {})",
        windows.iter().min().unwrap(),
        windows.iter().max().unwrap(),
        kv.name(),
        100.0 * rate(family_alarms),
        100.0 * rate(single_alarms),
        100.0 * rate(caught),
        1.0 - beta
    );
    // Binomial sampling error of 40 runs: about 3.5 points at 5%, 5 at 90%.
    assert!(
        rate(family_alarms) <= alpha + 0.08,
        "family-wise false alarms"
    );
    assert!(rate(caught) >= 1.0 - beta - 0.12, "power");
}
