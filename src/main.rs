//! `ninfer-perplexity`: the evaluator's command line. Parsing and the modes live in the
//! library (`ninfer_perplexity::app`); this file only dispatches.

use ninfer_perplexity::app::{self, Command};
use std::process::ExitCode;

fn main() -> ExitCode {
    app::exit(try_main())
}

fn try_main() -> anyhow::Result<()> {
    match Command::from_args(std::env::args_os()) {
        Command::Run(args) => app::run(args),
        Command::Compare(args) => app::compare(args),
        Command::Merge(args) => app::merge(args),
    }
}
