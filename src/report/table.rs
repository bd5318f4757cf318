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

/// Renders the domain/overall table, under a `#` line naming what the numbers measure: the
/// weight and KV formats and the protocol. `calibration` adds the mean entropy, top-1
/// accuracy, mean top-1 confidence and ECE columns (`-` where the backend has none).
pub fn render(r: &Report, calibration: bool) -> String {
    let mut out = String::new();
    let s = &r.settings;
    let _ = writeln!(
        out,
        "# weights {} | kv {} | context {} stride {}",
        r.artifact.weight_format, s.kv_dtype, s.context, s.stride
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
