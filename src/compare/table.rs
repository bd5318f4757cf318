//! The comparison as people read it: a table on stdout and a verdict in words.

use super::{Comparison, Row, Side};
use std::fmt::Write;

fn interval(c: Option<[f64; 2]>, digits: usize) -> String {
    match c {
        Some([lo, hi]) => format!("[{lo:+.digits$}, {hi:+.digits$}]"),
        None => "(one window)".into(),
    }
}

fn ratio_interval(c: Option<[f64; 2]>) -> String {
    match c {
        Some([lo, hi]) => format!("[{lo:.5}, {hi:.5}]"),
        None => "(one window)".into(),
    }
}

fn line(out: &mut String, r: &Row) {
    let p = &r.paired;
    let _ = writeln!(
        out,
        "{:<22} {:>7} {:>9} {:>9.5} {:>9.5} {:>+10.6} {:>23} {:>9.5} {:>20} {:>+11.6}",
        r.title,
        p.windows,
        p.scored,
        p.base_mean_nll,
        p.new_mean_nll,
        p.delta_nll,
        interval(p.delta_nll_ci95, 6),
        p.ppl_ratio,
        ratio_interval(p.ppl_ratio_ci95),
        r.delta_bits_per_byte
    );
}

fn describe(s: &Side) -> String {
    let name = std::path::Path::new(&s.artifact)
        .file_name()
        .map_or(s.artifact.clone(), |n| n.to_string_lossy().into_owned());
    let fault = s
        .test_fault
        .as_ref()
        .map_or(String::new(), |f| format!(" | test fault {f}"));
    format!(
        "weights {} | kv {} | {} {} ({name}){fault}",
        s.weight_format, s.kv_dtype, s.device, s.precision
    )
}

/// The stdout table: domains and the overall row, under `#` lines naming both runs.
pub fn render(c: &Comparison) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# base: {}", describe(&c.base));
    let _ = writeln!(out, "# new:  {}", describe(&c.new));
    let _ = writeln!(
        out,
        "# context {} stride {} | delta = new - base, nats/token | 95% intervals over paired windows",
        c.context, c.stride
    );
    let _ = writeln!(
        out,
        "{:<22} {:>7} {:>9} {:>9} {:>9} {:>10} {:>23} {:>9} {:>20} {:>11}",
        "domain",
        "windows",
        "scored",
        "base_nll",
        "new_nll",
        "delta_nll",
        "delta_nll 95% CI",
        "ppl_ratio",
        "ratio 95% CI",
        "delta_bpb"
    );
    for d in &c.domains {
        line(&mut out, d);
    }
    line(&mut out, &c.overall);
    out
}

/// One sentence on the overall row, for stderr.
pub fn verdict(c: &Comparison) -> String {
    let p = &c.overall.paired;
    if p.delta_nll_ci95 == Some([0.0, 0.0]) && p.delta_nll == 0.0 {
        return format!(
            "identical scores: the same NLL in all {} windows",
            p.windows
        );
    }
    let (d, ci) = (p.delta_nll, interval(p.delta_nll_ci95, 6));
    let ratio = format!(
        "PPL x{:.5} {}",
        p.ppl_ratio,
        ratio_interval(p.ppl_ratio_ci95)
    );
    match p.delta_nll_ci95 {
        Some([lo, _]) if lo > 0.0 => format!(
            "new is worse: {d:+.6} nats/token, 95% CI {ci}, {ratio}, over {} windows",
            p.windows
        ),
        Some([_, hi]) if hi < 0.0 => format!(
            "new is better: {d:+.6} nats/token, 95% CI {ci}, {ratio}, over {} windows",
            p.windows
        ),
        Some(_) => format!(
            "no difference detected at 95%: {d:+.6} nats/token, 95% CI {ci} includes 0, over {} windows",
            p.windows
        ),
        None => format!("{d:+.6} nats/token over one window: no interval"),
    }
}
