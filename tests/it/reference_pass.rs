//! `--reference-kv` / `--reference-artifact`: the in-run comparison with a reference pass,
//! against an independent transformers computation of the same KL divergences, and its
//! invariants (a reference equal to the run gives exactly 0; adding a reference leaves the
//! run's own scores' bits alone) and bad input.

use crate::common;

use ninfer_perplexity::backend::cpu::model::fault::{Fault, Faults};
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::score::Protocol;

fn load(name: &str) -> Engine {
    Engine::load(
        &common::artifact(name),
        &LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap()
}

/// Per-position KL(f32 ‖ nvfp4) of SmolLM2 against transformers with the same KV format
/// written in PyTorch (eval/generators/make_kld_fixture.py), and the Jensen–Shannon
/// divergence and top-5 / top-10 overlap computed there.
#[test(prepared)]
fn kld_matches_transformers() {
    let fx = common::read_json("eval/fixtures/smollm2_kld_f32_vs_nvfp4.json");
    let mut e = load("smollm2-135m-f32.ninfer");
    e.set_reference(KvDtype::F32, None).unwrap();
    let ids = e.tokenizer.encode(fx["text"].as_str().unwrap()).unwrap();
    let want_ids: Vec<u32> = fx["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, want_ids);
    let p = Protocol::new(
        fx["context"].as_u64().unwrap() as usize,
        fx["stride"].as_u64().unwrap() as usize,
    )
    .unwrap();
    let s = e
        .score(&ids, p, KvDtype::Nvfp4, true, &mut |_, _| {})
        .unwrap();
    let r = s.reference.as_ref().unwrap();
    // This engine's own noise on the same numbers: the embeddings scaled by 1 ± 1e-7, a
    // numerically harmless change that nvfp4's rounding turns into a few flipped codes, as
    // a second engine's float32 rounding does.
    let mut means = vec![];
    let mut agrees = vec![];
    let mut perturbed = vec![];
    let mut dps = vec![];
    // Mean Jensen–Shannon, top-5 and top-10 overlap of each run.
    let mut shape = vec![];
    let shape_of = |r: &ninfer_perplexity::score::ReferenceAcc| {
        let n = r.js.len() as f64;
        [
            r.js.iter().map(|&k| k as f64).sum::<f64>() / n,
            r.top5_sum as f64 / (5.0 * n),
            r.top10_sum as f64 / (10.0 * n),
        ]
    };
    for eps in ["1e-7", "-1e-7"] {
        let f = Fault::parse(&format!("embed-scale={eps}")).unwrap();
        e.set_faults(Faults::of(f)).unwrap();
        let t = e
            .score(&ids, p, KvDtype::Nvfp4, false, &mut |_, _| {})
            .unwrap();
        let t = t.reference.unwrap();
        perturbed.push(t.kld.clone());
        means.push(t.kld.iter().map(|&k| k as f64).sum::<f64>() / t.kld.len() as f64);
        agrees.push(t.top1_agree as f64 / t.kld.len() as f64);
        dps.push(t.dp_sum / t.kld.len() as f64);
        shape.push(shape_of(&t));
    }
    e.set_faults(Faults::NONE).unwrap();
    let want: Vec<f64> = fx["windows"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| {
            w["kld"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
        })
        .collect();
    assert_eq!(r.kld.len(), want.len());
    let max_abs = r
        .kld
        .iter()
        .zip(&want)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max);
    let mean: f64 = r.kld.iter().map(|&k| k as f64).sum::<f64>() / want.len() as f64;
    let want_mean = fx["mean_kld"].as_f64().unwrap();
    let agree = r.top1_agree as f64 / want.len() as f64;
    let want_agree = fx["top1_agreement"].as_f64().unwrap();
    let summary = s.reference.as_ref().unwrap().summary().unwrap();
    means.push(mean);
    agrees.push(agree);
    // Mean Δp of the target, p_run − p_ref, from the fixture's two log-probabilities.
    let (mut fdp, mut k) = (0.0, 0usize);
    for w in fx["windows"].as_array().unwrap() {
        let (a, b) = (
            w["run_logprob"].as_array().unwrap(),
            w["ref_logprob"].as_array().unwrap(),
        );
        for (x, y) in a.iter().zip(b) {
            fdp += x.as_f64().unwrap().exp() - y.as_f64().unwrap().exp();
            k += 1;
        }
    }
    let (dp, want_dp) = (r.dp_sum / want.len() as f64, fdp / k as f64);
    dps.push(dp);
    let spread = |v: &[f64]| {
        v.iter().cloned().fold(f64::MIN, f64::max) - v.iter().cloned().fold(f64::MAX, f64::min)
    };
    eprintln!(
        "own spread under embed-scale ±1e-7: mean KLD {:.2e} ({:?}), top-1 agreement {:.4} ({:?})",
        spread(&means),
        means,
        spread(&agrees),
        agrees
    );
    eprintln!(
        "{} positions: mean KLD {mean:.6} vs transformers {want_mean:.6} (rel {:.2e}), max |Δ KLD| {max_abs:.2e}, \
         top-1 agreement {agree:.4} vs {want_agree:.4}; delta_nll {:+.5} {:?}",
        want.len(),
        (mean - want_mean).abs() / want_mean,
        summary.delta_nll,
        summary.delta_nll_ci95
    );
    // Per position: the median |Δ KLD| against transformers, and against this engine with
    // the harmless perturbation.
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let cross = median(
        r.kld
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .collect(),
    );
    let own = median(
        r.kld
            .iter()
            .zip(&perturbed[0])
            .map(|(a, b)| (*a as f64 - *b as f64).abs())
            .collect(),
    );
    eprintln!("median |Δ KLD| per position: {cross:.2e} against transformers, {own:.2e} against the perturbed run");
    // The bounds for the mean KLD and the top-1 agreement are this engine's own measured
    // noise (above) with a 1.5x margin: the two engines differ by no more than a harmless
    // perturbation of one of them does (measured with the seed engine's nvfp4: 1.9e-3
    // against a spread of 3.5e-3, 0.0021 against 0.0063). Per position the bound is the
    // measured median |Δ KLD| against transformers, 4.0e-3 (the perturbation's: 3.9e-3),
    // with a 1.5x margin. At this noise the direction of the KL is not told apart end to end;
    // the head's unit tests hold it to a direct computation within 1e-4.
    assert!(
        spread(&means) > 0.0 && own > 0.0,
        "the perturbation moved nothing"
    );
    assert!(
        (mean - want_mean).abs() <= 1.5 * spread(&means),
        "mean KLD {mean} vs {want_mean}"
    );
    assert!(
        (agree - want_agree).abs() <= 1.5 * spread(&agrees),
        "top-1 agreement {agree} vs {want_agree}"
    );
    eprintln!(
        "mean Δp {dp:+.5} vs transformers {want_dp:+.5}; own spread {:.2e} ({dps:?})",
        spread(&dps)
    );
    assert!(
        (dp - want_dp).abs() <= 1.5 * spread(&dps),
        "mean Δp {dp} vs {want_dp}"
    );
    assert!(
        cross <= 1.5 * 4.0e-3,
        "median |Δ KLD| {cross:.3e} (own {own:.3e})"
    );
    // Jensen–Shannon and top-k overlap (the generator computes them in float64 from the
    // logits, top lists by a stable sort): within 1.5x this engine's own spread under the
    // perturbation, as the mean KLD. Measured: mean JS 0.014340 vs 0.013881 (spread 6.2e-4),
    // top-5 0.8671 vs 0.8612 (5.5e-3), top-10 0.8765 vs 0.8751 (1.3e-3).
    let ours = shape_of(r);
    shape.push(ours);
    for (i, key) in ["mean_js", "top5_overlap", "top10_overlap"]
        .iter()
        .enumerate()
    {
        let want = fx[*key].as_f64().unwrap();
        let own: Vec<f64> = shape.iter().map(|s| s[i]).collect();
        eprintln!(
            "{key}: {:.6} vs transformers {want:.6}; own spread {:.2e} ({own:?})",
            ours[i],
            spread(&own)
        );
        assert!(spread(&own) > 0.0, "{key}: the perturbation moved nothing");
        assert!(
            (ours[i] - want).abs() <= 1.5 * spread(&own),
            "{key} {} vs {want}",
            ours[i]
        );
    }
}

/// A reference equal to the run gives KL exactly 0 and agreement exactly 1; a reference of
/// any kind leaves the run's own scores bit for bit as without one.
#[test(prepared)]
fn an_identical_reference_gives_exactly_zero_and_the_run_keeps_its_bits() {
    let text = std::fs::read_to_string(
        common::repo().join("eval/corpora/perplexity-1m/streams/en-ref-1.txt"),
    )
    .unwrap();
    let plain = load("smollm2-135m-bf16.ninfer");
    let ids = plain.tokenizer.encode(&text).unwrap()[..700].to_vec();
    let p = Protocol::new(256, 128).unwrap();
    let base = plain
        .score(&ids, p, KvDtype::Int8, false, &mut |_, _| {})
        .unwrap();
    for (rkv, other) in [
        (KvDtype::Int8, None),
        (KvDtype::F32, Some("smollm2-135m-f32.ninfer")),
    ] {
        let mut e = load("smollm2-135m-bf16.ninfer");
        e.set_reference(rkv, other.map(load)).unwrap();
        let s = e
            .score(&ids, p, KvDtype::Int8, false, &mut |_, _| {})
            .unwrap();
        assert_eq!(
            s.totals.nll_sum.to_bits(),
            base.totals.nll_sum.to_bits(),
            "{rkv:?} {other:?}"
        );
        assert_eq!(s.calibration, base.calibration);
        let r = s.reference.unwrap().summary().unwrap();
        if other.is_none() {
            assert_eq!((r.mean_kld, r.kld_max, r.top1_agreement), (0.0, 0.0, 1.0));
            assert_eq!((r.delta_nll, r.delta_nll_ci95), (0.0, Some([0.0, 0.0])));
        } else {
            assert!(r.mean_kld > 0.0 && r.top1_agreement < 1.0, "{r:?}");
        }
    }
}

#[test(prepared)]
fn bad_references_are_refused() {
    let tmp = common::tempdir();
    let tiny = common::tiny_artifact(tmp.path());
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "A few words to score, and a few more. ".repeat(6)).unwrap();
    let out = tmp.path().join("out");
    let run = |extra: &[&str]| {
        let mut args = vec![
            tiny.to_str().unwrap(),
            "--text",
            text.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        common::run_bin("ninfer-perplexity", &args)
    };
    let bf16 = common::artifact("smollm2-135m-bf16.ninfer");
    let o = run(&["--reference-artifact", bf16.to_str().unwrap()]);
    let line = common::error_line(&o);
    for n in [
        "smollm2-135m-bf16.ninfer",
        "its tokenizer",
        "differs from",
        "sha256:",
    ] {
        assert!(line.contains(n), "`{n}` not in: {line}");
    }
    assert!(!out.exists(), "nothing written");
    let o = run(&["--reference-kv", "fp9"]);
    assert!(common::error_line(&o).contains("--reference-kv: unknown KV dtype `fp9`"));
    let o = run(&["--reference-kv", "f32", "--device", "cuda"]);
    assert!(common::error_line(&o).contains("CPU backend only"));
    let o = run(&["--reference-artifact", "no-such-artifact"]);
    assert!(common::error_line(&o).contains("--reference-artifact"));
    assert!(!out.exists());
    // The same KV as the run is allowed and says so.
    let o = run(&["--reference-kv", "fp8", "--plot"]);
    assert!(o.status.success());
    let svg = std::fs::read_to_string(out.join("plot.svg")).unwrap();
    assert!(
        svg.contains("KL(reference || run) per position"),
        "{svg:.300}"
    );
    let cmp = tmp.path().join("cmp.svg");
    let o2 = common::run_bin(
        "ninfer-perplexity",
        &[
            "compare",
            out.to_str().unwrap(),
            out.to_str().unwrap(),
            "--plot",
            cmp.to_str().unwrap(),
        ],
    );
    assert!(
        o2.status.success(),
        "{}",
        String::from_utf8_lossy(&o2.stderr)
    );
    assert!(std::fs::read_to_string(&cmp)
        .unwrap()
        .contains("new run: KL(reference || run)"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("KL divergence 0 and agreement 1 by construction"),
        "{err}"
    );
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("# reference: weights f32 | kv fp8"),
        "{table}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["overall"]["reference"]["mean_kld"].as_f64(), Some(0.0));
    // Every position's KL is exactly 0: all in the first histogram bin.
    let h = r["overall"]["reference"]["kld_histogram"]
        .as_array()
        .unwrap();
    assert_eq!(h.len(), 9);
    assert_eq!(h[0], r["overall"]["reference"]["positions"]);
    assert_eq!(r["settings"]["reference"]["kv_dtype"], "fp8");
}

/// The diagnostics of a reference pass: both KL directions, depth and confidence buckets
/// that count every position once, a stream's worst positions in KL order naming their
/// tokens, its worst windows in ΔNLL order, the strip around its worst position reading as
/// the text it covers, and the strip drawn in `--plot`.
#[test]
fn a_reference_pass_points_at_its_worst_tokens() {
    let tmp = common::tempdir();
    let art = common::mini_artifact(tmp.path());
    let text = tmp.path().join("t.txt");
    let body = "Quantized caches forget the rare word: sesquipedalian, then again sesquipedalian. "
        .repeat(6);
    std::fs::write(&text, &body).unwrap();
    let out = tmp.path().join("run");
    let o = common::score_text(
        &art,
        &text,
        &out,
        &["--kv-dtype", "nvfp4", "--reference-kv", "f32", "--plot"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    for want in [
        "kld_rev",
        "# by depth in the window",
        "# by the reference's confidence",
        "# worst positions",
    ] {
        assert!(
            stdout.contains(want),
            "`{want}` not in the tables:\n{stdout}"
        );
    }
    let r = common::report(&out);
    let x = &r["streams"][0]["reference"];
    let positions = x["positions"].as_u64().unwrap();
    assert!(x["mean_kld"].as_f64().unwrap() > 0.0);
    assert!(x["mean_kld_reverse"].as_f64().unwrap() > 0.0);
    assert_ne!(x["mean_kld"], x["mean_kld_reverse"]);
    for key in ["by_depth", "by_confidence"] {
        let n: u64 = x[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["positions"].as_u64().unwrap())
            .sum();
        assert_eq!(n, positions, "{key} counts every position once");
    }
    let worst = x["worst_positions"].as_array().unwrap();
    assert_eq!(worst.len(), 10);
    let klds: Vec<f64> = worst.iter().map(|p| p["kld"].as_f64().unwrap()).collect();
    assert!(klds.windows(2).all(|w| w[0] >= w[1]), "{klds:?}");
    assert!((klds[0] - x["kld_max"].as_f64().unwrap()).abs() < 1e-6);
    // The byte tokenizer: every target token is one byte of the text.
    for p in worst {
        let at = p["position"].as_u64().unwrap() as usize;
        assert_eq!(p["token_id"].as_u64().unwrap(), body.as_bytes()[at] as u64);
    }
    let ww = x["worst_windows"].as_array().unwrap();
    let d: Vec<f64> = ww
        .iter()
        .map(|w| w["delta_nll"].as_f64().unwrap())
        .collect();
    assert!(!d.is_empty() && d.windows(2).all(|w| w[0] >= w[1]), "{d:?}");
    let strip = x["strip"].as_array().unwrap();
    let first = strip[0]["position"].as_u64().unwrap() as usize;
    let last = strip.last().unwrap()["position"].as_u64().unwrap() as usize;
    let read: String = strip.iter().map(|t| t["token"].as_str().unwrap()).collect();
    assert_eq!(read, &body[first..=last], "the strip reads as its text");
    let svg = std::fs::read_to_string(out.join("plot.svg")).unwrap();
    assert!(
        svg.contains("coloured by KL(reference || run)"),
        "the strip is drawn"
    );
}
