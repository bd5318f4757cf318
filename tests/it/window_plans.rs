//! `--window-plan disjoint|kld-chunks`: the windows other tools publish numbers with,
//! recorded in the report, shardable and merged like the seed's plan, and never compared
//! with another plan's run. (Their figures against `llama-perplexity` itself are in
//! docs/metric.md.)

use crate::common;

use serde_json::Value;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn windows(r: &Value) -> Vec<(u64, u64, u64)> {
    r["streams"][0]["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            let g = |k: &str| w[k].as_u64().unwrap();
            (g("begin"), g("start"), g("end"))
        })
        .collect()
}

#[test]
fn each_plan_scores_its_windows_and_says_so() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let art = common::mini_artifact(dir);
    let text = dir.join("t.txt");
    // 150 characters of a byte-level tokenizer: 150 tokens.
    std::fs::write(&text, "0123456789abcde".repeat(10)).unwrap();
    let run = |out: &str, plan: &str, extra: &[&str]| {
        let mut a = vec![
            s(&art),
            "--text",
            s(&text),
            "--context",
            "32",
            "--window-plan",
            plan,
        ];
        let o = dir.join(out);
        a.extend(["--output", s(&o)]);
        a.extend_from_slice(extra);
        let o = common::run_bin("ninfer-perplexity", &a);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            common::report(&dir.join(out)),
            String::from_utf8(o.stdout).unwrap(),
        )
    };
    let (sliding, _) = run("sliding", "sliding", &["--stride", "16"]);
    let n = sliding["streams"][0]["input_tokens"].as_u64().unwrap();
    assert_eq!(n, 150);
    let (disjoint, table) = run("disjoint", "disjoint", &[]);
    assert!(table.contains("context 32, disjoint windows"), "{table}");
    assert_eq!(
        windows(&disjoint),
        vec![
            (0, 1, 32),
            (32, 33, 64),
            (64, 65, 96),
            (96, 97, 128),
            (128, 129, 150)
        ]
    );
    assert_eq!(disjoint["overall"]["scored"].as_u64(), Some(150 - 5));
    assert_eq!(disjoint["settings"]["window_plan"], "disjoint");
    assert_eq!(disjoint["execution"]["window_plan"], "disjoint");
    assert_eq!(disjoint["execution"]["stride_tokens"], 32);
    assert_eq!(
        disjoint["metric"]["name"],
        "disjoint-window causal perplexity"
    );
    // The first window is the sliding plan's first window: the same inputs, the same bits.
    assert_eq!(
        disjoint["streams"][0]["windows"][0]["nll_sum"],
        sliding["streams"][0]["windows"][0]["nll_sum"]
    );
    let (chunks, table) = run("chunks", "kld-chunks", &[]);
    assert!(
        table.contains("llama.cpp chunks (last 15 scored)"),
        "{table}"
    );
    assert_eq!(
        windows(&chunks),
        vec![(0, 17, 32), (32, 49, 64), (64, 81, 96), (96, 113, 128)]
    );
    assert_eq!(chunks["overall"]["scored"].as_u64(), Some(4 * 15));
    assert_eq!(
        chunks["streams"][0]["unscored_tokens"].as_u64(),
        Some(150 - 60)
    );
    assert_eq!(chunks["execution"]["window_plan"], "kld-chunks");
    assert_eq!(
        chunks["metric"]["name"],
        "llama.cpp KLD-chunk causal perplexity"
    );
    assert_eq!(sliding["settings"]["window_plan"], "sliding");

    // Shards of a chunk run merge into it, bit for bit.
    for i in 1..=2 {
        run(
            &format!("shard{i}"),
            "kld-chunks",
            &["--shard", &format!("{i}/2")],
        );
    }
    let merged = dir.join("merged");
    let o = common::run_bin(
        "ninfer-perplexity",
        &[
            "merge",
            s(&dir.join("shard1")),
            s(&dir.join("shard2")),
            "--output",
            s(&merged),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = common::report(&merged);
    assert_eq!(m["overall"]["nll_sum"], chunks["overall"]["nll_sum"]);
    assert_eq!(m["settings"]["window_plan"], "kld-chunks");

    // Another plan's run is not comparable, whatever its numbers.
    let o = common::run_bin(
        "ninfer-perplexity",
        &["compare", s(&dir.join("disjoint")), s(&dir.join("chunks"))],
    );
    assert!(!o.status.success());
    let e = common::error_line(&o);
    assert!(
        e.contains("different window plans (disjoint vs kld-chunks)"),
        "{e}"
    );

    // Too short for two chunks, as llama-perplexity: one line, no report.
    let o = common::run_bin(
        "ninfer-perplexity",
        &[
            s(&art),
            "--text",
            s(&text),
            "--context",
            "100",
            "--window-plan",
            "kld-chunks",
            "--output",
            s(&dir.join("short")),
        ],
    );
    assert!(!o.status.success());
    let e = common::error_line(&o);
    assert!(e.contains("needs at least 2 x --context tokens"), "{e}");
    assert!(!dir.join("short/report.json").exists());
}
