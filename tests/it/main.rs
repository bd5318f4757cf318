//! The integration tests: one binary, a module per area (the shape of ripgrep's one test binary).
//! Run one area with a filter: `cargo test --release --test it -- shard::`.
//!
//! Every test is an ordinary `#[test]` function run by `ninfer-testkit` (tests/testkit): one
//! that reads the prepared model, tokenizer or corpus says `#[test(prepared)]` and is
//! reported ignored, with the reason, until `bash ci/prepare.sh` has run. The device parity
//! tests are `tests/parity/`, the regression harness `tests/harness/main.rs`.

#[macro_use]
extern crate ninfer_testkit;

#[path = "../common/mod.rs"]
mod common;

// --- The evaluator end to end, through its binaries.
// Real runs and every bad-input path of the two binaries: one error line, no report.
mod cli;
// Corpus mode: manifests, the domain table, the corpus's bad inputs.
mod corpus;
// Hostile and edge-case inputs, one test per class, including races and FIFOs.
mod bad_input;
// Every reader and writer of both binaries against FIFOs, devices, links and directories.
mod hostile_files;
// Bounded mutation of every parser a user's file reaches.
mod mutation;
// `compare`: paired deltas of two runs and every way two files fail to be comparable.
mod compare;
// `--shard I/N` and `merge`: shards merge into the unsharded run bit for bit.
mod shard;
// `--window-plan disjoint|kld-chunks`: other tools' windows, recorded, sharded, not compared.
mod window_plans;
// The CPU memory plan: refusals with both figures, caps planned for.
mod memory;

// --- The numbers against independent references.
// transformers float32 log-probabilities of every family.
mod reference;
// `--reference-kv` / `--reference-artifact`: KL divergence against transformers.
mod reference_pass;
// `--save-reference` / `--kld-base`: a saved reference gives the in-process numbers.
mod saved_reference;
// The KV formats against PyTorch fixtures, bit for bit, and their error bounds.
mod kv_formats;
// fp8 and nvfp4 weights against ModelOpt and compressed-tensors.
mod weights;
// The same bits for any thread count and run to run.
mod determinism;

// --- Packing and model families.
// GGUF input: dequantization, the Q/K un-permute, the real SmolLM2 GGUF.
mod pack_gguf;
// Mixture-of-experts reporting and refusals.
mod moe;
// Quantized experts: packed, imported and un-grouped.
mod moe_quantized;

// --- Output formats and documentation.
// report.json's schema and the reviewed stdout table.
mod report;
// The environment variables and the paths module headers cite, against the tree.
mod docs;

fn main() -> std::process::ExitCode {
    ninfer_testkit::main(ninfer_testkit::Probes::host(common::repo()))
}
