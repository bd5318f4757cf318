//! `--shard I/N` and `ninfer-perplexity merge`: shards of a run merge into the unsharded
//! run's report bit for bit (NLL sums, calibration sums, table), and everything that is not
//! exactly the N pieces of one run is refused with one line and no output.

use crate::common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

fn perplexity(args: &[&str]) -> Output {
    common::run_bin("ninfer-perplexity", args)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p.join("report.json")).unwrap()).unwrap()
}

/// Runs the evaluator, asserting success; returns stdout (the table).
fn ok(args: &[&str]) -> String {
    let o = perplexity(args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// The report without what describes the process rather than the numbers.
fn numbers(mut r: Value) -> Value {
    let o = r.as_object_mut().unwrap();
    for k in [
        "run_id",
        "started_unix_s",
        "timings",
        "timing",
        "throughput",
        "peak_rss_bytes",
        "cpu_memory", // one process's plan against its machine: a merge has no single one
        "invocation", // likewise its command line and host
        "merged_from",
    ] {
        o.remove(k);
    }
    let st = o["settings"].as_object_mut().unwrap();
    st.remove("threads");
    st.remove("device"); // `cpu (N threads)`: the class stays and is compared
    for s in o["streams"].as_array_mut().unwrap() {
        let s = s.as_object_mut().unwrap();
        s.remove("seconds");
        s.remove("processed_tokens_per_s");
        for w in s["windows"].as_array_mut().unwrap() {
            w.as_object_mut().unwrap().remove("seconds");
        }
    }
    r
}

/// Asserts `got == want`, naming the first JSON path where they differ.
fn same(got: Value, want: Value) {
    fn first_diff(a: &Value, b: &Value, at: String) -> Option<String> {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<_> = x.keys().chain(y.keys()).collect();
                keys.into_iter().find_map(|k| match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => first_diff(p, q, format!("{at}.{k}")),
                    _ => Some(format!("{at}.{k}: present on one side only")),
                })
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
                .iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (p, q))| first_diff(p, q, format!("{at}[{i}]"))),
            _ => (a != b).then(|| format!("{at}: {a} vs {b}")),
        }
    }
    if let Some(d) = first_diff(&got, &want, String::new()) {
        panic!("merged report differs from the unsharded one at {d}");
    }
}

/// SmolLM2 on the corpus's four quick streams, 600 tokens each: 36 windows, cut into 3
/// shards (one with one thread), merged in a shuffled order.
#[test(prepared)]
fn shards_merge_into_the_unsharded_report_bit_for_bit() {
    let art = common::artifact("smollm2-135m-bf16.ninfer");
    let manifest = common::repo().join("eval/corpora/perplexity-1m/manifest.json");
    let tmp = common::tempdir();
    let base = [
        s(&art),
        "--corpus",
        s(&manifest),
        "--quick",
        "--max-tokens",
        "600",
        "--context",
        "128",
        "--stride",
        "64",
        "--log-level",
        "warn",
    ];
    let run = |dir: &Path, extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(&["--output", s(dir)]);
        a.extend_from_slice(extra);
        ok(&a)
    };
    let full = tmp.path().join("full");
    let full_table = run(&full, &["--show-calibration"]);
    let dirs: Vec<PathBuf> = (1..=3).map(|i| tmp.path().join(format!("s{i}"))).collect();
    run(&dirs[0], &["--shard", "1/3"]);
    run(&dirs[1], &["--shard", "2/3", "--threads", "1"]);
    let shard3_table = run(&dirs[2], &["--shard", "3/3"]);
    assert!(
        shard3_table.starts_with("# shard 3/3: windows 24..36 of 36 only"),
        "{shard3_table}"
    );

    // The plan cuts by processed tokens: a stream spans two shards, a shard holds two streams.
    let ids = |d: &Path| -> Vec<String> {
        read(d)["streams"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_string())
            .collect()
    };
    let (a, b) = (ids(&dirs[0]), ids(&dirs[1]));
    assert!(a.len() >= 2, "{a:?}");
    assert!(
        a.iter().any(|x| b.contains(x)),
        "no stream split: {a:?} {b:?}"
    );

    let merged = tmp.path().join("merged");
    let o = perplexity(&[
        "merge",
        s(&dirs[2]),
        s(&dirs[0].join("report.json")),
        s(&dirs[1]),
        "--output",
        s(&merged),
        "--show-calibration",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8(o.stdout).unwrap(), full_table);
    let (want, got) = (read(&full), read(&merged));
    assert_eq!(got["merged_from"].as_array().unwrap().len(), 3);
    assert_eq!(got["merged_from"][1]["threads"], 1);
    assert!(got.get("shard").is_none());
    assert!(
        got["streams"][0]["windows"][0].get("calibration").is_none(),
        "per-window calibration stays in the shard reports"
    );
    same(numbers(got.clone()), numbers(want.clone()));
    // Not vacuous: the sums are there and non-trivial.
    assert_eq!(got["overall"]["scored"], 2396);
    assert!(got["overall"]["calibration"]["rows"] == 2396);

    // A merged report is a run like any other: compare says 0 against the unsharded run.
    let o = perplexity(&["compare", s(&full), s(&merged)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("identical scores: the same NLL in all 36 windows"),
        "{err}"
    );
}

struct Tiny {
    tmp: tempfile::TempDir,
    art: PathBuf,
    text: PathBuf,
}

fn tiny() -> Tiny {
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "Shards of one run merge into the run; shards of two runs do not. ".repeat(10),
    )
    .unwrap();
    Tiny { tmp, art, text }
}

