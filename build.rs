//! Build facts for `--version` and `report.json`: the git commit the binary was built from
//! (with `-dirty` when tracked files differed from it), the cargo profile and the enabled
//! features. A build outside a git checkout says `unknown`. Why at build time: a report must
//! name the code that produced it, and a merge must refuse shards of different builds.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    // Rebuild when HEAD moves or the sources change (the dirty flag follows them).
    for p in ["build.rs", "Cargo.toml", "src", "kernels"] {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = Path::new(&dir);
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        println!(
            "cargo:rerun-if-changed={}",
            dir.join("packed-refs").display()
        );
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", dir.join(r).display());
        }
    }
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) if !c.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{c}{}", if dirty { "-dirty" } else { "" })
        }
        _ => "unknown".to_string(),
    };
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".into());
    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| {
            k.strip_prefix("CARGO_FEATURE_")
                .map(|f| f.to_lowercase().replace('_', "-"))
        })
        .collect();
    features.retain(|f| f != "default");
    features.sort();
    let features = if features.is_empty() {
        "none".to_string()
    } else {
        features.join(",")
    };
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    println!("cargo:rustc-env=BUILD_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=BUILD_PROFILE={profile}");
    println!("cargo:rustc-env=BUILD_FEATURES={features}");
    println!(
        "cargo:rustc-env=BUILD_LONG_VERSION={version} (git {commit}, {profile}, features: {features})"
    );
}
