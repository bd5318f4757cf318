//! The human table printed on stdout: one row per domain and an overall row.

use super::{Aggregate, Report};
use std::fmt::Write;

fn row(out: &mut String, a: &Aggregate, calibration: bool) {
    let t = &a.totals;
    let _ = write!(
        out,
        "{:<22} {:>7} {:>10} {:>9.5} {:>10.4} {:>21} {:>9.5}",
        a.title,
        a.streams,
        t.scored,
        t.mean_nll,
        t.ppl,
        format!("[{:.4}, {:.4}]", t.ppl_ci95[0], t.ppl_ci95[1]),
        t.bits_per_byte
    );
    if calibration {
        let _ = match &a.calibration {
            Some(c) => write!(
                out,
                " {:>9.5} {:>8.4} {:>8.4} {:>7.4}",
                c.mean_entropy, c.top1_accuracy, c.mean_top1_confidence, c.ece
            ),
            None => write!(out, " {:>9} {:>8} {:>8} {:>7}", "-", "-", "-", "-"),
        };
    }
    out.push('\n');
}

/// `context C stride S` for the seed's plan; `context C, disjoint windows` or `context C,
/// llama.cpp chunks (last C-1-C/2 scored)` for the others.
pub fn protocol_label(p: &crate::score::Protocol) -> String {
    use crate::score::WindowPlan;
    match p.plan {
        WindowPlan::Sliding => format!("context {} stride {}", p.context, p.stride),
        WindowPlan::Disjoint => format!("context {}, disjoint windows", p.context),
        WindowPlan::KldChunks => format!(
            "context {}, llama.cpp chunks (last {} scored)",
            p.context,
            p.context.saturating_sub(1 + p.context / 2)
        ),
    }
}

/// Renders the domain/overall table, under a `#` line naming what the numbers measure: the
/// weight and KV formats and the protocol. `calibration` adds the mean entropy, top-1
/// accuracy, mean top-1 confidence and ECE columns (`-` where the backend has none).
pub fn render(r: &Report, calibration: bool) -> String {
    let mut out = String::new();
    let s = &r.settings;
    let protocol = crate::score::Protocol {
        context: s.context,
        stride: s.stride,
        plan: s.window_plan,
    };
    let _ = writeln!(
        out,
        "# weights {} | kv {} | {}",
        r.artifact.weight_format,
        s.kv_dtype,
        protocol_label(&protocol)
    );
    let _ = write!(
        out,
        "{:<22} {:>7} {:>10} {:>9} {:>10} {:>21} {:>9}",
        "domain", "streams", "scored", "mean_nll", "ppl", "ppl 95% CI", "bits/byte"
    );
    if calibration {
        let _ = write!(
            out,
            " {:>9} {:>8} {:>8} {:>7}",
            "entropy", "top1_acc", "top1_p", "ece"
        );
    }
    out.push('\n');
    for d in &r.domains {
        row(&mut out, d, calibration);
    }
    row(&mut out, &r.overall, calibration);
    out
}

/// The line above a shard run's table: its rows are partial.
pub fn shard_note(s: &crate::shard::ShardInfo) -> String {
    format!(
        "# shard {}/{}: windows {}..{} of {} only; `ninfer-perplexity merge` gives the run's figures\n",
        s.index, s.count, s.windows[0], s.windows[1], s.run_windows
    )
}

fn reference_row(out: &mut String, a: &Aggregate) {
    let Some(r) = &a.reference else { return };
    let ci = match r.delta_nll_ci95 {
        Some([lo, hi]) => format!("[{lo:+.5}, {hi:+.5}]"),
        None => "(one window)".into(),
    };
    let _ = writeln!(
        out,
        "{:<22} {:>9} {:>9.6} {:>9.6} {:>9.6} {:>9.6} {:>9.5} {:>9.6} {:>9.6} {:>10.5} {:>7.4} {:>7.4} {:>+9.6} {:>8.6} {:>+10.6} {:>22}",
        a.title,
        r.positions,
        r.mean_kld,
        r.kld_median,
        r.kld_p90,
        r.kld_p99,
        r.kld_max,
        r.mean_kld_reverse,
        r.mean_js,
        r.top1_agreement,
        r.top5_overlap,
        r.top10_overlap,
        r.mean_delta_p,
        r.rms_delta_p,
        r.delta_nll,
        ci
    );
}

