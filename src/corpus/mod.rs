//! The corpus manifest and stream loading.
//!
//! A manifest names a fixed set of independent UTF-8 streams, each with its domain, a
//! quick flag, its byte count and sha256. Streams are built by
//! `eval/corpora/perplexity-1m/build.py` into a folder beside the manifest; this module
//! only reads and verifies them, so a stale or hand-edited stream can never be scored
//! under the corpus's name. The seed engine's manifest shape is read too ([`seed`]).

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Largest manifest read.
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;
/// Largest `--text` file read.
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

// The one way to open an input, used here for manifests and streams.
pub use crate::input::{read_bounded, require_regular_file};

pub mod seed;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Domain {
    pub id: String,
    pub title: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StreamEntry {
    pub id: String,
    pub domain: String,
    pub title: String,
    #[serde(default)]
    pub quick: bool,
    #[serde(default)]
    pub licence: Option<String>,
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub schema_version: u32,
    pub domains: Vec<Domain>,
    pub streams: Vec<StreamEntry>,
    /// A manifest of the seed engine's shape: its modes' stream orders. Its streams pin no
    /// size or digest (`bytes` 0, `sha256` empty) and lie beside the manifest.
    #[serde(skip)]
    pub seed_modes: Option<seed::Modes>,
}

/// Supported manifest schema version.
pub const MANIFEST_SCHEMA: u32 = 1;

/// A stream read from disk, verified and ready to tokenize.
#[derive(Clone, Debug)]
pub struct LoadedStream {
    pub id: String,
    pub domain: String,
    pub path: PathBuf,
    pub sha256: String,
    pub text: String,
}

pub struct Corpus {
    pub manifest_path: PathBuf,
    pub manifest_sha256: String,
    pub manifest: Manifest,
    /// Where the stream files live (`streams/` beside the manifest unless overridden).
    pub stream_dir: PathBuf,
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

impl Manifest {
    /// Parses and validates a manifest; errors name the offending field.
    pub fn parse(text: &str) -> Result<Manifest> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| anyhow!("invalid manifest: {e}"))?;
        if seed::is_seed_shape(&v) {
            return seed::parse(v);
        }
        let m: Manifest =
            serde_json::from_value(v).map_err(|e| anyhow!("invalid manifest: {e}"))?;
        m.validate()?;
        Ok(m)
    }

    pub fn validate(&self) -> Result<()> {
        if self.schema_version != MANIFEST_SCHEMA {
            bail!(
                "`schema_version` is {}, this build reads {MANIFEST_SCHEMA}",
                self.schema_version
            );
        }
        if self.name.trim().is_empty() {
            bail!("`name` is empty");
        }
        if self.domains.is_empty() {
            bail!("`domains` is empty");
        }
        let mut domains = HashSet::new();
        for d in &self.domains {
            if !domains.insert(d.id.as_str()) {
                bail!("`domains`: id `{}` appears twice", d.id);
            }
        }
        if self.streams.is_empty() {
            bail!("`streams` is empty");
        }
        let mut ids = HashSet::new();
        for (i, s) in self.streams.iter().enumerate() {
            if s.id.is_empty() {
                bail!("`streams[{i}].id` is empty");
            }
            if !ids.insert(s.id.as_str()) {
                bail!("`streams[{i}].id`: `{}` appears twice", s.id);
            }
            if !domains.contains(s.domain.as_str()) {
                bail!(
                    "`streams[{i}].domain`: unknown domain `{}` for stream `{}`",
                    s.domain,
                    s.id
                );
            }
            if s.sha256.len() != 64 || !s.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                bail!(
                    "`streams[{i}].sha256` of stream `{}` is not a sha256 hex digest",
                    s.id
                );
            }
            if s.file.is_empty() || s.file.contains("..") || Path::new(&s.file).is_absolute() {
                bail!(
                    "`streams[{i}].file` of stream `{}` must be a relative file name",
                    s.id
                );
            }
        }
        Ok(())
    }
}

