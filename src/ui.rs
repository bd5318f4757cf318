//! Human output on stderr: leveled log lines and scoring progress.
//!
//! On a terminal, progress is one transient line (redrawn in place, cleared at the end);
//! when stderr is redirected, a persistent line is printed every 10 seconds instead, so
//! CI logs show progress without carriage-return noise.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
}

/// The process's stderr verbosity, set once by the command line ([`set_level`]); library
/// code (the CUDA backend's planning details, for instance) logs through the same functions,
/// so `--log-level` governs every line.
static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Info as u8);

pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether lines of `level` are printed.
pub fn enabled(level: LogLevel) -> bool {
    level as u8 <= LEVEL.load(Ordering::Relaxed)
}

pub fn info(msg: impl AsRef<str>) {
    if enabled(LogLevel::Info) {
        eprintln!("{}", msg.as_ref());
    }
}

pub fn warn(msg: impl AsRef<str>) {
    if enabled(LogLevel::Warn) {
        eprintln!("warning: {}", msg.as_ref());
    }
}

pub fn debug(msg: impl AsRef<str>) {
    if enabled(LogLevel::Debug) {
        eprintln!("debug: {}", msg.as_ref());
    }
}

/// A progress line over a known number of units (tensors loaded, tokens scored).
pub struct ProgressLine {
    bar: Option<indicatif::ProgressBar>,
    total: u64,
    started: Instant,
    last_line: Instant,
    every: Duration,
    enabled: bool,
    label: String,
    unit: String,
}

fn fmt_eta(secs: f64) -> String {
    if !secs.is_finite() {
        return "?".into();
    }
    let s = secs.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

impl ProgressLine {
    pub fn new(label: &str, total: u64, unit: &str) -> ProgressLine {
        let enabled = enabled(LogLevel::Info);
        let bar = if enabled && std::io::stderr().is_terminal() {
            let b = indicatif::ProgressBar::with_draw_target(
                Some(total),
                indicatif::ProgressDrawTarget::stderr(),
            );
            b.set_style(
                indicatif::ProgressStyle::with_template(&format!(
                    "{{msg}} {{wide_bar}} {{pos}}/{{len}} {unit} {{per_sec}} ETA {{eta}}"
                ))
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b.set_message(label.to_string());
            Some(b)
        } else {
            None
        };
        let now = Instant::now();
        ProgressLine {
            bar,
            total,
            started: now,
            last_line: now,
            every: Duration::from_secs(10),
            enabled,
            label: label.into(),
            unit: unit.into(),
        }
    }

    /// Sets the total once it is known.
    pub fn set_total(&mut self, total: u64) {
        if self.total != total {
            self.total = total;
            if let Some(b) = &self.bar {
                b.set_length(total);
            }
        }
    }

    pub fn set_message(&mut self, msg: &str) {
        self.label = msg.to_string();
        if let Some(b) = &self.bar {
            b.set_message(msg.to_string());
        }
    }

    /// `done` tokens processed so far (over the whole run).
    pub fn update(&mut self, done: u64) {
        if let Some(b) = &self.bar {
            b.set_position(done);
            return;
        }
        if self.enabled && self.last_line.elapsed() >= self.every {
            self.last_line = Instant::now();
            let el = self.started.elapsed().as_secs_f64();
            let rate = done as f64 / el.max(1e-9);
            let eta = (self.total.saturating_sub(done)) as f64 / rate;
            eprintln!(
                "progress: {} {done}/{} {unit} ({:.1}%), {:.1} {unit}/s, ETA {}",
                self.label,
                self.total,
                100.0 * done as f64 / self.total.max(1) as f64,
                rate,
                fmt_eta(eta),
                unit = self.unit
            );
        }
    }

    /// Runs `f` (which prints to stderr) without garbling the transient line.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

impl Drop for ProgressLine {
    fn drop(&mut self) {
        self.finish();
    }
}
