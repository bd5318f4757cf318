//! The evaluator's modes, one function each: [`run`] scores an artifact, [`compare`] pairs
//! two reports window by window, [`merge`] joins the reports of a sharded run. `main.rs`
//! is `main -> try_main -> one of these`, and [`exit`] turns the result into the process's
//! exit status with errors as one line, the same for both binaries.

use crate::cli::{Args, CompareArgs, MergeArgs};
use anyhow::Result;
use clap::Parser;
use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

/// What the command line asks for.
pub enum Command {
    Run(Box<Args>),
    Compare(CompareArgs),
    Merge(MergeArgs),
}

impl Command {
    /// Parses the process's arguments (clap prints help and usage errors and exits).
    /// `compare` and `merge` are words, not artifacts: an artifact file of that name is
    /// `./compare`.
    pub fn from_args(args: impl IntoIterator<Item = OsString>) -> Command {
        let mut args: Vec<OsString> = args.into_iter().collect();
        match args.get(1).and_then(|a| a.to_str()) {
            Some(word @ ("compare" | "merge")) => {
                let compare = word == "compare";
                args.remove(1);
                if compare {
                    Command::Compare(CompareArgs::parse_from(args))
                } else {
                    Command::Merge(MergeArgs::parse_from(args))
                }
            }
            _ => Command::Run(Box::new(Args::parse_from(args))),
        }
    }
}

/// The exit status of a mode's result: success, or `error: ...` on one line and failure. A
/// reader that closed the pipe early (`| head`) wanted no more output: success.
pub fn exit(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<GateFailed>().is_some() => {
            eprintln!("{e}");
            ExitCode::from(GATE_FAILED)
        }
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Writes the product output to stdout.
fn print(text: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// `ninfer-perplexity ARTIFACT ...`: scores the corpus or text; the table on stdout.
pub fn run(args: Box<Args>) -> Result<()> {
    let cfg = (*args).validate()?;
    crate::ui::set_level(cfg.log_level);
    let out = crate::run::run(&cfg)?;
    print(&out.table)
}

/// `ninfer-perplexity compare BASE NEW`: the paired deltas; the table on stdout, the JSON
/// and the plot written both or neither.
pub fn compare(args: CompareArgs) -> Result<()> {
    use crate::compare::{self, load::load, plot, table};
    crate::ui::set_level(args.log_level);
    let (base, new) = (load(&args.base)?, load(&args.new)?);
    for out in args.json.iter().chain(&args.plot) {
        crate::outfile::check_output(out, &[base.path.clone(), new.path.clone()])?;
    }
    if let (Some(a), Some(b)) = (&args.json, &args.plot) {
        if a == b {
            anyhow::bail!("{}: --json and --plot name the same file", a.display());
        }
    }
    let c = compare::compare(&base, &new)?;
    let svg = match &args.plot {
        Some(_) => Some(plot::compare_plot(&base, &new, &c)?),
        None => None,
    };
    let rendered = table::render(&c);
    if let Some(out) = &args.json {
        compare::write_json(&c, out)?;
    }
    if let (Some(out), Some(svg)) = (&args.plot, &svg) {
        if let Err(e) = crate::outfile::write_atomic(out, svg.as_bytes()) {
            // Both or neither: a failed plot takes the JSON written just before with it.
            if let Some(j) = &args.json {
                let _ = std::fs::remove_file(j);
            }
            return Err(e);
        }
    }
    crate::ui::info(table::verdict(&c));
    print(&rendered)?;
    match args.fail_on {
        Some(nats) => gate(&c.overall.paired, nats),
        None => Ok(()),
    }
}

/// A `compare --fail-on` gate that tripped: exit code [`GATE_FAILED`], not an error.
#[derive(Debug)]
pub struct GateFailed(pub String);

impl std::fmt::Display for GateFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GateFailed {}

/// Exit codes: 0 success, 2 a command line that does not parse (clap's), 3 a
/// `compare --fail-on` gate that tripped, 1 any other error.
pub const GATE_FAILED: u8 = 3;

/// `--fail-on NATS`: trips when the delta's 95% lower bound (the point delta when there is
/// no interval) exceeds `nats`.
fn gate(p: &crate::score::paired::Paired, nats: f64) -> Result<()> {
    let (bound, what) = match p.delta_nll_ci95 {
        Some([lo, _]) => (lo, "the 95% interval's lower bound"),
        None => (p.delta_nll, "the delta (one window, no interval)"),
    };
    if bound > nats {
        return Err(GateFailed(format!(
            "fail: new is worse by more than --fail-on {nats} nats/token: {what} is {bound:+.6}"
        ))
        .into());
    }
    Ok(())
}

/// `ninfer-perplexity merge SHARD...`: one report from a sharded run's reports.
pub fn merge(args: MergeArgs) -> Result<()> {
    use crate::report::{plot, table, write};
    crate::ui::set_level(args.log_level);
    let loaded = args
        .shards
        .iter()
        .map(|p| crate::compare::load::load(p))
        .collect::<Result<Vec<_>>>()?;
    let rep = crate::merge::merge(&loaded)?;
    let json = serde_json::to_string_pretty(&rep)?;
    let svg = if args.plot {
        Some(plot::run_plot(&rep)?)
    } else {
        None
    };
    let out = match &args.output {
        Some(dir) => write::OutputDir::claim(dir, write::Claim::AbsentOrEmpty)?,
        // The run id comes from a shard's file: only a sanitized component of it.
        None => write::OutputDir::claim(
            &std::path::PathBuf::from("profiles/perplexity")
                .join(write::safe_component(&rep.run_id)),
            write::Claim::New,
        )?,
    };
    let extras: Vec<(&str, &[u8])> = svg.iter().map(|p| ("plot.svg", p.as_bytes())).collect();
    let path = out.write_report_with(&json, &extras)?;
    crate::ui::info(format!(
        "merged     {} shards: {} scored tokens, mean_nll {:.5}, ppl {:.4}; report {}",
        loaded.len(),
        rep.overall.totals.scored,
        rep.overall.totals.mean_nll,
        rep.overall.totals.ppl,
        path.display()
    ));
    print(&table::render(&rep, args.show_calibration))
}
