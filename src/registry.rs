//! Registered artifacts: `eval/registry.json` names the artifacts under test, so the CLI
//! and the harness can refer to them by name.

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
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
    /// Test tiers that use it: "cpu", "gpu", "emu" (the CUDA model on the emulated device).
    #[serde(default)]
    pub tiers: Vec<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// The regression harness's tolerance per device class (`cpu`, `cuda`, or a full class
    /// such as `cuda-sm90`), optionally for one KV format (`cuda/nvfp4`); what is not listed
    /// uses the harness defaults (docs/harness.md).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tolerance: BTreeMap<String, Tolerance>,
    /// The paired drift gate per device class and KV format (keys as for `tolerance`): for
    /// trials it covers it replaces the tolerance (docs/harness.md, [`crate::gate`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gate: BTreeMap<String, GateEntry>,
    /// The Main KV formats the harness runs this artifact with; empty: every format.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_dtypes: Vec<String>,
}

impl Entry {
    /// Whether the harness runs this artifact with KV format `kv` (its name).
    pub fn runs_kv(&self, kv: &str) -> bool {
        self.kv_dtypes.is_empty() || self.kv_dtypes.iter().any(|k| k == kv)
    }
}

/// A registered paired gate: θ, α, β and the measured run-to-run spread θ was derived from
/// (a θ without its measurement is refused: numbers are measured, never typed in).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateEntry {
    pub theta: f64,
    pub alpha: f64,
    pub beta: f64,
    #[serde(default)]
    pub spread: Option<Spread>,
}

/// Run-to-run spread measured by the harness's `--measure-spread N`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spread {
    /// Repeated runs (each paired with the first).
    pub runs: usize,
    /// Windows per trial (the fewest over the streams measured).
    pub windows: usize,
    /// The largest paired standard error of ΔNLL seen, nats per token.
    pub max_std_err: f64,
    /// θ = margin · (t_α + t_β) · max_std_err.
    pub margin: f64,
}

impl GateEntry {
    pub fn spec(&self) -> crate::gate::GateSpec {
        crate::gate::GateSpec {
            theta: self.theta,
            alpha: self.alpha,
            beta: self.beta,
        }
    }

    /// θ, α, β valid, the spread there, and θ detectable at α and β with that spread.
    fn check(&self) -> Result<()> {
        self.spec().validate()?;
        let Some(sp) = &self.spread else {
            bail!("θ without the measured `spread` it was derived from (measure it: cargo test --release --test harness -- --measure-spread 5)");
        };
        if sp.runs < 2 || sp.windows < 2 || !(sp.max_std_err.is_finite() && sp.max_std_err >= 0.0) {
            bail!(
                "`spread` needs at least 2 runs of at least 2 windows and a finite standard error"
            );
        }
        let (ta, tb) = crate::gate::multipliers(&self.spec(), sp.windows);
        let floor = (ta + tb) * sp.max_std_err;
        if self.theta < floor {
            bail!(
                "θ {} is below the {floor:.3e} nats/token the measured spread can detect at α and β",
                self.theta
            );
        }
        Ok(())
    }
}

/// The test tiers an artifact can belong to.
pub const TIERS: [&str; 3] = ["cpu", "gpu", "emu"];

/// How far a re-run's mean NLL (nats per token) may move from its baseline before the
/// regression harness calls it drift: `|new - old| <= abs + rel * |old|`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    #[serde(default)]
    pub abs: f64,
    #[serde(default)]
    pub rel: f64,
}

impl Tolerance {
    /// The largest allowed |delta| of the mean NLL for a baseline value `old`.
    pub fn allowed(&self, old: f64) -> f64 {
        self.abs + self.rel * old.abs()
    }
}

impl Entry {
    /// The gate the registry sets for a device class and KV format (the same key order as
    /// [`Entry::tolerance_for`]).
    pub fn gate_for(&self, class: &str, kv: &str) -> Option<&GateEntry> {
        lookup_keys(class, kv).iter().find_map(|k| self.gate.get(k))
    }

    /// The tolerance the registry sets for a device class and KV format, most specific key
    /// first: `<class>/<kv>`, `<family>/<kv>`, `<class>`, `<family>`, where the family is the
    /// part of the class before the first `-` or `:` (`cuda` for `cuda-sm90`).
    pub fn tolerance_for(&self, class: &str, kv: &str) -> Option<Tolerance> {
        lookup_keys(class, kv)
            .iter()
            .find_map(|k| self.tolerance.get(k).copied())
    }
}

impl Entry {
    /// Whether some `gate` entry could judge this artifact's trials with KV format `kv` on a
    /// device of `family` (`cpu`, `cuda`, `emu`): its key's device part is that family or
    /// one of its classes (`cuda-sm90`), its KV part absent or `kv`. The harness counts
    /// these trials as the family its gates share α over, before any device is probed.
    pub fn may_gate(&self, family: &str, kv: &str) -> bool {
        self.gate.keys().any(|k| {
            let (device, k_kv) = match k.split_once('/') {
                Some((d, x)) => (d, Some(x)),
                None => (k.as_str(), None),
            };
            let device_family = device.split(['-', ':']).next().unwrap_or(device);
            device_family == family && k_kv.is_none_or(|x| x == kv)
        })
    }
}

