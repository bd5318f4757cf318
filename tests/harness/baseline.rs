//! Baselines: one insta snapshot per trial, compared with a tolerance.
//!
//! A baseline lives at `baselines/<artifact>/<device-class>/<kv>/<stream>.snap`. Its body is
//! a small JSON document (rendered here, never typed in) with the trial's identity, the
//! protocol, exact token counts and the NLL figures. Comparison goes through insta's own
//! machinery with a [`TolerantComparator`]: identity, protocol and token counts must match
//! exactly, the mean NLL within the tolerance. Below the stream totals the body keeps every
//! window's scored tokens and NLL sum (two one-line arrays, so a diff of the totals stays
//! readable), which lets a trial pair its windows with the baseline's. So `cargo insta review` / `cargo insta accept`
//! handle the pending `.snap.new` files a failing trial leaves, and `CI=true` /
//! `INSTA_UPDATE=no` write nothing.

use ninfer_perplexity::gate::{self, GateSpec};
use ninfer_perplexity::registry::Tolerance;
use ninfer_perplexity::score::paired::WindowPair;
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Version of the baseline body; bump it when the body's meaning changes (2: per-window
/// sums).
pub const SCHEMA: u64 = 2;

/// What one trial measured (and what a baseline holds).
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub artifact: String,
    pub device_class: String,
    pub kv_dtype: String,
    pub stream: String,
    pub context: usize,
    pub stride: usize,
    /// The token prefix scored; `None` scores the whole stream.
    pub max_tokens: Option<usize>,
    pub corpus: String,
    pub stream_sha256: String,
    pub tokenizer_sha256: String,
    pub stream_tokens: usize,
    pub input_tokens: usize,
    pub scored_tokens: u64,
    pub mean_nll: f64,
    pub ppl: f64,
    pub nll_sum: f64,
    /// Every window's scored tokens and NLL sum, in window order.
    pub window_scored: Vec<u64>,
    pub window_nll_sums: Vec<f64>,
}

#[derive(Serialize)]
struct Body<'a> {
    schema: u64,
    artifact: &'a str,
    device_class: &'a str,
    kv_dtype: &'a str,
    stream: &'a str,
    protocol: BodyProtocol,
    identity: BodyIdentity<'a>,
    tokens: BodyTokens,
    nll: BodyNll,
}

#[derive(Serialize)]
struct BodyProtocol {
    context: usize,
    stride: usize,
    max_tokens: Option<usize>,
}

#[derive(Serialize)]
struct BodyIdentity<'a> {
    corpus: &'a str,
    stream_sha256: &'a str,
    tokenizer_sha256: &'a str,
}

#[derive(Serialize)]
struct BodyTokens {
    stream: usize,
    input: usize,
    scored: u64,
}

#[derive(Serialize)]
struct BodyNll {
    mean_nll: f64,
    ppl: f64,
    nll_sum: f64,
}

impl Record {
    /// The snapshot body: pretty JSON, fields in a fixed order, floats written so that they
    /// read back to the same bits.
    pub fn render(&self) -> String {
        let b = Body {
            schema: SCHEMA,
            artifact: &self.artifact,
            device_class: &self.device_class,
            kv_dtype: &self.kv_dtype,
            stream: &self.stream,
            protocol: BodyProtocol {
                context: self.context,
                stride: self.stride,
                max_tokens: self.max_tokens,
            },
            identity: BodyIdentity {
                corpus: &self.corpus,
                stream_sha256: &self.stream_sha256,
                tokenizer_sha256: &self.tokenizer_sha256,
            },
            tokens: BodyTokens {
                stream: self.stream_tokens,
                input: self.input_tokens,
                scored: self.scored_tokens,
            },
            nll: BodyNll {
                mean_nll: self.mean_nll,
                ppl: self.ppl,
                nll_sum: self.nll_sum,
            },
        };
        let top = serde_json::to_string_pretty(&b).expect("a baseline body always serializes");
        // The windows last, each array on one line.
        format!(
            "{},\n  \"windows\": {{\n    \"scored\": {},\n    \"nll_sum\": {}\n  }}\n}}",
            top.strip_suffix("\n}").expect("a pretty JSON object"),
            one_line(&self.window_scored),
            one_line(&self.window_nll_sums)
        )
    }

