//! What this binary is: its version, the git commit it was built from, the cargo profile
//! and the enabled features (set by `build.rs`), and where a run happened (command line,
//! host, CPU). `--version` prints the first; `report.json` records both, so a report names
//! the code and machine that produced it and `merge` can refuse shards of different builds.

use serde::{Deserialize, Serialize};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// `0.1.0 (git 0123456789ab[-dirty], release, features: cuda)`.
pub const LONG_VERSION: &str = env!("BUILD_LONG_VERSION");
/// 12 hex digits, `-dirty` when tracked files differed from it; `unknown` outside git.
pub const GIT_COMMIT: &str = env!("BUILD_GIT_COMMIT");
pub const PROFILE: &str = env!("BUILD_PROFILE");
/// Comma-separated, sorted; `none` when none.
pub const FEATURES: &str = env!("BUILD_FEATURES");

/// Where and how a run was invoked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Invocation {
    /// The process's arguments, the program first (lossily UTF-8).
    pub command_line: Vec<String>,
    pub host: String,
    /// The CPU's model name (`/proc/cpuinfo`), `unknown` where it cannot be read.
    pub cpu_model: String,
    /// `linux x86_64` and the like.
    pub os: String,
}

impl Invocation {
    pub fn current() -> Invocation {
        Invocation {
            command_line: std::env::args_os()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            host: small_file("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "unknown".into()),
            cpu_model: small_file("/proc/cpuinfo")
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("model name"))
                        .and_then(|l| l.split_once(':'))
                        .map(|(_, v)| v.trim().to_string())
                })
                .unwrap_or_else(|| "unknown".into()),
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        }
    }
}

/// A kernel-provided text file, read up to 1 MiB.
fn small_file(path: &str) -> Option<String> {
    use std::io::Read;
    let mut s = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(1 << 20)
        .read_to_string(&mut s)
        .ok()?;
    Some(s)
}