impl Tiny {
    fn run(&self, name: &str, extra: &[&str]) -> PathBuf {
        self.run_on(&self.text, name, extra)
    }

    /// Scores `text` into the run directory `name` (context 32, stride 16 unless `extra` sets
    /// the stride), asserting success.
    fn run_on(&self, text: &Path, name: &str, extra: &[&str]) -> PathBuf {
        let dir = self.tmp.path().join(name);
        let o = self.score(&self.art, text, &dir, extra);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        dir
    }

    /// `art` on `text` into `dir` at context 32 (stride 16 unless `extra` sets it).
    fn score(&self, art: &Path, text: &Path, dir: &Path, extra: &[&str]) -> Output {
        let mut a = vec![
            s(art),
            "--text",
            s(text),
            "--context",
            "32",
            "--output",
            s(dir),
            "--log-level",
            "warn",
        ];
        if !extra.contains(&"--stride") {
            a.extend_from_slice(&["--stride", "16"]);
        }
        a.extend_from_slice(extra);
        perplexity(&a)
    }
}

/// Merges `inputs` into a fresh directory, expecting a refusal containing every needle and
/// nothing written.
fn refused(t: &Tiny, inputs: &[&Path], needles: &[&str]) {
    let out = t.tmp.path().join("never");
    let mut a = vec!["merge"];
    a.extend(inputs.iter().map(|p| s(p)));
    a.extend_from_slice(&["--output", s(&out)]);
    let o = perplexity(&a);
    let e = common::error_line(&o);
    for n in needles {
        assert!(e.contains(n), "`{n}` not in: {e}");
    }
    assert!(o.stdout.is_empty(), "no table on a refusal");
    assert!(!out.exists(), "a refused merge leaves no directory");
}

