//! ninfer-perplexity: causal perplexity of `.ninfer` language-model artifacts.
//!
//! The crate is layered so that the numerical engine knows nothing about corpora,
//! reports or the command line:
//!
//! * [`artifact`] reads and writes the single-file `.ninfer` container;
//! * [`pack`] turns GGUF files and Hugging Face directories into artifacts;
//! * [`model`] holds the text-model configuration, weights and forward pass;
//! * [`kv`] defines the Main KV representations (the CPU code is the specification);
//! * [`score`] implements the window protocol and NLL accumulation;
//! * [`tokenizer`], [`corpus`] and [`report`] feed and describe a run.
//!
//! The CLI (`src/main.rs`) and the regression harness (`tests/harness.rs`) both call
//! [`engine`], so scoring logic exists exactly once.

pub mod artifact;
pub mod kv;
pub mod model;
pub mod pack;
pub mod score;
pub mod tokenizer;