    /// Parses a body; an error names the field (`tokens.scored`).
    pub fn parse(body: &str) -> Result<Record, String> {
        let v: Value =
            serde_json::from_str(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        if !v.is_object() {
            return Err("the body must be a JSON object".into());
        }
        let schema = uint(&v, "schema")?;
        if schema != SCHEMA {
            return Err(format!(
                "field `schema`: version {schema} is not supported (this harness writes {SCHEMA})"
            ));
        }
        let max_tokens = match field(&v, "protocol.max_tokens")? {
            Value::Null => None,
            x => Some(
                x.as_u64()
                    .ok_or_else(|| bad("protocol.max_tokens", "a whole number or null", x))?
                    as usize,
            ),
        };
        Ok(Record {
            artifact: string(&v, "artifact")?,
            device_class: string(&v, "device_class")?,
            kv_dtype: string(&v, "kv_dtype")?,
            stream: string(&v, "stream")?,
            context: uint(&v, "protocol.context")? as usize,
            stride: uint(&v, "protocol.stride")? as usize,
            max_tokens,
            corpus: string(&v, "identity.corpus")?,
            stream_sha256: string(&v, "identity.stream_sha256")?,
            tokenizer_sha256: string(&v, "identity.tokenizer_sha256")?,
            stream_tokens: uint(&v, "tokens.stream")? as usize,
            input_tokens: uint(&v, "tokens.input")? as usize,
            scored_tokens: uint(&v, "tokens.scored")?,
            mean_nll: number(&v, "nll.mean_nll")?,
            ppl: number(&v, "nll.ppl")?,
            nll_sum: number(&v, "nll.nll_sum")?,
            window_scored: array(&v, "windows.scored", |x| x.as_u64())?,
            window_nll_sums: array(&v, "windows.nll_sum", |x| {
                x.as_f64().filter(|f| f.is_finite())
            })?,
        })
        .and_then(|r| {
            if r.window_scored.len() != r.window_nll_sums.len() {
                return Err(format!(
                    "field `windows`: {} scored counts for {} NLL sums",
                    r.window_scored.len(),
                    r.window_nll_sums.len()
                ));
            }
            if r.window_scored.iter().sum::<u64>() != r.scored_tokens {
                return Err("field `windows.scored`: does not add up to `tokens.scored`".into());
            }
            let sum: f64 = r.window_nll_sums.iter().sum();
            if (sum - r.nll_sum).abs() > 1e-9 * r.nll_sum.abs().max(1.0) {
                return Err(format!(
                    "field `windows.nll_sum`: adds up to {sum}, not `nll.nll_sum` {}",
                    r.nll_sum
                ));
            }
            Ok(r)
        })
    }

    /// The trial's name as the harness lists it.
    pub fn subject(&self) -> String {
        format!(
            "{}/{}/{} on {}",
            self.artifact, self.stream, self.kv_dtype, self.device_class
        )
    }
}

fn field<'a>(v: &'a Value, path: &str) -> Result<&'a Value, String> {
    let mut cur = v;
    for part in path.split('.') {
        cur = cur
            .get(part)
            .ok_or_else(|| format!("missing field `{path}`"))?;
    }
    Ok(cur)
}

fn bad(path: &str, expected: &str, found: &Value) -> String {
    format!("field `{path}`: expected {expected}, found `{found}`")
}

fn string(v: &Value, path: &str) -> Result<String, String> {
    let x = field(v, path)?;
    x.as_str()
        .map(str::to_string)
        .ok_or_else(|| bad(path, "a string", x))
}

fn uint(v: &Value, path: &str) -> Result<u64, String> {
    let x = field(v, path)?;
    x.as_u64().ok_or_else(|| bad(path, "a whole number", x))
}

/// An array whose every element `f` accepts.
fn array<T>(v: &Value, path: &str, f: impl Fn(&Value) -> Option<T>) -> Result<Vec<T>, String> {
    let x = field(v, path)?;
    let a = x.as_array().ok_or_else(|| bad(path, "an array", x))?;
    a.iter()
        .enumerate()
        .map(|(i, e)| f(e).ok_or_else(|| format!("field `{path}`: element {i} is `{e}`")))
        .collect()
}

/// One-line JSON of a value (the window arrays); floats read back to the same bits.
fn one_line<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("a baseline body always serializes")
}

