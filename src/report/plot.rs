//! `--plot`: a picture of a run beside its `report.json` (`plot.svg`): the mean NLL of every
//! window along each stream, one panel per domain, and, for a run with a reference pass, the
//! distribution of the per-position KL divergence and the tokens around the worst position
//! (a strip coloured by KL divergence).
//!
//! Drawn with plotters' SVG backend (no fonts needed: text stays text in the SVG).

use super::{Report, StreamReport};
use anyhow::{anyhow, Result};
use plotters::prelude::*;

const WIDTH: u32 = 1000;
const PANEL: u32 = 280;

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e:?}")
}

/// A color per stream within its panel.
pub(crate) fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

/// (first target, mean NLL) of every window of a stream.
fn window_points(s: &StreamReport) -> Vec<(f64, f64)> {
    // At most MAX_POINTS points, evenly taken: what is drawn bounds the work, not what the
    // file claims.
    let step = s.windows.len().div_ceil(MAX_POINTS).max(1);
    s.windows
        .iter()
        .step_by(step)
        .map(|w| (w.first_target as f64, w.nll_sum / w.scored.max(1) as f64))
        .collect()
}

/// Most panels (domains) one plot draws; a real corpus has four.
const MAX_PANELS: usize = 16;
/// Most streams one panel draws.
const MAX_SERIES: usize = 32;
/// Most points one stream's line has.
const MAX_POINTS: usize = 2048;

/// `[lo, hi]` of the values with a little room, never empty.
pub(crate) fn range(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    if lo > hi {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.08).max(1e-3);
    (lo - pad, hi + pad)
}

/// The SVG of `r` (with the KL-divergence histogram when the run had a reference pass).
pub fn run_plot(r: &Report) -> Result<String> {
    let kld = r
        .overall
        .reference
        .as_ref()
        .map(|x| x.kld_histogram.as_slice());
    // A panel per domain; a `--text` run has none: one panel of its streams.
    let groups: Vec<(&str, &str, f64)> = if r.domains.is_empty() {
        vec![("", r.overall.title.as_str(), r.overall.totals.mean_nll)]
    } else {
        r.domains
            .iter()
            .take(MAX_PANELS)
            .map(|d| (d.id.as_str(), d.title.as_str(), d.totals.mean_nll))
            .collect()
    };
    // The stream whose worst position is the worst of all, for the token strip.
    let strip = r
        .streams
        .iter()
        .filter_map(|st| {
            let x = st.reference.as_ref()?;
            let worst = x.worst_positions.first()?;
            (!x.strip.is_empty()).then_some((st.id.as_str(), worst.kld, &x.strip))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let panels = groups.len() as u32 + u32::from(kld.is_some()) + u32::from(strip.is_some());
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 40 + PANEL * panels.max(1)))
            .into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let title = format!(
            "weights {} | kv {} | context {} stride {}",
            r.artifact.weight_format, r.settings.kv_dtype, r.settings.context, r.settings.stride
        );
        let (top, rest) = root.split_vertically(40);
        top.titled(&title, ("sans-serif", 18)).map_err(err)?;
        let areas = rest.split_evenly((panels.max(1) as usize, 1));
        for (&(id, title, mean), area) in groups.iter().zip(&areas) {
            let streams: Vec<&StreamReport> = r
                .streams
                .iter()
                .filter(|s| id.is_empty() || s.domain == id)
                .take(MAX_SERIES)
                .collect();
            let pts: Vec<Vec<(f64, f64)>> = streams.iter().map(|s| window_points(s)).collect();
            let (y0, y1) = range(pts.iter().flatten().map(|p| p.1));
            let x1 = pts.iter().flatten().map(|p| p.0).fold(1.0, f64::max);
            let mut c = ChartBuilder::on(area)
                .caption(
                    format!("{title}: mean NLL per window (overall {mean:.4})"),
                    ("sans-serif", 15),
                )
                .margin(8)
                .x_label_area_size(32)
                .y_label_area_size(56)
                .build_cartesian_2d(0f64..x1 * 1.02, y0..y1)
                .map_err(err)?;
            c.configure_mesh()
                .x_label_formatter(&|x| format!("{x:.0}"))
                .x_desc("first target of the window (token)")
                .y_desc("nats / token")
                .draw()
                .map_err(err)?;
            for (i, (s, p)) in streams.iter().zip(&pts).enumerate() {
                let col = color(i);
                c.draw_series(LineSeries::new(p.iter().copied(), col.stroke_width(2)))
                    .map_err(err)?
                    .label(s.id.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], col));
                c.draw_series(p.iter().map(|&q| Circle::new(q, 2, col.filled())))
                    .map_err(err)?;
            }
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(err)?;
        }
        let kld_area = if strip.is_some() {
            areas.len().checked_sub(2).and_then(|i| areas.get(i))
        } else {
            areas.last()
        };
        if let (Some((id, _, tokens)), Some(area)) = (strip, areas.last()) {
            token_strip(area, id, tokens)?;
        }
        if let (Some(k), Some(area), Some(rs)) = (kld, kld_area, &r.settings.reference) {
            let mean = r.overall.reference.as_ref().map_or(0.0, |x| x.mean_kld);
            let title = format!(
                "KL(reference || run) per position, reference: weights {} | kv {} (mean {mean:.5})",
                rs.weight_format, rs.kv_dtype
            );
            kld_histogram(area, k, &title)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Positions per decade of KL divergence (`counts` as in
/// [`crate::score::ReferenceSummary::kld_histogram`]).
pub(crate) fn kld_histogram<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    counts: &[u64],
    title: &str,
) -> Result<()> {
    let (lo, hi) = (
        crate::score::reference::KLD_DECADES.start,
        crate::score::reference::KLD_DECADES.end,
    );
    let ymax = counts.iter().copied().max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 15))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(56)
        .build_cartesian_2d(lo as f64..hi as f64, 0f64..ymax)
        .map_err(err)?;
    c.configure_mesh()
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("log10 KL divergence (nats)")
        .y_desc("positions")
        .draw()
        .map_err(err)?;
    // One bar per decade of the axis; a count past them has nowhere to be drawn.
    let counts = &counts[..counts.len().min((hi - lo).max(0) as usize)];
    c.draw_series(counts.iter().enumerate().map(|(i, &n)| {
        let x = (lo + i as i32) as f64;
        Rectangle::new([(x + 0.05, 0.0), (x + 0.95, n as f64)], color(0).filled())
    }))
    .map_err(err)?;
    Ok(())
}

