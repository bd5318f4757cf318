//! Documentation that must follow the code: every `NINFER_*` environment variable the
//! repository reads is in `docs/environment.md` (and nothing listed there is no longer
//! read), and every repository path a module header (`//!`) cites exists.

use crate::common;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The files under `dir` (recursively) whose names end with one of `exts`, skipping build
/// outputs, caches and Python environments.
fn files(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | ".venv" | ".cache" | "__pycache__") {
                files(&p, exts, out);
            }
        } else if exts.iter().any(|x| name.ends_with(x)) {
            out.push(p);
        }
    }
}

/// Every `NINFER_[A-Z0-9_]*` word in `text` (a name ends at its last letter or digit).
fn env_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("NINFER_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].trim_end_matches('_');
        if name.len() > "NINFER_".len() {
            out.insert(name.to_string());
        }
        rest = &tail[end.max(1)..];
    }
    out
}

/// The variables the code and scripts read: Rust, shell and Python sources (the kernels'
/// `NINFER_EMU` is a preprocessor macro, not the environment).
fn read_by_the_repository(root: &Path) -> BTreeSet<String> {
    let mut paths = Vec::new();
    for dir in ["src", "tests", "benches", "ci", "eval", ".ci"] {
        files(
            &root.join(dir),
            &[".rs", ".sh", ".py", ".yml", ".yaml", ".sbatch", "run"],
            &mut paths,
        );
    }
    paths
        .iter()
        .filter(|p| !p.ends_with("tests/it/docs.rs")) // this file's own examples
        .flat_map(|p| env_names(&std::fs::read_to_string(p).unwrap_or_default()))
        .collect()
}

#[test]
fn every_environment_variable_is_documented_and_every_documented_one_is_read() {
    let root = common::repo();
    let read = read_by_the_repository(&root);
    let doc = std::fs::read_to_string(root.join("docs/environment.md")).unwrap();
    let documented = env_names(&doc);
    let missing: Vec<_> = read.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&read).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/environment.md: not documented {missing:?}; documented but read nowhere {stale:?}"
    );
    assert!(read.len() >= 30, "the scan found only {read:?}");
}

#[test]
fn the_scan_finds_names_and_stops_at_their_end() {
    let got = env_names("x NINFER_A_B=1 `NINFER_EMU_*` NINFER_PROFILE.\nNINFER_");
    let want: BTreeSet<String> = ["NINFER_A_B", "NINFER_EMU", "NINFER_PROFILE"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
}

/// Backquoted words of `line` that look like repository paths (a `/` and a file
/// extension, no spaces or wildcards).
fn cited_paths(line: &str) -> Vec<&str> {
    line.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            w.contains('/')
                && !w.contains([' ', '*', '<', '{', '$', ':'])
                // `DIR/summary.md`: a placeholder, not a path
                && !w.split('/').next().is_some_and(|s| s.chars().any(|c| c.is_ascii_uppercase()))
                && [
                    ".rs", ".cu", ".cuh", ".h", ".cpp", ".sh", ".py", ".md", ".json", ".toml",
                ]
                .iter()
                .any(|x| w.ends_with(x))
        })
        .collect()
}

#[test]
fn paths_cited_in_module_headers_exist() {
    let root = common::repo();
    let mut sources = Vec::new();
    for dir in ["src", "tests", "benches"] {
        files(&root.join(dir), &[".rs"], &mut sources);
    }
    let mut broken = Vec::new();
    for file in &sources {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let Some(doc) = line.trim_start().strip_prefix("//!") else {
                continue;
            };
            for p in cited_paths(doc) {
                // From the repository root, or (inside src/) from src/.
                if !root.join(p).exists() && !root.join("src").join(p).exists() {
                    broken.push(format!(
                        "{}:{}: {p}",
                        file.strip_prefix(&root).unwrap_or(file).display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "module headers cite missing files:\n{}",
        broken.join("\n")
    );
}

/// The long flags of a `--help`: the first `--name` of every option line (not `--help` and
/// `--version`, which clap adds everywhere).
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .filter_map(|l| {
            let at = l.find("--")?;
            let name: String = l[at + 2..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            Some(format!("--{name}"))
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// The flags of the table that follows `<!-- flags: COMMAND -->` in `doc` (the first
/// backquoted `--name` of each row), or None when there is no such marker.
fn doc_flags(doc: &str, command: &str) -> Option<BTreeSet<String>> {
    let marker = format!("<!-- flags: {command} -->");
    let after = &doc[doc.find(&marker)? + marker.len()..];
    let table = after
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'));
    Some(
        table
            .filter_map(|row| {
                let cell = row.split('|').nth(1)?.trim().strip_prefix("`--")?;
                let name: String = cell
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                Some(format!("--{name}"))
            })
            .collect(),
    )
}

#[test]
fn every_flag_in_help_is_in_the_usage_tables_and_back() {
    let doc = std::fs::read_to_string(common::repo().join("docs/usage.md")).unwrap();
    for command in [
        "ninfer-perplexity",
        "ninfer-perplexity compare",
        "ninfer-perplexity merge",
        "ninfer-pack gguf",
        "ninfer-pack hf",
        "ninfer-pack random",
        "ninfer-pack inspect",
    ] {
        let mut words = command.split(' ');
        let bin = words.next().unwrap();
        let mut args: Vec<&str> = words.collect();
        args.push("--help");
        let o = common::run_bin(bin, &args);
        assert!(o.status.success(), "{command} --help");
        let help = help_flags(&String::from_utf8_lossy(&o.stdout));
        assert!(!help.is_empty(), "{command}: no flags found in --help");
        let documented = doc_flags(&doc, command)
            .unwrap_or_else(|| panic!("docs/usage.md has no `<!-- flags: {command} -->` table"));
        let missing: Vec<_> = help.difference(&documented).collect();
        let stale: Vec<_> = documented.difference(&help).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "docs/usage.md, {command}: in --help but not documented {missing:?}; documented but not in --help {stale:?}"
        );
    }
}

#[test]
fn the_flag_scans_read_help_lines_and_table_rows() {
    let help =
        "Options:\n      --corpus <M>  x --not-this\n  -o, --output <O>  y\n  -h, --help  z\n";
    let want: BTreeSet<String> = ["--corpus", "--output"].map(String::from).into();
    assert_eq!(help_flags(help), want);
    let doc = "<!-- flags: a -->\n| flag | m |\n|---|---|\n| `--corpus M` | x |\n| `--output PATH` (`-o`) | `--no` |\n\n| `--later` | y |\n";
    assert_eq!(doc_flags(doc, "a"), Some(want));
    assert_eq!(doc_flags(doc, "b"), None);
}
