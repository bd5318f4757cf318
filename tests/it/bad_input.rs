//! Hostile and edge-case inputs to both binaries, one test per class: each must end in one
//! `error:` line naming the file and the problem, a non-zero exit and no report, or (for the
//! races) leave the first run's report intact; never a silent wrong number, a hang or an
//! unbounded read.

use crate::common;

use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn perplexity(args: &[&str]) -> Output {
    common::run_bin("ninfer-perplexity", args)
}

fn pack(args: &[&str]) -> Output {
    common::run_bin("ninfer-pack", args)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a failed run with a single `error:` line containing every `needle`, no table.
fn assert_error(o: &Output, needles: &[&str]) -> String {
    let line = common::error_line(o);
    for n in needles {
        assert!(line.contains(n), "error line lacks `{n}`: {line}");
    }
    assert!(o.stdout.is_empty(), "no table on failure");
    line
}

fn text(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

/// Runs a binary with a deadline: a hang is a test failure, not a stuck CI job.
fn run_with_deadline(bin: &str, args: &[&str], secs: u64) -> Output {
    let mut child = Command::new(common::bin(bin))
        .args(args)
        .current_dir(common::repo())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            panic!("{bin} {args:?} did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A tensor's name and an edit of its bytes.
type TensorEdit<'a> = (&'a str, &'a dyn Fn(&mut [u8]));

/// A copy of the tiny f32 artifact with its safetensors header and tensor bytes edited.
fn edited_artifact(
    dir: &Path,
    name: &str,
    edit_config: impl FnOnce(&mut Value),
    edit_tensor: Option<TensorEdit>,
) -> PathBuf {
    let base = common::tiny_artifact(dir);
    let b = std::fs::read(&base).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut data = b[8 + n..].to_vec();
    let mut config: Value =
        serde_json::from_str(header["__metadata__"]["config"].as_str().unwrap()).unwrap();
    edit_config(&mut config);
    header["__metadata__"]["config"] = Value::String(config.to_string());
    if let Some((tensor, f)) = edit_tensor {
        let off = &header[tensor]["data_offsets"];
        let (a, z) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        f(&mut data[a..z]);
    }
    let mut j = serde_json::to_vec(&header).unwrap();
    while !j.len().is_multiple_of(8) {
        j.push(b' ');
    }
    let mut out = (j.len() as u64).to_le_bytes().to_vec();
    out.extend(j);
    out.extend(data);
    let p = dir.join(name);
    std::fs::write(&p, out).unwrap();
    p
}

fn fill_f32(v: f32) -> impl Fn(&mut [u8]) {
    move |b: &mut [u8]| {
        for c in b.chunks_exact_mut(4) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    }
}

// ---- 1. Non-finite values ------------------------------------------------------------

#[test(prepared)]
fn a_non_finite_weight_is_refused_at_load_naming_the_tensor() {
    let tmp = common::tempdir();
    let nan_at_3 = |b: &mut [u8]| b[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
    let art = edited_artifact(
        tmp.path(),
        "nan.ninfer",
        |_| {},
        Some(("model.layers.1.mlp.down_proj.weight", &nan_at_3)),
    );
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    let out = tmp.path().join("out");
    let o = perplexity(&[s(&art), "--text", s(&t), "--output", s(&out)]);
    assert_error(
        &o,
        &[
            "nan.ninfer",
            "tensor `model.layers.1.mlp.down_proj.weight` holds a non-finite value (NaN) at flat index 3",
        ],
    );
    assert!(!out.exists(), "no report, no directory left behind");
}

#[test(prepared)]
fn an_overflowing_query_fails_the_window_saying_where() {
    // Finite weights so large that the queries overflow: the run must fail, naming the
    // stream, the window, the layer, the position and the head, not print a perplexity.
    let tmp = common::tempdir();
    let art = edited_artifact(
        tmp.path(),
        "big.ninfer",
        |_| {},
        Some(("model.layers.0.self_attn.q_proj.weight", &fill_f32(3e38))),
    );
    let t = text(tmp.path(), "t.txt", "hello world, hello world, hello world");
    let o = perplexity(&[s(&art), "--text", s(&t), "--context", "8", "--stride", "4"]);
    let line = assert_error(
        &o,
        &[
            "stream `t.txt`",
            "window 0 [0, 8)",
            "non-finite query at layer 0, window position 0, query head",
        ],
    );
    assert!(!line.contains('\n'));
}

// ---- 2. Reports are never lost or replaced ----------------------------------------------

#[test(prepared)]
fn a_second_run_never_replaces_the_first_report() {
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let t = text(
        tmp.path(),
        "t.txt",
        &"one two three four five six. ".repeat(20),
    );
    let out = tmp.path().join("out");
    let args = |o: &Path| {
        vec![
            s(&art).to_string(),
            "--text".into(),
            s(&t).to_string(),
            "--context".into(),
            "32".into(),
            "--stride".into(),
            "16".into(),
            "--output".into(),
            s(o).to_string(),
        ]
    };
    let a: Vec<String> = args(&out);
    let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    assert!(perplexity(&a).status.success());
    let first = std::fs::read(out.join("report.json")).unwrap();
    assert_error(&perplexity(&a), &["out", "--output directory is not empty"]);
    assert_eq!(std::fs::read(out.join("report.json")).unwrap(), first);

    // Two runs started together on one new directory: one writes its report, the other
    // fails at startup; the report is whole and is the winner's.
    let race = tmp.path().join("race");
    let a: Vec<String> = args(&race);
    let spawn = || {
        Command::new(common::bin("ninfer-perplexity"))
            .args(&a)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (x, y) = (spawn(), spawn());
    let (x, y) = (x.wait_with_output().unwrap(), y.wait_with_output().unwrap());
    let wins = [&x, &y].iter().filter(|o| o.status.success()).count();
    assert_eq!(
        wins,
        1,
        "exactly one run may own the directory:\n{}\n{}",
        stderr(&x),
        stderr(&y)
    );
    let loser = if x.status.success() { &y } else { &x };
    let line = common::error_line(loser);
    assert!(
        line.contains("another run") || line.contains("not empty"),
        "{line}"
    );
    let r: Value =
        serde_json::from_slice(&std::fs::read(race.join("report.json")).unwrap()).unwrap();
    assert_eq!(r["schema_version"], 1);
    let names: Vec<String> = std::fs::read_dir(&race)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["report.json"], "no lock or temporary file left");

    // Without --output, two runs in the same second get directories of their own.
    let cwd = tmp.path().join("cwd");
    std::fs::create_dir(&cwd).unwrap();
    let a: Vec<String> = args(&cwd)[..7].to_vec();
    let spawn = || {
        Command::new(common::bin("ninfer-perplexity"))
            .args(&a)
            .current_dir(&cwd)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (x, y) = (spawn(), spawn());
    assert!(x.wait_with_output().unwrap().status.success());
    assert!(y.wait_with_output().unwrap().status.success());
    // The seed engine's layout: <model>/<weights>/<kv>/<corpus>/<mode>/<UTC time>[-N].
    let mut runs = Vec::new();
    let mut todo = vec![cwd.join("profiles/perplexity")];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.file_name().unwrap() == "report.json" {
                runs.push(
                    p.parent()
                        .unwrap()
                        .strip_prefix(&cwd)
                        .unwrap()
                        .to_path_buf(),
                );
            }
        }
    }
    assert_eq!(runs.len(), 2, "{runs:?}");
    for r in &runs {
        let parts: Vec<String> = r.iter().map(|c| c.to_string_lossy().into_owned()).collect();
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(cwd.join(r).join("report.json")).unwrap())
                .unwrap();
        let a = &r["artifact"];
        assert_eq!(
            parts[..7],
            [
                "profiles",
                "perplexity",
                a["model_id"].as_str().unwrap(),
                a["weights_id"].as_str().unwrap(),
                r["execution"]["kv_dtype"].as_str().unwrap(),
                r["corpus"]["id"].as_str().unwrap(),
                r["corpus"]["mode"].as_str().unwrap()
            ]
        );
        let stamp = &parts[7];
        assert!(
            stamp.len() >= 15
                && stamp.as_bytes()[8] == b'-'
                && stamp[..8].bytes().all(|b| b.is_ascii_digit()),
            "{stamp}"
        );
    }
    assert_ne!(runs[0], runs[1]);
}

#[test(prepared)]
fn an_unusable_output_directory_fails_before_any_scoring() {
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    let file = text(tmp.path(), "file", "x");
    let under_file = file.join("out");
    assert_error(
        &perplexity(&[s(&art), "--text", s(&t), "--output", s(&under_file)]),
        &["file/out", "cannot create"],
    );
    let long = tmp.path().join("x".repeat(300));
    let o = perplexity(&[s(&art), "--text", s(&t), "--output", s(&long)]);
    assert_error(&o, &["cannot create output directory"]);
    assert!(
        !stderr(&o).contains("scoring"),
        "the run must fail before loading and scoring: {}",
        stderr(&o)
    );
}

// ---- 3. Sizes without bounds -------------------------------------------------------------

#[test(prepared)]
fn huge_config_sizes_are_refused_by_name() {
    let tmp = common::tempdir();
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    let art = edited_artifact(
        tmp.path(),
        "layers.ninfer",
        |c| c["num_layers"] = 100_000.into(),
        None,
    );
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--text", s(&t)], 20);
    assert_error(
        &o,
        &[
            "layers.ninfer",
            "config field `num_layers` is 100000, above the largest this engine takes (1024)",
        ],
    );
    // A mixture of experts claiming 1024 layers of 4096 experts (12.6M tensors) in a file of
    // a few dozen: refused from the count, before any name is built.
    let art = edited_artifact(
        tmp.path(),
        "experts.ninfer",
        |c| {
            c["family"] = "qwen3_moe".into();
            c["num_layers"] = 1024.into();
            c["moe"] = serde_json::json!({
                "num_experts": 4096, "num_experts_per_tok": 8, "moe_intermediate_size": 8,
                "norm_topk_prob": true, "shared_expert_intermediate_size": 0,
                "sparse_layers": vec![true; 1024],
            });
        },
        None,
    );
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--text", s(&t)], 20);
    assert_error(
        &o,
        &[
            "experts.ninfer",
            "but a qwen3_moe model with this config has 12592130",
        ],
    );
    let art = edited_artifact(
        tmp.path(),
        "pos.ninfer",
        |c| c["max_position_embeddings"] = 0.into(),
        None,
    );
    assert_error(
        &perplexity(&[s(&art), "--text", s(&t)]),
        &[
            "pos.ninfer",
            "config field `max_position_embeddings` must be positive",
        ],
    );

    // The same field in a Hugging Face config.json and in `ninfer-pack random`.
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let fixture = common::repo().join("eval/fixtures/tiny-qwen3");
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = 100_000.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        fixture.join("model.safetensors"),
        hf.join("model.safetensors"),
    )
    .unwrap();
    let tok = common::cache_file("qwen3-tokenizer.json");
    let o = run_with_deadline(
        "ninfer-pack",
        &[
            "hf",
            s(&hf),
            "--tokenizer",
            s(&tok),
            "-o",
            s(&tmp.path().join("x.ninfer")),
        ],
        20,
    );
    assert_error(&o, &["config.json", "`num_layers` is 100000"]);
    let o = run_with_deadline(
        "ninfer-pack",
        &[
            "random",
            "--preset",
            "smollm2-135m",
            "--layers",
            "100000",
            "-o",
            s(&tmp.path().join("r.ninfer")),
        ],
        20,
    );
    assert_error(&o, &["--layers", "`num_layers` is 100000"]);
    let mut synth = common::gguf_synth::Synth::new(false);
    synth.set("llama.block_count", common::gguf_synth::Val::U32(100_000));
    let gguf = synth.write(tmp.path(), "huge.gguf");
    let o = run_with_deadline(
        "ninfer-pack",
        &["gguf", s(&gguf), "-o", s(&tmp.path().join("g.ninfer"))],
        20,
    );
    assert_error(&o, &["huge.gguf", "`num_layers` is 100000"]);
    assert!(!tmp.path().join("x.ninfer").exists() && !tmp.path().join("r.ninfer").exists());
}

// ---- 4. Files that are not regular files --------------------------------------------------

#[test(prepared)]
fn pipes_and_devices_are_refused_without_blocking_or_reading_forever() {
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let fifo = tmp.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    let o = run_with_deadline("ninfer-perplexity", &[s(&fifo), "--text", s(&t)], 20);
    assert_error(&o, &["fifo", "artifact is not a regular file"]);
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--text", s(&fifo)], 20);
    assert_error(&o, &["fifo", "text is not a regular file"]);
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--text", "/dev/zero"], 20);
    assert_error(&o, &["/dev/zero", "text is not a regular file"]);
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--corpus", "/dev/zero"], 20);
    assert_error(&o, &["/dev/zero", "manifest is not a regular file"]);
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--text", s(tmp.path())], 20);
    assert_error(&o, &["text is a directory"]);

    // A corpus stream that is a FIFO, and one longer than the manifest says (read no further
    // than one byte past its size).
    let corpus = tmp.path().join("corpus");
    std::fs::create_dir_all(corpus.join("streams")).unwrap();
    let manifest = serde_json::json!({
        "corpus_id": "mini",
        "streams": [
            {"id": "p", "domain": "a", "path": "streams/p.txt", "bytes": 5,
             "sha256": "0".repeat(64)},
        ],
        "modes": {"quick": ["p"], "full": ["p"]},
    });
    std::fs::write(corpus.join("m.json"), manifest.to_string()).unwrap();
    assert!(Command::new("mkfifo")
        .arg(corpus.join("streams/p.txt"))
        .status()
        .unwrap()
        .success());
    let m = corpus.join("m.json");
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--corpus", s(&m)], 20);
    assert_error(&o, &["stream `p`", "stream is not a regular file"]);
    std::fs::remove_file(corpus.join("streams/p.txt")).unwrap();
    std::fs::write(corpus.join("streams/p.txt"), "x".repeat(1 << 20)).unwrap();
    let o = run_with_deadline("ninfer-perplexity", &[s(&art), "--corpus", s(&m)], 20);
    assert_error(
        &o,
        &[
            "stream `p`",
            "stream is 1048576 bytes, more than the 6 this reads",
        ],
    );
}

/// `mkfifo PATH`.
fn fifo(path: &Path) -> PathBuf {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
    path.to_path_buf()
}

/// Every input the packer reads, and the registry, go through the one way to open an input:
/// a FIFO or a device is refused at once, by name, and nothing is written.
#[test]
fn packer_inputs_and_the_registry_are_opened_like_any_input() {
    let tmp = common::tempdir();
    let d = tmp.path();
    let out = d.join("out.ninfer");
    let o = run_with_deadline(
        "ninfer-pack",
        &["gguf", s(&fifo(&d.join("m.gguf"))), "-o", s(&out)],
        20,
    );
    assert_error(&o, &["m.gguf", "the GGUF file is not a regular file"]);
    let o = run_with_deadline("ninfer-pack", &["gguf", "/dev/zero", "-o", s(&out)], 20);
    assert_error(&o, &["/dev/zero", "the GGUF file is not a regular file"]);

    // A Hugging Face directory whose config.json, tokenizer or shard is a FIFO.
    let hf = d.join("hf");
    std::fs::create_dir(&hf).unwrap();
    fifo(&hf.join("config.json"));
    let o = run_with_deadline("ninfer-pack", &["hf", s(&hf), "-o", s(&out)], 20);
    assert_error(&o, &["config.json is not a regular file"]);
    std::fs::remove_file(hf.join("config.json")).unwrap();
    std::fs::copy(
        common::repo().join("eval/fixtures/tiny-qwen3/config.json"),
        hf.join("config.json"),
    )
    .unwrap();
    fifo(&hf.join("tokenizer.json"));
    let o = run_with_deadline("ninfer-pack", &["hf", s(&hf), "-o", s(&out)], 20);
    assert_error(
        &o,
        &["tokenizer.json", "the tokenizer is not a regular file"],
    );
    let o = run_with_deadline(
        "ninfer-pack",
        &["hf", s(&hf), "--tokenizer", "/dev/zero", "-o", s(&out)],
        20,
    );
    assert_error(&o, &["/dev/zero", "the tokenizer is not a regular file"]);
    std::fs::remove_file(hf.join("tokenizer.json")).unwrap();
    std::fs::write(
        hf.join("tokenizer.json"),
        ninfer_perplexity::artifact::random::byte_tokenizer_json(),
    )
    .unwrap();
    fifo(&hf.join("model.safetensors"));
    let o = run_with_deadline("ninfer-pack", &["hf", s(&hf), "-o", s(&out)], 20);
    assert_error(&o, &["model.safetensors", "is not a regular file"]);
    let o = run_with_deadline(
        "ninfer-pack",
        &[
            "random",
            "--tokenizer",
            s(&hf.join("model.safetensors")),
            "-o",
            s(&out),
        ],
        20,
    );
    assert_error(&o, &["the tokenizer is not a regular file"]);
    assert!(!out.exists(), "nothing written");

    // The registry, named by NINFER_REGISTRY, is bounded like any input.
    let t = text(d, "t.txt", "hello");
    let o = Command::new(common::bin("ninfer-perplexity"))
        .args(["smollm2-135m-bf16", "--text", s(&t)])
        .env("NINFER_REGISTRY", "/dev/zero")
        .current_dir(common::repo())
        .output()
        .unwrap();
    assert_error(&o, &["/dev/zero", "the registry is not a regular file"]);
}

/// An output path where a FIFO (or a device) is is refused before any work, for the
/// packer's `-o` and `compare --json/--plot`, and the FIFO is still there afterwards.
#[test(prepared)]
fn outputs_never_replace_a_device_or_a_pipe() {
    let tmp = common::tempdir();
    let d = tmp.path();
    let p = fifo(&d.join("p"));
    let o = run_with_deadline(
        "ninfer-pack",
        &[
            "random",
            "--preset",
            "smollm2-135m",
            "--layers",
            "1",
            "-o",
            s(&p),
        ],
        20,
    );
    assert_error(&o, &["the output is not a regular file"]);
    // Device nodes: hostile_files.rs, against a private node, never the real /dev/null (a
    // writer that lost its check would replace it when the tests run as root).
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&p).unwrap().file_type().is_fifo());
    let art = common::tiny_artifact(d);
    let run = d.join("run");
    let o = common::score_text(
        &art,
        &text(d, "t.txt", "hello world, hello world"),
        &run,
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    for flag in ["--json", "--plot"] {
        let o = run_with_deadline(
            "ninfer-perplexity",
            &["compare", s(&run), s(&run), flag, s(&p)],
            20,
        );
        assert_error(&o, &["is not a regular file"]);
        assert!(std::fs::metadata(&p).unwrap().file_type().is_fifo());
    }
}

/// An artifact that lacks a tensor is refused naming the tensor, not with a count.
#[test]
fn a_missing_tensor_is_named() {
    let tmp = common::tempdir();
    let full = tmp.path().join("full.ninfer");
    let o = pack(&[
        "random",
        "--preset",
        "smollm2-135m",
        "--layers",
        "1",
        "-o",
        s(&full),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&full).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    let cut = tmp.path().join("cut.ninfer");
    safetensors::serialize_to_file(kept, meta.metadata().clone(), &cut).unwrap();
    let t = text(tmp.path(), "t.txt", "hello world");
    let o = perplexity(&[s(&cut), "--text", s(&t)]);
    assert_error(&o, &["cut.ninfer", "tensor `model.norm.weight` is missing"]);

    // `inspect` into a full device says it was stdout that could not be written.
    let o = Command::new(common::bin("ninfer-pack"))
        .args(["inspect", s(&full)])
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    let line = common::error_line(&o);
    assert!(
        line.contains("stdout: cannot write the description"),
        "{line}"
    );
}

// ---- 5. The small ones ----------------------------------------------------------------

#[test(prepared)]
fn a_closed_stdout_ends_quietly() {
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    for (bin, args) in [
        ("ninfer-pack", vec!["inspect", s(&art)]),
        (
            "ninfer-perplexity",
            vec![
                s(&art),
                "--text",
                s(&t),
                "--output",
                s(&tmp.path().join("o")),
            ],
        ),
    ] {
        let mut child = Command::new(common::bin(bin))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before anything is written
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "{bin}: {status:?} {err}");
        assert!(
            !err.contains("panicked") && !err.contains("error:"),
            "{bin}: {err}"
        );
    }
}

#[test(prepared)]
fn the_packer_checks_its_output_first_and_never_replaces_an_input() {
    let tmp = common::tempdir();
    let gguf = tmp.path().join("model.gguf");
    std::fs::write(&gguf, common::gguf_synth::Synth::new(false).bytes()).unwrap();
    let before = std::fs::read(&gguf).unwrap();
    assert_error(
        &pack(&["gguf", s(&gguf), "-o", s(&gguf)]),
        &["model.gguf: the output is one of the inputs"],
    );
    assert_eq!(std::fs::read(&gguf).unwrap(), before);
    let fixture = common::repo().join("eval/fixtures/tiny-qwen3");
    let shard = fixture.join("model.safetensors");
    assert_error(
        &pack(&["hf", s(&fixture), "-o", s(&shard)]),
        &["the output is one of the inputs"],
    );
    // The output is checked before the input is read: a broken input and a bad output
    // path give the output's error, once, with its cause.
    let file = text(tmp.path(), "file", "x");
    let line = assert_error(
        &pack(&["gguf", s(&file), "-o", s(&file.join("x.ninfer"))]),
        &[
            "file/x.ninfer: cannot create its directory",
            "is not a directory",
        ],
    );
    assert_eq!(line.matches("not a directory").count(), 1, "{line}");
}

#[test(prepared)]
fn the_packer_names_the_shard_of_a_bad_tensor() {
    let tmp = common::tempdir();
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let fixture = common::repo().join("eval/fixtures/tiny-qwen3");
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = 64.into();
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        fixture.join("model.safetensors"),
        hf.join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    let tok = common::cache_file("qwen3-tokenizer.json");
    assert_error(
        &pack(&["hf", s(&hf), "--tokenizer", s(&tok), "-o", s(&tmp.path().join("x.ninfer"))]),
        &["model-00001-of-00001.safetensors: tensor `model.layers.0.mlp.gate_proj.weight` has shape [32, 16], the config implies [64, 16]"],
    );
}

/// A copy of the tiny Qwen3.5 checkpoint with its text config edited.
fn hybrid_copy(dir: &Path, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let fixture = common::repo().join("eval/fixtures/tiny-qwen3_5");
    let hf = dir.join("qwen3_5");
    std::fs::create_dir_all(&hf).unwrap();
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        fixture.join("model.safetensors"),
        hf.join("model.safetensors"),
    )
    .unwrap();
    hf
}

