//! A small libtest-mimic runner for the integration tests that need prepared inputs.
//!
//! Stock `#[test]` functions can be ignored only at compile time, so on a fresh clone (before
//! `bash ci/prepare.sh`) a test that needs the pinned model could only panic or silently pass.
//! Here every test says what it needs; one that needs prepared inputs is reported *ignored*,
//! with the missing file and "run bash ci/prepare.sh" as the reason, and never passes without
//! running. Ordinary libtest flags (name filters, `--exact`, `--nocapture`, `--test-threads`,
//! `--ignored`) keep working.

use libtest_mimic::{Arguments, Completion, Trial};
use std::process::ExitCode;

/// What a test reads besides the repository.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Nothing: synthetic inputs and committed fixtures only.
    Nothing,
    /// What `bash ci/prepare.sh` makes: the SmolLM2 artifacts and GGUF, the Qwen3 tokenizer,
    /// the corpus streams.
    Prepared,
}

/// The prepared inputs, relative to the repository root.
pub const PREPARED: [&str; 6] = [
    "models/smollm2-135m-bf16.ninfer",
    "models/tiny-qwen3_5-f32.ninfer",
    "models/smollm2-135m-f32.ninfer",
    "models/cache/SmolLM2-135M-Instruct.Q4_1.gguf",
    "models/cache/qwen3-tokenizer.json",
    "eval/corpora/perplexity-1m/streams/en-ref-1.txt",
];

/// Why prepared inputs are not there, if they are not.
pub fn prepared_missing() -> Option<String> {
    let root = super::repo();
    PREPARED
        .iter()
        .find(|p| !root.join(p).exists())
        .map(|p| format!("run bash ci/prepare.sh ({p} is missing)"))
}

/// One test: its name, what it needs, and the function (which panics to fail).
pub struct Case {
    pub name: &'static str,
    pub needs: Needs,
    pub run: fn(),
}

/// Runs the cases under libtest-mimic with the process's arguments.
pub fn run(cases: Vec<Case>) -> ExitCode {
    let args = Arguments::from_args();
    let missing = prepared_missing();
    let trials = cases
        .into_iter()
        .map(|c| {
            let why = (c.needs == Needs::Prepared)
                .then(|| missing.clone())
                .flatten();
            Trial::ignorable_test(c.name, move || match why {
                Some(reason) => Ok(Completion::ignored_with(reason)),
                None => {
                    (c.run)();
                    Ok(Completion::Completed)
                }
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// The cases of a test file: `cases![Nothing a_test, Prepared another_test]`.
#[macro_export]
macro_rules! cases {
    ($($needs:ident $name:ident),* $(,)?) => {
        vec![$(common::trials::Case {
            name: stringify!($name),
            needs: common::trials::Needs::$needs,
            run: $name,
        }),*]
    };
}

/// `fn main` for a test file: `test_main! { Nothing a_test, Prepared another_test }`.
#[macro_export]
macro_rules! test_main {
    ($($t:tt)*) => {
        fn main() -> std::process::ExitCode {
            common::trials::run($crate::cases![$($t)*])
        }
    };
}
