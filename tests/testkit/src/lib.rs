//! The one test runner of this repository's test binaries (the library's unit tests, the
//! integration binary, the device-parity binary and the regression harness).
//!
//! Tests are ordinary `#[test]` functions. A binary's root says `#[macro_use] extern crate
//! ninfer_testkit;`, which replaces the built-in attribute with [`test`]: each function is
//! recorded in [`TESTS`] at link time and run under libtest-mimic, so every libtest flag
//! (filters, `--exact`, `--list`, `--test-threads`, `--ignored`) and cargo-nextest keep
//! working. Two things the built-in harness cannot do are the reason this exists:
//!
//! * **One skip policy.** A test says what it reads besides the repository —
//!   `#[test(prepared)]`, `#[test(gxx)]`, `#[test(nvrtc)]`, `#[test(gpu)]` — and where that
//!   is missing it is reported *ignored* with the reason, never passed and never panicking.
//! * **The harness's flags reach every binary.** `cargo test --release -- --kv-dtype fp8`
//!   hands `--kv-dtype fp8` to every test executable; each one built on this runner takes
//!   the regression harness's selection flags ([`HARNESS_FLAGS`]) out of its arguments
//!   before libtest's parser sees them, so no cargo runner has to rewrite arguments.

use libtest_mimic::{Arguments, Completion, Trial};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;

pub use libtest_mimic;
pub use linkme;
pub use ninfer_testkit_macros::test;

/// What a test reads besides the repository's committed files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Nothing: synthetic inputs and committed fixtures only.
    Nothing,
    /// What `bash ci/prepare.sh` makes ([`PREPARED`]).
    Prepared,
    /// A C++ compiler for the emulated CUDA device (`g++`, or `NINFER_EMU_CXX`), and the
    /// prepared inputs.
    Gxx,
    /// The NVRTC library (`NINFER_NVRTC_LIB_DIR`, from `bash ci/install-nvrtc.sh`).
    Nvrtc,
    /// A CUDA GPU. (Not the prepared inputs: a GPU machine may carry only what its checks
    /// read, `ci/gpu-check.sh`; a test that needs a prepared file says so when it is
    /// missing.)
    Gpu,
}

/// One registered test (written by [`test`]; never by hand).
pub struct Test {
    /// `module_path!()` where the function is defined.
    pub module: &'static str,
    pub name: &'static str,
    pub needs: Needs,
    /// Runs the function; panics to fail.
    pub run: fn(),
}

/// Every `#[test]` of the binary, gathered by the linker.
#[linkme::distributed_slice]
pub static TESTS: [Test];

/// A test function's result: `()` or a `Result` whose error fails the test.
pub trait Outcome {
    fn check(self);
}

impl Outcome for () {
    fn check(self) {}
}

impl<E: std::fmt::Debug> Outcome for Result<(), E> {
    fn check(self) {
        if let Err(e) = self {
            panic!("test returned an error: {e:?}");
        }
    }
}

/// The inputs `bash ci/prepare.sh` makes, relative to the repository root.
pub const PREPARED: [&str; 8] = [
    "models/smollm2-135m-bf16.ninfer",
    "models/smollm2-135m-f32.ninfer",
    "models/smollm2-135m-fp8.ninfer",
    "models/smollm2-135m-nvfp4.ninfer",
    "models/tiny-qwen3_5-f32.ninfer",
    "models/cache/SmolLM2-135M-Instruct.Q4_1.gguf",
    "models/cache/qwen3-tokenizer.json",
    "eval/corpora/perplexity-1m/streams/en-ref-1.txt",
];

/// The regression harness's selection flags, each with a value (`--flag V` or `--flag=V`).
/// The harness parses them; every other binary drops them.
pub const HARNESS_FLAGS: [&str; 6] = [
    "--kv-dtype",
    "--artifact",
    "--device",
    "--tier",
    "--precision",
    "--measure-spread",
];

/// libtest options whose value is the next argument: they and their value pass through.
pub const LIBTEST_WITH_VALUE: [&str; 6] = [
    "--test-threads",
    "--logfile",
    "--skip",
    "--color",
    "--format",
    "-Z",
];

