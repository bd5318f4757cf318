//! Proves the regression harness gates: with the engine deliberately perturbed
//! (`NINFER_TEST_FAULT`) its trials fail, two clean runs give identical numbers, missing
//! artifacts are ignored (never passed), and bad input is reported by file and field.
//!
//! These are `#[test]`s of the harness binary itself. They run the binary again as a child
//! process with harness arguments and `NINFER_CHILD=1` (which leaves these tests out of the
//! child's list), so the harness runs in a process of its own with its own environment (the
//! fault switch is read when the model is built) and exits with its own status.

use crate::baseline::{self, Location, Record, Verdict};
use crate::common;
use crate::flags::{self, DeviceKind, Tier};
use crate::report::TrialReport;
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::registry::{Registry, Tolerance};
use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    trials: Vec<TrialReport>,
}

/// Runs the harness in a child process. Nothing is ever written into the tree
/// (`INSTA_UPDATE=no`); the reports go to a temporary directory.
fn run_harness(args: &[&str], envs: &[(&str, &str)]) -> Run {
    let report = common::tempdir();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(args)
        .env("NINFER_CHILD", "1")
        .env("INSTA_UPDATE", "no")
        .env("NINFER_HARNESS_REPORT_DIR", report.path())
        .env("RUST_BACKTRACE", "0")
        .env_remove("NINFER_TEST_FAULT")
        .env_remove("NINFER_HARNESS_FLAGS")
        .env_remove("NINFER_HARNESS_THREADS")
        .env_remove("NINFER_REGISTRY");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("start the harness child");
    let trials = std::fs::read_to_string(report.path().join("trials.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a trials.jsonl line"))
        .collect();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        trials,
    }
}