/// The registry keys for a device class and KV format, most specific first: `<class>/<kv>`,
/// `<family>/<kv>`, `<class>`, `<family>` (the family: the class up to the first `-` or `:`).
fn lookup_keys(class: &str, kv: &str) -> [String; 4] {
    let family = class.split(['-', ':']).next().unwrap_or(class);
    [
        format!("{class}/{kv}"),
        format!("{family}/{kv}"),
        class.to_string(),
        family.to_string(),
    ]
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    pub schema_version: u32,
    pub artifacts: Vec<Entry>,
}

impl Registry {
    pub fn load(path: &Path) -> Result<Registry> {
        let text = crate::input::read_text_bounded(path, "the registry", 16 << 20)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| anyhow!("{}: invalid registry: {e}", path.display()))?;
        check_shape(&value).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let r: Registry = serde_json::from_value(value)
            .map_err(|e| anyhow!("{}: invalid registry: {e}", path.display()))?;
        if r.schema_version != 1 {
            bail!(
                "{}: `schema_version` {} is not supported (expected 1)",
                path.display(),
                r.schema_version
            );
        }
        let mut seen = std::collections::HashSet::new();
        for (i, e) in r.artifacts.iter().enumerate() {
            for (key, g) in &e.gate {
                g.check().map_err(|err| {
                    anyhow!("{}: `artifacts[{i}].gate.{key}`: {err}", path.display())
                })?;
            }
            if !seen.insert(e.name.as_str()) {
                bail!(
                    "{}: `artifacts[{i}].name`: `{}` appears twice",
                    path.display(),
                    e.name
                );
            }
        }
        Ok(r)
    }

    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.artifacts.iter().find(|e| e.name == name)
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Checks the registry's JSON shape field by field, so that an error names the field
/// (`artifacts[1].tiers[0]`) rather than a line and column.
fn check_shape(v: &Value) -> Result<()> {
    let top = v
        .as_object()
        .ok_or_else(|| anyhow!("the registry must be a JSON object, found {}", kind(v)))?;
    for key in top.keys() {
        if key != "schema_version" && key != "artifacts" {
            bail!("unknown field `{key}` (fields: schema_version, artifacts)");
        }
    }
    match top.get("schema_version") {
        Some(Value::Number(n)) if n.as_u64().is_some() => {}
        Some(other) => bail!(
            "`schema_version`: expected a whole number, found {}",
            kind(other)
        ),
        None => bail!("missing field `schema_version`"),
    }
    let arts = match top.get("artifacts") {
        Some(Value::Array(a)) => a,
        Some(other) => bail!("`artifacts`: expected an array, found {}", kind(other)),
        None => bail!("missing field `artifacts`"),
    };
    const FIELDS: [&str; 9] = [
        "name",
        "path",
        "digest",
        "produce",
        "tiers",
        "description",
        "tolerance",
        "gate",
        "kv_dtypes",
    ];
    for (i, a) in arts.iter().enumerate() {
        let at = |f: &str| format!("`artifacts[{i}].{f}`");
        let obj = a
            .as_object()
            .ok_or_else(|| anyhow!("`artifacts[{i}]`: expected an object, found {}", kind(a)))?;
        for key in obj.keys() {
            if !FIELDS.contains(&key.as_str()) {
                bail!(
                    "`artifacts[{i}]`: unknown field `{key}` (fields: {})",
                    FIELDS.join(", ")
                );
            }
        }
        for f in ["name", "path", "produce"] {
            match obj.get(f) {
                Some(Value::String(s)) if !s.trim().is_empty() => {}
                Some(Value::String(_)) => bail!("{}: must not be empty", at(f)),
                Some(other) => bail!("{}: expected a string, found {}", at(f), kind(other)),
                None => bail!("`artifacts[{i}]`: missing field `{f}`"),
            }
        }
        for f in ["digest", "description"] {
            match obj.get(f) {
                None | Some(Value::Null) | Some(Value::String(_)) => {}
                Some(other) => bail!(
                    "{}: expected a string or null, found {}",
                    at(f),
                    kind(other)
                ),
            }
        }
        match obj.get("tiers") {
            None => {}
            Some(Value::Array(tiers)) => {
                for (j, t) in tiers.iter().enumerate() {
                    match t.as_str() {
                        Some(t) if TIERS.contains(&t) => {}
                        Some(t) => bail!(
                            "{}: unknown tier `{t}` (valid: {})",
                            at(&format!("tiers[{j}]")),
                            TIERS.join(", ")
                        ),
                        None => bail!(
                            "{}: expected a string, found {}",
                            at(&format!("tiers[{j}]")),
                            kind(t)
                        ),
                    }
                }
            }
            Some(other) => bail!(
                "{}: expected an array of tier names, found {}",
                at("tiers"),
                kind(other)
            ),
        }
        match obj.get("kv_dtypes") {
            None => {}
            Some(Value::Array(kvs)) => {
                for (j, k) in kvs.iter().enumerate() {
                    let kat = at(&format!("kv_dtypes[{j}]"));
                    let k = k.as_str().ok_or_else(|| {
                        anyhow!("{kat}: expected a KV format name, found {}", kind(k))
                    })?;
                    crate::kv::KvDtype::parse(k).map_err(|e| anyhow!("{kat}: {e}"))?;
                }
            }
            Some(other) => bail!(
                "{}: expected an array of KV format names, found {}",
                at("kv_dtypes"),
                kind(other)
            ),
        }
        match obj.get("tolerance") {
            None => {}
            Some(Value::Object(classes)) => {
                for (class, tol) in classes {
                    let tat = at(&format!("tolerance.{class}"));
                    let (device, kv) = match class.split_once('/') {
                        Some((d, k)) => (d, Some(k)),
                        None => (class.as_str(), None),
                    };
                    if device.is_empty() {
                        bail!("{tat}: expected a device class (`cpu`, `cuda`) or `<class>/<kv>` (`cuda/nvfp4`)");
                    }
                    if let Some(k) = kv {
                        crate::kv::KvDtype::parse(k).map_err(|e| anyhow!("{tat}: {e}"))?;
                    }
                    let tol = tol.as_object().ok_or_else(|| anyhow!("{tat}: expected an object like {{\"abs\": 0, \"rel\": 1e-9}}, found {}", kind(tol)))?;
                    for (k, x) in tol {
                        if k != "abs" && k != "rel" {
                            bail!("{tat}: unknown field `{k}` (fields: abs, rel)");
                        }
                        // 1 nat/token, or 100% of the value, passes any regression: that
                        // is a disabled check, not a tolerance (and a huge `rel` would make
                        // the allowed drift infinite).
                        match x.as_f64() {
                            Some(x) if x.is_finite() && (0.0..1.0).contains(&x) => {}
                            _ => bail!(
                                "{}: expected a number in [0, 1) (nats/token for abs, a fraction for rel), found {x}",
                                at(&format!("tolerance.{class}.{k}"))
                            ),
                        }
                    }
                }
            }
            Some(other) => bail!(
                "{}: expected an object keyed by device class, found {}",
                at("tolerance"),
                kind(other)
            ),
        }
    }
    Ok(())
}

