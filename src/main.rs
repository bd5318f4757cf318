//! `ninfer-perplexity`: the evaluator's command line.
//!
//! `main` only maps the result to an exit code; `run` does the work and returns errors
//! that are printed as one line (`error: <context>: <cause>`).

use clap::Parser;
use ninfer_perplexity::cli::{Args, CompareArgs, MergeArgs};
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    // `compare` is a word, not an artifact: an artifact file of that name is `./compare`.
    // So is `merge`.
    let mut raw = std::env::args_os();
    let word = std::env::args_os().nth(1);
    let result = if word
        .as_ref()
        .is_some_and(|a| a == "compare" || a == "merge")
    {
        let argv0 = raw.next();
        raw.next();
        let argv = std::iter::once(argv0.unwrap_or_default()).chain(raw);
        if word.is_some_and(|a| a == "compare") {
            compare(CompareArgs::parse_from(argv))
        } else {
            merge(MergeArgs::parse_from(argv))
        }
    } else {
        run(Args::parse())
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The report is written; a reader that closed the pipe early wanted no more table.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
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

fn compare(args: CompareArgs) -> anyhow::Result<()> {
    ninfer_perplexity::ui::set_level(args.log_level);
    use ninfer_perplexity::compare::load::load;
    let (base, new) = (load(&args.base)?, load(&args.new)?);
    for out in args.json.iter().chain(&args.plot) {
        ninfer_perplexity::outfile::check_output(out, &[base.path.clone(), new.path.clone()])?;
    }
    if let (Some(a), Some(b)) = (&args.json, &args.plot) {
        if a == b {
            anyhow::bail!("{}: --json and --plot name the same file", a.display());
        }
    }
    let c = ninfer_perplexity::compare::compare(&base, &new)?;
    let svg = match &args.plot {
        Some(_) => Some(ninfer_perplexity::compare::plot::compare_plot(
            &base, &new, &c,
        )?),
        None => None,
    };
    let table = ninfer_perplexity::compare::table::render(&c);
    if let Some(out) = &args.json {
        ninfer_perplexity::compare::write_json(&c, out)?;
    }
    if let (Some(out), Some(svg)) = (&args.plot, &svg) {
        if let Err(e) = ninfer_perplexity::outfile::write_atomic(out, svg.as_bytes()) {
            // Both or neither: a failed plot takes the JSON written just before with it.
            if let Some(j) = &args.json {
                let _ = std::fs::remove_file(j);
            }
            return Err(e);
        }
    }
    ninfer_perplexity::ui::info(ninfer_perplexity::compare::table::verdict(&c));
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(table.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

fn merge(args: MergeArgs) -> anyhow::Result<()> {
    use ninfer_perplexity::report::{table, write};
    use ninfer_perplexity::ui;
    ui::set_level(args.log_level);
    let loaded = args
        .shards
        .iter()
        .map(|p| ninfer_perplexity::compare::load::load(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let rep = ninfer_perplexity::merge::merge(&loaded)?;
    let json = serde_json::to_string_pretty(&rep)?;
    let plot = if args.plot {
        Some(ninfer_perplexity::report::plot::run_plot(&rep)?)
    } else {
        None
    };
    let out = match &args.output {
        Some(dir) => write::OutputDir::claim(dir, write::Claim::AbsentOrEmpty)?,
        None => write::OutputDir::claim(
            &std::path::PathBuf::from("profiles/perplexity").join(&rep.run_id),
            write::Claim::New,
        )?,
    };
    let extras: Vec<(&str, &[u8])> = plot.iter().map(|p| ("plot.svg", p.as_bytes())).collect();
    let path = out.write_report_with(&json, &extras)?;
    ui::info(format!(
        "merged     {} shards: {} scored tokens, mean_nll {:.5}, ppl {:.4}; report {}",
        loaded.len(),
        rep.overall.totals.scored,
        rep.overall.totals.mean_nll,
        rep.overall.totals.ppl,
        path.display()
    ));
    let table = table::render(&rep, args.show_calibration);
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(table.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

fn run(args: Args) -> anyhow::Result<()> {
    let cfg = args.validate()?;
    ninfer_perplexity::ui::set_level(cfg.log_level);
    let out = ninfer_perplexity::run::run(&cfg)?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.table.as_bytes())?;
    stdout.flush()?;
    Ok(())
}
