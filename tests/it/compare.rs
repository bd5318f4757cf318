//! `ninfer-perplexity compare`: paired deltas of two real runs, and every way a pair of files
//! can fail to be comparable. Each error is one line naming the file(s) and the problem, exits
//! non-zero, and writes no `--json` file.

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

/// Scores `text` with `art` into `dir`, returning the run directory.
fn score(art: &Path, text: &Path, dir: &Path, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        s(art),
        "--text",
        s(text),
        "--output",
        s(dir),
        "--log-level",
        "warn",
    ];
    args.extend_from_slice(extra);
    let o = perplexity(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dir.to_path_buf()
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

struct Runs {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    text: PathBuf,
    art: PathBuf,
}

fn runs() -> Runs {
    let tmp = common::tempdir();
    let dir = tmp.path().to_path_buf();
    let art = common::tiny_artifact(&dir);
    let text = dir.join("t.txt");
    let para = "Paired windows make the interval about the change, not about the text. \
                Ein zweiter Satz, 第三句话, and some code: for (int i = 0; i < n; ++i) {} ";
    std::fs::write(&text, para.repeat(12)).unwrap();
    Runs {
        _tmp: tmp,
        dir,
        text,
        art,
    }
}

/// The tiny model on the text at context 64 / stride 32, bf16 KV, into `r.dir/name`.
fn plain(r: &Runs, name: &str) -> PathBuf {
    score(
        &r.art,
        &r.text,
        &r.dir.join(name),
        &["--context", "64", "--stride", "32"],
    )
}

/// Asserts that comparing `base` with `new` fails with one line holding every needle, and
/// that neither a table nor the `--json` file was written.
fn refused(base: &Path, new: &Path, json: &Path, needles: &[&str]) {
    let o = perplexity(&["compare", s(base), s(new), "--json", s(json)]);
    let line = common::error_line(&o);
    for n in needles {
        assert!(line.contains(n), "`{n}` not in: {line}");
    }
    assert!(o.stdout.is_empty() && !json.exists(), "nothing written");
}

#[test(prepared)]
fn a_run_compared_with_itself_is_zero_with_a_zero_width_interval() {
    let r = runs();
    let a = plain(&r, "a");
    let json = r.dir.join("self.json");
    let o = perplexity(&[
        "compare",
        s(&a),
        s(&a.join("report.json")),
        "--json",
        s(&json),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c = read(&json);
    assert_eq!(c["schema"], "ninfer-perplexity.compare");
    let all = c["overall"].clone();
    assert!(all["windows"].as_u64().unwrap() >= 8, "{all}");
    assert_eq!(all["delta_nll"].as_f64(), Some(0.0));
    assert_eq!(all["delta_nll_ci95"], serde_json::json!([0.0, 0.0]));
    assert_eq!(all["ppl_ratio"].as_f64(), Some(1.0));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("identical"), "{err}");
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.starts_with("# base: weights f32 | kv fp8"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("overall")), "{table}");
}

#[test(prepared)]
fn kv_formats_compare_window_by_window() {
    let r = runs();
    let p = ["--context", "48", "--stride", "16"];
    let base = score(
        &r.art,
        &r.text,
        &r.dir.join("f32"),
        &[&p[..], &["--kv-dtype", "f32", "--plot"]].concat(),
    );
    let new = score(
        &r.art,
        &r.text,
        &r.dir.join("nvfp4"),
        &[&p[..], &["--kv-dtype", "nvfp4"]].concat(),
    );
    let json = r.dir.join("cmp.json");
    let o = perplexity(&["compare", s(&base), s(&new), "--json", s(&json)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c = read(&json);
    assert_eq!(c["base"]["kv_dtype"], "f32");
    assert_eq!(c["new"]["kv_dtype"], "nvfp4");
    // Recompute the overall delta and bits per byte from the two reports' windows.
    let (rb, rn) = (
        read(&base.join("report.json")),
        read(&new.join("report.json")),
    );
    let wins = |r: &Value| -> Vec<(u64, f64)> {
        r["streams"][0]["windows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                (
                    w["scored"].as_u64().unwrap(),
                    w["nll_sum"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let (wb, wn) = (wins(&rb), wins(&rn));
    let n: u64 = wb.iter().map(|w| w.0).sum();
    let d: f64 = wb.iter().zip(&wn).map(|(a, b)| b.1 - a.1).sum();
    let all = &c["overall"];
    approx::assert_relative_eq!(
        all["delta_nll"].as_f64().unwrap(),
        d / n as f64,
        max_relative = 1e-12
    );
    let bytes = rb["overall"]["bytes"].as_f64().unwrap();
    approx::assert_relative_eq!(
        all["delta_bits_per_byte"].as_f64().unwrap(),
        d / std::f64::consts::LN_2 / bytes,
        max_relative = 1e-12
    );
    assert_ne!(d, 0.0, "nvfp4 KV changes the scores");
    // --plot: one point per window plus one legend marker per domain.
    let svg = r.dir.join("cmp.svg");
    let o = perplexity(&["compare", s(&base), s(&new), "--plot", s(&svg)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.starts_with("<svg") && text.contains("overall 95% interval"),
        "{text:.200}"
    );
    // The run's own plot.svg (a text run: one panel of its stream), a marker per window.
    let own = std::fs::read_to_string(base.join("plot.svg")).unwrap();
    assert!(own.contains("overall: mean NLL per window"));
    assert_eq!(own.matches("<circle").count(), wb.len());
    // A text run has no domains: one group, one legend marker.
    assert!(rb["domains"].as_array().unwrap().is_empty());
    assert_eq!(text.matches("<circle").count(), wb.len() + 1);
    let [lo, hi] = [0, 1].map(|i| all["delta_nll_ci95"][i].as_f64().unwrap());
    assert!(lo < all["delta_nll"].as_f64().unwrap() && all["delta_nll"].as_f64().unwrap() < hi);
    assert_eq!(all["windows"].as_u64().unwrap() as usize, wb.len());
    // One stream: its row is the overall row.
    assert_eq!(c["streams"][0]["delta_nll"], all["delta_nll"]);
    // --fail-on NATS: exit 3 exactly when the lower bound exceeds NATS, the table printed
    // either way; the other direction (an improvement) never trips it. The worse run is the
    // base with every window's NLL raised by 0.3 to 0.3 + 0.01·i nats per token.
    let mut doctored = rb.clone();
    for (i, w) in doctored["streams"][0]["windows"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        let raise = (0.3 + 0.01 * i as f64) * w["scored"].as_f64().unwrap();
        w["nll_sum"] = (w["nll_sum"].as_f64().unwrap() + raise).into();
    }
    let worse = r.dir.join("worse.json");
    std::fs::write(&worse, serde_json::to_string(&doctored).unwrap()).unwrap();
    let o = perplexity(&[
        "compare",
        s(&base),
        s(&worse),
        "--json",
        s(&r.dir.join("w.json")),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lower = read(&r.dir.join("w.json"))["overall"]["delta_nll_ci95"][0]
        .as_f64()
        .unwrap();
    assert!(lower > 0.29, "{lower}");
    let (worse_base, worse_new) = (&base, &worse);
    let gate = |b: &Path, n: &Path, nats: f64| {
        let o = perplexity(&["compare", s(b), s(n), "--fail-on", &nats.to_string()]);
        assert!(!o.stdout.is_empty(), "the table is printed");
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, err) = gate(worse_base, worse_new, 0.0);
    assert_eq!(code, Some(3), "{err}");
    assert!(
        err.contains("fail: new is worse by more than --fail-on 0"),
        "{err}"
    );
    assert_eq!(gate(worse_base, worse_new, lower * 0.99).0, Some(3));
    assert_eq!(gate(worse_base, worse_new, lower * 1.01).0, Some(0));
    assert_eq!(gate(worse_new, worse_base, 0.0).0, Some(0));
    for bad in ["-1", "nan", "inf", "x"] {
        let o = perplexity(&["compare", s(&base), s(&new), "--fail-on", bad]);
        assert_eq!(o.status.code(), Some(2), "--fail-on {bad}: a usage error");
    }
}

#[test(prepared)]
fn incomparable_runs_are_refused() {
    let r = runs();
    let base = plain(&r, "base");
    let json = r.dir.join("out.json");
    let refused = |new: &Path, needles: &[&str]| {
        refused(
            &base,
            new,
            &json,
            &[&["are not comparable"], needles].concat(),
        )
    };
    let other = score(
        &r.art,
        &r.text,
        &r.dir.join("proto"),
        &["--context", "64", "--stride", "16"],
    );
    refused(
        &other,
        &["different protocols (context 64 stride 32 vs context 64 stride 16)"],
    );
    let capped = score(
        &r.art,
        &r.text,
        &r.dir.join("cap"),
        &["--context", "64", "--stride", "32", "--max-tokens", "100"],
    );
    refused(&capped, &["different --max-tokens (none vs 100)"]);
    std::fs::create_dir(r.dir.join("other")).unwrap();
    let text2 = r.dir.join("other/t.txt");
    std::fs::write(
        &text2,
        std::fs::read_to_string(&r.text)
            .unwrap()
            .replace("code", "kode"),
    )
    .unwrap();
    let changed = score(
        &r.art,
        &text2,
        &r.dir.join("text2"),
        &["--context", "64", "--stride", "32"],
    );
    refused(&changed, &["stream t.txt has different contents"]);
    // The same text under another name is the same stream.
    let copy = r.dir.join("copy.txt");
    std::fs::copy(&r.text, &copy).unwrap();
    let renamed = score(
        &r.art,
        &copy,
        &r.dir.join("copy"),
        &["--context", "64", "--stride", "32"],
    );
    let o = perplexity(&["compare", s(&base), s(&renamed)]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("identical"),
        "{o:?}"
    );
    // Another tokenizer: the same report with its tokenizer hash changed.
    let mut v = read(&base.join("report.json"));
    v["tokenizer"]["sha256"] = "0".repeat(64).into();
    let forged = r.dir.join("tok.json");
    std::fs::write(&forged, v.to_string()).unwrap();
    refused(&forged, &["different tokenizers", &"0".repeat(64)]);
    // The same targets in other windows.
    let mut v = read(&base.join("report.json"));
    v["streams"][0]["windows"][1]["begin"] = 1.into();
    let moved = r.dir.join("moved.json");
    std::fs::write(&moved, v.to_string()).unwrap();
    refused(&moved, &["different windows"]);
}

#[test(prepared)]
fn files_that_are_not_reports_are_refused() {
    let r = runs();
    let base = plain(&r, "base");
    let report = base.join("report.json");
    let json = r.dir.join("out.json");
    let refused = |new: &Path, needles: &[&str]| refused(&report, new, &json, needles);
    let write = |name: &str, text: &str| {
        let p = r.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    refused(&r.dir.join("absent.json"), &["absent.json", "cannot read"]);
    let empty_dir = r.dir.join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    refused(&empty_dir, &["empty", "a directory without a report.json"]);
    refused(
        &write("text.json", "perplexity 3.2"),
        &["text.json", "not JSON"],
    );
    refused(
        &write("other.json", r#"{"a": 1}"#),
        &["other.json", "no `schema` field"],
    );
    refused(
        &write("cmp.json", r#"{"schema": "ninfer-perplexity.compare"}"#),
        &[
            "cmp.json",
            "schema `ninfer-perplexity.compare`, not a ninfer-perplexity.report file",
        ],
    );
    let mut v = read(&report);
    v["schema_version"] = 2.into();
    refused(
        &write("v2.json", &v.to_string()),
        &[
            "v2.json",
            "report schema version 2; this build reads version 1",
        ],
    );
    let mut v = read(&report);
    v.as_object_mut().unwrap().remove("streams");
    refused(
        &write("nostreams.json", &v.to_string()),
        &["nostreams.json", "not a valid version-1 report", "streams"],
    );
    let mut v = read(&report);
    v["streams"][0]["windows"][0]["nll_sum"] = "NaN".into();
    refused(
        &write("nan.json", &v.to_string()),
        &["nan.json", "not a valid version-1 report"],
    );
    // Output paths that cannot take the JSON: a directory, one of the inputs.
    let o = perplexity(&["compare", s(&report), s(&report), "--json", s(&r.dir)]);
    assert!(common::error_line(&o).contains("the output is a directory"));
    let o = perplexity(&["compare", s(&report), s(&report), "--json", s(&report)]);
    assert!(common::error_line(&o).contains("the output is one of the inputs"));
    let same = r.dir.join("same");
    let o = perplexity(&[
        "compare",
        s(&report),
        s(&report),
        "--json",
        s(&same),
        "--plot",
        s(&same),
    ]);
    assert!(common::error_line(&o).contains("--json and --plot name the same file"));
    assert!(!same.exists());
    let o = perplexity(&["compare", s(&report), s(&report), "--plot", s(&r.dir)]);
    assert!(common::error_line(&o).contains("the output is a directory"));
    assert_eq!(
        read(&report)["schema"],
        "ninfer-perplexity.report",
        "input untouched"
    );
    // Usage errors are clap's (exit 2).
    let o = perplexity(&["compare", s(&report)]);
    assert_eq!(o.status.code(), Some(2));
}

/// Numbers a report holds are checked as a whole before anything is computed from them:
/// sums that overflow, a window that claims more targets than its bounds hold, a window
/// past its stream. `merge` reads reports the same way.
#[test(prepared)]
fn reports_whose_numbers_do_not_add_up_are_refused() {
    let r = runs();
    let base = plain(&r, "base");
    let report = base.join("report.json");
    let json = r.dir.join("out.json");
    let edited = |name: &str, edit: &dyn Fn(&mut Value)| {
        let mut v = read(&report);
        edit(&mut v);
        let p = r.dir.join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p
    };
    let huge = edited("huge.json", &|v| {
        for w in v["streams"][0]["windows"].as_array_mut().unwrap() {
            w["nll_sum"] = serde_json::json!(1e308);
        }
    });
    refused(
        &report,
        &huge,
        &json,
        &["huge.json", "window 1", "NLL sums overflow"],
    );
    let wrapped = edited("wrapped.json", &|v| {
        v["streams"][0]["windows"][0]["scored"] = serde_json::json!(1u64 << 63);
    });
    refused(
        &report,
        &wrapped,
        &json,
        &[
            "wrapped.json",
            "window 0",
            "`scored` is 9223372036854775808",
        ],
    );
    let past = edited("past.json", &|v| {
        v["streams"][0]["windows"][0]["end"] = serde_json::json!(1u64 << 40);
    });
    refused(
        &report,
        &past,
        &json,
        &["past.json", "do not fit the stream's"],
    );
    // Finite sums whose comparison is not: refused, with a plot asked for too (the chart
    // library would spin on an infinite axis).
    let far = edited("far.json", &|v| {
        v["streams"][0]["windows"][0]["nll_sum"] = serde_json::json!(1e300);
    });
    let o = perplexity(&[
        "compare",
        s(&report),
        s(&far),
        "--plot",
        s(&r.dir.join("p.svg")),
    ]);
    assert!(
        common::error_line(&o).contains("the comparison is not finite"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!r.dir.join("p.svg").exists());
    let o = perplexity(&["merge", s(&huge), "--output", s(&r.dir.join("m"))]);
    assert!(common::error_line(&o).contains("NLL sums overflow"));
    assert!(!r.dir.join("m").exists());
}
