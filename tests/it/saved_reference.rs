//! `--save-reference FILE` and `--kld-base FILE`: a run saved as a reference and compared
//! with later, without the reference model. The comparison must be the one an in-process
//! `--reference-kv` run computes (the same positions, the same statistics); a file that does
//! not belong to the run (other tokens, protocol, head), or that is damaged, is refused with
//! one line and no report.

use crate::common;

use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

struct Setup {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    art: PathBuf,
    text: PathBuf,
}

fn setup() -> Setup {
    let tmp = common::tempdir();
    let dir = tmp.path().to_path_buf();
    let art = common::mini_artifact(&dir);
    let text = dir.join("t.txt");
    std::fs::write(
        &text,
        "A reference saved once is compared with many later runs. ".repeat(5),
    )
    .unwrap();
    Setup {
        _tmp: tmp,
        dir,
        art,
        text,
    }
}

/// `ninfer-perplexity ART --text TEXT --context 32 --stride 16 --output DIR EXTRA...`.
fn run(st: &Setup, text: &Path, out: &str, extra: &[&str]) -> std::process::Output {
    common::score_text(&st.art, text, &st.dir.join(out), extra)
}

#[test]
fn a_saved_reference_gives_the_numbers_of_an_in_process_one() {
    let st = setup();
    let refbin = st.dir.join("ref.bin");
    let o = run(
        &st,
        &st.text,
        "saved",
        &["--kv-dtype", "f32", "--save-reference", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let saved = common::report(&st.dir.join("saved"));
    let positions = saved["overall"]["scored"].as_u64().unwrap();
    assert!(
        stderr.contains(&format!("{positions} positions")),
        "the saved line names the positions: {stderr}"
    );
    // The saving run's own scores are those of a run without it.
    let plain = run(&st, &st.text, "plain", &["--kv-dtype", "f32"]);
    assert!(plain.status.success());
    let plain = common::report(&st.dir.join("plain"));
    assert_eq!(saved["overall"]["nll_sum"], plain["overall"]["nll_sum"]);

    let o = run(
        &st,
        &st.text,
        "base",
        &["--kv-dtype", "nvfp4", "--kld-base", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("# reference: weights"));
    let o = run(
        &st,
        &st.text,
        "inproc",
        &["--kv-dtype", "nvfp4", "--reference-kv", "f32"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (b, i) = (
        common::report(&st.dir.join("base")),
        common::report(&st.dir.join("inproc")),
    );
    for row in ["overall"] {
        let (x, y) = (&b[row]["reference"], &i[row]["reference"]);
        assert_eq!(x["positions"], y["positions"]);
        assert!(x["mean_kld"].as_f64().unwrap() > 0.0);
        for k in [
            "mean_kld",
            "kld_median",
            "kld_p99",
            "kld_max",
            "mean_kld_reverse",
            "top1_agreement",
            "mean_delta_p",
            "rms_delta_p",
            "ref_mean_nll",
            "delta_nll",
        ] {
            let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-9,
                "{row}.{k}: saved {p} vs in-process {q}"
            );
        }
    }
    assert_eq!(
        b["streams"][0]["reference"]["strip"],
        i["streams"][0]["reference"]["strip"]
    );
    let r = &b["settings"]["reference"];
    assert_eq!(r["kv_dtype"], "f32");
    assert!(r["saved"]["path"].as_str().unwrap().ends_with("ref.bin"));
    assert_eq!(
        r["saved"]["bytes"].as_u64(),
        Some(std::fs::metadata(&refbin).unwrap().len())
    );
}

#[test]
fn a_saved_reference_that_does_not_belong_to_the_run_is_refused() {
    let st = setup();
    let refbin = st.dir.join("ref.bin");
    let o = run(
        &st,
        &st.text,
        "saved",
        &["--kv-dtype", "f32", "--save-reference", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let refused = |out: &str, o: std::process::Output, needles: &[&str]| {
        let line = common::error_line(&o);
        for n in needles {
            assert!(line.contains(n), "`{n}` not in: {line}");
        }
        assert!(!st.dir.join(out).join("report.json").exists(), "no report");
    };
    // Other text: other tokens.
    let other = st.dir.join("other.txt");
    std::fs::write(
        &other,
        "Something else entirely, scored against the wrong file. ".repeat(5),
    )
    .unwrap();
    let o = run(&st, &other, "a", &["--kld-base", s(&refbin)]);
    refused("a", o, &["ref.bin", "has no stream with these"]);
    // Other windows.
    let o = common::run_bin(
        "ninfer-perplexity",
        &[
            s(&st.art),
            "--text",
            s(&st.text),
            "--context",
            "48",
            "--stride",
            "16",
            "--kld-base",
            s(&refbin),
            "--output",
            s(&st.dir.join("b")),
        ],
    );
    refused("b", o, &["ref.bin", "saved with other windows"]);
    // Another head: an artifact of other weights.
    let other_dir = st.dir.join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let o = common::run_bin(
        "ninfer-pack",
        &[
            "random",
            "--preset",
            "smollm2-135m",
            "--layers",
            "1",
            "-o",
            s(&other_dir.join("o.ninfer")),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = common::score_text(
        &other_dir.join("o.ninfer"),
        &st.text,
        &st.dir.join("c"),
        &["--kld-base", s(&refbin)],
    );
    refused("c", o, &["ref.bin", "output head differs"]);
    // Damaged: one byte flipped in the middle, and the file cut short.
    let mut bytes = std::fs::read(&refbin).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    let damaged = st.dir.join("damaged.bin");
    std::fs::write(&damaged, &bytes).unwrap();
    let o = run(&st, &st.text, "d", &["--kld-base", s(&damaged)]);
    refused("d", o, &["damaged.bin", "checksum does not match"]);
    bytes[mid] ^= 0x40;
    std::fs::write(&damaged, &bytes[..bytes.len() - 100]).unwrap();
    let o = run(&st, &st.text, "e", &["--kld-base", s(&damaged)]);
    refused("e", o, &["damaged.bin"]);
    // Not a saved reference at all.
    let o = run(&st, &st.text, "f", &["--kld-base", s(&st.text)]);
    refused("f", o, &["t.txt", "not a saved reference"]);
    // A run that fails leaves no saved reference behind.
    let o = run(
        &st,
        &st.text,
        "h",
        &[
            "--save-reference",
            s(&st.dir.join("new.bin")),
            "--kv-dtype",
            "bogus",
        ],
    );
    refused("h", o, &["--kv-dtype"]);
    assert!(!st.dir.join("new.bin").exists());
}

/// A reference saved by the CUDA model (on the emulated device: its rows read back from the
/// device) is read by a CPU run: the first GPU run can be held to the CPU position by
/// position. In f32 both paths compute the same function, so the divergence is tiny but,
/// the reduction orders differing, not zero.
#[test]
fn a_reference_saved_on_the_emulated_device_is_read_on_the_cpu() {
    if !cfg!(feature = "cuda") {
        return;
    }
    let st = setup();
    let refbin = st.dir.join("emu.bin");
    let o = run(
        &st,
        &st.text,
        "emu",
        &[
            "--device",
            "emu",
            "--precision",
            "f32",
            "--kv-dtype",
            "f32",
            "--save-reference",
            s(&refbin),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(
        &st,
        &st.text,
        "cpu",
        &["--kv-dtype", "f32", "--kld-base", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = common::report(&st.dir.join("cpu"));
    let x = &r["overall"]["reference"];
    let (kld, rev, dnll) = (
        x["mean_kld"].as_f64().unwrap(),
        x["mean_kld_reverse"].as_f64().unwrap(),
        x["delta_nll"].as_f64().unwrap(),
    );
    eprintln!(
        "KL(emu || cpu) {kld:.3e}, KL(cpu || emu) {rev:.3e}, ΔNLL {dnll:+.3e}, max {}",
        x["kld_max"]
    );
    assert_eq!(x["positions"], r["overall"]["scored"]);
    assert!(r["settings"]["reference"]["saved"]["device"]
        .as_str()
        .unwrap()
        .contains("emu"));
    // Near zero, a KL computed in f32 can come out a few 1e-9 below it (cancellation).
    assert!(kld.abs() < 1e-6 && rev.abs() < 1e-6, "{kld} {rev}");
    assert!(dnll.abs() < 1e-5, "{dnll}");
    assert_eq!(x["top1_agreement"].as_f64(), Some(1.0));
}

/// `--kld-base` on the emulated device: the CUDA model's paired head (both rows through the
/// device's head, compared there) gives the CPU's table for the same saved reference, with
/// the head's vocabulary split into chunks (a small device memory forces 256-entry chunks
/// over the 260-token vocabulary); the run's own scores keep the bits of a plain device run;
/// and a reference the device saved itself compares to exactly 0 in either arithmetic.
#[test]
fn the_emulated_device_compares_with_a_saved_reference_as_the_cpu_does() {
    if !cfg!(feature = "cuda") {
        return;
    }
    let st = setup();
    let refbin = st.dir.join("ref.bin");
    let o = run(
        &st,
        &st.text,
        "saved",
        &["--kv-dtype", "f32", "--save-reference", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let emu_run = |out: &str, extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_ninfer-perplexity"))
            .arg(&st.art)
            .args(["--text", s(&st.text), "--context", "32", "--stride", "16"])
            .args(["--output", s(&st.dir.join(out)), "--device", "emu"])
            .args(extra)
            .env("NINFER_EMU_MEMORY_MB", "48")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{out}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        common::report(&st.dir.join(out))
    };
    let o = run(
        &st,
        &st.text,
        "cpu",
        &["--kv-dtype", "nvfp4", "--kld-base", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cpu = common::report(&st.dir.join("cpu"));
    let emu = emu_run(
        "emu",
        &[
            "--precision",
            "f32",
            "--kv-dtype",
            "nvfp4",
            "--kld-base",
            s(&refbin),
        ],
    );
    let plain = emu_run("plain", &["--precision", "f32", "--kv-dtype", "nvfp4"]);
    assert_eq!(emu["overall"]["nll_sum"], plain["overall"]["nll_sum"]);
    let (x, y) = (&emu["overall"]["reference"], &cpu["overall"]["reference"]);
    assert_eq!(x["positions"], y["positions"]);
    // Measured: means within 1e-8, single-position quantiles within 1e-6 (f64 sums on
    // the device, f32 chunk partials on the CPU); bounds 10x and 5x that. Jensen–Shannon:
    // mean 8.5e-10, max 7.5e-8 (bounds 1e-8, 5e-7); the top-k overlaps are the same.
    let mut seen = Vec::new();
    for (k, bound) in [
        ("mean_kld", 1e-7),
        ("kld_median", 5e-6),
        ("kld_p99", 5e-6),
        ("kld_max", 5e-6),
        ("mean_kld_reverse", 1e-7),
        ("mean_js", 1e-8),
        ("js_max", 5e-7),
        ("top1_agreement", 0.0),
        ("top5_overlap", 0.0),
        ("top10_overlap", 0.0),
        ("mean_delta_p", 1e-9),
        ("ref_mean_nll", 1e-6),
        ("delta_nll", 1e-6),
    ] {
        let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
        seen.push(format!("{k} {:.1e}", (p - q).abs()));
        assert!((p - q).abs() <= bound, "{k}: emu {p} vs cpu {q}");
    }
    eprintln!("emu vs cpu --kld-base: {}", seen.join(", "));
    assert!(
        x["mean_kld"].as_f64().unwrap() > 1e-4,
        "nvfp4 differs from f32"
    );
    // The device's own reference, read back by the device: exactly 0 everywhere.
    for precision in ["f32", "bf16"] {
        let own = st.dir.join(format!("own-{precision}.bin"));
        let common = ["--precision", precision, "--kv-dtype", "int8"];
        let save = [&common[..], &["--save-reference", s(&own)]].concat();
        emu_run(&format!("save-{precision}"), &save);
        let base = [&common[..], &["--kld-base", s(&own)]].concat();
        let r = emu_run(&format!("same-{precision}"), &base);
        let z = &r["overall"]["reference"];
        assert_eq!(z["kld_max"].as_f64(), Some(0.0), "{precision}: {z}");
        assert_eq!(z["top1_agreement"].as_f64(), Some(1.0), "{precision}");
        assert_eq!(z["js_max"].as_f64(), Some(0.0), "{precision}");
        assert_eq!(z["top10_overlap"].as_f64(), Some(1.0), "{precision}");
        assert_eq!(z["delta_nll"].as_f64(), Some(0.0), "{precision}");
    }
}

/// `ninfer-perplexity ART --text TEXT --window-plan kld-chunks --context C --output DIR
/// EXTRA...`.
fn chunk_run(st: &Setup, out: &str, context: usize, extra: &[&str]) -> std::process::Output {
    let (c, o) = (context.to_string(), st.dir.join(out));
    let mut a = vec![
        s(&st.art),
        "--text",
        s(&st.text),
        "--window-plan",
        "kld-chunks",
        "--context",
        &c,
        "--output",
        s(&o),
    ];
    a.extend_from_slice(extra);
    common::run_bin("ninfer-perplexity", &a)
}

/// Writes a file as `llama-perplexity --kl-divergence-base` does (layout in
/// `score::llama_logits`) holding this artifact's own f32-KV distributions, computed here
/// in float64 from a saved reference's hidden states and the head: what llama.cpp would
/// write if it computed exactly as this tool does.
fn llama_file(st: &Setup, context: usize, out: &Path) {
    use ninfer_perplexity::score::saved::SavedReference;
    let refbin = st.dir.join("for-llama.bin");
    let o = chunk_run(
        st,
        "for-llama",
        context,
        &["--kv-dtype", "f32", "--save-reference", s(&refbin)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let a = ninfer_perplexity::artifact::Artifact::open(&st.art).unwrap();
    let (d, vocab) = (a.config.hidden_size, a.config.vocab_size);
    let head = if a.config.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    let w = a.tensor_f32(head).unwrap();
    let saved = SavedReference::open(&refbin).unwrap();
    let stream = &saved.index.streams[0];
    let tokens = saved.tokens(stream).unwrap();
    let chunks = stream.windows.len();
    let mut b = b"_logits_".to_vec();
    b.extend((context as u32).to_le_bytes());
    b.extend((vocab as i32).to_le_bytes());
    b.extend((chunks as i32).to_le_bytes());
    for t in &tokens[..chunks * context] {
        b.extend((*t as i32).to_le_bytes());
    }
    for win in &stream.windows {
        let h = saved.rows(win).unwrap();
        for row in h.chunks_exact(d) {
            let l: Vec<f32> = (0..vocab)
                .map(|v| {
                    (0..d)
                        .map(|x| row[x] as f64 * w[v * d + x] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            // llama.cpp's log_softmax (perplexity.cpp): 16 nats below the top, 16-bit steps.
            let max = l.iter().cloned().fold(f32::MIN, f32::max);
            let min = l.iter().cloned().fold(f32::MAX, f32::min).max(max - 16.0);
            let lse = l
                .iter()
                .map(|&x| ((x - max) as f64).exp())
                .sum::<f64>()
                .ln() as f32;
            let scale = (max - min) / 65535.0;
            b.extend(scale.to_le_bytes());
            b.extend((min - max - lse).to_le_bytes());
            for &x in &l {
                let q = if x > min {
                    ((x - min) / scale).round() as u16
                } else {
                    0
                };
                b.extend(q.to_le_bytes());
            }
            if vocab % 2 == 1 {
                b.extend([0u8; 2]);
            }
        }
    }
    std::fs::write(out, b).unwrap();
}

/// `--kld-base` with another engine's log-probabilities (llama.cpp's
/// `--kl-divergence-base` file): the same positions as the `kld-chunks` plan, KL as
/// llama.cpp computes it on its own file; a file of the run's own distributions gives
/// (nearly) zero, a format's KL is the in-process one; other tokens, another vocabulary, a
/// file cut short and the CUDA path are refused with one line. (Against `llama-perplexity`
/// itself: docs/compare.md, where the real file gives llama.cpp's own statistics.)
#[test]
fn another_engine_s_log_probabilities_are_a_reference() {
    let st = setup();
    let dump = st.dir.join("base.kld");
    llama_file(&st, 16, &dump);
    let chunked = |out: &str, extra: &[&str]| chunk_run(&st, out, 16, extra);
    let o = chunked("same", &["--kv-dtype", "f32", "--kld-base", s(&dump)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = common::report(&st.dir.join("same"));
    let x = &r["overall"]["reference"];
    assert_eq!(x["positions"], r["overall"]["scored"]);
    eprintln!(
        "own distributions through the file: KL {}, reverse {}, dNLL {}",
        x["mean_kld"], x["mean_kld_reverse"], x["delta_nll"]
    );
    // The file's 16-bit steps: measured |KL| at most 2.5e-5 at a position (mean 1e-6), Δp
    // 7e-8; bounds 4x and 10x. Its floor 16 nats below the top caps the log-probability of
    // a target less likely than that (this random model has many: NLL 22), so ΔNLL is not
    // 0 here, and only ever positive (the floor raises the reference's probability).
    for k in ["kld_max", "kld_reverse_max"] {
        assert!(x[k].as_f64().unwrap().abs() < 1e-4, "{k}: {x}");
    }
    assert!(x["mean_delta_p"].as_f64().unwrap().abs() < 1e-6, "{x}");
    assert!(x["delta_nll"].as_f64().unwrap() >= 0.0, "{x}");
    assert_eq!(x["top1_agreement"].as_f64(), Some(1.0));
    assert_eq!(r["settings"]["reference"]["saved"]["device"], "llama.cpp");
    // A format against the file is that format against the f32 run in process.
    let o = chunked("file", &["--kv-dtype", "nvfp4", "--kld-base", s(&dump)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = chunked("inproc", &["--kv-dtype", "nvfp4", "--reference-kv", "f32"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (f, i) = (
        common::report(&st.dir.join("file")),
        common::report(&st.dir.join("inproc")),
    );
    let (kf, ki) = (
        f["overall"]["reference"]["mean_kld"].as_f64().unwrap(),
        i["overall"]["reference"]["mean_kld"].as_f64().unwrap(),
    );
    eprintln!("nvfp4: KL against the file {kf:.6e}, in process {ki:.6e}");
    assert!(ki > 1e-4 && (kf - ki).abs() <= 1e-3 * ki, "{kf} vs {ki}");
    assert_eq!(
        f["overall"]["reference"]["top1_agreement"],
        i["overall"]["reference"]["top1_agreement"]
    );

    // Refusals: one line, no report.
    let refused = |out: &str, o: std::process::Output, needles: &[&str]| {
        assert!(!o.status.success(), "{out}: accepted");
        let e = common::error_line(&o);
        for n in needles {
            assert!(e.contains(n), "{out}: {e}");
        }
        assert!(!st.dir.join(out).join("report.json").exists());
    };
    let bytes = std::fs::read(&dump).unwrap();
    // Other tokens: one token id changed.
    let mut other = bytes.clone();
    other[20] ^= 1;
    let p = st.dir.join("other.kld");
    std::fs::write(&p, &other).unwrap();
    let o = chunked("r1", &["--kv-dtype", "f32", "--kld-base", s(&p)]);
    refused("r1", o, &["other.kld", "no stream with these"]);
    // The file's chunks are not this run's windows (another context).
    let o = chunk_run(&st, "r2", 8, &["--kld-base", s(&dump)]);
    refused("r2", o, &["base.kld"]);
    // Cut short.
    let p = st.dir.join("short.kld");
    std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
    let o = chunked("r3", &["--kld-base", s(&p)]);
    refused("r3", o, &["short.kld", "cut short"]);
    // Another vocabulary.
    let mut v = bytes.clone();
    v[12..16].copy_from_slice(&(259i32).to_le_bytes());
    let p = st.dir.join("vocab.kld");
    std::fs::write(&p, &v).unwrap();
    let o = chunked("r4", &["--kld-base", s(&p)]);
    refused("r4", o, &["vocab.kld"]);
    // A damaged position (its scale not a number): the read error itself, naming the file.
    let mut nan = bytes.clone();
    let chunks = i32::from_le_bytes(bytes[16..20].try_into().unwrap()) as usize;
    let at = 20 + 4 * chunks * 16;
    nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let p = st.dir.join("nan.kld");
    std::fs::write(&p, &nan).unwrap();
    let o = chunked("r6", &["--kld-base", s(&p)]);
    refused("r6", o, &["nan.kld", "a position with scale NaN"]);
    if cfg!(feature = "cuda") {
        let o = chunked("r5", &["--device", "emu", "--kld-base", s(&dump)]);
        refused("r5", o, &["CPU backend only"]);
    }
}
