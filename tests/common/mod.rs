//! Shared helpers for integration tests: repository paths and prepared artifacts.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub mod checkpoint;
pub mod gguf_synth;
pub mod logprobs;
pub mod rng;

/// The repository: `NINFER_REPO` when set (a test binary carried to another machine by
/// `ci/gpu-check.sh`), else where the test was built.
pub fn repo() -> PathBuf {
    std::env::var_os("NINFER_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// A prepared artifact under `models/` (tests that read one are `Needs::Prepared`, so they
/// are ignored before `bash ci/prepare.sh`; the panic is for a partial preparation).
pub fn artifact(name: &str) -> PathBuf {
    let p = repo().join("models").join(name);
    assert!(
        p.exists(),
        "{} is missing: run bash ci/prepare.sh",
        p.display()
    );
    p
}

pub fn cache_file(name: &str) -> PathBuf {
    let p = repo().join("models/cache").join(name);
    assert!(
        p.exists(),
        "{} is missing: run bash ci/prepare.sh",
        p.display()
    );
    p
}

pub fn read_json(rel: &str) -> serde_json::Value {
    let p = repo().join(rel);
    let t = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub fn bin(name: &str) -> PathBuf {
    // Integration tests are built next to the binaries (target/<profile>/deps/..).
    let mut p = std::env::current_exe().unwrap();
    p.pop();
    if p.ends_with("deps") {
        p.pop();
    }
    p.join(name)
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// Runs one of the crate's binaries from the repository root.
pub fn run_bin(name: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin(name))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap()
}

/// The single `error:` line of a failed run (asserts failure and exactly one such line).
pub fn error_line(o: &std::process::Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "expected failure, got success; stderr: {e}"
    );
    let lines: Vec<&str> = e.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "exactly one error line expected: {e}");
    lines[0].to_string()
}

/// `ninfer-pack hf DIR --tokenizer <the Qwen3 tokenizer> --weights f32 -o OUT`.
pub fn pack_hf_f32(dir: &Path, out: &Path) -> std::process::Output {
    pack_hf(dir, "f32", out)
}

/// `ninfer-pack hf DIR --tokenizer <the pinned Qwen3 tokenizer> --weights W -o OUT`.
pub fn pack_hf(dir: &Path, weights: &str, out: &Path) -> std::process::Output {
    let tok = cache_file("qwen3-tokenizer.json");
    let (dir, tok, out) = (
        dir.to_str().unwrap(),
        tok.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    run_bin(
        "ninfer-pack",
        &[
            "hf",
            dir,
            "--tokenizer",
            tok,
            "--weights",
            weights,
            "-o",
            out,
        ],
    )
}

/// `ninfer-perplexity ART --text TEXT --context 32 --stride 16 --output OUT EXTRA...`: a
/// short text in a few windows.
pub fn score_text(art: &Path, text: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let p = |p: &Path| p.to_str().unwrap().to_string();
    let mut a = vec![
        p(art),
        "--text".into(),
        p(text),
        "--context".into(),
        "32".into(),
        "--stride".into(),
        "16".into(),
        "--output".into(),
        p(out),
    ];
    a.extend(extra.iter().map(|x| x.to_string()));
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    run_bin("ninfer-perplexity", &a)
}

/// The `report.json` of a run's output directory.
pub fn report(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap()
}

/// Packs `dir` with `ninfer-pack hf --weights f32`; asserts one error line holding every
/// needle and no artifact written.
pub fn pack_fails(dir: &Path, needles: &[&str]) {
    let out = dir.join("out.ninfer");
    let o = pack_hf_f32(dir, &out);
    let line = error_line(&o);
    for n in needles {
        assert!(line.contains(n), "`{n}` not in: {line}");
    }
    assert!(!out.exists(), "nothing is written on failure");
}

/// The tiny qwen3 fixture packed through `ninfer-pack` into `dir/tiny.ninfer`.
pub fn tiny_artifact(dir: &Path) -> PathBuf {
    let out = dir.join("tiny.ninfer");
    let o = pack_hf_f32(&repo().join("eval/fixtures/tiny-qwen3"), &out);
    assert!(
        o.status.success(),
        "pack failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// `dir/mini.ninfer`: a random-weight artifact of 2 layers (hidden 32, vocab 260) with the
/// byte tokenizer, made in memory in milliseconds; for tests of file handling that need a
/// valid artifact but no prepared model.
pub fn mini_artifact(dir: &Path) -> PathBuf {
    use ninfer_perplexity::pack::random::{write_random_artifact, RandomSpec};
    let mut c = ninfer_perplexity::model::presets::preset("smollm2-135m").unwrap();
    (
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_layers,
    ) = (260, 32, 48, 2);
    (
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.max_position_embeddings,
    ) = (4, 2, 8, 512);
    let p = dir.join("mini.ninfer");
    let spec = RandomSpec {
        config: c,
        seed: 3,
        tokenizer_json: None,
        quantize: None,
    };
    write_random_artifact(&spec, &p, &mut |_, _| {}).unwrap();
    p
}