/// Tokens one strip draws at most (a stream's report holds about 64).
const MAX_STRIP: usize = 256;

/// The tokens around a stream's worst position as boxes in reading order, each coloured by
/// its KL(reference ‖ run) (white at 0, full red at the strip's largest), with the target
/// token's text inside and its ΔNLL below.
fn token_strip<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    stream: &str,
    tokens: &[crate::score::reference::WorstPosition],
) -> Result<()> {
    let tokens = &tokens[..tokens.len().min(MAX_STRIP)];
    let top = tokens.iter().map(|t| t.kld).fold(0.0f64, f64::max);
    let title = format!(
        "`{stream}`, positions {}..{}: each target token coloured by KL(reference || run) (red = {top:.3} nats), ΔNLL below",
        tokens.first().map_or(0, |t| t.position),
        tokens.last().map_or(0, |t| t.position)
    );
    area.draw_text(&title, &("sans-serif", 15).into_text_style(area), (10, 6))
        .map_err(err)?;
    let (w, _) = area.dim_in_pixel();
    let (mut x, mut y) = (10i32, 34i32);
    let (row_h, char_w) = (46i32, 7i32);
    for t in tokens {
        let text: String = t
            .token
            .chars()
            .map(|c| match c {
                '\n' => '⏎',
                '\t' => '→',
                ' ' => '␣',
                c if c.is_control() => '·',
                c => c,
            })
            .take(14)
            .collect();
        let bw = (char_w * text.chars().count() as i32 + 8).max(30);
        if x + bw > w as i32 - 10 {
            (x, y) = (10, y + row_h);
        }
        let share = if top > 0.0 {
            (t.kld / top).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let fade = (255.0 * (1.0 - share)) as u8;
        let fill = RGBColor(255, fade, fade);
        area.draw(&Rectangle::new([(x, y), (x + bw, y + 22)], fill.filled()))
            .map_err(err)?;
        area.draw(&Rectangle::new([(x, y), (x + bw, y + 22)], BLACK.mix(0.3)))
            .map_err(err)?;
        area.draw_text(
            &text,
            &("monospace", 12).into_text_style(area),
            (x + 4, y + 5),
        )
        .map_err(err)?;
        area.draw_text(
            &format!("{:+.2}", t.delta_nll),
            &("sans-serif", 9).into_text_style(area),
            (x + 2, y + 25),
        )
        .map_err(err)?;
        x += bw + 3;
    }
    Ok(())
}
