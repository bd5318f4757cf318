//! The corpus manifest, in the seed engine's shape: `corpus_id`, `streams[{id, domain,
//! path}]` and `modes{quick, full}`, so a corpus made for NInfer's `ninfer-perplexity`
//! scores here unchanged and this project's own manifest scores there.
//!
//! This project's extras sit beside those fields and are optional: `domains[{id, title}]`
//! (order and titles of the domain rows), per stream `title`, `licence`, and the pin
//! `bytes` + `sha256` (a pinned stream that differs from its pin is refused, so a stale or
//! hand-edited file can never be scored under the corpus's name; `tokens` and `recipe` are
//! the builder's and are not read here). The seed loader's rules hold: both modes present,
//! non-empty, listing unique known stream ids; paths relative, without `..`; stream text
//! non-empty, valid UTF-8 and NUL-free; streams scored in the order of the mode's list.

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::Path;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Domain {
    pub id: String,
    pub title: String,
}

/// One stream as the manifest lists it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StreamEntry {
    pub id: String,
    pub domain: String,
    /// Relative to the manifest's folder (the seed's meaning).
    pub path: String,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub licence: Option<String>,
    /// The pin: both or neither.
    #[serde(default)]
    pub bytes: Option<u64>,
    #[serde(default)]
    pub sha256: Option<String>,
}

impl StreamEntry {
    /// `(bytes, sha256)` when the manifest pins the stream.
    pub fn pin(&self) -> Option<(u64, &str)> {
        Some((self.bytes?, self.sha256.as_deref()?))
    }
}

/// The stream order of the two modes, by id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Modes {
    pub quick: Vec<String>,
    pub full: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub corpus_id: String,
    /// Every domain a stream names: the manifest's `domains` order when it has one, else the
    /// order of first appearance (titled by id).
    #[serde(default)]
    pub domains: Vec<Domain>,
    pub streams: Vec<StreamEntry>,
    pub modes: Modes,
}

impl Manifest {
    /// Parses and validates a manifest; errors name the offending field.
    pub fn parse(text: &str) -> Result<Manifest> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| anyhow!("invalid manifest: {e}"))?;
        if v.get("corpus_id").is_none() && v.get("name").is_some() {
            bail!("a manifest of the retired shape (`name`, `streams[].file`, `quick`): this build reads `corpus_id`, `streams[{{id, domain, path}}]` and `modes{{quick, full}}` (docs/corpus.md)");
        }
        let mut m: Manifest = serde_json::from_value(v).map_err(|e| {
            anyhow!("invalid manifest (corpus_id, streams[{{id, domain, path}}], modes{{quick, full}}): {e}")
        })?;
        m.validate()?;
        if m.domains.is_empty() {
            for s in &m.streams {
                if !m.domains.iter().any(|d| d.id == s.domain) {
                    m.domains.push(Domain {
                        id: s.domain.clone(),
                        title: s.domain.clone(),
                    });
                }
            }
        }
        Ok(m)
    }

    fn validate(&self) -> Result<()> {
        if self.corpus_id.trim().is_empty() {
            bail!("`corpus_id` is empty");
        }
        let mut domains = HashSet::new();
        for (i, d) in self.domains.iter().enumerate() {
            if d.id.is_empty() || !domains.insert(d.id.as_str()) {
                bail!("`domains[{i}].id` is empty or appears twice (`{}`)", d.id);
            }
        }
        if self.streams.is_empty() {
            bail!("`streams` is empty");
        }
        let mut ids = HashSet::new();
        for (i, s) in self.streams.iter().enumerate() {
            if s.id.is_empty() || !ids.insert(s.id.as_str()) {
                bail!("`streams[{i}].id` is empty or appears twice (`{}`)", s.id);
            }
            if s.domain.is_empty() {
                bail!("`streams[{i}].domain` of stream `{}` is empty", s.id);
            }
            if !self.domains.is_empty() && !domains.contains(s.domain.as_str()) {
                bail!(
                    "`streams[{i}].domain`: domain `{}` of stream `{}` is not in `domains`",
                    s.domain,
                    s.id
                );
            }
            let p = Path::new(&s.path);
            if s.path.is_empty() || p.is_absolute() || p.components().any(|c| c.as_os_str() == "..")
            {
                bail!(
                    "`streams[{i}].path` of stream `{}` must be a relative path without `..`",
                    s.id
                );
            }
            match (&s.bytes, &s.sha256) {
                (None, None) => {}
                (Some(_), Some(h)) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
                }
                (Some(_), Some(_)) => bail!(
                    "`streams[{i}].sha256` of stream `{}` is not a sha256 hex digest",
                    s.id
                ),
                _ => bail!(
                    "`streams[{i}]` of stream `{}` pins only one of `bytes` and `sha256`",
                    s.id
                ),
            }
        }
        for (name, list) in [("quick", &self.modes.quick), ("full", &self.modes.full)] {
            if list.is_empty() {
                bail!("`modes.{name}` is empty");
            }
            let mut seen = HashSet::new();
            for id in list {
                if !ids.contains(id.as_str()) {
                    bail!("`modes.{name}` names `{id}`, which is not a stream");
                }
                if !seen.insert(id) {
                    bail!("`modes.{name}` names `{id}` twice");
                }
            }
        }
        Ok(())
    }

    /// A mode's stream list, in its order.
    pub fn mode(&self, quick: bool) -> &[String] {
        if quick {
            &self.modes.quick
        } else {
            &self.modes.full
        }
    }

    pub fn stream(&self, id: &str) -> Option<&StreamEntry> {
        self.streams.iter().find(|s| s.id == id)
    }
}
