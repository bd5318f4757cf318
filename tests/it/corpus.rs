//! The evaluator in corpus mode: a small manifest of our own streams, the domain table, and
//! the corpus bad-input paths.

use crate::common;

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Output;

fn perplexity(args: &[&str]) -> Output {
    common::run_bin("ninfer-perplexity", args)
}

fn err_line(o: &Output) -> String {
    common::error_line(o)
}

struct Mini {
    _dir: tempfile::TempDir,
    manifest: PathBuf,
    root: PathBuf,
}

/// A manifest with two domains and three streams (one quick per domain unless `no_quick`).
fn mini(streams: &[(&str, &str, bool, &str)], tamper: Option<&str>) -> Mini {
    let dir = common::tempdir();
    let root = dir.path().to_path_buf();
    std::fs::create_dir(root.join("streams")).unwrap();
    let mut entries = Vec::new();
    let (mut quick_ids, mut all) = (Vec::new(), Vec::new());
    for (id, domain, quick, text) in streams {
        std::fs::write(root.join("streams").join(format!("{id}.txt")), text).unwrap();
        let sha = hex::encode(Sha256::digest(text.as_bytes()));
        entries.push(serde_json::json!({
            "id": id, "domain": domain, "path": format!("streams/{id}.txt"), "title": id,
            "bytes": text.len(), "sha256": sha, "licence": "test text written for this test"
        }));
        all.push(*id);
        if *quick {
            quick_ids.push(*id);
        }
    }
    if quick_ids.is_empty() {
        // The seed's shape needs a non-empty quick mode.
        quick_ids.push(all[0]);
    }
    let mut m = serde_json::json!({
        "corpus_id": "mini", "schema_version": 1,
        "domains": [{"id": "prose", "title": "Prose"}, {"id": "code", "title": "Code"}],
        "streams": entries,
        "modes": {"quick": quick_ids, "full": all},
    })
    .to_string();
    if let Some(t) = tamper {
        let (from, to) = t.split_once("=>").unwrap();
        m = m.replacen(from, to, 1);
    }
    let manifest = root.join("manifest.json");
    std::fs::write(&manifest, m).unwrap();
    Mini {
        _dir: dir,
        manifest,
        root,
    }
}

