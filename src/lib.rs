//! ninfer-perplexity: causal perplexity of `.ninfer` language-model artifacts.
//!
//! Layered from the bottom up; a module uses only the ones above it in this list:
//!
//! * the formats: [`artifact`] (the single-file `.ninfer` container, its reader, writer and
//!   what the writer takes), [`quant`] (fp8 and nvfp4 weights), [`kv`] (the Main KV
//!   representations; the CPU code is the specification), [`tokenizer`];
//! * [`model`]: what a model is on any device (config, the layout tree of its parts, the
//!   rows of a forward pass, FLOPs, named real-size shapes);
//! * [`score`]: the window protocol, NLL accumulation, calibration, paired differences;
//! * [`backend`]: the forward passes behind one contract, the CPU reference
//!   (`backend/cpu/model/`) and its CUDA twin (`backend/cuda/model/`);
//! * [`engine`]: one artifact on one backend, the one API the CLI and the harness call;
//! * [`pack`]: GGUF files, Hugging Face directories and random weights into artifacts;
//! * [`corpus`], [`registry`], [`gate`], [`shard`]: the corpus manifest, registered
//!   artifacts, the paired regression gate, splitting a run;
//! * [`report`], [`compare`], [`merge`], [`run`]: what a run writes and how two runs or a
//!   run's shards are joined; [`outfile`] and [`ui`] write files and talk to the user;
//! * [`cli`] and [`app`]: the command line's flags and its modes.
//!
//! The numerical engine (everything up to [`engine`]) knows nothing about corpora, reports
//! or the command line.

pub mod app;
pub mod artifact;
pub mod backend;
pub mod build_info;
pub mod cli;
pub mod compare;
pub mod corpus;
pub mod engine;
pub mod gate;
pub mod host;
pub mod input;
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