#[test(prepared)]
fn hybrid_configs_that_contradict_their_tensors_are_refused() {
    let tmp = common::tempdir();
    let tok = common::cache_file("qwen3-tokenizer.json");
    let out = tmp.path().join("x.ninfer");
    let pack_hf = |hf: &Path| pack(&["hf", s(hf), "--tokenizer", s(&tok), "-o", s(&out)]);
    // Layer 0 claimed to be full attention: its self_attn tensors do not exist.
    let hf = hybrid_copy(tmp.path(), |c| {
        c["text_config"]["layer_types"][0] = "full_attention".into();
    });
    assert_error(
        &pack_hf(&hf),
        &[
            "tensor `model.layers.0.self_attn.q_proj.weight` is missing from",
            "model.safetensors",
        ],
    );
    // Twice the value heads: the projections have the wrong shapes.
    let hf = hybrid_copy(tmp.path(), |c| {
        c["text_config"]["linear_num_value_heads"] = 12.into()
    });
    assert_error(
        &pack_hf(&hf),
        &["model.safetensors: tensor `model.layers.0.linear_attn.in_proj_qkv.weight` has shape [68, 16], the config implies [104, 16]"],
    );
    // Value heads not a multiple of key heads, a layer kind that does not exist, a gate
    // activation that does not exist.
    let hf = hybrid_copy(tmp.path(), |c| {
        c["text_config"]["linear_num_value_heads"] = 5.into()
    });
    assert_error(
        &pack_hf(&hf),
        &[
            "config.json",
            "linear_num_value_heads (5) is not a multiple of linear_num_key_heads (2)",
        ],
    );
    let hf = hybrid_copy(tmp.path(), |c| {
        c["text_config"]["layer_types"][2] = "mamba".into()
    });
    assert_error(
        &pack_hf(&hf),
        &["config.json", "`text_config.layer_types[2]` is \"mamba\""],
    );
    let hf = hybrid_copy(tmp.path(), |c| {
        c["text_config"]["output_gate_type"] = "tanh".into()
    });
    assert_error(
        &pack_hf(&hf),
        &["`text_config.output_gate_type` is `tanh` (supported: silu, swish, sigmoid)"],
    );
    assert!(!out.exists());

    // A checkpoint with a vision tower and no text model.
    let vis = tmp.path().join("vision-only");
    std::fs::create_dir(&vis).unwrap();
    std::fs::copy(hf.join("config.json"), vis.join("config.json")).unwrap();
    let cfg = hybrid_copy(tmp.path(), |_| {});
    std::fs::copy(cfg.join("config.json"), vis.join("config.json")).unwrap();
    let data = vec![0u8; 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
    safetensors::serialize_to_file(
        [("model.visual.patch_embed.proj.weight", view)],
        None,
        &vis.join("model.safetensors"),
    )
    .unwrap();
    assert_error(
        &pack_hf(&vis),
        &["vision-only", "a vision tower but no text model"],
    );
}

#[test(prepared)]
fn windows_past_the_trained_context_are_warned_about_and_recorded() {
    let tmp = common::tempdir();
    let art = edited_artifact(
        tmp.path(),
        "short.ninfer",
        |c| c["max_position_embeddings"] = 16.into(),
        None,
    );
    let t = text(
        tmp.path(),
        "t.txt",
        &"one two three four five six. ".repeat(20),
    );
    let out = tmp.path().join("out");
    let o = perplexity(&[
        s(&art),
        "--text",
        s(&t),
        "--context",
        "32",
        "--stride",
        "16",
        "--output",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let warn = "windows of up to 32 tokens exceed the model's trained context (max_position_embeddings 16)";
    assert!(
        stderr(&o).contains(&format!("warning: {warn}")),
        "{}",
        stderr(&o)
    );
    let r: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert!(
        r["warnings"][0].as_str().unwrap().starts_with(warn),
        "{}",
        r["warnings"]
    );
}

#[test(prepared)]
fn a_registered_name_means_the_registered_bytes() {
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let digest = {
        let o = pack(&["inspect", s(&art)]);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        v["digest"].as_str().unwrap().to_string()
    };
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    let registry = |pin: &str| {
        let p = tmp.path().join("registry.json");
        let r = serde_json::json!({"schema_version": 1, "artifacts": [{
            "name": "tiny", "path": s(&art), "digest": pin, "produce": "make-tiny",
            "tiers": [], "description": "test"}]});
        std::fs::write(&p, r.to_string()).unwrap();
        p
    };
    let run = |reg: &Path, out: &str| {
        Command::new(common::bin("ninfer-perplexity"))
            .args([
                "tiny",
                "--text",
                s(&t),
                "--output",
                s(&tmp.path().join(out)),
            ])
            .env("NINFER_REGISTRY", reg)
            .output()
            .unwrap()
    };
    let wrong = format!("sha256:{}", "0".repeat(64));
    assert_error(
        &run(&registry(&wrong), "o1"),
        &["tiny:", "records digest", "pins", &wrong],
    );
    let ok = run(&registry(&digest), "o2");
    assert!(ok.status.success(), "{}", stderr(&ok));
}

#[test(prepared)]
fn reports_and_artifacts_get_the_usual_mode() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = common::tempdir();
    let art = common::tiny_artifact(tmp.path());
    let t = text(tmp.path(), "t.txt", "hello world, hello world");
    let out = tmp.path().join("out");
    assert!(perplexity(&[s(&art), "--text", s(&t), "--output", s(&out)])
        .status
        .success());
    let umask = ninfer_perplexity::outfile::umask();
    for p in [art, out.join("report.json")] {
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            mode,
            0o666 & !umask,
            "{}: mode {mode:o} under umask {umask:o}",
            p.display()
        );
    }
}

// ---- 6. Long inputs ------------------------------------------------------------------------

#[test(prepared)]
fn a_capped_run_tokenizes_only_its_prefix_and_gets_the_same_tokens() {
    let tmp = common::tempdir();
    let art = common::artifact("smollm2-135m-bf16.ninfer");
    let stream = std::fs::read_to_string(
        common::repo().join("eval/corpora/perplexity-1m/streams/en-long-1.txt"),
    )
    .unwrap();
    // A long text (about 2.7 MB): the capped run must not tokenize it whole.
    let long = text(tmp.path(), "long.txt", &stream.repeat(8));
    let out = tmp.path().join("out");
    let o = perplexity(&[
        s(&art),
        "--text",
        s(&long),
        "--max-tokens",
        "64",
        "--context",
        "32",
        "--stride",
        "16",
        "--output",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let st = &r["streams"][0];
    assert!(
        st["tokens"].is_null(),
        "the whole text's count is not known: {}",
        st["tokens"]
    );
    assert_eq!(st["input_tokens"], 64);

    // The prefix's tokens and bytes are exactly those of the whole text, for both
    // tokenizers the project uses, on every corpus domain.
    let smollm = ninfer_perplexity::artifact::Artifact::open(&art).unwrap();
    let tokenizers = [
        ninfer_perplexity::tokenizer::Tokenizer::from_json(smollm.tokenizer_json()).unwrap(),
        ninfer_perplexity::tokenizer::Tokenizer::from_json(
            &std::fs::read_to_string(common::cache_file("qwen3-tokenizer.json")).unwrap(),
        )
        .unwrap(),
    ];
    for id in ["en-ref-1", "en-long-1", "zh-ref-1", "code-1"] {
        let p = common::repo().join(format!("eval/corpora/perplexity-1m/streams/{id}.txt"));
        if !p.exists() {
            continue; // the quick streams are what ci/prepare.sh builds at least
        }
        let one = std::fs::read_to_string(p).unwrap();
        let many = one.repeat(8);
        for (text, long) in [(&one, false), (&many, true)] {
            if long && !matches!(id, "en-long-1" | "zh-ref-1") {
                continue; // two long texts suffice; whole tokenizations of 2 MB take seconds
            }
            for tok in &tokenizers {
                let ns = [1, 64, 5000, 30000];
                let wholes = tok.prefixes_of_whole(text, &ns).unwrap();
                for (n, mut whole) in ns.into_iter().zip(wholes) {
                    let pre = tok.encode_prefix(text, n).unwrap();
                    if long {
                        assert!(pre.whole.is_none(), "{id}, {n} tokens: not a prefix");
                    }
                    if pre.whole.is_none() {
                        whole.whole = None;
                    }
                    assert_eq!(
                        pre,
                        whole,
                        "{id} (x{}), {n} tokens",
                        if long { 8 } else { 1 }
                    );
                }
            }
        }
    }
}
