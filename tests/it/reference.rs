//! The engine against independent references: transformers float32 log-probabilities
//! committed as fixtures by `eval/generators/make_fixtures.py`.
//!
//! Tolerances: f32 weights with the exact KV path must match per-token log-probabilities
//! within 2e-4 (absolute, max over all tokens) and mean NLL within 1e-5 (relative). The
//! bf16 artifact rounds every weight, so it is held to the measured bound documented in
//! `docs/accuracy.md`.

use crate::common;

use common::logprobs::compare;

use ninfer_perplexity::artifact::{write_artifact, WeightFormat};
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::pack::hf::read_hf_dir;
use std::path::Path;

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

#[test(prepared)]
fn smollm2_f32_matches_transformers() {
    let fx = common::read_json("eval/fixtures/smollm2_logprobs.json");
    let e = load(&common::artifact("smollm2-135m-f32.ninfer"), 0);
    let d = compare(&e, &fx);
    eprintln!("smollm2 f32: {d:?}");
    assert!(d.tokens > 300, "fixture too small");
    assert!(
        d.max_abs_logprob <= 2e-4,
        "max |Δ logprob| {:.3e} > 2e-4",
        d.max_abs_logprob
    );
    assert!(
        d.max_rel_mean_nll <= 1e-5,
        "max relative Δ mean NLL {:.3e} > 1e-5",
        d.max_rel_mean_nll
    );
}

/// bf16 weights against the float32 reference. Measured on the committed fixture
/// (docs/accuracy.md): max |Δ logprob| 0.0833, max relative Δ mean NLL 9.17e-4; the bounds
/// are those measurements with a 1.5x margin.
#[test(prepared)]
fn smollm2_bf16_stays_within_measured_bound() {
    let fx = common::read_json("eval/fixtures/smollm2_logprobs.json");
    let e = load(&common::artifact("smollm2-135m-bf16.ninfer"), 0);
    let d = compare(&e, &fx);
    eprintln!("smollm2 bf16: {d:?}");
    assert!(
        d.max_rel_mean_nll <= BF16_MAX_REL_MEAN_NLL,
        "bf16 relative Δ mean NLL {:.3e}",
        d.max_rel_mean_nll
    );
    assert!(
        d.max_abs_logprob <= BF16_MAX_ABS_LOGPROB,
        "bf16 max |Δ logprob| {:.3e}",
        d.max_abs_logprob
    );
}

const BF16_MAX_REL_MEAN_NLL: f64 = 1.4e-3;
const BF16_MAX_ABS_LOGPROB: f64 = 0.125;

fn tiny(dir: &str, fixture: &str) {
    let tok = common::cache_file("qwen3-tokenizer.json");
    let src = read_hf_dir(&common::repo().join(dir), Some(&tok)).unwrap();
    let tmp = common::tempdir();
    let art = tmp.path().join("tiny.ninfer");
    write_artifact(&src, WeightFormat::F32, &art).unwrap();
    let e = load(&art, 0);
    let d = compare(&e, &common::read_json(fixture));
    eprintln!("{dir}: {d:?}");
    assert!(
        d.max_abs_logprob <= 2e-4,
        "max |Δ logprob| {:.3e} > 2e-4",
        d.max_abs_logprob
    );
    assert!(
        d.max_rel_mean_nll <= 1e-5,
        "relative Δ mean NLL {:.3e} > 1e-5",
        d.max_rel_mean_nll
    );
}

#[test(prepared)]
fn tiny_qwen3_moe_matches_transformers() {
    tiny(
        "eval/fixtures/tiny-qwen3_moe",
        "eval/fixtures/tiny_qwen3_moe_logprobs.json",
    );
}

#[test(prepared)]
fn tiny_qwen3_5_moe_matches_transformers() {
    tiny(
        "eval/fixtures/tiny-qwen3_5_moe",
        "eval/fixtures/tiny_qwen3_5_moe_logprobs.json",
    );
}

#[test(prepared)]
fn tiny_qwen3_next_matches_transformers() {
    tiny(
        "eval/fixtures/tiny-qwen3_next",
        "eval/fixtures/tiny_qwen3_next_logprobs.json",
    );
}

#[test(prepared)]
fn tiny_qwen3_matches_transformers() {
    tiny(
        "eval/fixtures/tiny-qwen3",
        "eval/fixtures/tiny_qwen3_logprobs.json",
    );
}

#[test(prepared)]
fn tiny_qwen2_matches_transformers() {
    tiny(
        "eval/fixtures/tiny-qwen2",
        "eval/fixtures/tiny_qwen2_logprobs.json",
    );
}

#[test(prepared)]
fn tiny_qwen3_5_hybrid_matches_transformers() {
    tiny(
        "eval/fixtures/tiny-qwen3_5",
        "eval/fixtures/tiny_qwen3_5_logprobs.json",
    );
}

/// Packs the tiny checkpoint of `family` (`eval/fixtures/tiny-{family}`) in f32 and requires
/// each of `faults`, planted alone, to move it past the bound (by a wide margin: more than
/// 1e-2), and the model without them to be back within it.
fn planted_faults_fail(
    family: &str,
    faults: &[ninfer_perplexity::backend::cpu::model::fault::Pitfall],
) {
    use ninfer_perplexity::backend::cpu::model::fault::{Fault, Faults};
    let tok = common::cache_file("qwen3-tokenizer.json");
    let dir = common::repo().join(format!("eval/fixtures/tiny-{family}"));
    let src = read_hf_dir(&dir, Some(&tok)).unwrap();
    let tmp = common::tempdir();
    let art = tmp.path().join("tiny.ninfer");
    write_artifact(&src, WeightFormat::F32, &art).unwrap();
    let mut e = load(&art, 0);
    let fixture = common::read_json(&format!("eval/fixtures/tiny_{family}_logprobs.json"));
    for &p in faults {
        e.set_faults(Faults::of(Fault::Pitfall(p))).unwrap();
        let d = compare(&e, &fixture);
        eprintln!(
            "{family} {}: max |Δ logprob| {:.3e}",
            p.name(),
            d.max_abs_logprob
        );
        assert!(
            d.max_abs_logprob > 1e-2,
            "{family}: {} went unnoticed: {d:?}",
            p.name()
        );
    }
    // Removed again, the model is back within the bound.
    e.set_faults(Faults::NONE).unwrap();
    assert!(compare(&e, &fixture).max_abs_logprob <= 2e-4);
}

/// Each classic mistake of the hybrid math, planted alone, must fail the bound above (the
/// reference moves 0.1 to 22 nats for them).
#[test(prepared)]
fn every_planted_hybrid_pitfall_fails_the_reference() {
    planted_faults_fail(
        "qwen3_5",
        &ninfer_perplexity::backend::cpu::model::fault::Pitfall::ALL,
    );
}

/// Each planted routing mistake fails the MoE references: top-k off by one and no
/// renormalisation on every family, the shared expert's gate as SiLU on qwen3_5_moe and
/// qwen3_next (qwen3_moe has no shared expert).
#[test(prepared)]
fn every_planted_routing_fault_fails_the_moe_references() {
    use ninfer_perplexity::backend::cpu::model::fault::Pitfall;
    planted_faults_fail("qwen3_moe", &Pitfall::MOE[..2]);
    planted_faults_fail("qwen3_5_moe", &Pitfall::MOE);
    planted_faults_fail("qwen3_next", &Pitfall::MOE);
}