fn number(v: &Value, path: &str) -> Result<f64, String> {
    let x = field(v, path)?;
    match x.as_f64() {
        Some(f) if f.is_finite() => Ok(f),
        _ => Err(bad(path, "a finite number", x)),
    }
}

/// The outcome of comparing a new record with its baseline.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Within tolerance (`delta` is new - old mean NLL).
    Pass { delta: f64, allowed: f64 },
    /// The baseline is for another trial (artifact, stream, KV format or device class).
    WrongSubject(Vec<String>),
    /// The scoring protocol or prefix changed: the numbers measure something else.
    ProtocolChanged(Vec<String>),
    /// Token counts (or the tokenizer / stream identity) differ: the tokenizer or the corpus
    /// changed, so NLL values are not comparable.
    TokensChanged(Vec<String>),
    /// Mean NLL outside the tolerance.
    Drift { delta: f64, allowed: f64 },
    /// Judged by the paired gate over the windows (`delta`: paired ΔNLL; `threshold`: the
    /// gate's threshold on |ΔNLL|); `message` says it in words.
    Gated {
        passed: bool,
        delta: f64,
        threshold: f64,
        message: String,
    },
}

impl Verdict {
    pub fn passed(&self) -> bool {
        matches!(
            self,
            Verdict::Pass { .. } | Verdict::Gated { passed: true, .. }
        )
    }
}

/// How a trial is judged against its baseline: a tolerance on the mean (exact tiers, and
/// what has no gate yet), or the paired gate over its windows ([`gate`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    Tolerance(Tolerance),
    Gate(GateSpec),
}

impl Rule {
    pub fn text(&self) -> String {
        match self {
            Rule::Tolerance(t) => tolerance_text(*t),
            Rule::Gate(g) => format!(
                "paired gate: drift of θ = {:e} nats/token caught with power {} at false-alarm rate {:.3e} per trial (the registry's α shared by the run's gated trials)",
                g.theta,
                1.0 - g.beta,
                g.alpha
            ),
        }
    }
}

/// Compares `new` with the baseline `old` under `rule`.
pub fn judge(old: &Record, new: &Record, rule: Rule) -> Verdict {
    let spec = match rule {
        Rule::Tolerance(t) => return compare(old, new, t),
        Rule::Gate(g) => g,
    };
    if let Some(v) = incomparable(old, new) {
        return v;
    }
    let pairs: Vec<WindowPair> = old
        .window_scored
        .iter()
        .zip(&old.window_nll_sums)
        .zip(&new.window_nll_sums)
        .map(|((&scored, &base), &new)| WindowPair { scored, base, new })
        .collect();
    match gate::decide(&pairs, spec) {
        Ok(d) => Verdict::Gated {
            passed: d.passed(),
            delta: d.paired.delta_nll,
            threshold: d.threshold,
            message: d.message(),
        },
        Err(e) => Verdict::Gated {
            passed: false,
            delta: f64::NAN,
            threshold: f64::NAN,
            message: format!("the paired gate cannot judge these windows: {e:#}"),
        },
    }
}

fn diffs(pairs: &[(&str, String, String)]) -> Vec<String> {
    pairs
        .iter()
        .filter(|(_, a, b)| a != b)
        .map(|(n, a, b)| format!("{n}: {a} -> {b}"))
        .collect()
}

/// Compares `new` with the baseline `old` by the tolerance on the mean NLL.
pub fn compare(old: &Record, new: &Record, tol: Tolerance) -> Verdict {
    if let Some(v) = incomparable(old, new) {
        return v;
    }
    let delta = new.mean_nll - old.mean_nll;
    let allowed = tol.allowed(old.mean_nll);
    // The sum must agree too (a hand-edited baseline could make the two disagree).
    let sum_allowed = allowed * old.scored_tokens.max(1) as f64;
    if delta.abs() <= allowed && (new.nll_sum - old.nll_sum).abs() <= sum_allowed {
        Verdict::Pass { delta, allowed }
    } else {
        Verdict::Drift { delta, allowed }
    }
}