impl Corpus {
    pub fn open(manifest_path: &Path, stream_dir: Option<&Path>) -> Result<Corpus> {
        let bytes = read_bounded(manifest_path, "manifest", MAX_MANIFEST_BYTES)
            .with_context(|| manifest_path.display().to_string())?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| anyhow!("{}: manifest is not UTF-8", manifest_path.display()))?;
        let manifest =
            Manifest::parse(text).with_context(|| manifest_path.display().to_string())?;
        let beside = manifest_path.parent().unwrap_or(Path::new("."));
        let stream_dir = match stream_dir {
            Some(d) => d.to_path_buf(),
            // The seed shape's paths are relative to the manifest's folder.
            None if manifest.seed_modes.is_some() => beside.to_path_buf(),
            None => beside.join("streams"),
        };
        Ok(Corpus {
            manifest_path: manifest_path.to_path_buf(),
            manifest_sha256: sha256_hex(&bytes),
            manifest,
            stream_dir,
        })
    }

    /// The selected streams: all, the quick ones, or the named ones.
    pub fn select(&self, quick: bool, only: &[String]) -> Result<Vec<&StreamEntry>> {
        let mut out: Vec<&StreamEntry> = match &self.manifest.seed_modes {
            // The seed shape: the mode's list, in its order.
            Some(m) => (if quick { &m.quick } else { &m.full })
                .iter()
                .filter_map(|id| self.manifest.streams.iter().find(|s| &s.id == id))
                .collect(),
            None => self
                .manifest
                .streams
                .iter()
                .filter(|s| !quick || s.quick)
                .collect(),
        };
        if quick && out.is_empty() {
            bail!(
                "{}: --quick selects nothing: no stream is marked quick",
                self.manifest_path.display()
            );
        }
        if !only.is_empty() {
            for id in only {
                if !self.manifest.streams.iter().any(|s| &s.id == id) {
                    bail!("{}: no stream named `{id}`", self.manifest_path.display());
                }
            }
            out.retain(|s| only.contains(&s.id));
            if out.is_empty() {
                bail!(
                    "{}: the --stream selection and --quick leave no stream",
                    self.manifest_path.display()
                );
            }
        }
        Ok(out)
    }

    /// Reads one stream file and checks its size, sha256 and UTF-8.
    pub fn load(&self, s: &StreamEntry) -> Result<LoadedStream> {
        let path = self.stream_dir.join(&s.file);
        if self.manifest.seed_modes.is_some() {
            return load_unpinned(s, path);
        }
        let rebuild = "build it with `python3 eval/corpora/perplexity-1m/build.py`";
        // One byte more than the manifest says is enough to know the file is wrong.
        let bytes = read_bounded(&path, "stream", s.bytes.saturating_add(1))
            .map_err(|e| anyhow!("stream `{}`: {}: {e:#}; {rebuild}", s.id, path.display()))?;
        let sha = sha256_hex(&bytes);
        if sha != s.sha256 || bytes.len() as u64 != s.bytes {
            bail!(
                "stream `{}`: {} does not match the manifest (sha256 {sha}, {} bytes; expected {}, {} bytes); rebuild it with `python3 eval/corpora/perplexity-1m/build.py`",
                s.id,
                path.display(),
                bytes.len(),
                s.sha256,
                s.bytes
            );
        }
        let text = decode_utf8(bytes)
            .map_err(|e| anyhow!("stream `{}`: {}: {e}", s.id, path.display()))?;
        Ok(LoadedStream {
            id: s.id.clone(),
            domain: s.domain.clone(),
            path,
            sha256: sha,
            text,
        })
    }
}

/// A stream of a seed-shaped manifest: no pinned size or digest, so the seed loader's
/// rules: non-empty, valid UTF-8, no NUL; read up to [`MAX_TEXT_BYTES`].
fn load_unpinned(s: &StreamEntry, path: PathBuf) -> Result<LoadedStream> {
    let bytes = read_bounded(&path, "stream", MAX_TEXT_BYTES)
        .map_err(|e| anyhow!("stream `{}`: {}: {e:#}", s.id, path.display()))?;
    if bytes.is_empty() {
        bail!("stream `{}`: {} is empty", s.id, path.display());
    }
    if let Some(at) = bytes.iter().position(|&b| b == 0) {
        bail!(
            "stream `{}`: {} has a NUL byte at offset {at}",
            s.id,
            path.display()
        );
    }
    let sha256 = sha256_hex(&bytes);
    let text =
        decode_utf8(bytes).map_err(|e| anyhow!("stream `{}`: {}: {e}", s.id, path.display()))?;
    Ok(LoadedStream {
        id: s.id.clone(),
        domain: s.domain.clone(),
        path,
        sha256,
        text,
    })
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
    let sha256 = sha256_hex(&bytes);
    let text = decode_utf8(bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let id = if path == Path::new("-") {
        "stdin".into()
    } else {
        path.file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "text".into())
    };
    Ok(LoadedStream {
        id,
        domain: "text".into(),
        path: path.to_path_buf(),
        sha256,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(streams: &str) -> String {
        format!(
            r#"{{"name":"t","schema_version":1,"domains":[{{"id":"a","title":"A"}},{{"id":"b","title":"B"}}],"streams":[{streams}]}}"#
        )
    }
    const SHA: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn valid_manifest_parses() {
        let s = format!(
            r#"{{"id":"a-1","domain":"a","title":"x","quick":true,"file":"a-1.txt","bytes":3,"sha256":"{SHA}"}}"#
        );
        let m = Manifest::parse(&manifest(&s)).unwrap();
        assert_eq!(m.streams.len(), 1);
    }

    #[test]
    fn errors_name_the_field() {
        let bad_domain = format!(
            r#"{{"id":"a-1","domain":"zz","title":"x","file":"a-1.txt","bytes":3,"sha256":"{SHA}"}}"#
        );
        let e = Manifest::parse(&manifest(&bad_domain))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown domain `zz`") && e.contains("streams[0].domain"),
            "{e}"
        );
        let dup = format!(
            r#"{{"id":"a","domain":"a","title":"x","file":"a.txt","bytes":3,"sha256":"{SHA}"}},{{"id":"a","domain":"b","title":"y","file":"b.txt","bytes":3,"sha256":"{SHA}"}}"#
        );
        let e = Manifest::parse(&manifest(&dup)).unwrap_err().to_string();
        assert!(e.contains("streams[1].id"), "{e}");
        let missing = r#"{"id":"a","domain":"a","title":"x","file":"a.txt","sha256":"00"}"#;
        let e = Manifest::parse(&manifest(missing)).unwrap_err().to_string();
        assert!(e.contains("bytes"), "{e}");
        let badsha =
            r#"{"id":"a","domain":"a","title":"x","file":"a.txt","bytes":1,"sha256":"00"}"#;
        let e = Manifest::parse(&manifest(badsha)).unwrap_err().to_string();
        assert!(e.contains("streams[0].sha256"), "{e}");
    }

    #[test]
    fn invalid_utf8_reports_offset() {
        let e = decode_utf8(vec![b'a', b'b', 0xff, b'c'])
            .unwrap_err()
            .to_string();
        assert_eq!(e, "invalid UTF-8 at byte offset 2");
    }
}
