//! Every file the two binaries read and every path they write, against what is not a regular
//! file: a FIFO (an ordinary open blocks until a writer comes), a character device
//! (`/dev/zero` reads forever; a rename over `/dev/null` would replace it), a symbolic link to
//! either, and a directory where a file is expected.
//!
//! One table of readers and one of writers, so that a new flag that opens a file is one row
//! here. Each case must end within a deadline, in one `error:` line that names the path and
//! says what is wrong with it, with a non-zero exit; nothing may be written, and the hostile
//! thing must still be what it was. `bad_input` holds the single-class tests these rows
//! generalize (the corpus stream longer than its manifest says, `--text -`, the lock).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long one case may take: every refusal happens before any reading or scoring.
const DEADLINE: Duration = Duration::from_secs(20);

/// What is put where a file is expected.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    Fifo,
    LinkToFifo,
    /// A link to `/dev/zero` (a reader) or `/dev/null` (a writer).
    LinkToDevice,
    /// `/dev/zero` or `/dev/null` itself, named directly.
    Device,
    Directory,
}

impl Hostile {
    /// Places the hostile thing at `slot` (or, for [`Hostile::Device`], returns the device
    /// itself); `spare` is a directory for a link's target.
    fn place(self, slot: &Path, spare: &Path, device: &Path) -> PathBuf {
        use std::os::unix::fs::symlink;
        match self {
            Hostile::Fifo => {
                mkfifo(slot);
            }
            Hostile::LinkToFifo => {
                let target = mkfifo(&spare.join(format!("target-fifo-{}", unique())));
                symlink(target, slot).unwrap();
            }
            Hostile::LinkToDevice => symlink(device, slot).unwrap(),
            Hostile::Device => return device.to_path_buf(),
            Hostile::Directory => std::fs::create_dir(slot).unwrap(),
        }
        slot.to_path_buf()
    }

    /// What the error line must say about it.
    fn complaint(self) -> &'static str {
        match self {
            Hostile::Directory => "is a directory",
            _ => "not a regular file",
        }
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn mkfifo(path: &Path) -> PathBuf {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path it is given.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {path:?}"
    );
    path.to_path_buf()
}

/// The file type at `p` without following a link, where a link points, and the type of
/// what it points to.
fn kind_of(p: &Path) -> String {
    let target = std::fs::metadata(p).map(|m| format!("{:?}", m.file_type()));
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => {
            format!("link to {:?} ({target:?})", std::fs::read_link(p).unwrap())
        }
        Ok(m) => format!("{:?}", m.file_type()),
        Err(e) => format!("absent ({e})"),
    }
}

/// [`verdict`], then the hostile thing at `shown` must still be what it was (`before`).
fn judged(
    o: Result<Output, String>,
    shown: &Path,
    needles: &[&str],
    out: &Path,
    before: &str,
) -> Result<(), String> {
    verdict(o, shown, needles, out)?;
    let after = kind_of(shown);
    if after == before {
        Ok(())
    } else {
        Err(format!("{} was {before}, is {after}", shown.display()))
    }
}

