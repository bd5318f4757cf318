//! The seed engine's corpus manifest, read as it is: `corpus_id`, `streams[{id, domain,
//! path}]` and `modes{quick, full}` (NInfer's `ninfer-ppl-1m-v1`), so a corpus made for
//! that engine scores here unchanged.
//!
//! Its loader's rules are kept: both modes present, non-empty, listing unique known stream
//! ids; paths relative, without `..`; stream text non-empty, valid UTF-8 and NUL-free;
//! streams scored in the order of the selected mode's list. The shape pins no sizes or
//! digests, so its streams are read as they are (up to [`super::MAX_TEXT_BYTES`] each) and
//! their sha256 is recorded in the report as computed.

use super::{Domain, Manifest, StreamEntry, MANIFEST_SCHEMA};
use anyhow::{anyhow, bail, Result};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::Path;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SeedStream {
    id: String,
    domain: String,
    path: String,
}

#[derive(Deserialize)]
struct SeedModes {
    quick: Vec<String>,
    full: Vec<String>,
}

#[derive(Deserialize)]
struct SeedManifest {
    corpus_id: String,
    streams: Vec<SeedStream>,
    modes: SeedModes,
}

/// The stream order of the two modes, by id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Modes {
    pub quick: Vec<String>,
    pub full: Vec<String>,
}

/// Whether `v` is a manifest of the seed engine's shape (it has `corpus_id` and `modes`).
pub fn is_seed_shape(v: &serde_json::Value) -> bool {
    v.get("corpus_id").is_some() && v.get("modes").is_some()
}

/// The seed shape as this project's manifest: domains in order of first appearance (titled
/// by their ids), each stream's `path` as its file (relative to the manifest's folder), no
/// pinned size or digest, and the modes' orders.
pub fn parse(v: serde_json::Value) -> Result<Manifest> {
    let m: SeedManifest =
        serde_json::from_value(v).map_err(|e| {
            anyhow!("invalid manifest of the seed engine's shape (corpus_id, streams[{{id, domain, path}}], modes{{quick, full}}): {e}")
        })?;
    if m.corpus_id.trim().is_empty() {
        bail!("`corpus_id` is empty");
    }
    if m.streams.is_empty() {
        bail!("`streams` is empty");
    }
    let mut ids = HashSet::new();
    let mut domains: Vec<Domain> = Vec::new();
    let mut streams = Vec::with_capacity(m.streams.len());
    for (i, s) in m.streams.into_iter().enumerate() {
        if s.id.is_empty() || !ids.insert(s.id.clone()) {
            bail!("`streams[{i}].id` is empty or appears twice (`{}`)", s.id);
        }
        if s.domain.is_empty() {
            bail!("`streams[{i}].domain` of stream `{}` is empty", s.id);
        }
        let p = Path::new(&s.path);
        if s.path.is_empty() || p.is_absolute() || p.components().any(|c| c.as_os_str() == "..") {
            bail!(
                "`streams[{i}].path` of stream `{}` must be a relative path without `..`",
                s.id
            );
        }
        if !domains.iter().any(|d| d.id == s.domain) {
            domains.push(Domain {
                id: s.domain.clone(),
                title: s.domain.clone(),
            });
        }
        streams.push(StreamEntry {
            id: s.id,
            domain: s.domain,
            title: String::new(),
            quick: false,
            licence: None,
            file: s.path,
            bytes: 0,
            sha256: String::new(),
        });
    }
    for (name, list) in [("quick", &m.modes.quick), ("full", &m.modes.full)] {
        if list.is_empty() {
            bail!("`modes.{name}` is empty");
        }
        let mut seen = HashSet::new();
        for id in list {
            if !ids.contains(id) {
                bail!("`modes.{name}` names `{id}`, which is not a stream");
            }
            if !seen.insert(id) {
                bail!("`modes.{name}` names `{id}` twice");
            }
        }
    }
    for s in &mut streams {
        s.quick = m.modes.quick.contains(&s.id);
    }
    Ok(Manifest {
        name: m.corpus_id,
        schema_version: MANIFEST_SCHEMA,
        domains,
        streams,
        seed_modes: Some(Modes {
            quick: m.modes.quick,
            full: m.modes.full,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::super::Corpus;
    use std::path::Path;

    /// A corpus in the seed engine's shape, with its streams under `data/`.
    fn corpus(dir: &Path, manifest: &str) -> anyhow::Result<Corpus> {
        std::fs::create_dir_all(dir.join("data/wiki")).unwrap();
        std::fs::write(dir.join("data/wiki/00.txt"), "Wiki zero.").unwrap();
        std::fs::write(dir.join("data/wiki/01.txt"), "Wiki one.").unwrap();
        std::fs::write(dir.join("data/code.txt"), "int main() {}").unwrap();
        std::fs::write(dir.join("data/nul.txt"), "a\0b").unwrap();
        let m = dir.join("manifest.json");
        std::fs::write(&m, manifest).unwrap();
        Corpus::open(&m, None)
    }

    const OK: &str = r#"{"corpus_id": "tiny-v1",
      "streams": [
        {"id": "wiki-00", "domain": "english_reference", "path": "data/wiki/00.txt"},
        {"id": "wiki-01", "domain": "english_reference", "path": "data/wiki/01.txt"},
        {"id": "code-00", "domain": "code", "path": "data/code.txt"}],
      "modes": {"quick": ["code-00", "wiki-00"], "full": ["wiki-01", "wiki-00", "code-00"]}}"#;

    #[test]
    fn the_seed_shape_loads_in_its_modes_order() {
        let d = tempfile::tempdir().unwrap();
        let c = corpus(d.path(), OK).unwrap();
        assert_eq!(c.manifest.name, "tiny-v1");
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
            &OK.replace(r#""quick": ["code-00", "wiki-00"], "#, ""),
            "modes{quick, full}): missing field `quick`",
        );
        bad(
            &OK.replace(r#"["code-00", "wiki-00"]"#, "[]"),
            "`modes.quick` is empty",
        );
        bad(
            &OK.replace(r#"["code-00", "wiki-00"]"#, r#"["code-00", "code-00"]"#),
            "twice",
        );
        bad(
            &OK.replace(r#"["code-00", "wiki-00"]"#, r#"["nope"]"#),
            "`nope`, which is not a stream",
        );
        bad(&OK.replace("data/code.txt", "../code.txt"), "without `..`");
        bad(&OK.replace("data/code.txt", "/etc/passwd"), "without `..`");
        bad(
            &OK.replace(r#""corpus_id": "tiny-v1""#, r#""corpus_id": " ""#),
            "`corpus_id` is empty",
        );
        // A NUL byte in a stream is refused when the stream is read.
        let c = corpus(d.path(), &OK.replace("data/code.txt", "data/nul.txt")).unwrap();
        let e = format!("{:#}", c.load(c.select(true, &[]).unwrap()[0]).unwrap_err());
        assert!(e.contains("NUL byte at offset 1"), "{e}");
    }
}
