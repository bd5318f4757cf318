//! `ninfer-perplexity`: the evaluator's command line.
//!
//! `main` only maps the result to an exit code; `run` does the work and returns errors
//! that are printed as one line (`error: <context>: <cause>`).

use clap::Parser;
use ninfer_perplexity::cli::Args;
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
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
