//! The perplexity regression harness (`harness = false`): one libtest-mimic trial per
//! (artifact, stream, KV format), gated by insta baselines under `baselines/`.
//!
//! `cargo test --release --test harness -- [--kv-dtype ..] [--artifact ..] [--device ..]
//! [--tier ..] [libtest flags]`; see `docs/harness.md`.

#[path = "harness/mod.rs"]
mod harness;

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(harness::main_with(std::env::args_os().collect()))
}
