//! Registered artifacts: `eval/registry.json` names the artifacts under test, so the CLI
//! and the harness can refer to them by name.

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Default registry location, relative to the repository root (the working directory).
pub const DEFAULT_REGISTRY: &str = "eval/registry.json";

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub name: String,
    /// Path of the .ninfer file, relative to the repository root.
    pub path: String,
    /// The digest the file must have (`sha256:...`), when pinned.
    #[serde(default)]
    pub digest: Option<String>,
    /// How to produce the file (a command).
    pub produce: String,
    /// Test tiers that use it: "cpu", "gpu".
    #[serde(default)]
    pub tiers: Vec<String>,
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    pub schema_version: u32,
    pub artifacts: Vec<Entry>,
}

impl Registry {
    pub fn load(path: &Path) -> Result<Registry> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read registry: {e}", path.display()))?;
        let r: Registry = serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid registry: {e}", path.display()))?;
        if r.schema_version != 1 {
            bail!("{}: `schema_version` {} is not supported (expected 1)", path.display(), r.schema_version);
        }
        let mut seen = std::collections::HashSet::new();
        for (i, e) in r.artifacts.iter().enumerate() {
            if !seen.insert(e.name.as_str()) {
                bail!("{}: `artifacts[{i}].name`: `{}` appears twice", path.display(), e.name);
            }
        }
        Ok(r)
    }

    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.artifacts.iter().find(|e| e.name == name)
    }
}

fn registry_path() -> PathBuf {
    std::env::var_os("NINFER_REGISTRY").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(DEFAULT_REGISTRY))
}

/// A path that exists, or a registered name whose file exists.
pub fn resolve_artifact(arg: &str) -> Result<PathBuf> {
    let p = PathBuf::from(arg);
    if p.exists() {
        return Ok(p);
    }
    let reg_path = registry_path();
    if reg_path.exists() {
        let reg = Registry::load(&reg_path)?;
        if let Some(e) = reg.get(arg) {
            let file = PathBuf::from(&e.path);
            if !file.exists() {
                bail!("{arg}: registered artifact file {} is missing; produce it with `{}`", e.path, e.produce);
            }
            return Ok(file);
        }
        let names: Vec<&str> = reg.artifacts.iter().map(|e| e.name.as_str()).collect();
        bail!(
            "{arg}: no such artifact file, and not a name registered in {} (registered: {})",
            reg_path.display(),
            names.join(", ")
        );
    }
    bail!("{arg}: no such artifact file")
}