const PROSE: &str = "Rain fell on the quiet town all night, and by morning the river had risen over the old stone steps. ";
const CODE: &str = "for (int i = 0; i < n; ++i) { out[i] = a[i] * b[i] + c; }\n";

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test(prepared)]
fn smollm2_corpus_run_prints_domain_table() {
    let art = common::artifact("smollm2-135m-bf16.ninfer");
    let m = mini(
        &[
            ("p1", "prose", true, &PROSE.repeat(3)),
            ("p2", "prose", false, &PROSE.repeat(2)),
            ("c1", "code", true, &CODE.repeat(4)),
        ],
        None,
    );
    let out = m.root.join("out");
    let o = perplexity(&[
        s(&art),
        "--corpus",
        s(&m.manifest),
        "--context",
        "32",
        "--stride",
        "16",
        "--output",
        s(&out),
        "--log-level",
        "debug",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let stdout = String::from_utf8(o.stdout).unwrap();
    let rows: Vec<&str> = stdout.lines().skip(1).collect(); // after the `#` title
    assert_eq!(rows.len(), 4, "{stdout}");
    assert!(rows[1].starts_with("Prose") && rows[1].split_whitespace().nth(1) == Some("2"));
    assert!(rows[2].starts_with("Code"));
    assert!(rows[3].starts_with("overall") && rows[3].split_whitespace().nth(1) == Some("3"));
    for needle in [
        "corpus     mini",
        "3 streams",
        "debug: stream p1 begins",
        "stream     p2",
        "stream     c1",
    ] {
        assert!(err.contains(needle), "stderr lacks `{needle}`: {err}");
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["corpus"]["name"], "mini");
    let scored: u64 = r["domains"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["scored"].as_u64().unwrap())
        .sum();
    assert_eq!(scored, r["overall"]["scored"].as_u64().unwrap());
    // Calibration from the same head pass: one row per scored target, and the domains add up.
    let cal = &r["overall"]["calibration"];
    assert_eq!(cal["rows"], r["overall"]["scored"]);
    let correct: u64 = r["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|st| st["calibration"]["top1_correct"].as_u64().unwrap())
        .sum();
    assert_eq!(cal["top1_correct"].as_u64(), Some(correct));
    assert!(!out.join("plot.svg").exists(), "no plot unless asked");
    let acc = cal["top1_accuracy"].as_f64().unwrap();
    assert!(acc > 0.0 && acc < 1.0, "{cal}");
    let ent = cal["mean_entropy"].as_f64().unwrap();
    assert!(ent > 0.0 && ent < (49152f64).ln(), "{cal}");

    // --quick keeps one stream per domain; --show-calibration adds four columns.
    let out2 = m.root.join("out2");
    let o = perplexity(&[
        s(&art),
        "--corpus",
        s(&m.manifest),
        "--quick",
        "--context",
        "32",
        "--stride",
        "16",
        "--output",
        s(&out2),
        "--show-calibration",
        "--plot",
    ]);
    assert!(o.status.success());
    // plot.svg beside the report: a panel per domain, a marker per window.
    let svg = std::fs::read_to_string(out2.join("plot.svg")).unwrap();
    for title in ["Prose: mean NLL per window", "Code: mean NLL per window"] {
        assert!(svg.contains(title), "{title}");
    }
    let stdout = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[1].ends_with("entropy top1_acc   top1_p     ece"),
        "{stdout}"
    );
    assert_eq!(lines[2].split_whitespace().count(), 12, "{stdout}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out2.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["streams"].as_array().unwrap().len(), 2);
    assert_eq!(r["settings"]["quick"], true);
    let windows: usize = r["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|st| st["windows"].as_array().unwrap().len())
        .sum();
    let svg = std::fs::read_to_string(out2.join("plot.svg")).unwrap();
    assert_eq!(svg.matches("<circle").count(), windows);
}

#[test(prepared)]
fn corpus_bad_input() {
    let dir = common::tempdir();
    let art = common::tiny_artifact(dir.path());
    let run = |m: &Mini, extra: &[&str]| {
        let out = m.root.join("out");
        let mut a = vec![s(&art), "--corpus", s(&m.manifest), "--output", s(&out)];
        a.extend_from_slice(extra);
        let o = perplexity(&a);
        assert!(!out.exists(), "nothing may be written on failure");
        o
    };
    let good = [("p1", "prose", true, PROSE), ("c1", "code", false, CODE)];

    let m = mini(&good, Some("\"bytes\"=>\"bites\""));
    let e = err_line(&run(&m, &[]));
    assert!(
        e.contains("manifest.json") && e.contains("pins only one of `bytes` and `sha256`"),
        "{e}"
    );

    let m = mini(&good, Some("\"domain\":\"code\"=>\"domain\":\"poetry\""));
    let e = err_line(&run(&m, &[]));
    assert!(
        e.contains("domain `poetry` of stream `c1` is not in `domains`")
            && e.contains("streams[1].domain"),
        "{e}"
    );

    let m = mini(&good, None);
    std::fs::remove_file(m.root.join("streams/c1.txt")).unwrap();
    let e = err_line(&run(&m, &[]));
    assert!(
        e.contains("stream `c1`") && e.contains("cannot read") && e.contains("build.py"),
        "{e}"
    );

    let m = mini(&good, None);
    std::fs::write(m.root.join("streams/p1.txt"), PROSE.replace("Rain", "Snow")).unwrap();
    let e = err_line(&run(&m, &[]));
    assert!(
        e.contains("stream `p1`")
            && e.contains("does not match the manifest")
            && e.contains("rebuild"),
        "{e}"
    );

    let m = mini(&good, Some("\"quick\":[\"p1\"]=>\"quick\":[]"));
    let e = err_line(&run(&m, &["--quick"]));
    assert!(e.contains("`modes.quick` is empty"), "{e}");

    let m = mini(
        &[("p1", "prose", true, PROSE), ("c1", "code", false, "x")],
        None,
    );
    let e = err_line(&run(&m, &[]));
    assert!(e.contains("stream `c1`") && e.contains("at least 2"), "{e}");

    let m = mini(&good, None);
    let e = err_line(&run(&m, &["--stream", "nope"]));
    assert!(e.contains("no stream named `nope`"), "{e}");

    let o = perplexity(&[s(&art), "--corpus", "/nonexistent/manifest.json"]);
    let e = err_line(&o);
    assert!(
        e.contains("/nonexistent/manifest.json") && e.contains("cannot read manifest"),
        "{e}"
    );
}
