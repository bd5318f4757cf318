//! End-to-end tests of the two binaries: real runs and every bad-input path a user can hit.
//! Each error must be one line naming the file and the problem, exit non-zero, and leave no
//! report behind.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

fn perplexity(args: &[&str]) -> Output {
    common::run_bin("ninfer-perplexity", args)
}

fn pack(args: &[&str]) -> Output {
    common::run_bin("ninfer-pack", args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a failed run with a single `error:` line containing every `needle`.
fn assert_error(o: &Output, needles: &[&str]) {
    let line = common::error_line(o);
    for n in needles {
        assert!(line.contains(n), "error line lacks `{n}`: {line}");
    }
    assert!(o.stdout.is_empty(), "no table on failure");
}

fn tiny_artifact(dir: &Path) -> PathBuf {
    common::tiny_artifact(dir)
}

fn text_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test(prepared)]
fn smollm2_text_run_prints_table_and_writes_report() {
    let art = common::artifact("smollm2-135m-bf16.ninfer");
    let tmp = common::tempdir();
    let txt = text_file(
        tmp.path(),
        "t.txt",
        "The quick brown fox jumps over the lazy dog. "
            .repeat(8)
            .as_bytes(),
    );
    let out = tmp.path().join("out");
    let o = perplexity(&[
        s(&art),
        "--text",
        s(&txt),
        "--context",
        "32",
        "--stride",
        "16",
        "--output",
        s(&out),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let stdout = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "title + header + one row: {stdout}");
    assert!(
        lines[0].starts_with("# weights ") && lines[0].contains(" | kv fp8 | context 32 stride 16"),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("domain")
            && lines[1].contains("ppl 95% CI")
            && lines[1].contains("bits/byte")
    );
    assert!(lines[2].starts_with("overall"));
    for needle in [
        "artifact",
        "digest sha256:",
        "kv         fp8 (396 bytes per token per layer)",
        "stream     t.txt",
        "done",
    ] {
        assert!(err.contains(needle), "stderr lacks `{needle}`: {err}");
    }
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["settings"]["context"], 32);
    let st = &r["streams"][0];
    let windows = st["windows"].as_array().unwrap();
    assert!(windows.len() > 2);
    let scored: u64 = windows.iter().map(|w| w["scored"].as_u64().unwrap()).sum();
    assert_eq!(scored, st["scored"].as_u64().unwrap());
    assert_eq!(
        st["scored"].as_u64().unwrap() + 1,
        st["tokens"].as_u64().unwrap()
    );
    let nll: f64 = windows.iter().map(|w| w["nll_sum"].as_f64().unwrap()).sum();
    assert!((nll - st["nll_sum"].as_f64().unwrap()).abs() < 1e-9);
    assert!((st["ppl"].as_f64().unwrap() - st["mean_nll"].as_f64().unwrap().exp()).abs() < 1e-9);
    assert_eq!(r["overall"]["scored"], st["scored"]);
    for k in ["bytes", "bits_per_byte", "mean_nll_std_err", "ppl_ci95"] {
        assert!(!st[k].is_null(), "stream lacks {k}");
    }
    // The seed engine's schema-1 fields, with its meanings.
    assert_eq!(crate::report::seed_schema_errors(&r), Vec::<String>::new());
    let abs_txt = std::path::absolute(&txt).unwrap().display().to_string();
    assert_eq!(r["corpus"]["id"], "custom-t.txt");
    assert_eq!(r["corpus"]["mode"], "custom");
    assert_eq!(r["corpus"]["source"], abs_txt.as_str());
    assert_eq!(
        (st["id"].as_str(), st["domain"].as_str()),
        (Some("t.txt"), Some("custom"))
    );
    assert_eq!(st["path"], abs_txt.as_str());
    assert_eq!(st["unscored_tokens"], 1);
    assert_eq!(r["execution"]["kv_dtype"], "fp8-e4m3-r64");
    assert_eq!(r["artifact"]["model_id"], "smollm2-135m-bf16");
    assert_eq!(r["artifact"]["weights_id"], "bf16");
    assert_eq!(st["scored_tokens"], st["scored"]);
    assert_eq!(st["total_nll"], st["nll_sum"]);
    let mut seconds = 0.0;
    for (i, w) in windows.iter().enumerate() {
        assert_eq!(w["index"], i);
        let n = |k: &str| w[k].as_u64().unwrap();
        assert_eq!(n("first_target"), n("target_begin") - n("input_begin"));
        assert_eq!(n("target_end") - n("target_begin"), n("scored_tokens"));
        assert!(n("input_end") - n("input_begin") <= 32);
        seconds += w["seconds"].as_f64().unwrap();
    }
    let stream_s = st["seconds"].as_f64().unwrap();
    assert!(
        seconds <= stream_s && seconds > 0.5 * stream_s,
        "{seconds} vs {stream_s}"
    );
    // The build and the invocation: what --version says, and the command line as given.
    let v = perplexity(&["--version"]);
    let version = String::from_utf8_lossy(&v.stdout).trim().to_string();
    let t = &r["tool"];
    assert_eq!(
        version,
        format!(
            "ninfer-perplexity {} (git {}, {}, features: {})",
            t["version"].as_str().unwrap(),
            t["commit"].as_str().unwrap(),
            t["profile"].as_str().unwrap(),
            t["features"].as_str().unwrap()
        )
    );
    let inv = &r["invocation"];
    assert_eq!(inv["command_line"][1], s(&art));
    assert_eq!(inv["command_line"].as_array().unwrap().len(), 10);
    for k in ["host", "cpu_model", "os"] {
        assert!(!inv[k].as_str().unwrap().is_empty(), "invocation lacks {k}");
    }
}

/// `--version` names the git commit the binary was built from (this checkout's HEAD when it
/// is a git checkout), the profile and the features; `ninfer-pack` the same.
#[test]
fn version_names_the_build() {
    let v = perplexity(&["--version"]);
    assert!(v.status.success());
    let line = String::from_utf8_lossy(&v.stdout).trim().to_string();
    let commit = line
        .split("(git ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("no commit in `{line}`"));
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(h) => assert!(commit.starts_with(&h), "`{line}` is not HEAD {h}"),
        None => assert_eq!(commit, "unknown"),
    }
    assert!(
        line.contains(", release, ") || line.contains(", debug, "),
        "{line}"
    );
    let p = pack(&["--version"]);
    assert!(String::from_utf8_lossy(&p.stdout).contains(&format!("(git {commit}, ")));
}

#[test(prepared)]
fn bad_artifacts() {
    let tmp = common::tempdir();
    let txt = text_file(tmp.path(), "t.txt", b"hello world, hello world");
    let out = tmp.path().join("out");
    let run = |art: &Path| perplexity(&[s(art), "--text", s(&txt), "--output", s(&out)]);

    assert_error(
        &run(&tmp.path().join("nope.ninfer")),
        &["nope.ninfer", "no such artifact file"],
    );

    let good = tiny_artifact(tmp.path());
    let bytes = std::fs::read(&good).unwrap();

    let empty = text_file(tmp.path(), "empty.ninfer", b"");
    assert_error(&run(&empty), &["empty.ninfer", "empty"]);

    let trunc = text_file(tmp.path(), "trunc.ninfer", &bytes[..bytes.len() - 100]);
    assert_error(&run(&trunc), &["trunc.ninfer", "truncated"]);

    let garbage = text_file(
        tmp.path(),
        "garbage.ninfer",
        b"this is not a model at all, just text....",
    );
    assert_error(
        &run(&garbage),
        &["garbage.ninfer", "not a .ninfer artifact"],
    );

    // A plain safetensors file (no ninfer metadata).
    assert_error(
        &run(&common::repo().join("eval/fixtures/tiny-qwen3/model.safetensors")),
        &["model.safetensors", "not a .ninfer artifact"],
    );

    // Rewrite the header's metadata (same length keeps offsets valid).
    let edit = |name: &str, from: &str, to: &str| -> PathBuf {
        assert_eq!(from.len(), to.len());
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        assert!(header.contains(from), "header lacks {from}");
        let mut b = bytes.clone();
        b[8..8 + n].copy_from_slice(header.replacen(from, to, 1).as_bytes());
        text_file(tmp.path(), name, &b)
    };
    assert_error(
        &run(&edit(
            "magic.ninfer",
            "\"format\":\"ninfer\"",
            "\"format\":\"nanfer\"",
        )),
        &["magic.ninfer", "wrong magic"],
    );
    assert_error(
        &run(&edit(
            "ver.ninfer",
            "\"format_version\":\"1\"",
            "\"format_version\":\"9\"",
        )),
        &["ver.ninfer", "unsupported format version 9"],
    );
    assert_error(
        &run(&edit(
            "shape.ninfer",
            "\\\"intermediate_size\\\":32",
            "\\\"intermediate_size\\\":64",
        )),
        &[
            "shape.ninfer",
            "mlp.gate_proj.weight",
            "has shape [32, 16] but the config implies [64, 16]",
        ],
    );
    assert_error(
        &run(&edit(
            "dtype.ninfer",
            "\"dtype\":\"F32\"",
            "\"dtype\":\"I32\"",
        )),
        &["dtype.ninfer", "dtype I32"],
    );

    // Flip one weight byte: loads, but --verify-artifact catches it.
    let mut b = bytes.clone();
    let last = b.len() - 3;
    b[last] ^= 0x40;
    let flipped = text_file(tmp.path(), "flip.ninfer", &b);
    let o = perplexity(&[
        s(&flipped),
        "--text",
        s(&txt),
        "--output",
        s(&out),
        "--verify-artifact",
    ]);
    assert_error(&o, &["flip.ninfer", "digest mismatch"]);
    assert!(!out.exists(), "no report may be written on failure");
}

#[test(prepared)]
fn bad_text_and_flags() {
    let tmp = common::tempdir();
    let art = tiny_artifact(tmp.path());
    let out = tmp.path().join("out");
    let run = |extra: &[&str]| {
        let mut a = vec![s(&art), "--output", s(&out)];
        a.extend_from_slice(extra);
        perplexity(&a)
    };
    let empty = text_file(tmp.path(), "empty.txt", b"");
    assert_error(
        &run(&["--text", s(&empty)]),
        &["empty.txt", "text file is empty"],
    );
    let bad = text_file(tmp.path(), "bad.txt", b"abc\xe4\xbd");
    assert_error(
        &run(&["--text", s(&bad)]),
        &["bad.txt", "invalid UTF-8 at byte offset 3"],
    );
    let one = text_file(tmp.path(), "one.txt", b"a");
    assert_error(
        &run(&["--text", s(&one)]),
        &["one.txt", "1 token(s); at least 2"],
    );
    assert_error(
        &run(&["--text", s(&tmp.path().join("missing.txt"))]),
        &["missing.txt", "cannot read text"],
    );
    let ok = text_file(tmp.path(), "ok.txt", b"hello world hello world");
    assert_error(
        &run(&["--text", s(&ok), "--context", "4", "--stride", "4"]),
        &["--context 4 --stride 4"],
    );
    assert_error(
        &run(&["--text", s(&ok), "--kv-dtype", "fp9"]),
        &[
            "fp9",
            "valid: bf16, int8, fp8, nvfp4, k8v4, f32, fp8-tensor",
        ],
    );
    assert_error(
        &run(&["--text", s(&ok), "--device", "cuda"]),
        &["--device cuda:0", "no CUDA backend"],
    );
    assert!(!out.exists(), "no report may be written on failure");

    // Non-empty --output is refused before any work.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep"), "x").unwrap();
    assert_error(&run(&["--text", s(&ok)]), &["not empty"]);
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);

    // clap usage errors exit 2 and mention the flags.
    let o = perplexity(&[s(&art), "--text", s(&ok), "--corpus", "x.json"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cannot be used with"));
}

#[test(prepared)]
fn a_bad_gemm_switch_is_refused() {
    let tmp = common::tempdir();
    let art = tiny_artifact(tmp.path());
    let ok = text_file(tmp.path(), "ok.txt", b"hello world hello world");
    let out = tmp.path().join("out");
    let o = std::process::Command::new(common::bin("ninfer-perplexity"))
        .args([s(&art), "--text", s(&ok), "--output", s(&out)])
        .env("NINFER_CPU_GEMM", "mkl")
        .output()
        .unwrap();
    assert_error(
        &o,
        &[
            "NINFER_CPU_GEMM=\"mkl\"",
            "expected matrixmultiply, tile16 or auto",
        ],
    );
    assert!(!out.exists(), "no report may be written on failure");
}

#[test]
fn pack_errors_name_the_input() {
    let tmp = common::tempdir();
    let o = pack(&["hf", s(tmp.path()), "-o", s(&tmp.path().join("x.ninfer"))]);
    assert_error(&o, &["config.json", "cannot read"]);
    let cfg = tmp.path().join("config.json");
    std::fs::write(&cfg, r#"{"architectures":["GPTNeoXForCausalLM"]}"#).unwrap();
    let o = pack(&["hf", s(tmp.path()), "-o", s(&tmp.path().join("x.ninfer"))]);
    assert_error(&o, &["unsupported architecture `GPTNeoXForCausalLM`"]);
    let o = pack(&["gguf", s(&cfg), "-o", s(&tmp.path().join("x.ninfer"))]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("config.json"), "{}", stderr(&o));
    assert!(!tmp.path().join("x.ninfer").exists());
}

#[test]
fn help_says_what_each_binary_does() {
    let first = |bin: &str| {
        let o = common::run_bin(bin, &["--help"]);
        assert!(o.status.success());
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    };
    assert_eq!(
        first("ninfer-pack"),
        "Packs models (GGUF files, Hugging Face directories) into .ninfer artifacts and inspects them"
    );
    assert_eq!(
        first("ninfer-perplexity"),
        "Causal perplexity of a .ninfer artifact on a fixed corpus or a text file"
    );
    let o = common::run_bin("ninfer-perplexity", &["compare", "--help"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.starts_with("Compare two runs"),
        "{text}"
    );
    assert!(
        text.contains("Usage: ninfer-perplexity compare [OPTIONS] <BASE> <NEW>"),
        "{text}"
    );
}

/// With stderr redirected, a progress line comes at least every 12 s of wall time, also
/// while one long window runs, and it moves inside the window (the CPU model reports each
/// layer it finishes): one window of 6144 tokens on one thread takes about 20 s.
#[test(prepared)]
fn progress_lines_come_every_ten_seconds_inside_a_long_window() {
    use std::io::BufRead;
    use std::time::Instant;
    let dir = common::tempdir();
    let mut child = std::process::Command::new(common::bin("ninfer-perplexity"))
        .args([
            "smollm2-135m-bf16",
            "--corpus",
            "eval/corpora/perplexity-1m/manifest.json",
            "--stream",
            "en-long-1",
            "--max-tokens",
            "6144",
            "--context",
            "6144",
            "--stride",
            "3072",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--output",
            s(&dir.path().join("out")),
        ])
        .current_dir(common::repo())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines: Vec<(Instant, String)> = Vec::new();
    for l in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        lines.push((Instant::now(), l.unwrap()));
    }
    assert!(child.wait().unwrap().success());
    let text: Vec<&str> = lines.iter().map(|(_, l)| l.as_str()).collect();
    let start = text.iter().position(|l| l.starts_with("scoring")).unwrap();
    let end = text.iter().position(|l| l.starts_with("done")).unwrap();
    let took = lines[end].0 - lines[start].0;
    assert!(
        took.as_secs() >= 12,
        "the window took {took:?}: too short to test"
    );
    for w in lines[start..=end].windows(2) {
        let gap = w[1].0 - w[0].0;
        assert!(
            gap.as_secs_f64() <= 12.0,
            "{gap:?} between `{}` and `{}`",
            w[0].1,
            w[1].1
        );
    }
    // The first progress line comes while the one window runs, with tokens done inside it.
    let first = text[start..end]
        .iter()
        .find(|l| l.starts_with("progress: en-long-1 "))
        .unwrap_or_else(|| panic!("no progress line in {text:#?}"));
    let done: u64 = first["progress: en-long-1 ".len()..]
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(done > 0 && done < 6144, "{first}");
    assert!(
        first.contains("tokens/s") && first.contains("ETA"),
        "{first}"
    );
}

/// The spec's long-context profile, `--context 65536 --stride 32768`, end to end on the CPU
/// with the tiny Qwen3.5 hybrid (two windows of 65536 tokens over two concatenated corpus
/// streams): it scores every target once, and since the model was trained to 32768
/// positions it says so on stderr and in the report, naming both figures.
#[test(prepared)]
fn the_long_context_profile_runs_end_to_end_on_the_tiny_hybrid() {
    let dir = common::tempdir();
    let streams = common::repo().join("eval/corpora/perplexity-1m/streams");
    let mut text = std::fs::read(streams.join("en-long-1.txt")).unwrap();
    text.extend(std::fs::read(streams.join("en-long-2.txt")).unwrap());
    let file = text_file(dir.path(), "long.txt", &text);
    let out = dir.path().join("out");
    let o = perplexity(&[
        "tiny-qwen3_5-f32",
        "--text",
        s(&file),
        "--context",
        "65536",
        "--stride",
        "32768",
        "--max-tokens",
        "98304",
        "--output",
        s(&out),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let warning = "warning: windows of up to 65536 tokens exceed the model's trained context (max_position_embeddings 32768)";
    assert!(err.contains(warning), "{err}");
    let r = common::report(&out);
    assert_eq!(r["settings"]["context"], 65536);
    assert_eq!(r["settings"]["stride"], 32768);
    let windows = r["streams"][0]["windows"].as_array().unwrap();
    let scored: Vec<u64> = windows
        .iter()
        .map(|w| w["scored"].as_u64().unwrap())
        .collect();
    assert_eq!(scored, [65535, 32768], "every target once");
    assert!(windows
        .iter()
        .all(|w| w["mean_nll"].as_f64().is_some_and(f64::is_finite)));
    assert!(
        r["warnings"][0]
            .as_str()
            .unwrap()
            .contains("max_position_embeddings 32768"),
        "{}",
        r["warnings"]
    );
}

/// `--text -` reads standard input, from a pipe too, as one stream named `stdin`, with the
/// same result as the same bytes in a file; empty input is refused with one line and no
/// output.
#[test]
fn text_from_standard_input() {
    use std::io::Write;
    let d = common::tempdir();
    let art = tiny_artifact(d.path());
    let text = "Standard input is a text like any other. ".repeat(8);
    let file = text_file(d.path(), "t.txt", text.as_bytes());
    let run = |input: &[u8], out: &Path| {
        let mut c = std::process::Command::new(common::bin("ninfer-perplexity"))
            .args([s(&art), "--text", "-", "--context", "32", "--stride", "16"])
            .args(["--output", s(out)])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input).unwrap();
        c.wait_with_output().unwrap()
    };
    let piped = d.path().join("piped");
    let o = run(text.as_bytes(), &piped);
    assert!(o.status.success(), "{}", stderr(&o));
    let from_file = d.path().join("file");
    let o = common::score_text(&art, &file, &from_file, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (common::report(&piped), common::report(&from_file));
    assert_eq!(a["streams"][0]["id"], "stdin");
    assert_eq!(a["overall"]["nll_sum"], b["overall"]["nll_sum"]);
    assert_eq!(a["streams"][0]["sha256"], b["streams"][0]["sha256"]);
    let empty = d.path().join("empty");
    let o = run(b"", &empty);
    assert_error(&o, &["-: text file is empty"]);
    assert!(!empty.exists());
}