fn registry_path() -> PathBuf {
    std::env::var_os("NINFER_REGISTRY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_REGISTRY))
}

/// An artifact named on the command line, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    pub path: PathBuf,
    /// For a registered name: the name and the digest the registry pins (a registered name
    /// must mean the registered bytes).
    pub registered: Option<(String, Option<String>)>,
}

impl Resolved {
    /// Refuses a registered artifact whose file records another digest than the registry's.
    pub fn check_digest(&self, recorded: &str) -> Result<()> {
        if let Some((name, Some(pinned))) = &self.registered {
            if pinned != recorded {
                bail!(
                    "{name}: {} records digest {recorded} but {} pins {pinned} for this name; re-produce the file or pass its path",
                    self.path.display(),
                    registry_path().display()
                );
            }
        }
        Ok(())
    }
}

/// A path that exists, or a registered name whose file exists.
pub fn resolve_artifact(arg: &str) -> Result<Resolved> {
    let p = PathBuf::from(arg);
    if p.exists() {
        return Ok(Resolved {
            path: p,
            registered: None,
        });
    }
    let reg_path = registry_path();
    if reg_path.exists() {
        let reg = Registry::load(&reg_path)?;
        if let Some(e) = reg.get(arg) {
            let file = PathBuf::from(&e.path);
            if !file.exists() {
                bail!(
                    "{arg}: registered artifact file {} is missing; produce it with `{}`",
                    e.path,
                    e.produce
                );
            }
            return Ok(Resolved {
                path: file,
                registered: Some((e.name.clone(), e.digest.clone())),
            });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_key_covers_its_device_family_and_kv_format() {
        let g = GateEntry {
            theta: 1.0,
            alpha: 0.05,
            beta: 0.1,
            spread: None,
        };
        let entry = |keys: &[&str]| Entry {
            name: "a".into(),
            path: "a.ninfer".into(),
            digest: None,
            produce: "make".into(),
            tiers: vec![],
            description: None,
            tolerance: BTreeMap::new(),
            gate: keys.iter().map(|k| (k.to_string(), g.clone())).collect(),
            kv_dtypes: vec![],
        };
        let e = entry(&["cuda-sm90/fp8", "cpu"]);
        assert!(e.may_gate("cuda", "fp8"));
        assert!(!e.may_gate("cuda", "nvfp4"));
        assert!(e.may_gate("cpu", "nvfp4"));
        assert!(!e.may_gate("emu", "fp8"));
        assert!(!entry(&[]).may_gate("cpu", "fp8"));
        assert!(entry(&["cuda:1"]).may_gate("cuda", "bf16"));
    }
}
