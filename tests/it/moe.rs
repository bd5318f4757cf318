//! Mixture-of-experts models end to end: what a run reports about the experts, and every way
//! a MoE checkpoint can contradict its config (one line naming the file and tensor, no
//! artifact written). Quantized experts are `tests/it/moe_quantized.rs`.

use crate::common;

use common::checkpoint::fixture_copy as checkpoint;
use common::pack_hf_f32 as pack;
use common::{report, score_text as score};
use serde_json::Value;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test(prepared)]
fn contradicting_checkpoints_are_refused() {
    let experts_key = |c: &Value| {
        if c.get("num_experts").is_some() {
            "num_experts"
        } else {
            "num_local_experts"
        }
    };
    for (family, what, edit, needles) in [
        (
            "qwen3_moe",
            "top-k above the expert count",
            Box::new(|c: &mut Value| c["num_experts_per_tok"] = 9.into())
                as Box<dyn Fn(&mut Value)>,
            vec!["num_experts_per_tok is 9, outside 1..=num_experts (8)"],
        ),
        (
            "qwen3_moe",
            "an expert the checkpoint lacks",
            Box::new(move |c: &mut Value| {
                let k = experts_key(c);
                c[k] = 9.into();
            }),
            vec![
                "tensor `model.layers.0.mlp.experts.8.gate_proj.weight` is missing",
                "model.safetensors",
            ],
        ),
        (
            "qwen3_moe",
            "a router of the wrong width",
            Box::new(move |c: &mut Value| {
                let k = experts_key(c);
                c[k] = 7.into();
            }),
            vec![
                "model.safetensors: tensor `model.layers.0.mlp.gate.weight` has shape [8, 16], the config implies [7, 16]",
            ],
        ),
        (
            "qwen3_5_moe",
            "fused experts of another count",
            Box::new(move |c: &mut Value| {
                let k = experts_key(c);
                c[k] = 4.into();
            }),
            vec!["model.safetensors: tensor `model.layers.0.mlp.gate.weight` has shape [8, 16], the config implies [4, 16]"],
        ),
        (
            "qwen3_5_moe",
            "experts of another width",
            Box::new(|c: &mut Value| c["moe_intermediate_size"] = 10.into()),
            vec!["model.safetensors: tensor `model.layers.0.mlp.experts.0.gate_proj.weight` has shape [12, 16], the config implies [10, 16]"],
        ),
    ] {
        let (tmp, dir) = checkpoint(family, edit);
        let out = tmp.path().join("out.ninfer");
        let o = pack(&dir, &out);
        let e = common::error_line(&o);
        for n in needles {
            assert!(e.contains(n), "{family}, {what}: `{n}` not in {e}");
        }
        assert!(!out.exists(), "{family}, {what}: no artifact written");
    }
}

/// A run of the tiny hybrid MoE reports the experts, the active parameters and the routing
/// balance; its shards merge with the same counts; the CUDA model on the emulated device
/// routes the same tokens.
#[test(prepared)]
fn a_moe_run_reports_its_routing() {
    let (tmp, dir) = checkpoint("qwen3_5_moe", |_| {});
    let art = tmp.path().join("moe.ninfer");
    assert!(pack(&dir, &art).status.success());
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "Experts share the work; the router decides who does what. ".repeat(8),
    )
    .unwrap();
    let run = |out: &Path, extra: &[&str]| score(&art, &text, out, extra);
    let full = tmp.path().join("full");
    let o = run(&full, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("experts    8 per sparse layer (4 of 4 layers), top-2 renormalised, a gated shared expert 20 wide"),
        "{err}"
    );
    let r = report(&full);
    let cfg = &r["artifact"]["config"]["moe"];
    assert_eq!(cfg["num_experts"], 8);
    assert_eq!(cfg["num_experts_per_tok"], 2);
    let active = r["artifact"]["active_params"].as_u64().unwrap();
    let total = r["artifact"]["params"].as_u64().unwrap();
    // 4 sparse layers × 6 unused experts × 3 matrices of 12 × 16.
    assert_eq!(total - active, 4 * 6 * 3 * 12 * 16);
    let routing = &r["streams"][0]["routing"];
    let per: Vec<u64> = routing["tokens_per_expert"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(per.len(), 8);
    assert_eq!(
        routing["assignments"].as_u64().unwrap(),
        per.iter().sum::<u64>()
    );
    assert_eq!(
        routing["tokens_per_expert_max"].as_u64(),
        per.iter().max().copied()
    );
    // Every routed row picks 2 experts in each of the 4 layers: rows of every window, the last
    // layer only those that predict targets.
    let windows = r["streams"][0]["windows"].as_array().unwrap();
    let rows: u64 = windows
        .iter()
        .map(|w| {
            let (b, st, e) = (
                w["begin"].as_u64().unwrap(),
                w["start"].as_u64().unwrap(),
                w["end"].as_u64().unwrap(),
            );
            3 * (e - b) + (e - (st - 1).max(b))
        })
        .sum();
    assert_eq!(routing["assignments"].as_u64().unwrap(), 2 * rows);

    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    assert!(run(&a, &["--shard", "1/2"]).status.success());
    assert!(run(&b, &["--shard", "2/2"]).status.success());
    let m = tmp.path().join("m");
    let o = common::run_bin(
        "ninfer-perplexity",
        &["merge", s(&a), s(&b), "--output", s(&m)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mr = report(&m);
    assert_eq!(mr["streams"][0]["routing"], r["streams"][0]["routing"]);
    // Routing counts past what the shard's tokens could have made are refused, naming them.
    let doctored = tmp.path().join("doctored");
    std::fs::create_dir(&doctored).unwrap();
    let mut v = report(&b);
    let at = &mut v["streams"][0]["routing"];
    at["tokens_per_expert"][0] = serde_json::json!(1u64 << 40);
    let sum: u64 = at["tokens_per_expert"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .sum();
    at["assignments"] = sum.into();
    std::fs::write(doctored.join("report.json"), v.to_string()).unwrap();
    let m2 = tmp.path().join("m2");
    let o = common::run_bin(
        "ninfer-perplexity",
        &["merge", s(&a), s(&doctored), "--output", s(&m2)],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("routing assignments") && err.contains("at most"),
        "{err}"
    );
    assert!(!m2.exists());

    // The CUDA model on the emulated device routes the same tokens to the same experts
    // (its grouping is built from its own router's choices) and reports the same balance.
    if cfg!(feature = "cuda") {
        let emu = tmp.path().join("emu");
        let o = run(&emu, &["--device", "emu", "--precision", "f32"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let er = report(&emu);
        assert_eq!(er["streams"][0]["routing"], r["streams"][0]["routing"]);
        let (a, b) = (
            er["streams"][0]["mean_nll"].as_f64().unwrap(),
            r["streams"][0]["mean_nll"].as_f64().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b.abs(), "emu {a} vs cpu {b}");
    }
}
