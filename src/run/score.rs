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
            reference: score
                .reference
                .as_ref()
                .and_then(|r| diagnosed(r, &p.tokens, &engine.tokenizer)),
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

/// Positions listed per stream: the worst by KL, and the strip drawn around the worst one.
const WORST_POSITIONS: usize = 10;
const WORST_WINDOWS: usize = 5;
const STRIP_BEFORE: usize = 48;
const STRIP_AFTER: usize = 15;

/// A stream's reference summary with its worst positions and windows and the strip of
/// tokens around its worst position, each position with its token's id and text.
fn diagnosed(
    acc: &crate::score::ReferenceAcc,
    tokens: &[u32],
    tokenizer: &crate::tokenizer::Tokenizer,
) -> Option<crate::score::ReferenceSummary> {
    let mut s = acc.summary()?;
    let name = |mut v: Vec<crate::score::reference::WorstPosition>| {
        for p in &mut v {
            if let Some(&id) = tokens.get(p.position) {
                p.token_id = id;
                p.token = piece_at(tokens, p.position, tokenizer);
            }
        }
        v
    };
    s.worst_positions = name(acc.worst_positions(WORST_POSITIONS));
    s.worst_windows = acc.worst_windows(WORST_WINDOWS);
    s.strip = name(acc.strip(STRIP_BEFORE, STRIP_AFTER));
    // In the strip each token shows the text it completes, decoded in sequence: the bytes
    // of a character split over byte-level tokens appear at the token that ends it.
    let ids: Vec<u32> = s.strip.iter().map(|p| p.token_id).collect();
    let mut before = String::new();
    for (i, p) in s.strip.iter_mut().enumerate() {
        let now = tokenizer.decode(&ids[..=i]);
        let kept = before.trim_end_matches('\u{FFFD}');
        if let Some(piece) = now.strip_prefix(kept) {
            p.token = piece.replace('\u{FFFD}', "");
        }
        before = now;
    }
    Some(s)
}

/// The text token `pos` adds to the tokens before it: what it decodes to in context, so
/// that a byte-level token in the middle of a character shows that character, marked
/// "(part)", rather than a replacement character.
fn piece_at(tokens: &[u32], pos: usize, tokenizer: &crate::tokenizer::Tokenizer) -> String {
    const BAD: char = '\u{FFFD}';
    let start = pos.saturating_sub(8);
    let before = tokenizer.decode(&tokens[start..pos]);
    let kept = before.trim_end_matches(BAD);
    let now = tokenizer.decode(&tokens[start..=pos]);
    match now.strip_prefix(kept) {
        Some(p) if p.chars().any(|c| c != BAD) => p.replace(BAD, ""),
        _ => {
            let ahead = tokenizer.decode(&tokens[start..(pos + 4).min(tokens.len())]);
            ahead
                .strip_prefix(kept)
                .and_then(|a| a.chars().find(|&c| c != BAD))
                .map_or_else(String::new, |c| format!("{c} (part)"))
        }
    }
}
