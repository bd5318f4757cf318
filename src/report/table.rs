//! The human table printed on stdout: one row per domain and an overall row.

use super::{Aggregate, Report};
use std::fmt::Write;

fn row(out: &mut String, a: &Aggregate) {
    let t = &a.totals;
    let _ = writeln!(
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
}

/// Renders the domain/overall table, under a `#` line naming what the numbers measure: the
/// weight and KV formats and the protocol.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let s = &r.settings;
    let _ = writeln!(
        out,
        "# weights {} | kv {} | context {} stride {}",
        r.artifact.weight_format, s.kv_dtype, s.context, s.stride
    );
    let _ = writeln!(
        out,
        "{:<22} {:>7} {:>10} {:>9} {:>10} {:>21} {:>9}",
        "domain", "streams", "scored", "mean_nll", "ppl", "ppl 95% CI", "bits/byte"
    );
    for d in &r.domains {
        row(&mut out, d);
    }
    row(&mut out, &r.overall);
    out
}