impl Run {
    fn show(&self) -> String {
        format!(
            "exit {}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Two CPU-tier trials: one plain, one through the most lossy KV format.
const GATE_FILTER: &str = "smollm2-135m-bf16/en-ref-1/";
const GATE_KV: &str = "bf16,nvfp4";

fn gate_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--tier", "cpu", "--kv-dtype", GATE_KV, GATE_FILTER];
    v.extend_from_slice(extra);
    v
}

fn no_pending_snapshots() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.to_string_lossy().ends_with(".snap.new") {
                out.push(p.display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(&common::repo().join("baselines"), &mut out);
    out
}

#[test(prepared)]
fn fault_switch_makes_trials_fail() {
    common::artifact("smollm2-135m-bf16.ninfer");
    let before = no_pending_snapshots();
    for fault in ["rope-shift", "skip-final-norm"] {
        let run = run_harness(&gate_args(&[]), &[("NINFER_TEST_FAULT", fault)]);
        assert_eq!(
            run.code,
            101,
            "{fault}: the harness must fail\n{}",
            run.show()
        );
        assert!(
            run.stdout.contains("0 passed; 2 failed"),
            "{fault}: both trials must fail\n{}",
            run.show()
        );
        assert_eq!(run.trials.len(), 2, "{}", run.show());
        for t in &run.trials {
            assert_eq!(
                t.status,
                "drift",
                "{fault}: {} should drift\n{}",
                t.name,
                run.show()
            );
            let delta = t.delta_mean_nll.unwrap();
            assert!(delta.abs() > t.allowed.unwrap(), "{fault}: {}", t.name);
        }
        assert!(
            run.stdout.contains("mean NLL drifted beyond the tolerance"),
            "{}",
            run.show()
        );
        assert!(
            run.stderr.contains("NINFER_TEST_FAULT"),
            "the harness must say the engine is perturbed\n{}",
            run.show()
        );
    }
    assert_eq!(
        no_pending_snapshots(),
        before,
        "a faulty run must not leave pending snapshots"
    );
}

#[test(prepared)]
fn clean_runs_pass_with_identical_numbers() {
    common::artifact("smollm2-135m-bf16.ninfer");
    // One engine thread and one trial at a time, then two trials at once on all cores.
    let a = run_harness(
        &gate_args(&["--test-threads", "1"]),
        &[("NINFER_HARNESS_THREADS", "1")],
    );
    let b = run_harness(&gate_args(&["--test-threads", "2"]), &[]);
    for run in [&a, &b] {
        assert_eq!(
            run.code,
            0,
            "a clean run must pass its baselines\n{}",
            run.show()
        );
        assert!(run.stdout.contains("2 passed; 0 failed"), "{}", run.show());
    }
    let key = |r: &Run| {
        let mut v: Vec<(String, u64, u64, u64)> = r
            .trials
            .iter()
            .map(|t| {
                let n = t.result.as_ref().unwrap();
                (
                    t.name.clone(),
                    n.mean_nll.to_bits(),
                    n.nll_sum.to_bits(),
                    n.scored_tokens,
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(key(&a).len(), 2);
    assert_eq!(key(&a), key(&b), "two clean runs must give the same bits");
    for t in &a.trials {
        assert_eq!(
            t.delta_mean_nll,
            Some(0.0),
            "{}: the CPU path reproduces its baseline exactly",
            t.name
        );
    }
}

#[test]
fn missing_artifact_is_ignored_with_the_reason_never_passed() {
    let dir = common::tempdir();
    let reg = dir.path().join("registry.json");
    std::fs::write(
        &reg,
        r#"{"schema_version": 1, "artifacts": [{"name": "ghost", "path": "models/no-such-file.ninfer",
            "produce": "bash make-ghost.sh", "tiers": ["cpu", "gpu"]}]}"#,
    )
    .unwrap();
    let reg = reg.to_str().unwrap();
    for extra in [&[][..], &["--include-ignored"][..]] {
        let mut args = vec!["--artifact", "ghost", "--kv-dtype", "f32", "--tier", "cpu"];
        args.extend_from_slice(extra);
        let run = run_harness(&args, &[("NINFER_REGISTRY", reg)]);
        assert_eq!(run.code, 0, "{}", run.show());
        assert!(
            run.stdout.contains("0 passed; 0 failed; 16 ignored"),
            "{}",
            run.show()
        );
        if extra.is_empty() {
            assert!(
                run.stderr.contains("artifact file models/no-such-file.ninfer is missing (produce it with `bash make-ghost.sh`)"),
                "{}",
                run.show()
            );
        } else {
            // Forced to run, the trial still reports itself ignored, with the reason.
            assert!(
                run.stdout
                    .contains("ignored (artifact file models/no-such-file.ninfer is missing"),
                "{}",
                run.show()
            );
        }
    }
}

#[test(prepared)]
fn gpu_tier_is_ignored_without_a_gpu() {
    if ninfer_perplexity::backend::Device::select(
        ninfer_perplexity::backend::DeviceRequest::Cuda(0),
        1,
    )
    .is_ok()
    {
        return; // a GPU machine: the GPU tier runs there
    }
    let run = run_harness(&["--tier", "gpu", "--kv-dtype", "bf16", "--list"], &[]);
    assert_eq!(run.code, 0, "{}", run.show());
    assert!(
        run.stdout
            .contains("cuda/smollm2-135m-bf16/en-ref-1/bf16: test"),
        "{}",
        run.show()
    );
    let run = run_harness(&["--tier", "gpu", "--kv-dtype", "bf16"], &[]);
    assert_eq!(run.code, 0, "{}", run.show());
    assert!(
        run.stdout.contains("0 passed; 0 failed; 16 ignored"),
        "{}",
        run.show()
    );
    assert!(
        run.stderr
            .contains("16 trial(s) ignored: gpu-tier smollm2-135m-bf16: no usable GPU"),
        "{}",
        run.show()
    );
}

#[test]
fn harness_flags_from_the_environment() {
    let run = run_harness(
        &["--list"],
        &[("NINFER_HARNESS_FLAGS", "--tier cpu --kv-dtype=k8v4")],
    );
    assert_eq!(run.code, 0, "{}", run.show());
    let names: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.ends_with(": test"))
        .collect();
    // One trial per stream for every CPU-tier artifact that runs k8v4.
    let reg = common::read_json("eval/registry.json");
    let artifacts = reg["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| {
            let has =
                |key: &str, v: &str| a[key].as_array().is_some_and(|l| l.iter().any(|x| x == v));
            has("tiers", "cpu") && (a.get("kv_dtypes").is_none() || has("kv_dtypes", "k8v4"))
        })
        .count();
    assert!(artifacts >= 2, "the registry's CPU tier");
    assert_eq!(names.len(), 16 * artifacts, "{}", run.show());
    assert!(
        names
            .iter()
            .all(|n| n.ends_with("/k8v4: test") && !n.starts_with("cuda/")),
        "{names:?}"
    );
    // An artifact whose registry entry limits its KV formats gets no k8v4 trial.
    assert!(!names.iter().any(|n| n.starts_with("smollm2-135m-nvfp4/")));
    let run = run_harness(&["--list"], &[("NINFER_HARNESS_FLAGS", "--exact")]);
    assert_eq!(run.code, 2, "{}", run.show());
    assert!(
        run.stderr
            .contains("NINFER_HARNESS_FLAGS may hold only harness flags"),
        "{}",
        run.show()
    );
}

#[test]
fn bad_flag_values_list_the_choices() {
    for (args, want) in [
        (
            &["--kv-dtype", "fp9"][..],
            "unknown KV dtype `fp9` (valid: bf16, int8, fp8, nvfp4, k8v4, f32, fp8-tensor)",
        ),
        (
            &["--tier=fast"][..],
            "--tier: unknown tier `fast` (valid: cpu, gpu, emu)",
        ),
        (
            &["--device", "tpu"][..],
            "--device: unknown device `tpu` (valid: cpu, cuda, cuda:N, emu)",
        ),
        (&["--artifact", "nope"][..], "`nope` is not registered in"),
        (&["--kv-dtype"][..], "--kv-dtype needs a value"),
    ] {
        let run = run_harness(args, &[]);
        assert_eq!(run.code, 2, "{args:?}\n{}", run.show());
        assert!(
            run.stderr.contains(want),
            "{args:?}: expected `{want}`\n{}",
            run.show()
        );
    }
}

// ---- in-process checks of the pieces ----------------------------------------------------

fn argv(v: &[&str]) -> Vec<OsString> {
    std::iter::once("harness")
        .chain(v.iter().copied())
        .map(OsString::from)
        .collect()
}

#[test]
fn harness_flags_are_removed_and_libtest_flags_kept() {
    let (f, rest) = flags::extract(argv(&[
        "--kv-dtype",
        "fp8,int8",
        "--exact",
        "--artifact=a",
        "--skip",
        "code-",
        "x/y",
        "--device",
        "cuda:1",
        "--tier",
        "cpu",
        "--test-threads",
        "3",
        "--format",
        "terse",
        "--list",
    ]))
    .unwrap();
    assert_eq!(f.kv, vec![KvDtype::Fp8, KvDtype::Int8]);
    assert_eq!(f.artifacts, vec!["a".to_string()]);
    assert_eq!(f.devices, vec![DeviceKind::Cuda]);
    assert_eq!(f.cuda_index, 1);
    assert_eq!(f.tiers, vec![Tier::Cpu]);
    let rest: Vec<String> = rest.into_iter().map(|s| s.into_string().unwrap()).collect();
    assert_eq!(
        rest,
        [
            "harness",
            "--exact",
            "--skip",
            "code-",
            "x/y",
            "--test-threads",
            "3",
            "--format",
            "terse",
            "--list"
        ]
    );
    let args = libtest_mimic::Arguments::from_iter(rest);
    assert!(args.exact && args.list);
    assert_eq!(args.filter.as_deref(), Some("x/y"));
    assert_eq!(args.test_threads, Some(3));
    assert_eq!(args.skip, vec!["code-".to_string()]);
}

fn record() -> Record {
    Record {
        artifact: "a".into(),
        device_class: "cpu".into(),
        kv_dtype: "bf16".into(),
        stream: "s".into(),
        context: 128,
        stride: 64,
        max_tokens: Some(256),
        corpus: "c".into(),
        stream_sha256: "00".into(),
        tokenizer_sha256: "11".into(),
        stream_tokens: 1000,
        input_tokens: 256,
        scored_tokens: 255,
        mean_nll: 3.0,
        ppl: 3f64.exp(),
        nll_sum: 765.0,
        window_scored: vec![127, 64, 64],
        window_nll_sums: vec![381.0, 192.0, 192.0],
    }
}

#[test]
fn baseline_bodies_round_trip_and_compare_with_tolerance() {
    let r = record();
    assert_eq!(Record::parse(&r.render()).unwrap(), r);
    let tol = Tolerance {
        abs: 0.0,
        rel: 1e-9,
    };
    match baseline::compare(&r, &r, tol) {
        Verdict::Pass { delta, allowed } => assert!(delta == 0.0 && (allowed - 3e-9).abs() < 1e-20),
        v => panic!("{v:?}"),
    }
    let mut n = r.clone();
    n.mean_nll += 1e-12;
    n.nll_sum += 255e-12;
    assert!(
        baseline::compare(&r, &n, tol).passed(),
        "inside the tolerance"
    );
    n.mean_nll = 3.001;
    n.nll_sum = 3.001 * 255.0;
    assert!(matches!(
        baseline::compare(&r, &n, tol),
        Verdict::Drift { .. }
    ));
    let msg = baseline::failure_message(
        Some(&r),
        &n,
        Some(&baseline::compare(&r, &n, tol)),
        baseline::Rule::Tolerance(tol),
    );
    assert!(
        msg.contains("mean_nll 3.000000000") && msg.contains("mean_nll 3.001000000"),
        "{msg}"
    );
    assert!(
        msg.contains("delta:    +1.000e-3") && msg.contains("allowed 3.000e-9"),
        "{msg}"
    );

    let mut t = r.clone();
    t.stream_tokens = 1001;
    t.mean_nll = 9.0;
    let v = baseline::compare(&r, &t, tol);
    assert!(matches!(v, Verdict::TokensChanged(_)), "{v:?}");
    let msg = baseline::failure_message(Some(&r), &t, Some(&v), baseline::Rule::Tolerance(tol));
    assert!(
        msg.contains("the tokenizer or the corpus changed")
            && msg.contains("stream tokens: 1000 -> 1001"),
        "{msg}"
    );
    assert!(
        !msg.contains("delta:"),
        "no NLL delta for changed tokens: {msg}"
    );

    let mut p = r.clone();
    p.context = 256;
    assert!(matches!(
        baseline::compare(&r, &p, tol),
        Verdict::ProtocolChanged(_)
    ));
}

#[test]
fn malformed_baseline_names_the_file_and_the_field() {
    let dir = common::tempdir();
    let loc = Location {
        dir: dir.path().join("b"),
        name: "s".into(),
    };
    std::fs::create_dir_all(&loc.dir).unwrap();
    let good = record().render();
    let bad = good.replace("\"scored\": 255", "\"scored\": \"many\"");
    std::fs::write(loc.snap(), format!("---\nsource: x\n---\n{bad}\n")).unwrap();
    let e = baseline::load(&loc, dir.path()).unwrap_err();
    assert!(
        e.starts_with("b/s.snap: ") && e.contains("field `tokens.scored`"),
        "{e}"
    );
    let missing = good.replace("\"mean_nll\"", "\"mean\"");
    std::fs::write(loc.snap(), format!("---\nsource: x\n---\n{missing}\n")).unwrap();
    let e = baseline::load(&loc, dir.path()).unwrap_err();
    assert!(e.contains("missing field `nll.mean_nll`"), "{e}");
    std::fs::write(loc.snap(), format!("---\nsource: x\n---\n{good}\n")).unwrap();
    assert_eq!(baseline::load(&loc, dir.path()).unwrap(), Some(record()));
}

/// The paired gate judges a trial by its windows: an exact repeat and last-bit noise pass, a
/// drift of θ spread over the windows fails with the figures in words, and a trial whose
/// windows do not line up with the baseline's is refused before any NLL is compared.
#[test]
fn the_paired_gate_judges_by_the_windows() {
    let spec = ninfer_perplexity::gate::GateSpec {
        theta: 1e-3,
        alpha: 0.05,
        beta: 0.1,
    };
    let rule = baseline::Rule::Gate(spec);
    let mut base = record();
    base.window_scored = vec![64; 40];
    base.window_nll_sums = (0..40).map(|i| 150.0 + (i % 7) as f64).collect();
    base.scored_tokens = 64 * 40;
    base.nll_sum = base.window_nll_sums.iter().sum();
    base.mean_nll = base.nll_sum / base.scored_tokens as f64;
    assert!(baseline::judge(&base, &base, rule).passed());
    // Noise of about 1e-4 nats per token per window, zero mean: passes.
    let mut noisy = base.clone();
    for (i, s) in noisy.window_nll_sums.iter_mut().enumerate() {
        *s += if i % 2 == 0 { 64e-4 } else { -64e-4 };
    }
    let v = baseline::judge(&base, &noisy, rule);
    assert!(v.passed(), "{v:?}");
    // Every window worse by 1.1 θ per token: fails, and says so.
    let mut worse = base.clone();
    worse
        .window_nll_sums
        .iter_mut()
        .for_each(|s| *s += 64.0 * 1.1e-3);
    let v = baseline::judge(&base, &worse, rule);
    let msg = baseline::failure_message(Some(&base), &worse, Some(&v), rule);
    assert!(!v.passed(), "{v:?}");
    assert!(
        msg.contains("paired ΔNLL +1.100e-3") && msg.contains("drift detected"),
        "{msg}"
    );
    // Different windows: not comparable.
    let mut other = base.clone();
    other.window_scored = vec![64; 39];
    assert!(matches!(
        baseline::judge(&base, &other, rule),
        Verdict::TokensChanged(_)
    ));
    // A body whose windows do not add up to its totals is refused, naming the field.
    let mut bad = base.clone();
    bad.window_nll_sums[3] += 1.0;
    let e = Record::parse(&bad.render()).unwrap_err();
    assert!(e.contains("field `windows.nll_sum`"), "{e}");
    assert_eq!(Record::parse(&base.render()).unwrap(), base);
}

#[test]
fn malformed_registry_names_the_file_and_the_field() {
    let dir = common::tempdir();
    let p = dir.path().join("registry.json");
    let entry = r#""name": "a", "path": "m.ninfer", "produce": "make""#;
    for (body, want) in [
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tiers": ["cpu", "tpu"]}}]}}"#
            ),
            "`artifacts[0].tiers[1]`: unknown tier `tpu` (valid: cpu, gpu, emu)",
        ),
        (
            format!(r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tiers": "cpu"}}]}}"#),
            "`artifacts[0].tiers`: expected an array",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tolerance": {{"cpu": {{"rel": -1}}}}}}]}}"#
            ),
            "`artifacts[0].tolerance.cpu.rel`: expected a number in [0, 1)",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tolerance": {{"cpu": {{"rel": 1e308}}}}}}]}}"#
            ),
            "`artifacts[0].tolerance.cpu.rel`: expected a number in [0, 1) (nats/token for abs, a fraction for rel), found 1e+308",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tolerance": {{"cpu": {{"relative": 1}}}}}}]}}"#
            ),
            "unknown field `relative` (fields: abs, rel)",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tolerance": {{"cuda/fp9": {{"abs": 1}}}}}}]}}"#
            ),
            "`artifacts[0].tolerance.cuda/fp9`: unknown KV dtype `fp9` (valid:",
        ),
        (
            r#"{"schema_version": 1, "artifacts": [{"name": "a", "path": 3, "produce": "make"}]}"#
                .to_string(),
            "`artifacts[0].path`: expected a string, found a number",
        ),
        (
            r#"{"schema_version": 1, "artifacts": [{"name": "a", "produce": "make"}]}"#.to_string(),
            "`artifacts[0]`: missing field `path`",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "gate": {{"cuda/fp8": {{"theta": 1e-3, "alpha": 0.05, "beta": 0.1}}}}}}]}}"#
            ),
            "`artifacts[0].gate.cuda/fp8`: θ without the measured `spread` it was derived from",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "gate": {{"cuda": {{"theta": 1e-6, "alpha": 0.05, "beta": 0.1, "spread": {{"runs": 5, "windows": 60, "max_std_err": 1e-5, "margin": 2}}}}}}}}]}}"#
            ),
            "`artifacts[0].gate.cuda`: θ 0.000001 is below the",
        ),
        (
            format!(
                r#"{{"schema_version": 1, "artifacts": [{{{entry}, "gate": {{"cuda": {{"theta": 1e-3, "alpha": 0.9, "beta": 0.1, "spread": {{"runs": 5, "windows": 60, "max_std_err": 1e-5, "margin": 2}}}}}}}}]}}"#
            ),
            "`artifacts[0].gate.cuda`: alpha must be in (0, 0.5], not 0.9",
        ),
    ] {
        std::fs::write(&p, &body).unwrap();
        let e = format!("{:#}", Registry::load(&p).unwrap_err());
        assert!(
            e.starts_with(&p.display().to_string()) && e.contains(want),
            "expected `{want}` in: {e}"
        );
    }
    std::fs::write(
        &p,
        format!(r#"{{"schema_version": 1, "artifacts": [{{{entry}, "tolerance": {{"cuda": {{"abs": 1e-3}}, "cuda/nvfp4": {{"abs": 1e-2}}}}}}]}}"#),
    )
    .unwrap();
    let r = Registry::load(&p).unwrap();
    let e = r.get("a").unwrap();
    assert_eq!(
        e.tolerance_for("cuda-sm90", "bf16"),
        Some(Tolerance {
            abs: 1e-3,
            rel: 0.0
        })
    );
    assert_eq!(
        e.tolerance_for("cuda-sm90", "nvfp4"),
        Some(Tolerance {
            abs: 1e-2,
            rel: 0.0
        })
    );
    assert_eq!(e.tolerance_for("cpu", "bf16"), None);
}

#[test(prepared)]
fn the_registry_in_the_tree_loads_and_every_tier_artifact_has_cpu_tolerance() {
    let r = Registry::load(&common::repo().join("eval/registry.json")).unwrap();
    for e in r
        .artifacts
        .iter()
        .filter(|e| e.tiers.iter().any(|t| t == "cpu"))
    {
        for kv in KvDtype::ALL {
            let t = e
                .tolerance_for("cpu", kv.name())
                .unwrap_or_else(|| crate::default_tolerance("cpu", kv));
            assert!(
                t.allowed(3.0) < 1e-6,
                "{}: the CPU tier must stay (almost) exact",
                e.name
            );
        }
    }
}
