//! ninfer-perplexity: causal perplexity of `.ninfer` language-model artifacts.
//!
//! The crate is layered so that the numerical engine knows nothing about corpora,
//! reports or the command line:
//!
//! * [`artifact`] reads and writes the single-file `.ninfer` container;
//! * [`pack`] turns GGUF files and Hugging Face directories into artifacts;
//! * [`model`] holds the text-model configuration, weights and forward pass;
//! * [`backend`] holds the compute kernels (the CPU reference);
//! * [`kv`] defines the Main KV representations (the CPU code is the specification);
//! * [`score`] implements the window protocol and NLL accumulation;
//! * [`engine`] ties them together: the one API the CLI and the harness call;
//! * [`tokenizer`] and [`report`] feed and describe a run.

pub mod artifact;
pub mod backend;
pub mod cli;
pub mod compare;
pub mod corpus;
pub mod engine;
pub mod gate;
pub mod kv;
pub mod merge;
pub mod model;
pub mod outfile;
pub mod pack;
pub mod quant;
pub mod registry;
pub mod report;
pub mod run;
pub mod score;
pub mod shard;
pub mod tokenizer;
pub mod ui;

// The unit tests' build: `#[test]` is ninfer-testkit's (a test says what it needs, and the
// harness's flags are accepted), and this crate is their binary (`harness = false`).
#[cfg(test)]
#[macro_use]
extern crate ninfer_testkit;

#[cfg(test)]
fn main() -> std::process::ExitCode {
    ninfer_testkit::main(ninfer_testkit::Probes::host(std::path::PathBuf::from(
        env!("CARGO_MANIFEST_DIR"),
    )))
}
