//! Reading two `report.json` files and refusing pairs whose numbers do not line up.
//!
//! A paired comparison is only meaningful when both runs scored the same targets with the
//! same tokenizer under the same protocol, window for window. Everything else (the artifact's
//! weights, the KV format, the device, the precision, the thread count) may differ: that is
//! what a comparison is for.

use crate::report::{Report, SCHEMA, SCHEMA_VERSION};
use anyhow::{anyhow, bail, Result};
use std::path::{Path, PathBuf};

/// Reports hold a few numbers per window; a real one is well under a megabyte per million
/// tokens scored. Anything this large is not a report.
const MAX_REPORT_BYTES: u64 = 256 << 20;

/// A report and the file it came from.
pub struct Loaded {
    pub path: PathBuf,
    pub report: Report,
}

/// Reads `arg`: a `report.json` or a run directory holding one.
pub fn load(arg: &Path) -> Result<Loaded> {
    // A run directory means its report.json; whatever is at the path is opened the one
    // way every input is (regular files only, the read bounded).
    let path = if arg.is_dir() {
        let p = arg.join("report.json");
        if std::fs::symlink_metadata(&p).is_err() {
            bail!("{}: a directory without a report.json", arg.display());
        }
        p
    } else {
        arg.to_path_buf()
    };
    let shown = path.display();
    let text = crate::input::read_text_bounded(&path, "the report", MAX_REPORT_BYTES)
        .map_err(|e| anyhow!("{shown}: {e}"))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{shown}: not JSON: {e}"))?;
    match value.get("schema").and_then(|s| s.as_str()) {
        Some(SCHEMA) => {}
        Some(other) => bail!("{shown}: schema `{other}`, not a {SCHEMA} file"),
        None => bail!("{shown}: not a ninfer-perplexity report (no `schema` field)"),
    }
    match value.get("schema_version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(SCHEMA_VERSION) => {}
        Some(v) => {
            bail!("{shown}: report schema version {v}; this build reads version {SCHEMA_VERSION}")
        }
        None => bail!("{shown}: no numeric `schema_version`"),
    }
    let report: Report = serde_json::from_value(value)
        .map_err(|e| anyhow!("{shown}: not a valid version-{SCHEMA_VERSION} report: {e}"))?;
    check_numbers(&report).map_err(|e| anyhow!("{shown}: {e}"))?;
    Ok(Loaded { path, report })
}

/// The numbers `compare` and `merge` compute with, checked as a whole: every window within
/// its stream and scoring the targets its bounds say, every sum finite and every count added
/// without overflow, so that nothing derived from them can be infinite, NaN or wrapped.
pub fn check_numbers(r: &Report) -> Result<()> {
    for s in &r.streams {
        let at = |j: usize| format!("stream `{}` window {j}", s.id);
        let (mut scored, mut nll, mut sq) = (0u64, 0f64, 0f64);
        for (j, w) in s.windows.iter().enumerate() {
            if !(w.begin <= w.first_target && w.first_target <= w.end && w.end <= s.input_tokens) {
                bail!(
                    "{}: bounds {}..{} (first target {}) do not fit the stream's {} tokens",
                    at(j),
                    w.begin,
                    w.end,
                    w.first_target,
                    s.input_tokens
                );
            }
            if w.scored != (w.end - w.first_target) as u64 {
                bail!(
                    "{}: `scored` is {}, its bounds hold {} targets",
                    at(j),
                    w.scored,
                    w.end - w.first_target
                );
            }
            if !(w.nll_sum.is_finite() && w.nll_sq_sum.is_finite()) {
                bail!("{}: `nll_sum` or `nll_sq_sum` is not finite", at(j));
            }
            scored = scored
                .checked_add(w.scored)
                .ok_or_else(|| anyhow!("{}: the scored tokens overflow", at(j)))?;
            nll += w.nll_sum;
            sq += w.nll_sq_sum;
            if !(nll.is_finite() && sq.is_finite()) {
                bail!(
                    "{}: the stream's NLL sums overflow (a window's `nll_sum` of {:e})",
                    at(j),
                    w.nll_sum
                );
            }
        }
        if !s.windows.is_empty() && scored != s.totals.scored {
            bail!(
                "stream `{}`: its windows score {scored} tokens, its totals say {}",
                s.id,
                s.totals.scored
            );
        }
        if let Some(routing) = &s.routing {
            let sum = routing
                .tokens_per_expert
                .iter()
                .try_fold(0u64, |a, &b| a.checked_add(b))
                .ok_or_else(|| anyhow!("stream `{}`: the routing counts overflow", s.id))?;
            // Every routed row is one processed token in one sparse layer, sent to top-k
            // experts: more assignments than that were never made.
            let moe = r.artifact.config.moe.as_ref().ok_or_else(|| {
                anyhow!(
                    "stream `{}`: routing counts for a model without experts",
                    s.id
                )
            })?;
            if routing.tokens_per_expert.len() != moe.num_experts {
                bail!(
                    "stream `{}`: routing counts for {} experts, the model has {}",
                    s.id,
                    routing.tokens_per_expert.len(),
                    moe.num_experts
                );
            }
            let sparse = moe.sparse_layers.iter().filter(|&&x| x).count() as u128;
            let most = s.processed_tokens as u128 * sparse * moe.num_experts_per_tok as u128;
            if sum as u128 > most || routing.assignments != sum {
                bail!(
                    "stream `{}`: {} routing assignments (`assignments` {}) for {} processed tokens, {sparse} sparse layers and top-{}: at most {most}",
                    s.id,
                    sum,
                    routing.assignments,
                    s.processed_tokens,
                    moe.num_experts_per_tok
                );
            }
        }
    }
    Ok(())
}