/// Splits `args` (program name first) into the harness flags with their values and the
/// rest, in order. A harness flag without its value stays in the rest (libtest then names
/// it as unknown).
pub fn split_harness_flags(args: Vec<OsString>) -> (Vec<OsString>, Vec<OsString>) {
    let (mut harness, mut rest) = (Vec::new(), Vec::with_capacity(args.len()));
    let mut it = args.into_iter().peekable();
    if let Some(program) = it.next() {
        rest.push(program);
    }
    while let Some(arg) = it.next() {
        let s = arg.to_str().unwrap_or("");
        if LIBTEST_WITH_VALUE.contains(&s) {
            rest.push(arg);
            rest.extend(it.next());
        } else if HARNESS_FLAGS.contains(&s) && it.peek().is_some() {
            harness.push(arg);
            harness.extend(it.next());
        } else if s
            .split_once('=')
            .is_some_and(|(name, _)| HARNESS_FLAGS.contains(&name))
        {
            harness.push(arg);
        } else {
            rest.push(arg);
        }
    }
    (harness, rest)
}

/// How a binary answers the questions [`Needs`] asks that this crate cannot (it does not
/// link the engine).
pub struct Probes {
    /// The repository root.
    pub root: PathBuf,
    /// `Err(why)` when no CUDA GPU is usable.
    pub gpu: fn() -> Result<(), String>,
    /// `Err(why)` when NVRTC cannot be loaded.
    pub nvrtc: fn() -> Result<(), String>,
}

impl Probes {
    /// Probes that find no GPU and no NVRTC (binaries without device tests).
    pub fn host(root: PathBuf) -> Probes {
        Probes {
            root,
            gpu: || Err("this binary has no GPU tests".into()),
            nvrtc: || Err("this binary has no NVRTC tests".into()),
        }
    }
}

/// Why the prepared inputs are not there, if they are not.
pub fn prepared_missing(root: &Path) -> Option<String> {
    PREPARED
        .iter()
        .find(|p| !root.join(p).exists())
        .map(|p| format!("run bash ci/prepare.sh ({p} is missing)"))
}

fn gxx_missing() -> Option<String> {
    let cxx = std::env::var("NINFER_EMU_CXX").unwrap_or_else(|_| "g++".into());
    match std::process::Command::new(&cxx).arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some(format!(
            "the emulated CUDA device needs a C++ compiler ({cxx} not found: apt-get install g++)"
        )),
    }
}

/// Why a test that needs `needs` cannot run here (each probe runs at most once).
fn missing(needs: Needs, p: &Probes) -> Option<String> {
    static PREPARED_WHY: OnceLock<Option<String>> = OnceLock::new();
    static GXX_WHY: OnceLock<Option<String>> = OnceLock::new();
    static NVRTC_WHY: OnceLock<Option<String>> = OnceLock::new();
    static GPU_WHY: OnceLock<Option<String>> = OnceLock::new();
    let prepared = || {
        PREPARED_WHY
            .get_or_init(|| prepared_missing(&p.root))
            .clone()
    };
    match needs {
        Needs::Nothing => None,
        Needs::Prepared => prepared(),
        Needs::Gxx => prepared().or_else(|| GXX_WHY.get_or_init(gxx_missing).clone()),
        Needs::Nvrtc => NVRTC_WHY
            .get_or_init(|| (p.nvrtc)().err().map(|e| format!("needs NVRTC: {e}")))
            .clone(),
        Needs::Gpu => GPU_WHY
            .get_or_init(|| (p.gpu)().err().map(|e| format!("needs a CUDA GPU: {e}")))
            .clone(),
    }
}

/// The test's name as libtest would print it: its module path without the crate, then the
/// function.
fn full_name(t: &Test) -> String {
    match t.module.split_once("::") {
        Some((_, rest)) => format!("{rest}::{}", t.name),
        None => t.name.to_string(),
    }
}

/// The binary's registered tests as libtest-mimic trials, sorted by name.
pub fn trials(probes: &'static Probes) -> Vec<Trial> {
    let mut tests: Vec<(String, &'static Test)> = TESTS.iter().map(|t| (full_name(t), t)).collect();
    tests.sort_by(|a, b| a.0.cmp(&b.0));
    tests
        .into_iter()
        .map(|(name, t)| {
            Trial::ignorable_test(name, move || match missing(t.needs, probes) {
                Some(why) => Ok(Completion::ignored_with(why)),
                None => {
                    (t.run)();
                    Ok(Completion::Completed)
                }
            })
        })
        .collect()
}

/// `fn main` of a test binary with no trials of its own: the registered tests, with the
/// harness's flags dropped from the arguments.
pub fn main(probes: Probes) -> ExitCode {
    let probes: &'static Probes = Box::leak(Box::new(probes));
    let (_, rest) = split_harness_flags(std::env::args_os().collect());
    let args = Arguments::from_iter(rest);
    libtest_mimic::run(&args, trials(probes)).exit_code()
}
