//! The CPU memory plan end to end: a run that cannot fit is refused before the weights are
//! read, with one line giving what it needs and what is available (`--max-memory`, an
//! address-space cap); a run that fits records its plan in report.json. Never an
//! allocation abort.

use crate::common;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `ninfer-perplexity` on SmolLM2 bf16 over a short text, under `prlimit --as=CAP` when a
/// cap is given; returns the output and how long it took.
fn run(dir: &Path, cap: Option<u64>, extra: &[&str]) -> (Output, Duration) {
    let text = dir.join("t.txt");
    std::fs::write(&text, "The weights stay as stored. ".repeat(40)).unwrap();
    let art = common::artifact("smollm2-135m-bf16.ninfer");
    let out = dir.join("out");
    let bin = common::bin("ninfer-perplexity");
    let mut args: Vec<String> = [s(&art), "--text", s(&text), "--device", "cpu"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    args.extend(["--context", "64", "--stride", "32", "--output", s(&out)].map(String::from));
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut cmd = match cap {
        Some(bytes) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--as={bytes}")).arg("--").arg(&bin);
            c
        }
        None => Command::new(&bin),
    };
    cmd.args(&args).current_dir(common::repo());
    let t = Instant::now();
    let o = cmd
        .output()
        .expect("run ninfer-perplexity (prlimit is util-linux's)");
    (o, t.elapsed())
}

#[test(prepared)]
fn a_run_that_does_not_fit_is_refused_before_it_reads_the_weights() {
    let dir = common::tempdir();
    let (o, took) = run(dir.path(), None, &["--max-memory", "64M"]);
    let line = common::error_line(&o);
    for needle in [
        "smollm2-135m-bf16.ninfer: the CPU run needs about",
        "read in place",
        "but 0.06 GiB is available (--max-memory)",
    ] {
        assert!(line.contains(needle), "`{needle}` not in: {line}");
    }
    assert_eq!(o.status.code(), Some(1));
    assert!(!dir.path().join("out").exists(), "nothing is written");
    assert!(took < Duration::from_secs(10), "refused in {took:?}");
    // A bad size is a usage error naming the flag.
    let (o, _) = run(dir.path(), None, &["--max-memory", "lots"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("--max-memory") && e.contains("unknown unit"),
        "{e}"
    );
}

/// An address-space cap (`ulimit -v`, `prlimit --as`) counts the mapped artifact: a cap the
/// weights and a window cannot fit in is refused with the limit named, never an allocation
/// abort; a cap they fit in runs, and the report records the plan.
#[test(prepared)]
fn an_address_space_cap_is_planned_for() {
    let dir = common::tempdir();
    let (o, took) = run(dir.path(), Some(400 << 20), &[]);
    let line = common::error_line(&o);
    assert!(
        line.contains("of address space") && line.contains("RLIMIT_AS 400 MiB"),
        "{line}"
    );
    assert_eq!(o.status.code(), Some(1), "an error exit, not a signal");
    assert!(took < Duration::from_secs(10), "refused in {took:?}");
    assert!(!dir.path().join("out").exists());
    let (o, _) = run(dir.path(), Some(2 << 30), &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = common::report(&dir.path().join("out"));
    let plan = &r["cpu_memory"];
    assert!(plan["windows_in_flight"].as_u64().unwrap() >= 1, "{plan}");
    assert!(
        plan["allowed_by"].as_str().unwrap().contains("RLIMIT_AS"),
        "{plan}"
    );
    let artifact = std::fs::metadata(common::artifact("smollm2-135m-bf16.ninfer"))
        .unwrap()
        .len();
    assert_eq!(plan["artifact_bytes"].as_u64(), Some(artifact));
    assert!(r["peak_rss_bytes"].as_u64().unwrap() > 0);
}