/// Refuses `base` and `new` unless they scored the same windows of the same token streams.
pub fn check_comparable(base: &Loaded, new: &Loaded) -> Result<()> {
    let (a, b) = (&base.report, &new.report);
    let refuse = |what: String| -> Result<()> {
        bail!(
            "{} and {} are not comparable: {what}",
            base.path.display(),
            new.path.display()
        )
    };
    if a.tokenizer.sha256 != b.tokenizer.sha256 {
        return refuse(format!(
            "different tokenizers (sha256 {} vs {})",
            a.tokenizer.sha256, b.tokenizer.sha256
        ));
    }
    let (sa, sb) = (&a.settings, &b.settings);
    if sa.mode != sb.mode {
        return refuse(format!("a {} run and a {} run", sa.mode, sb.mode));
    }
    match (&a.corpus, &b.corpus) {
        (Some(x), Some(y)) if x.manifest_sha256 != y.manifest_sha256 => {
            return refuse(format!(
                "different corpora ({} manifest sha256 {} vs {} {})",
                x.name,
                x.manifest_sha256.as_deref().unwrap_or("none"),
                y.name,
                y.manifest_sha256.as_deref().unwrap_or("none")
            ))
        }
        _ => {}
    }
    if (sa.context, sa.stride) != (sb.context, sb.stride) {
        return refuse(format!(
            "different protocols (context {} stride {} vs context {} stride {})",
            sa.context, sa.stride, sb.context, sb.stride
        ));
    }
    if sa.window_plan != sb.window_plan {
        return refuse(format!(
            "different window plans ({} vs {})",
            sa.window_plan.name(),
            sb.window_plan.name()
        ));
    }
    if sa.max_tokens != sb.max_tokens {
        let show = |m: Option<usize>| m.map_or("none".to_string(), |n| n.to_string());
        return refuse(format!(
            "different --max-tokens ({} vs {})",
            show(sa.max_tokens),
            show(sb.max_tokens)
        ));
    }
    let ids = |r: &Report| r.streams.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
    // A `--text` stream is named after its file: a copy under another name is the same text.
    let text = sa.mode == "text" && a.streams.len() == b.streams.len();
    if !text && ids(a) != ids(b) {
        return refuse(format!(
            "different streams ({} vs {})",
            ids(a).join(","),
            ids(b).join(",")
        ));
    }
    for (x, y) in a.streams.iter().zip(&b.streams) {
        if x.sha256 != y.sha256 {
            return refuse(format!(
                "stream {} has different contents (sha256 {} vs {})",
                x.id, x.sha256, y.sha256
            ));
        }
        if x.domain != y.domain {
            return refuse(format!(
                "stream {} is in domain {} vs {}",
                x.id, x.domain, y.domain
            ));
        }
        if (x.input_tokens, x.totals.scored, x.totals.bytes)
            != (y.input_tokens, y.totals.scored, y.totals.bytes)
        {
            return refuse(format!(
                "stream {}: different token counts ({} input / {} scored vs {} / {})",
                x.id, x.input_tokens, x.totals.scored, y.input_tokens, y.totals.scored
            ));
        }
        let bounds = |w: &crate::score::WindowScore| (w.begin, w.first_target, w.end, w.scored);
        if x.windows.len() != y.windows.len()
            || x.windows
                .iter()
                .map(bounds)
                .ne(y.windows.iter().map(bounds))
        {
            return refuse(format!("stream {}: different windows", x.id));
        }
    }
    Ok(())
}
