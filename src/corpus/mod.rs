//! The corpus: its manifest ([`manifest`]) and stream loading.
//!
//! Streams are built by `eval/corpora/perplexity-1m/build.py` beside the manifest; this
//! module only reads and verifies them: a pinned stream (manifest `bytes` + `sha256`) must
//! match its pin, and every stream must be non-empty, NUL-free UTF-8 (the seed loader's
//! rules).

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Largest manifest read.
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;
/// Largest `--text` file, and largest unpinned stream, read.
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

// The one way to open an input, used here for manifests and streams.
pub use crate::input::{read_bounded, require_regular_file};

pub mod manifest;
pub use manifest::{Domain, Manifest, Modes, StreamEntry};

/// A stream read from disk, verified and ready to tokenize.
#[derive(Clone, Debug)]
pub struct LoadedStream {
    pub id: String,
    pub domain: String,
    /// The file read.
    pub path: PathBuf,
    /// The path as the report names it: the manifest's (relative to its folder), or the
    /// `--text` file's absolute path.
    pub report_path: String,
    pub sha256: String,
    pub text: String,
}

pub struct Corpus {
    pub manifest_path: PathBuf,
    pub manifest_sha256: String,
    pub manifest: Manifest,
    /// The manifest's folder: stream paths are relative to it.
    pub root: PathBuf,
    /// `--stream-dir`: the folder holding the stream files instead (each by its file name).
    pub stream_dir: Option<PathBuf>,
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

impl Corpus {
    pub fn open(manifest_path: &Path, stream_dir: Option<&Path>) -> Result<Corpus> {
        let bytes = read_bounded(manifest_path, "manifest", MAX_MANIFEST_BYTES)
            .with_context(|| manifest_path.display().to_string())?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| anyhow!("{}: manifest is not UTF-8", manifest_path.display()))?;
        let manifest =
            Manifest::parse(text).with_context(|| manifest_path.display().to_string())?;
        Ok(Corpus {
            manifest_path: manifest_path.to_path_buf(),
            manifest_sha256: sha256_hex(&bytes),
            manifest,
            root: manifest_path
                .parent()
                .unwrap_or(Path::new("."))
                .to_path_buf(),
            stream_dir: stream_dir.map(Path::to_path_buf),
        })
    }

    /// The selected streams: the mode's list in its order (`--quick`: `modes.quick`, else
    /// `modes.full`), narrowed to the named ones.
    pub fn select(&self, quick: bool, only: &[String]) -> Result<Vec<&StreamEntry>> {
        let mut out: Vec<&StreamEntry> = self
            .manifest
            .mode(quick)
            .iter()
            .filter_map(|id| self.manifest.stream(id))
            .collect();
        if !only.is_empty() {
            for id in only {
                if self.manifest.stream(id).is_none() {
                    bail!("{}: no stream named `{id}`", self.manifest_path.display());
                }
            }
            out.retain(|s| only.contains(&s.id));
            if out.is_empty() {
                bail!(
                    "{}: the --stream selection is not in the {} mode",
                    self.manifest_path.display(),
                    if quick { "quick" } else { "full" }
                );
            }
        }
        Ok(out)
    }

    /// Where stream `s` is read from.
    pub fn file_of(&self, s: &StreamEntry) -> PathBuf {
        match &self.stream_dir {
            Some(d) => d.join(Path::new(&s.path).file_name().unwrap_or_default()),
            None => self.root.join(&s.path),
        }
    }

    /// Reads one stream and checks it: its pin when it has one, then non-empty, NUL-free
    /// UTF-8.
    pub fn load(&self, s: &StreamEntry) -> Result<LoadedStream> {
        let path = self.file_of(s);
        let fail =
            |e: &dyn std::fmt::Display| anyhow!("stream `{}`: {}: {e}", s.id, path.display());
        let bytes = match s.pin() {
            Some((n, sha)) => {
                let rebuild = "build it with `python3 eval/corpora/perplexity-1m/build.py`";
                // One byte more than the manifest says is enough to know the file is wrong.
                let bytes = read_bounded(&path, "stream", n.saturating_add(1))
                    .map_err(|e| fail(&format!("{e:#}; {rebuild}")))?;
                let got = sha256_hex(&bytes);
                if got != sha || bytes.len() as u64 != n {
                    bail!(
                        "stream `{}`: {} does not match the manifest (sha256 {got}, {} bytes; expected {sha}, {n} bytes); re{rebuild}",
                        s.id,
                        path.display(),
                        bytes.len(),
                    );
                }
                bytes
            }
            None => read_bounded(&path, "stream", MAX_TEXT_BYTES)
                .map_err(|e| fail(&format!("{e:#}")))?,
        };
        if bytes.is_empty() {
            return Err(fail(&"is empty"));
        }
        if let Some(at) = bytes.iter().position(|&b| b == 0) {
            return Err(fail(&format!("has a NUL byte at offset {at}")));
        }
        let sha256 = sha256_hex(&bytes);
        let text = decode_utf8(bytes).map_err(|e| fail(&e))?;
        Ok(LoadedStream {
            id: s.id.clone(),
            domain: s.domain.clone(),
            path,
            report_path: s.path.clone(),
            sha256,
            text,
        })
    }
}

