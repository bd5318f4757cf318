//! `ninfer-perplexity compare BASE NEW`: did the change make the model worse, by how much,
//! and how sure is that?
//!
//! Two runs of the same corpus and protocol score the same windows, so their difference is
//! measured window by window (`paired`), which removes the text's own difficulty from the
//! noise: the interval is for the change, not for the corpus. Rows per stream, domain and
//! overall; the domain and overall rows pool the windows of their streams.

pub mod load;

pub mod plot;
pub mod table;

use crate::score::paired::{paired, Paired, WindowPair};
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::Path;

pub const SCHEMA: &str = "ninfer-perplexity.compare";
pub const SCHEMA_VERSION: u32 = 1;

/// How the intervals are computed, in words (written into the JSON).
pub const METHOD: &str = "paired per-window NLL differences; ratio estimate sum(d)/sum(n), \
cluster-robust variance over windows, Student t with windows-1 degrees of freedom";

/// What one side of the comparison ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Side {
    pub report: String,
    pub run_id: String,
    pub artifact: String,
    pub artifact_digest: String,
    pub weight_format: String,
    pub kv_dtype: String,
    pub device: String,
    pub precision: String,
    /// Present when the run had a deliberate test perturbation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_fault: Option<String>,
}

/// One row: a stream, a domain or everything.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub id: String,
    pub title: String,
    pub streams: usize,
    pub bytes: u64,
    #[serde(flatten)]
    pub paired: Paired,
    /// (new − base) NLL / ln 2 / UTF-8 bytes.
    pub delta_bits_per_byte: f64,
}

/// The whole comparison (`--json` writes it).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    pub schema: String,
    pub schema_version: u32,
    pub method: String,
    pub base: Side,
    pub new: Side,
    pub context: usize,
    pub stride: usize,
    pub max_tokens: Option<usize>,
    pub tokenizer_sha256: String,
    pub corpus: Option<String>,
    pub streams: Vec<Row>,
    pub domains: Vec<Row>,
    pub overall: Row,
}

fn side(l: &load::Loaded) -> Side {
    let r = &l.report;
    Side {
        report: l.path.display().to_string(),
        run_id: r.run_id.clone(),
        artifact: r.artifact.path.clone(),
        artifact_digest: r.artifact.digest.clone(),
        weight_format: r.artifact.weight_format.clone(),
        kv_dtype: r.settings.kv_dtype.clone(),
        device: r.settings.device.clone(),
        precision: r.settings.precision.clone(),
        test_fault: r.settings.test_fault.clone(),
    }
}

/// The rows of the streams that satisfy `keep`, pooled.
fn row(
    base: &load::Loaded,
    new: &load::Loaded,
    id: &str,
    title: &str,
    keep: impl Fn(&crate::report::StreamReport) -> bool,
) -> Result<Row> {
    let mut pairs = vec![];
    let (mut streams, mut bytes) = (0, 0u64);
    for (a, b) in base.report.streams.iter().zip(&new.report.streams) {
        if !keep(a) {
            continue;
        }
        streams += 1;
        bytes += a.totals.bytes;
        pairs.extend(a.windows.iter().zip(&b.windows).map(|(x, y)| WindowPair {
            scored: x.scored,
            base: x.nll_sum,
            new: y.nll_sum,
        }));
    }
    let p = paired(&pairs).with_context(|| id.to_string())?;
    let d = p.new_nll_sum - p.base_nll_sum;
    Ok(Row {
        id: id.into(),
        title: title.into(),
        streams,
        bytes,
        delta_bits_per_byte: if bytes > 0 {
            d / std::f64::consts::LN_2 / bytes as f64
        } else {
            0.0
        },
        paired: p,
    })
}

/// Compares two loaded reports (refusing incomparable ones).
pub fn compare(base: &load::Loaded, new: &load::Loaded) -> Result<Comparison> {
    load::check_comparable(base, new)?;
    let r = &base.report;
    let streams = r
        .streams
        .iter()
        .map(|s| row(base, new, &s.id, &s.id, |x| x.id == s.id))
        .collect::<Result<Vec<_>>>()?;
    let domains = r
        .domains
        .iter()
        .map(|d| row(base, new, &d.id, &d.title, |x| x.domain == d.id))
        .collect::<Result<Vec<_>>>()?;
    let overall = row(base, new, &r.overall.id, &r.overall.title, |_| true)?;
    // Every number the table, the JSON and the gate use must be finite.
    for row in streams.iter().chain(&domains).chain([&overall]) {
        let p = &row.paired;
        let numbers = [
            p.base_mean_nll,
            p.new_mean_nll,
            p.delta_nll,
            p.ppl_ratio,
            row.delta_bits_per_byte,
        ]
        .into_iter()
        .chain(p.delta_nll_std_err)
        .chain(p.delta_nll_ci95.into_iter().flatten())
        .chain(p.ppl_ratio_ci95.into_iter().flatten());
        if numbers.clone().any(|x| !x.is_finite()) {
            anyhow::bail!(
                "{} vs {}: `{}`: the comparison is not finite (ΔNLL {}, PPL ratio {}); the reports' sums are out of any real run's range",
                base.path.display(),
                new.path.display(),
                row.id,
                p.delta_nll,
                p.ppl_ratio
            );
        }
    }
    Ok(Comparison {
        schema: SCHEMA.into(),
        schema_version: SCHEMA_VERSION,
        method: METHOD.into(),
        base: side(base),
        new: side(new),
        context: r.settings.context,
        stride: r.settings.stride,
        max_tokens: r.settings.max_tokens,
        tokenizer_sha256: r.tokenizer.sha256.clone(),
        corpus: r.corpus.as_ref().map(|c| c.name.clone()),
        streams,
        domains,
        overall,
    })
}

/// Writes `c` as JSON to `out` atomically: a temporary file beside it, renamed into place.
pub fn write_json(c: &Comparison, out: &Path) -> Result<()> {
    let mut text = serde_json::to_string_pretty(c)?;
    text.push('\n');
    crate::outfile::write_atomic(out, text.as_bytes())
}