#[test(prepared)]
fn tiny_text_shards_merge_too() {
    let t = tiny();
    let full = t.run("full", &[]);
    let a = t.run("a", &["--shard", "1/2"]);
    let b = t.run("b", &["--shard", "2/2"]);
    let m = t.tmp.path().join("m");
    let o = perplexity(&["merge", s(&a), s(&b), "--output", s(&m)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    same(numbers(read(&m)), numbers(read(&full)));
    // One shard of one is its own run.
    let one = t.run("one", &["--shard", "1/1"]);
    let m1 = t.tmp.path().join("m1");
    let o = perplexity(&["merge", s(&one), "--output", s(&m1)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    same(numbers(read(&m1)), numbers(read(&full)));
}

#[test(prepared)]
fn shards_of_different_runs_are_refused() {
    let t = tiny();
    let full = t.run("full", &[]);
    let a = t.run("a", &["--shard", "1/2"]);
    let b = t.run("b", &["--shard", "2/2"]);
    let int8 = t.run("int8", &["--shard", "2/2", "--kv-dtype", "int8"]);
    let stride = t.run("stride", &["--shard", "2/2", "--stride", "8"]);
    let capped = t.run("capped", &["--shard", "2/2", "--max-tokens", "100"]);
    let of3 = t.run("of3", &["--shard", "2/3"]);
    // The same file name (so the same corpus id, `custom-t.txt`) with other text.
    std::fs::create_dir(t.tmp.path().join("elsewhere")).unwrap();
    let other_text = t.tmp.path().join("elsewhere/t.txt");
    std::fs::write(
        &other_text,
        "A different text, scored the same way. ".repeat(15),
    )
    .unwrap();
    let other = t.run_on(&other_text, "other", &["--shard", "2/2"]);
    // The same checkpoint packed in bf16: another artifact.
    let bf16 = t.tmp.path().join("bf16.ninfer");
    let tok = common::cache_file("qwen3-tokenizer.json");
    let o = common::run_bin(
        "ninfer-pack",
        &[
            "hf",
            s(&common::repo().join("eval/fixtures/tiny-qwen3")),
            "--tokenizer",
            s(&tok),
            "--weights",
            "bf16",
            "-o",
            s(&bf16),
        ],
    );
    assert!(o.status.success());
    let other_artifact = t.tmp.path().join("other-artifact");
    let o = t.score(&bf16, &t.text, &other_artifact, &["--shard", "2/2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    refused(
        &t,
        &[&a, &other_artifact],
        &["are shards of different runs: artifact digest sha256:"],
    );
    refused(
        &t,
        &[&a, &int8],
        &["are shards of different runs", "KV format fp8 vs int8"],
    );
    refused(
        &t,
        &[&a, &stride],
        &["protocol context 32 stride 16 vs context 32 stride 8"],
    );
    refused(&t, &[&a, &capped], &["--max-tokens none vs 100"]);
    refused(&t, &[&a, &of3], &["shard count 2 vs 3"]);
    refused(&t, &[&a, &other], &["stream 1 is", "sha256"]);
    refused(&t, &[&a, &a], &["shard 1/2 given twice"]);
    refused(&t, &[&a], &["its run has 2 shards; missing 2/2 (1 given)"]);
    refused(&t, &[&b], &["missing 1/2"]);
    refused(&t, &[&a, &full], &["full/report.json: not a shard report"]);
    // A merged report is not a shard.
    let m = t.tmp.path().join("m");
    let o = perplexity(&["merge", s(&a), s(&b), "--output", s(&m)]);
    assert!(o.status.success());
    refused(&t, &[&m], &["an already merged report"]);
    refused(&t, &[&t.text], &["t.txt: not JSON"]);

    // A shard whose windows were edited no longer matches the plan.
    let tampered = t.tmp.path().join("tampered.json");
    let mut v = read(&b);
    v["shard"]["windows"][0] = Value::from(0);
    std::fs::write(&tampered, v.to_string()).unwrap();
    refused(
        &t,
        &[&a, &tampered],
        &["tampered.json: shard 2/2 should hold windows"],
    );
    // Recorded counts that would make the plan enormous are refused before it is made.
    // Recorded counts that would make the plan enormous are refused before it is made.
    let one = t.run("one", &["--shard", "1/1"]);
    let mut v = read(&one);
    v["shard"]["run_streams"][0]["input_tokens"] = Value::from(1u64 << 60);
    std::fs::write(&tampered, v.to_string()).unwrap();
    refused(
        &t,
        &[&tampered],
        &[
            "tampered.json: stream",
            "records 1152921504606846976 tokens in",
        ],
    );
    let mut v = read(&one);
    v["shard"]["count"] = Value::from(1u64 << 40);
    std::fs::write(&tampered, v.to_string()).unwrap();
    refused(
        &t,
        &[&tampered],
        &["tampered.json: a shard count of 1099511627776"],
    );
    // A window dropped from a shard, or one moved.
    let mut v = read(&b);
    v["streams"][0]["windows"].as_array_mut().unwrap().pop();
    std::fs::write(&tampered, v.to_string()).unwrap();
    // (its stream's totals no longer add up: refused when the report is read)
    refused(
        &t,
        &[&a, &tampered],
        &["tampered.json: stream", "its windows score"],
    );
    let mut v = read(&b);
    let w0 = &mut v["streams"][0]["windows"][0];
    w0["begin"] = Value::from(w0["begin"].as_u64().unwrap() + 1);
    std::fs::write(&tampered, v.to_string()).unwrap();
    refused(
        &t,
        &[&a, &tampered],
        &[
            "tampered.json: stream",
            "does not hold the windows shard 2/2 should score",
        ],
    );

    // The merged report goes only into an absent or empty directory.
    let o = perplexity(&["merge", s(&a), s(&b), "--output", s(&a)]);
    assert!(common::error_line(&o).contains("not empty"));
}

#[test(prepared)]
fn bad_shard_specs_fail_before_any_output() {
    let t = tiny();
    for (spec, want) in [
        (
            "3/2",
            "--shard 3/2: the shard index counts from 1 to the shard count",
        ),
        ("0/0", "--shard 0/0: the shard count must be at least 1"),
        ("2", "--shard 2: expected I/N"),
        ("9999/9999", "--shard 9999/9999: the run has"),
    ] {
        let dir = t.tmp.path().join("out");
        let o = t.score(&t.art, &t.text, &dir, &["--shard", spec]);
        let e = common::error_line(&o);
        assert!(e.contains(want), "{spec}: {e}");
        assert!(!dir.exists(), "{spec}: nothing written");
    }
    let o = perplexity(&[
        s(&t.art),
        "--text",
        s(&t.text),
        "--shard",
        "1/2",
        "--reference-kv",
        "f32",
    ]);
    assert!(common::error_line(&o).contains("--shard cannot be combined with --reference-kv"));
}

/// `ci/examples/shard-task.sh`, the task of the Slurm and Kubernetes examples, with the
/// variables each scheduler sets (a 0-based Slurm array, an Indexed Job).
#[test(prepared)]
fn the_job_array_task_script_gives_mergeable_shards() {
    let t = tiny();
    let full = t.run("full", &[]);
    let script = common::repo().join("ci/examples/shard-task.sh");
    let task = |out: &Path, env: &[(&str, String)]| {
        let mut c = std::process::Command::new("bash");
        c.arg(&script)
            .arg(out)
            .arg(&t.art)
            .args(["--text", s(&t.text), "--context", "32", "--stride", "16"])
            .args(["--log-level", "warn"])
            .env("NINFER_PERPLEXITY", common::bin("ninfer-perplexity"))
            .env_remove("SLURM_ARRAY_TASK_ID")
            .env_remove("JOB_COMPLETION_INDEX");
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    for (name, envs) in [
        (
            "slurm",
            (0..2)
                .map(|i| {
                    vec![
                        ("SLURM_ARRAY_TASK_ID", i.to_string()),
                        ("SLURM_ARRAY_TASK_MIN", "0".to_string()),
                        ("SLURM_ARRAY_TASK_COUNT", "2".to_string()),
                    ]
                })
                .collect::<Vec<_>>(),
        ),
        (
            "k8s",
            (0..2)
                .map(|i| {
                    vec![
                        ("JOB_COMPLETION_INDEX", i.to_string()),
                        ("SHARDS", "2".to_string()),
                    ]
                })
                .collect(),
        ),
    ] {
        let out = t.tmp.path().join(name);
        for env in &envs {
            let o = task(&out, env);
            assert!(
                o.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        assert!(out.join("shard-1").is_dir() && out.join("shard-2").is_dir());
        let merged = out.join("merged");
        let o = perplexity(&[
            "merge",
            s(&out.join("shard-1")),
            s(&out.join("shard-2")),
            "--output",
            s(&merged),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        same(numbers(read(&merged)), numbers(read(&full)));
    }
    let o = task(&t.tmp.path().join("none"), &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not an array task"));
}