/// Fails with every failed case, after saying how many ran.
fn report(what: &str, cases: usize, rows: usize, failures: &[String]) {
    println!("hostile {what}: {cases} cases, {rows} rows");
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Runs `bin` in `cwd` with `env`, killed at the deadline (a hang fails the case).
fn run(bin: &str, args: &[String], cwd: &Path, env: &[(&str, &Path)]) -> Result<Output, String> {
    let mut c = Command::new(common::bin(bin));
    c.args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return Ok(child.wait_with_output().unwrap());
        }
        if t.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("did not finish within {} s", DEADLINE.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The valid files the rows start from.
struct World {
    root: PathBuf,
    artifact: PathBuf,
    text: PathBuf,
    run: PathBuf,
    shards: [PathBuf; 2],
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

fn world(root: &Path) -> World {
    let artifact = common::mini_artifact(root);
    let text = root.join("t.txt");
    std::fs::write(&text, "A short text for the hostile-file suite. ".repeat(4)).unwrap();
    let score = |out: &Path, extra: &[&str]| {
        let mut a = vec![
            s(&artifact),
            "--text".into(),
            s(&text),
            "--context".into(),
            "32".into(),
            "--stride".into(),
            "16".into(),
            "--output".into(),
            s(out),
            "--log-level".into(),
            "error".into(),
        ];
        a.extend(extra.iter().map(|x| x.to_string()));
        let o = run("ninfer-perplexity", &a, &common::repo(), &[]).unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let run_dir = root.join("run");
    score(&run_dir, &[]);
    let shards = [root.join("s1"), root.join("s2")];
    score(&shards[0], &["--shard", "1/2"]);
    score(&shards[1], &["--shard", "2/2"]);
    World {
        root: root.to_path_buf(),
        artifact,
        text,
        run: run_dir,
        shards,
    }
}

/// A Hugging Face directory in `case` (the tiny qwen3 fixture with the byte tokenizer), less
/// the file named `missing`, which the row puts in as the hostile thing.
fn hf_dir(case: &Path, missing: &str) -> PathBuf {
    let d = case.join("hf");
    std::fs::create_dir(&d).unwrap();
    let fixture = common::repo().join("eval/fixtures/tiny-qwen3");
    for f in ["config.json", "model.safetensors"] {
        if f != missing {
            std::fs::copy(fixture.join(f), d.join(f)).unwrap();
        }
    }
    if missing != "tokenizer.json" {
        std::fs::write(
            d.join("tokenizer.json"),
            ninfer_perplexity::artifact::random::byte_tokenizer_json(),
        )
        .unwrap();
    }
    d
}

/// A corpus in `case` whose one stream lives at `streams/p.txt`, left for the row to fill.
fn corpus(case: &Path) -> PathBuf {
    std::fs::create_dir_all(case.join("corpus/streams")).unwrap();
    let m = case.join("corpus/m.json");
    let manifest = serde_json::json!({
        "corpus_id": "mini",
        "streams": [{"id": "p", "domain": "a", "path": "streams/p.txt"}],
        "modes": {"quick": ["p"], "full": ["p"]},
    });
    std::fs::write(&m, manifest.to_string()).unwrap();
    m
}

/// One reader: the binary, where the hostile file goes (in a fresh case directory), the
/// arguments that make the binary open it (writing, if it got that far, to `out`), and the
/// role the error names.
struct Reader {
    name: &'static str,
    bin: &'static str,
    /// The slot for the hostile thing (preparing whatever valid files surround it).
    slot: fn(&World, &Path) -> PathBuf,
    args: fn(&World, &Path, &Path) -> Vec<String>,
    /// The hostile file is named by `NINFER_REGISTRY`, not an argument.
    registry: bool,
    /// A directory is a valid input here (a run directory, say): no directory case.
    takes_dirs: bool,
    role: &'static str,
}

/// The evaluator on the world's text, writing to `out`, with `extra` arguments first.
fn eval_args(w: &World, artifact: &Path, out: &Path, extra: &[String]) -> Vec<String> {
    let mut a = vec![
        s(artifact),
        "--context".into(),
        "32".into(),
        "--stride".into(),
        "16".into(),
        "--output".into(),
        s(out),
    ];
    if !extra.iter().any(|x| x == "--corpus") {
        a.extend(["--text".into(), s(&w.text)]);
    }
    a.extend(extra.iter().cloned());
    a
}

fn readers() -> Vec<Reader> {
    fn in_case(_: &World, case: &Path) -> PathBuf {
        case.join("hostile")
    }
    vec![
        Reader {
            name: "the artifact",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| eval_args(w, slot, out, &[]),
            registry: false,
            takes_dirs: false,
            role: "artifact",
        },
        Reader {
            name: "the registry (NINFER_REGISTRY)",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, _, out| eval_args(w, Path::new("smollm2-135m-bf16"), out, &[]),
            registry: true,
            takes_dirs: false,
            role: "the registry",
        },
        Reader {
            name: "--corpus",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| eval_args(w, &w.artifact, out, &["--corpus".into(), s(slot)]),
            registry: false,
            takes_dirs: false,
            role: "manifest",
        },
        Reader {
            name: "a corpus stream",
            bin: "ninfer-perplexity",
            slot: |_, case| {
                corpus(case);
                case.join("corpus/streams/p.txt")
            },
            args: |w, slot, out| {
                let m = slot.parent().unwrap().parent().unwrap().join("m.json");
                eval_args(w, &w.artifact, out, &["--corpus".into(), s(&m)])
            },
            registry: false,
            takes_dirs: false,
            role: "stream `p`",
        },
        Reader {
            name: "a stream under --stream-dir",
            bin: "ninfer-perplexity",
            slot: |_, case| {
                corpus(case);
                std::fs::create_dir(case.join("elsewhere")).unwrap();
                case.join("elsewhere/p.txt")
            },
            args: |w, slot, out| {
                let dir = slot.parent().unwrap();
                let m = dir.parent().unwrap().join("corpus/m.json");
                eval_args(
                    w,
                    &w.artifact,
                    out,
                    &["--corpus".into(), s(&m), "--stream-dir".into(), s(dir)],
                )
            },
            registry: false,
            takes_dirs: false,
            role: "stream `p`",
        },
        Reader {
            name: "--text",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| {
                vec![
                    s(&w.artifact),
                    "--text".into(),
                    s(slot),
                    "--output".into(),
                    s(out),
                ]
            },
            registry: false,
            takes_dirs: false,
            role: "text",
        },
        Reader {
            name: "--kv-scales",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| {
                let extra = [
                    "--kv-dtype".into(),
                    "fp8-tensor".into(),
                    "--kv-scales".into(),
                    s(slot),
                ];
                eval_args(w, &w.artifact, out, &extra)
            },
            registry: false,
            takes_dirs: false,
            role: "--kv-scales file",
        },
        Reader {
            name: "--reference-artifact",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| {
                let extra = ["--reference-artifact".into(), s(slot)];
                eval_args(w, &w.artifact, out, &extra)
            },
            registry: false,
            takes_dirs: false,
            role: "artifact",
        },
        Reader {
            name: "--kld-base",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| {
                let extra = ["--kld-base".into(), s(slot)];
                eval_args(w, &w.artifact, out, &extra)
            },
            registry: false,
            takes_dirs: false,
            role: "the saved reference",
        },
        Reader {
            name: "compare's base report",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, _| vec!["compare".into(), s(slot), s(&w.run)],
            registry: false,
            takes_dirs: true,
            role: "the report",
        },
        Reader {
            name: "compare's new report",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, _| vec!["compare".into(), s(&w.run), s(slot)],
            registry: false,
            takes_dirs: true,
            role: "the report",
        },
        Reader {
            name: "compare's run directory's report.json",
            bin: "ninfer-perplexity",
            slot: |_, case| {
                std::fs::create_dir(case.join("rundir")).unwrap();
                case.join("rundir/report.json")
            },
            args: |w, slot, _| vec!["compare".into(), s(&w.run), s(slot.parent().unwrap())],
            registry: false,
            takes_dirs: false,
            role: "the report",
        },
        Reader {
            name: "a merge shard",
            bin: "ninfer-perplexity",
            slot: in_case,
            args: |w, slot, out| {
                vec![
                    "merge".into(),
                    s(&w.shards[0]),
                    s(slot),
                    "--output".into(),
                    s(out),
                ]
            },
            registry: false,
            takes_dirs: true,
            role: "the report",
        },
        Reader {
            name: "ninfer-pack gguf's input",
            bin: "ninfer-pack",
            slot: in_case,
            args: |_, slot, out| vec!["gguf".into(), s(slot), "-o".into(), s(out)],
            registry: false,
            takes_dirs: false,
            role: "the GGUF file",
        },
        Reader {
            name: "ninfer-pack hf's config.json",
            bin: "ninfer-pack",
            slot: |_, case| hf_dir(case, "config.json").join("config.json"),
            args: |_, slot, out| hf_args(slot, out, None),
            registry: false,
            takes_dirs: false,
            role: "config.json",
        },
        Reader {
            name: "ninfer-pack hf's tokenizer.json",
            bin: "ninfer-pack",
            slot: |_, case| hf_dir(case, "tokenizer.json").join("tokenizer.json"),
            args: |_, slot, out| hf_args(slot, out, None),
            registry: false,
            takes_dirs: false,
            role: "the tokenizer",
        },
        Reader {
            name: "ninfer-pack hf --tokenizer",
            bin: "ninfer-pack",
            slot: |_, case| {
                hf_dir(case, "");
                case.join("hostile")
            },
            args: |_, slot, out| {
                // out is in the case directory, beside hf/ (slot may be /dev/zero itself)
                let dir = out.parent().unwrap().join("hf/config.json");
                hf_args(&dir, out, Some(slot))
            },
            registry: false,
            takes_dirs: false,
            role: "the tokenizer",
        },
        Reader {
            name: "ninfer-pack hf's safetensors shard",
            bin: "ninfer-pack",
            slot: |_, case| hf_dir(case, "model.safetensors").join("model.safetensors"),
            args: |_, slot, out| hf_args(slot, out, None),
            registry: false,
            takes_dirs: false,
            role: "safetensors shard",
        },
        Reader {
            name: "ninfer-pack random --tokenizer",
            bin: "ninfer-pack",
            slot: in_case,
            args: |_, slot, out| {
                vec![
                    "random".into(),
                    "--preset".into(),
                    "smollm2-135m".into(),
                    "--layers".into(),
                    "1".into(),
                    "--tokenizer".into(),
                    s(slot),
                    "-o".into(),
                    s(out),
                ]
            },
            registry: false,
            takes_dirs: false,
            role: "the tokenizer",
        },
        Reader {
            name: "ninfer-pack inspect",
            bin: "ninfer-pack",
            slot: in_case,
            args: |_, slot, _| vec!["inspect".into(), s(slot)],
            registry: false,
            takes_dirs: false,
            role: "artifact",
        },
    ]
}

/// `ninfer-pack hf <the directory of slot> [--tokenizer T] -o OUT`.
fn hf_args(slot_in_dir: &Path, out: &Path, tokenizer: Option<&Path>) -> Vec<String> {
    let mut a = vec!["hf".into(), s(slot_in_dir.parent().unwrap())];
    if let Some(t) = tokenizer {
        a.extend(["--tokenizer".into(), s(t)]);
    }
    a.extend(["-o".into(), s(out)]);
    a
}

/// Checks one finished case: one error line naming `shown` and the complaint, non-zero
/// exit, no stdout, nothing at `out`.
fn verdict(
    o: Result<Output, String>,
    shown: &Path,
    needles: &[&str],
    out: &Path,
) -> Result<(), String> {
    let o = o?;
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.success() {
        return Err(format!("exit 0; stderr: {err}"));
    }
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    let [line] = lines[..] else {
        return Err(format!("{} error lines: {err}", lines.len()));
    };
    let name = shown.file_name().unwrap().to_str().unwrap();
    for n in needles.iter().chain([&name]) {
        if !line.contains(n) {
            return Err(format!("the error line lacks `{n}`: {line}"));
        }
    }
    if !o.stdout.is_empty() {
        return Err(format!(
            "stdout not empty: {}",
            String::from_utf8_lossy(&o.stdout)
        ));
    }
    if std::fs::symlink_metadata(out).is_ok() {
        return Err(format!("{} was written", out.display()));
    }
    Ok(())
}

/// Every reader refuses a FIFO, `/dev/zero`, links to them and a directory, at once and by
/// name, and writes nothing.
#[test]
fn every_reader_refuses_what_is_not_a_regular_file() {
    let tmp = common::tempdir();
    let w = world(tmp.path());
    let kinds = [
        Hostile::Fifo,
        Hostile::LinkToFifo,
        Hostile::LinkToDevice,
        Hostile::Device,
        Hostile::Directory,
    ];
    let mut failures = Vec::new();
    let mut cases = 0;
    for (i, r) in readers().iter().enumerate() {
        for (j, k) in kinds.iter().enumerate() {
            if matches!(k, Hostile::Directory) && r.takes_dirs {
                continue;
            }
            let case = w.root.join(format!("case-{i}-{j}"));
            std::fs::create_dir(&case).unwrap();
            let slot = (r.slot)(&w, &case);
            if matches!(k, Hostile::Device) && slot.file_name().unwrap() != "hostile" {
                continue; // a file inside a directory cannot be /dev/zero itself
            }
            let shown = k.place(&slot, &case, Path::new("/dev/zero"));
            let out = case.join("out");
            let args = (r.args)(&w, &shown, &out);
            let env: Vec<(&str, &Path)> = if r.registry {
                vec![("NINFER_REGISTRY", shown.as_path())]
            } else {
                vec![]
            };
            cases += 1;
            let before = kind_of(&shown);
            let o = run(r.bin, &args, &common::repo(), &env);
            let v = judged(o, &shown, &[r.role, k.complaint()], &out, &before);
            if let Err(e) = v {
                failures.push(format!("{} / {k:?}: {e}", r.name));
            }
        }
    }
    report("readers", cases, readers().len(), &failures);
}

/// One writer: its arguments with the output path `out` (everything else valid).
struct Writer {
    name: &'static str,
    bin: &'static str,
    args: fn(&World, &Path) -> Vec<String>,
    /// The complaint for a path that is not what this writer writes.
    complaint: &'static str,
}

fn writers() -> Vec<Writer> {
    vec![
        Writer {
            name: "the evaluator's --output",
            bin: "ninfer-perplexity",
            args: |w, out| eval_args(w, &w.artifact, out, &[]),
            complaint: "is not a directory",
        },
        Writer {
            name: "--save-reference",
            bin: "ninfer-perplexity",
            args: |w, out| {
                let o = w.root.join(format!("unused-{}", unique()));
                eval_args(w, &w.artifact, &o, &["--save-reference".into(), s(out)])
            },
            complaint: "not a regular file",
        },
        Writer {
            name: "merge --output",
            bin: "ninfer-perplexity",
            args: |w, out| {
                vec![
                    "merge".into(),
                    s(&w.shards[0]),
                    s(&w.shards[1]),
                    "--output".into(),
                    s(out),
                ]
            },
            complaint: "is not a directory",
        },
        Writer {
            name: "compare --json",
            bin: "ninfer-perplexity",
            args: |w, out| {
                vec![
                    "compare".into(),
                    s(&w.run),
                    s(&w.run),
                    "--json".into(),
                    s(out),
                ]
            },
            complaint: "not a regular file",
        },
        Writer {
            name: "compare --plot",
            bin: "ninfer-perplexity",
            args: |w, out| {
                vec![
                    "compare".into(),
                    s(&w.run),
                    s(&w.run),
                    "--plot".into(),
                    s(out),
                ]
            },
            complaint: "not a regular file",
        },
        Writer {
            name: "ninfer-pack random -o",
            bin: "ninfer-pack",
            args: |_, out| {
                let a = ["random", "--preset", "smollm2-135m", "--layers", "1", "-o"];
                a.iter().map(|x| x.to_string()).chain([s(out)]).collect()
            },
            complaint: "not a regular file",
        },
        Writer {
            name: "ninfer-pack gguf -o",
            bin: "ninfer-pack",
            // The output is checked before the input is read, so any file will do.
            args: |w, out| vec!["gguf".into(), s(&w.text), "-o".into(), s(out)],
            complaint: "not a regular file",
        },
        Writer {
            name: "ninfer-pack hf -o",
            bin: "ninfer-pack",
            args: |_, out| {
                let fixture = common::repo().join("eval/fixtures/tiny-qwen3");
                vec!["hf".into(), s(&fixture), "-o".into(), s(out)]
            },
            complaint: "not a regular file",
        },
    ]
}

/// A private character device with `/dev/null`'s numbers, made in `dir` (root only): the
/// writers' device cases aim at it, never at the real `/dev/null`, so that a writer that
/// lost its check replaces a throwaway node and not the machine's `/dev/null`.
fn private_null(dir: &Path) -> Option<PathBuf> {
    let p = dir.join("null-device");
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: mknod reads the NUL-terminated path it is given.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    (rc == 0).then_some(p)
}

/// Every writer refuses a FIFO, a character device and links to them, before any work, and
/// leaves them as they were. The device is a private node (see [`private_null`]); without
/// the privilege to make one, the device cases are skipped and said so.
#[test]
fn every_writer_leaves_a_pipe_or_a_device_alone() {
    let tmp = common::tempdir();
    let w = world(tmp.path());
    let device = private_null(tmp.path());
    let mut kinds = vec![Hostile::Fifo, Hostile::LinkToFifo];
    match &device {
        Some(_) => kinds.extend([Hostile::LinkToDevice, Hostile::Device]),
        None => println!("hostile writers: no device cases (mknod needs root)"),
    }
    let device = device.unwrap_or_default();
    let mut failures = Vec::new();
    let mut cases = 0;
    for (i, wr) in writers().iter().enumerate() {
        for (j, k) in kinds.iter().enumerate() {
            let case = w.root.join(format!("wcase-{i}-{j}"));
            std::fs::create_dir(&case).unwrap();
            let shown = k.place(&case.join("hostile"), &case, &device);
            let before = kind_of(&shown);
            cases += 1;
            let o = run(wr.bin, &(wr.args)(&w, &shown), &common::repo(), &[]);
            let v = judged(o, &shown, &[wr.complaint], &case.join("absent"), &before);
            if let Err(e) = v {
                failures.push(format!("{} / {k:?}: {e}", wr.name));
            }
        }
    }
    report("writers", cases, writers().len(), &failures);
}