/// Why `new` cannot be compared with `old` at all (another trial, protocol, tokens or
/// windows), if it cannot.
fn incomparable(old: &Record, new: &Record) -> Option<Verdict> {
    let subject = diffs(&[
        ("artifact", old.artifact.clone(), new.artifact.clone()),
        ("stream", old.stream.clone(), new.stream.clone()),
        ("kv_dtype", old.kv_dtype.clone(), new.kv_dtype.clone()),
        (
            "device_class",
            old.device_class.clone(),
            new.device_class.clone(),
        ),
    ]);
    if !subject.is_empty() {
        return Some(Verdict::WrongSubject(subject));
    }
    let opt = |m: Option<usize>| m.map_or("whole stream".to_string(), |m| m.to_string());
    let protocol = diffs(&[
        ("context", old.context.to_string(), new.context.to_string()),
        ("stride", old.stride.to_string(), new.stride.to_string()),
        ("max_tokens", opt(old.max_tokens), opt(new.max_tokens)),
    ]);
    if !protocol.is_empty() {
        return Some(Verdict::ProtocolChanged(protocol));
    }
    let tokens = diffs(&[
        (
            "stream tokens",
            old.stream_tokens.to_string(),
            new.stream_tokens.to_string(),
        ),
        (
            "input tokens",
            old.input_tokens.to_string(),
            new.input_tokens.to_string(),
        ),
        (
            "scored tokens",
            old.scored_tokens.to_string(),
            new.scored_tokens.to_string(),
        ),
        ("corpus", old.corpus.clone(), new.corpus.clone()),
        (
            "stream sha256",
            old.stream_sha256.clone(),
            new.stream_sha256.clone(),
        ),
        (
            "tokenizer sha256",
            old.tokenizer_sha256.clone(),
            new.tokenizer_sha256.clone(),
        ),
    ]);
    if !tokens.is_empty() {
        return Some(Verdict::TokensChanged(tokens));
    }
    if old.window_scored != new.window_scored {
        let at = old
            .window_scored
            .iter()
            .zip(&new.window_scored)
            .position(|(a, b)| a != b)
            .map_or(String::new(), |i| {
                format!(", first difference at window {i}")
            });
        return Some(Verdict::TokensChanged(vec![format!(
            "windows: {} -> {}{at}",
            old.window_scored.len(),
            new.window_scored.len()
        )]));
    }
    None
}

/// Tells insta when two baseline bodies agree: by [`judge`] under the trial's rule, not text.
pub struct TolerantComparator {
    pub rule: Rule,
}

fn body_of(s: &insta::Snapshot) -> Option<String> {
    s.contents().as_text().map(|t| t.to_string())
}

impl insta::Comparator for TolerantComparator {
    fn matches(&self, reference: &insta::Snapshot, test: &insta::Snapshot) -> bool {
        let (Some(old), Some(new)) = (body_of(reference), body_of(test)) else {
            return false;
        };
        match (Record::parse(&old), Record::parse(&new)) {
            (Ok(old), Ok(new)) => judge(&old, &new, self.rule).passed(),
            _ => false,
        }
    }

    fn dyn_clone(&self) -> Box<dyn insta::Comparator> {
        Box::new(TolerantComparator { rule: self.rule })
    }
}

/// Where a trial's baseline lives.
pub struct Location {
    /// `baselines/<artifact>/<device-class>/<kv>`
    pub dir: PathBuf,
    /// The stream id: the snapshot's name and file stem.
    pub name: String,
}

impl Location {
    pub fn new(root: &Path, r: &Record) -> Location {
        Location {
            dir: root
                .join("baselines")
                .join(&r.artifact)
                .join(&r.device_class)
                .join(&r.kv_dtype),
            name: r.stream.clone(),
        }
    }
    pub fn snap(&self) -> PathBuf {
        self.dir.join(format!("{}.snap", self.name))
    }
    pub fn pending(&self) -> PathBuf {
        self.dir.join(format!("{}.snap.new", self.name))
    }
}

/// The committed baseline: `Ok(None)` when there is none; an error names the file and field.
pub fn load(loc: &Location, root: &Path) -> Result<Option<Record>, String> {
    let path = loc.snap();
    if !path.exists() {
        return Ok(None);
    }
    let shown = path
        .strip_prefix(root)
        .unwrap_or(&path)
        .display()
        .to_string();
    let snap = insta::Snapshot::from_file(&path)
        .map_err(|e| format!("{shown}: not a readable insta snapshot: {e}"))?;
    let body = body_of(&snap)
        .ok_or_else(|| format!("{shown}: a binary snapshot, expected a text baseline"))?;
    Record::parse(&body)
        .map(Some)
        .map_err(|e| format!("{shown}: {e}"))
}

