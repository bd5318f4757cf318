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

fn run(args: Args) -> anyhow::Result<()> {
    let cfg = args.validate()?;
    ninfer_perplexity::ui::set_level(cfg.log_level);
    let out = ninfer_perplexity::run::run(&cfg)?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.table.as_bytes())?;
    stdout.flush()?;
    Ok(())
}
