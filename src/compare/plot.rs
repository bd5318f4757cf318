//! `compare --plot FILE`: the paired per-window ΔNLL of two runs as an SVG — every window's
//! difference in window order, streams grouped by domain (one color per domain), the overall
//! Δ with its 95% interval as a band, and zero.

use super::load::Loaded;
use super::Comparison;
use crate::report::plot::{color, range};
use anyhow::{anyhow, Result};
use plotters::prelude::*;

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e:?}")
}

pub fn compare_plot(base: &Loaded, new: &Loaded, c: &Comparison) -> Result<String> {
    // Groups: the domains (a `--text` run has none: one group of every stream).
    let groups: Vec<(&str, &str)> = if base.report.domains.is_empty() {
        vec![("", base.report.overall.title.as_str())]
    } else {
        // A real corpus has four domains; what a file claims beyond 16 is not drawn.
        base.report
            .domains
            .iter()
            .take(16)
            .map(|d| (d.id.as_str(), d.title.as_str()))
            .collect()
    };
    // (window index over the whole run, ΔNLL per token, group index)
    let mut pts = vec![];
    for (gi, (id, _)) in groups.iter().enumerate() {
        for (a, b) in base.report.streams.iter().zip(&new.report.streams) {
            if !id.is_empty() && a.domain != *id {
                continue;
            }
            for (x, y) in a.windows.iter().zip(&b.windows) {
                let d = (y.nll_sum - x.nll_sum) / x.scored.max(1) as f64;
                pts.push((pts.len() as f64, d, gi));
            }
        }
    }
    // At most MAX_POINTS points, evenly taken: what is drawn bounds the work.
    const MAX_POINTS: usize = 20_000;
    let step = pts.len().div_ceil(MAX_POINTS).max(1);
    let pts: Vec<(f64, f64, usize)> = pts.into_iter().step_by(step).collect();
    let o = &c.overall.paired;
    let band = o.delta_nll_ci95.unwrap_or([o.delta_nll, o.delta_nll]);
    // The chart library spins on a non-finite axis range: refuse, never draw one.
    if let Some(p) = pts.iter().find(|p| !p.1.is_finite()) {
        anyhow::bail!(
            "{}: window {} has a non-finite ΔNLL; nothing to plot",
            new.path.display(),
            p.0
        );
    }
    if !band.iter().all(|b| b.is_finite()) {
        anyhow::bail!(
            "{}: the overall ΔNLL interval is not finite; nothing to plot",
            new.path.display()
        );
    }
    let (y0, y1) = range(pts.iter().map(|p| p.1).chain([0.0, band[0], band[1]]));
    let n = pts.len().max(1) as f64;
    let mut svg = String::new();
    {
        // A second panel with the KL-divergence histogram of a run that had a reference pass.
        let kld = new
            .report
            .overall
            .reference
            .as_ref()
            .zip(new.report.settings.reference.as_ref());
        let height = if kld.is_some() { 760 } else { 460 };
        let full = SVGBackend::with_string(&mut svg, (1000, height)).into_drawing_area();
        full.fill(&WHITE).map_err(err)?;
        let (root, below) = full.split_vertically(460);
        let title = format!(
            "new - base per window: kv {} -> {} | weights {} -> {} | overall {:+.5} [{:+.5}, {:+.5}]",
            c.base.kv_dtype, c.new.kv_dtype, c.base.weight_format, c.new.weight_format,
            o.delta_nll, band[0], band[1]
        );
        let mut ch = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(34)
            .y_label_area_size(64)
            .build_cartesian_2d(-0.5f64..n - 0.5, y0..y1)
            .map_err(err)?;
        ch.configure_mesh()
            .x_label_formatter(&|x| format!("{x:.0}"))
            .x_desc("window (streams in domain order)")
            .y_desc("delta NLL, nats / token")
            .draw()
            .map_err(err)?;
        ch.draw_series(std::iter::once(Rectangle::new(
            [(-0.5, band[0]), (n - 0.5, band[1])],
            RGBColor(120, 120, 120).mix(0.25).filled(),
        )))
        .map_err(err)?
        .label("overall 95% interval")
        .legend(|(x, y)| {
            Rectangle::new(
                [(x, y - 4), (x + 18, y + 4)],
                RGBColor(120, 120, 120).mix(0.25).filled(),
            )
        });
        ch.draw_series(LineSeries::new(
            [(-0.5, o.delta_nll), (n - 0.5, o.delta_nll)],
            BLACK.stroke_width(2),
        ))
        .map_err(err)?
        .label("overall delta")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(2)));
        ch.draw_series(LineSeries::new(
            [(-0.5, 0.0), (n - 0.5, 0.0)],
            RGBColor(90, 90, 90),
        ))
        .map_err(err)?;
        for (di, (_, title)) in groups.iter().enumerate() {
            let col = color(di);
            ch.draw_series(
                pts.iter()
                    .filter(|p| p.2 == di)
                    .map(|p| Circle::new((p.0, p.1), 3, col.filled())),
            )
            .map_err(err)?
            .label(title.to_string())
            .legend(move |(x, y)| Circle::new((x + 9, y), 3, col.filled()));
        }
        ch.configure_series_labels()
            .background_style(WHITE.mix(0.6))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err)?;
        if let Some((r, rs)) = kld {
            let title = format!(
                "new run: KL(reference || run) per position, reference weights {} | kv {} (mean {:.5})",
                rs.weight_format, rs.kv_dtype, r.mean_kld
            );
            crate::report::plot::kld_histogram(&below, &r.kld_histogram, &title)?;
        }
        full.present().map_err(err)?;
    }
    Ok(svg)
}
