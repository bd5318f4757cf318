//! Machine-readable results for CI: with `NINFER_HARNESS_REPORT_DIR=DIR` every finished
//! trial appends one JSON line to `DIR/trials.jsonl`, and the run ends by writing
//! `DIR/summary.md`, a table of per-stream deltas against the baselines.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Numbers {
    pub mean_nll: f64,
    pub ppl: f64,
    pub nll_sum: f64,
    pub input_tokens: usize,
    pub scored_tokens: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrialReport {
    pub name: String,
    pub tier: String,
    pub artifact: String,
    pub stream: String,
    pub kv_dtype: String,
    pub device_class: Option<String>,
    /// pass, drift, new, tokens-changed, protocol-changed, wrong-subject, bad-baseline, error
    pub status: String,
    pub message: Option<String>,
    pub baseline: Option<Numbers>,
    pub result: Option<Numbers>,
    pub delta_mean_nll: Option<f64>,
    pub allowed: Option<f64>,
    pub seconds: f64,
}

pub struct Sink {
    dir: Option<PathBuf>,
    rows: Mutex<Vec<TrialReport>>,
}

impl Sink {
    pub fn from_env() -> Result<Sink, String> {
        let dir = std::env::var_os("NINFER_HARNESS_REPORT_DIR").map(PathBuf::from);
        if let Some(d) = &dir {
            std::fs::create_dir_all(d)
                .map_err(|e| format!("NINFER_HARNESS_REPORT_DIR {}: {e}", d.display()))?;
            // A fresh run: earlier lines would mix two runs.
            let _ = std::fs::remove_file(d.join("trials.jsonl"));
        }
        Ok(Sink {
            dir,
            rows: Mutex::new(Vec::new()),
        })
    }

    pub fn push(&self, r: TrialReport) {
        if let Some(d) = &self.dir {
            let line = serde_json::to_string(&r).expect("report serializes");
            let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(d.join("trials.jsonl"))
            {
                let _ = writeln!(f, "{line}");
            }
            rows.push(r);
        }
    }

    /// Writes `summary.md`; `counts` is libtest-mimic's (passed, failed, ignored, filtered out).
    pub fn finish(&self, counts: (u64, u64, u64, u64), ignored_reasons: &[(String, usize)]) {
        let Some(d) = &self.dir else { return };
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner()).clone();
        rows.sort_by(|a, b| a.name.cmp(&b.name));
        let mut md = String::new();
        let (passed, failed, ignored, filtered) = counts;
        md.push_str("# Perplexity regression harness\n\n");
        md.push_str(&format!(
            "{} passed, {} failed, {} ignored, {} filtered out.{}\n\n",
            passed,
            failed,
            ignored,
            filtered,
            if failed > 0 {
                " **Drift or errors: the gate fails.**"
            } else {
                ""
            }
        ));
        for (reason, n) in ignored_reasons {
            md.push_str(&format!("- {n} trial(s) ignored: {reason}\n"));
        }
        if !ignored_reasons.is_empty() {
            md.push('\n');
        }
        md.push_str(
            "| trial | device | baseline ppl | new ppl | Δ mean NLL (nats) | allowed | status |\n",
        );
        md.push_str("| --- | --- | ---: | ---: | ---: | ---: | --- |\n");
        for r in &rows {
            let f = |x: Option<f64>, p: usize| x.map_or("–".to_string(), |x| format!("{x:.p$}"));
            let e = |x: Option<f64>| x.map_or("–".to_string(), |x| format!("{x:+.2e}"));
            md.push_str(&format!(
                "| `{}` | {} | {} | {} | {} | {} | {} |\n",
                r.name,
                r.device_class.as_deref().unwrap_or("–"),
                f(r.baseline.as_ref().map(|b| b.ppl), 4),
                f(r.result.as_ref().map(|b| b.ppl), 4),
                e(r.delta_mean_nll),
                r.allowed.map_or("–".to_string(), |x| format!("{x:.1e}")),
                if r.status == "pass" {
                    "pass".to_string()
                } else {
                    format!("**{}**", r.status)
                }
            ));
        }
        let failures: Vec<&TrialReport> = rows.iter().filter(|r| r.status != "pass").collect();
        if !failures.is_empty() {
            md.push_str("\n## Failures\n\n");
            for r in failures {
                md.push_str(&format!(
                    "### `{}`\n\n```\n{}\n```\n\n",
                    r.name,
                    r.message.as_deref().unwrap_or("")
                ));
            }
        }
        let _ = std::fs::write(d.join("summary.md"), md);
    }
}
