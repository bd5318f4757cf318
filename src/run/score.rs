//! Scoring a run's prepared streams one after another, with progress and a summary line per
//! stream on stderr.

use crate::kv::KvDtype;
use crate::report::{StreamReport, Totals};
use crate::run::inputs::Inputs;
use crate::ui::{self, ProgressLine};
use anyhow::{anyhow, Result};
use std::time::Instant;

/// Every stream's report, in input order.
pub fn score_streams(inputs: &Inputs, kv: KvDtype) -> Result<Vec<StreamReport>> {
    let engine = &inputs.engine;
    let total = inputs.processed_tokens() as u64;
    let mut progress = ProgressLine::new("scoring", total, "tokens");
    if matches!(engine.device, crate::backend::Device::Cpu { .. }) {
        progress.track_layers(engine.artifact.config.num_layers);
    }
    let mut done_before = 0u64;
    let mut reports = Vec::with_capacity(inputs.streams.len());
    for p in &inputs.streams {
        ui::debug(format!(
            "stream {} begins: {} tokens",
            p.stream.id,
            p.tokens.len()
        ));
        progress.set_message(&p.stream.id);
        let ts = Instant::now();
        let score = engine
            .score_windows(&p.tokens, &p.windows, kv, false, &mut |_w, pr| {
                progress.update(done_before + pr.processed);
            })
            .map_err(|e| anyhow!("stream `{}`: {e:#}", p.stream.id))?;
        let secs = ts.elapsed().as_secs_f64();
        done_before += score.processed_tokens as u64;
        // Bits per byte count the bytes of the text that was scored.
        let totals = Totals::new(&score.totals, p.bytes);
        let rate = score.processed_tokens as f64 / secs.max(1e-9);
        progress.suspend(|| {
            ui::info(format!(
                "stream     {:<12} {:>8} tokens {:>8} scored  mean_nll {:.5}  ppl {:.4}  {:.1}s  {:.1} tokens/s",
                p.stream.id,
                p.tokens.len(),
                totals.scored,
                totals.mean_nll,
                totals.ppl,
                secs,
                rate
            ))
        });
        reports.push(StreamReport {
            id: p.stream.id.clone(),
            domain: p.stream.domain.clone(),
            path: p.stream.report_path.clone(),
            sha256: p.stream.sha256.clone(),
            tokens: p.full_tokens,
            input_tokens: p.tokens.len(),
            unscored_tokens: p.tokens.len().saturating_sub(totals.scored as usize),
            processed_tokens: score.processed_tokens,
            totals,
            seconds: secs,
            processed_tokens_per_s: rate,
            reference: score.reference.as_ref().and_then(|r| r.summary()),
            reference_acc: score.reference.clone(),
            calibration: score
                .calibration
                .as_ref()
                .and_then(crate::report::CalibrationReport::new),
            routing: score
                .routing
                .as_deref()
                .and_then(crate::report::RoutingReport::new),
            windows: score
                .windows
                .into_iter()
                .map(|mut w| {
                    w.index += p.first_window;
                    w
                })
                .collect(),
        });
    }
    progress.finish();
    Ok(reports)
}