/// UTF-8 decoding whose error gives the byte offset.
pub fn decode_utf8(bytes: Vec<u8>) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        let off = e.utf8_error().valid_up_to();
        anyhow!("invalid UTF-8 at byte offset {off}")
    })
}

/// Standard input, at most `limit` bytes (one more is read to tell a longer input apart).
fn read_stdin_bounded(limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| anyhow!("-: cannot read standard input: {e}"))?;
    if bytes.len() as u64 > limit {
        bail!("-: standard input is longer than the {limit} bytes --text reads");
    }
    Ok(bytes)
}

/// The stream id of a `--text` input: its file name (`stdin` for `-`), as the seed engine.
pub fn text_stream_id(path: &Path) -> String {
    if path == Path::new("-") {
        return "stdin".into();
    }
    path.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "text".into())
}

/// The corpus id of a `--text` run whose stream is `stream_id`: `custom-<file name>`.
pub fn text_corpus_id(stream_id: &str) -> String {
    format!("custom-{stream_id}")
}

/// Reads a `--text` file as one stream; `-` is standard input (a pipe or a file), read up to
/// the same cap as a file ([`MAX_TEXT_BYTES`]).
pub fn load_text_file(path: &Path) -> Result<LoadedStream> {
    let bytes = if path == Path::new("-") {
        read_stdin_bounded(MAX_TEXT_BYTES)?
    } else {
        read_bounded(path, "text", MAX_TEXT_BYTES).with_context(|| path.display().to_string())?
    };
    if bytes.is_empty() {
        bail!("{}: text file is empty", path.display());
    }
    if let Some(at) = bytes.iter().position(|&b| b == 0) {
        bail!("{}: text has a NUL byte at offset {at}", path.display());
    }
    let sha256 = sha256_hex(&bytes);
    let text = decode_utf8(bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let report_path = if path == Path::new("-") {
        "-".to_string()
    } else {
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        abs.display().to_string()
    };
    Ok(LoadedStream {
        id: text_stream_id(path),
        // The seed engine's domain (and mode) for a `--text` run.
        domain: "custom".into(),
        path: path.to_path_buf(),
        report_path,
        sha256,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A corpus with its streams under `data/`.
    fn corpus(dir: &Path, manifest: &str) -> Result<Corpus> {
        std::fs::create_dir_all(dir.join("data/wiki")).unwrap();
        std::fs::write(dir.join("data/wiki/00.txt"), "Wiki zero.").unwrap();
        std::fs::write(dir.join("data/wiki/01.txt"), "Wiki one.").unwrap();
        std::fs::write(dir.join("data/code.txt"), "int main() {}").unwrap();
        std::fs::write(dir.join("data/nul.txt"), "a\0b").unwrap();
        let m = dir.join("manifest.json");
        std::fs::write(&m, manifest).unwrap();
        Corpus::open(&m, None)
    }

    /// The seed engine's shape, nothing more.
    const SEED: &str = r#"{"corpus_id": "tiny-v1",
      "streams": [
        {"id": "wiki-00", "domain": "english_reference", "path": "data/wiki/00.txt"},
        {"id": "wiki-01", "domain": "english_reference", "path": "data/wiki/01.txt"},
        {"id": "code-00", "domain": "code", "path": "data/code.txt"}],
      "modes": {"quick": ["code-00", "wiki-00"], "full": ["wiki-01", "wiki-00", "code-00"]}}"#;

    #[test]
    fn the_seed_shape_loads_in_its_modes_order() {
        let d = tempfile::tempdir().unwrap();
        let c = corpus(d.path(), SEED).unwrap();
        assert_eq!(c.manifest.corpus_id, "tiny-v1");
        let ids = |quick| -> Vec<String> {
            c.select(quick, &[])
                .unwrap()
                .iter()
                .map(|s| s.id.clone())
                .collect()
        };
        assert_eq!(ids(true), ["code-00", "wiki-00"]);
        assert_eq!(ids(false), ["wiki-01", "wiki-00", "code-00"]);
        let domains: Vec<&str> = c.manifest.domains.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(domains, ["english_reference", "code"]);
        let s = c.load(c.select(true, &[]).unwrap()[0]).unwrap();
        assert_eq!(s.text, "int main() {}");
        assert_eq!(s.domain, "code");
        assert_eq!(s.report_path, "data/code.txt");
        assert_eq!(s.sha256.len(), 64);
    }

    #[test]
    fn the_seed_loaders_rules_hold() {
        let d = tempfile::tempdir().unwrap();
        let bad = |m: &str, needle: &str| {
            let e = match corpus(d.path(), m) {
                Ok(_) => panic!("accepted: {m}"),
                Err(e) => format!("{e:#}"),
            };
            assert!(e.contains(needle), "`{needle}` not in: {e}");
        };
        bad(
            &SEED.replace(r#""quick": ["code-00", "wiki-00"], "#, ""),
            "missing field `quick`",
        );
        bad(
            &SEED.replace(r#"["code-00", "wiki-00"]"#, "[]"),
            "`modes.quick` is empty",
        );
        bad(
            &SEED.replace(r#"["code-00", "wiki-00"]"#, r#"["code-00", "code-00"]"#),
            "twice",
        );
        bad(
            &SEED.replace(r#"["code-00", "wiki-00"]"#, r#"["nope"]"#),
            "`nope`, which is not a stream",
        );
        bad(
            &SEED.replace("data/code.txt", "../code.txt"),
            "without `..`",
        );
        bad(
            &SEED.replace("data/code.txt", "/etc/passwd"),
            "without `..`",
        );
        bad(
            &SEED.replace(r#""corpus_id": "tiny-v1""#, r#""corpus_id": " ""#),
            "`corpus_id` is empty",
        );
        bad(
            r#"{"name": "t", "schema_version": 1, "domains": [], "streams": []}"#,
            "retired shape",
        );
        // A NUL byte in a stream is refused when the stream is read.
        let c = corpus(d.path(), &SEED.replace("data/code.txt", "data/nul.txt")).unwrap();
        let e = format!("{:#}", c.load(c.select(true, &[]).unwrap()[0]).unwrap_err());
        assert!(e.contains("NUL byte at offset 1"), "{e}");
    }

    /// This project's extras beside the seed's fields: domain titles and order, pins.
    #[test]
    fn extras_order_domains_and_pin_streams() {
        let d = tempfile::tempdir().unwrap();
        let code_sha = sha256_hex(b"int main() {}");
        let with = SEED
            .replace(
                r#""corpus_id": "tiny-v1","#,
                r#""corpus_id": "tiny-v1", "domains": [{"id": "code", "title": "Code"}, {"id": "english_reference", "title": "English"}],"#,
            )
            .replace(
                r#""path": "data/code.txt"}"#,
                &format!(r#""path": "data/code.txt", "bytes": 13, "sha256": "{code_sha}", "recipe": {{}}}}"#),
            );
        let c = corpus(d.path(), &with).unwrap();
        let titles: Vec<&str> = c
            .manifest
            .domains
            .iter()
            .map(|d| d.title.as_str())
            .collect();
        assert_eq!(titles, ["Code", "English"]);
        c.load(c.manifest.stream("code-00").unwrap()).unwrap();
        // A stream that differs from its pin is refused, naming both.
        std::fs::write(d.path().join("data/code.txt"), "int main() {;}").unwrap();
        let e = format!(
            "{:#}",
            c.load(c.manifest.stream("code-00").unwrap()).unwrap_err()
        );
        assert!(
            e.contains("does not match the manifest") && e.contains(&code_sha),
            "{e}"
        );
        let bad = |m: String, needle: &str| {
            let e = format!("{:#}", Manifest::parse(&m).unwrap_err());
            assert!(e.contains(needle), "`{needle}` not in: {e}");
        };
        bad(with.replace(r#""bytes": 13, "#, ""), "pins only one of");
        bad(with.replace(&code_sha, "00"), "`streams[2].sha256`");
        bad(
            with.replace(r#"{"id": "code", "title": "Code"}, "#, ""),
            "domain `code` of stream `code-00` is not in `domains`",
        );
    }

    #[test]
    fn invalid_utf8_reports_offset() {
        let e = decode_utf8(vec![b'a', b'b', 0xff, b'c'])
            .unwrap_err()
            .to_string();
        assert_eq!(e, "invalid UTF-8 at byte offset 2");
    }
}