/// A titled list of buckets: (bucket, positions, mean KL, ΔNLL); nothing when empty.
fn bucket_rows(out: &mut String, title: &str, rows: impl Iterator<Item = (String, u64, f64, f64)>) {
    let mut rows = rows.peekable();
    if rows.peek().is_none() {
        return;
    }
    let _ = writeln!(
        out,
        "# {title}: positions, mean KL(reference || run), delta_nll"
    );
    for (at, n, kld, dnll) in rows {
        let _ = writeln!(out, "{at:<22} {n:>9} {kld:>9.6} {dnll:>+10.6}");
    }
}

/// The second table of a run with a reference pass: per domain and overall, how far the
/// run's distribution is from the reference's (`None` without a reference).
pub fn render_reference(r: &Report) -> Option<String> {
    let rs = r.settings.reference.as_ref()?;
    r.overall.reference.as_ref()?;
    let mut out = String::new();
    let name = std::path::Path::new(&rs.artifact_path)
        .file_name()
        .map_or(rs.artifact_path.clone(), |n| {
            n.to_string_lossy().into_owned()
        });
    let _ = writeln!(
        out,
        "# reference: weights {} | kv {} ({name}) | KL(reference || run) in nats, kld_rev = mean KL(run || reference), js = mean Jensen-Shannon (nats), top5/top10 = mean share of the run's top 5/10 tokens among the reference's, dp = p_run(target) - p_ref(target), delta_nll = run - reference",
        rs.weight_format, rs.kv_dtype
    );
    let _ = writeln!(
        out,
        "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>7} {:>9} {:>8} {:>10} {:>22}",
        "domain",
        "positions",
        "mean_kld",
        "kld_p50",
        "kld_p90",
        "kld_p99",
        "kld_max",
        "kld_rev",
        "js",
        "top1_agree",
        "top5",
        "top10",
        "mean_dp",
        "rms_dp",
        "delta_nll",
        "delta_nll 95% CI"
    );
    for d in &r.domains {
        reference_row(&mut out, d);
    }
    reference_row(&mut out, &r.overall);
    // Overall, by depth in the window (where in the context the run departs) and by the
    // reference's confidence.
    if let Some(o) = &r.overall.reference {
        let depth = o.by_depth.iter().map(|d| {
            let at = format!("[{}, {})", d.from, d.to);
            (at, d.positions, d.mean_kld, d.delta_nll)
        });
        bucket_rows(&mut out, "by depth in the window (overall)", depth);
        let confidence = o.by_confidence.iter().map(|c| {
            let at = format!("[{:.1}, {:.1})", c.from, c.to);
            (at, c.positions, c.mean_kld, c.delta_nll)
        });
        let title = "by the reference's confidence p_ref(top-1) (overall)";
        bucket_rows(&mut out, title, confidence);
    }
    // The positions of largest KL over every stream.
    let mut worst: Vec<(&str, &crate::score::reference::WorstPosition)> = r
        .streams
        .iter()
        .filter_map(|st| st.reference.as_ref().map(|x| (st.id.as_str(), x)))
        .flat_map(|(id, x)| x.worst_positions.iter().map(move |p| (id, p)))
        .collect();
    worst.sort_by(|a, b| b.1.kld.total_cmp(&a.1.kld));
    if !worst.is_empty() {
        let _ = writeln!(
            out,
            "# worst positions: stream, position, target token, KL(reference || run), delta_nll"
        );
        for (id, p) in worst.iter().take(5) {
            let _ = writeln!(
                out,
                "{:<22} {:>9} {:<16} {:>9.5} {:>+10.5}",
                id,
                p.position,
                format!("{:?}", p.token),
                p.kld,
                p.delta_nll
            );
        }
    }
    Some(out)
}