/// Runs insta's file-snapshot assertion for `new` with the tolerant comparator. Returns
/// whether insta accepted it; when not, insta has written the pending `.snap.new` (unless
/// `CI=true` or `INSTA_UPDATE=no`) and printed its diff.
pub fn assert_with_insta(
    loc: &Location,
    new: &Record,
    rule: Rule,
    description: String,
    input_file: Option<&Path>,
) -> bool {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(&loc.dir);
    settings.set_prepend_module_to_snapshot(false);
    settings.set_omit_expression(true);
    settings.set_description(description);
    if let Some(p) = input_file {
        settings.set_input_file(p);
    }
    settings.set_comparator(Box::new(TolerantComparator { rule }));
    let body = new.render();
    let name = loc.name.as_str();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        settings.bind(|| insta::assert_snapshot!(name, body));
    }))
    .is_ok()
}

/// A perplexity, fixed-point while it is readable.
fn ppl_text(p: f64) -> String {
    if p < 1e6 {
        format!("{p:.6}")
    } else {
        format!("{p:.6e}")
    }
}

/// `x` with its sign, short.
fn signed(x: f64) -> String {
    format!("{x:+.3e}")
}

/// A tolerance in words: `|delta mean NLL| <= 0 + 1e-9 x |baseline|`.
pub fn tolerance_text(t: Tolerance) -> String {
    let n = |x: f64| {
        if x == 0.0 {
            "0".to_string()
        } else {
            format!("{x:e}")
        }
    };
    format!(
        "|delta mean NLL| <= {} + {} x |baseline mean NLL|",
        n(t.abs),
        n(t.rel)
    )
}

/// The failure message for a trial whose result does not match its baseline.
pub fn failure_message(
    old: Option<&Record>,
    new: &Record,
    verdict: Option<&Verdict>,
    rule: Rule,
) -> String {
    let now = format!(
        "mean_nll {:.9}  ppl {}  ({} scored tokens)",
        new.mean_nll,
        ppl_text(new.ppl),
        new.scored_tokens
    );
    let tol_text = rule.text();
    let (Some(old), Some(verdict)) = (old, verdict) else {
        return format!("no baseline yet for {}\n  new:      {now}", new.subject());
    };
    let was = format!(
        "mean_nll {:.9}  ppl {}  ({} scored tokens)",
        old.mean_nll,
        ppl_text(old.ppl),
        old.scored_tokens
    );
    match verdict {
        Verdict::Pass { .. } => format!("within tolerance, but insta did not accept it\n  baseline: {was}\n  new:      {now}"),
        Verdict::WrongSubject(d) => format!(
            "the baseline file holds another trial ({}); it was moved or edited by hand",
            d.join("; ")
        ),
        Verdict::ProtocolChanged(d) => format!(
            "the scoring protocol changed since the baseline ({}): the numbers measure something else, so no NLL delta is shown",
            d.join("; ")
        ),
        Verdict::TokensChanged(d) => format!(
            "token counts differ from the baseline: the tokenizer or the corpus changed ({}), so the NLL values are not comparable and no NLL delta is shown",
            d.join("; ")
        ),
        Verdict::Gated { message, .. } => format!(
            "the paired gate failed the trial\n  baseline: {was}\n  new:      {now}\n  {message}"
        ),
        Verdict::Drift { delta, allowed } => {
            let ratio = new.ppl / old.ppl;
            let ppl_change = if (0.5..=2.0).contains(&ratio) {
                format!("{:+.4}%", (ratio - 1.0) * 100.0)
            } else {
                format!("x{ratio:.3e}")
            };
            format!(
                "mean NLL drifted beyond the tolerance\n  baseline: {was}\n  new:      {now}\n  delta:    {} nats/token (ppl {}), allowed {:.3e} ({tol_text}): {:.1}x the tolerance",
                signed(*delta),
                ppl_change,
                allowed,
                if *allowed > 0.0 { delta.abs() / allowed } else { f64::INFINITY }
            )
        }
    }
}
