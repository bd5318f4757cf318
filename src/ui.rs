//! Human output on stderr: leveled log lines and scoring progress.
//!
//! On a terminal, progress is one transient line (redrawn in place, cleared at the end);
//! when stderr is redirected, a persistent line is printed every 10 seconds of wall time
//! instead (also while one long window runs: the CPU model reports each layer it finishes),
//! so CI logs show progress without carriage-return noise.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
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

/// Rows times layers the CPU model has finished in this process: a layer over `n` rows adds
/// `n`. Divided by the number of layers it is the tokens processed so far, also inside a
/// window, so that progress moves while a long window (65536 tokens, say) is still running.
static LAYER_ROWS: AtomicU64 = AtomicU64::new(0);

/// Called by the CPU model after each layer over `rows` rows.
pub fn layer_rows_done(rows: usize) {
    LAYER_ROWS.fetch_add(rows as u64, Ordering::Relaxed);
}

/// How often a redirected progress line is printed.
const EVERY: Duration = Duration::from_secs(10);
/// How often the ticker looks at the work done.
const TICK: Duration = Duration::from_millis(200);

struct State {
    /// Units finished, as the caller last said (tokens of finished windows).
    done: u64,
    total: u64,
    label: String,
    /// Layers per unit, when the units are tokens the CPU model processes (see
    /// [`layer_rows_done`]); 0 when progress moves only with [`ProgressLine::update`].
    layers: u64,
    /// [`LAYER_ROWS`] when this line began.
    rows_base: u64,
}

impl State {
    /// The best estimate of units done: the caller's count, or the layers finished since
    /// when that is further along (never past the total).
    fn estimate(&self) -> u64 {
        self.estimate_at(LAYER_ROWS.load(Ordering::Relaxed))
    }

    /// [`State::estimate`] when [`LAYER_ROWS`] is `rows_now`.
    fn estimate_at(&self, rows_now: u64) -> u64 {
        if self.layers == 0 {
            return self.done;
        }
        let rows = rows_now.saturating_sub(self.rows_base);
        (rows / self.layers).clamp(self.done, self.total.saturating_sub(1).max(self.done))
    }
}

/// A progress line over a known number of units (tensors loaded, tokens scored). A ticker
/// thread redraws it: on a terminal one transient line, when redirected a persistent line
/// every 10 s of wall time, also while a long window is running (a heartbeat).
pub struct ProgressLine {
    bar: Option<indicatif::ProgressBar>,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    ticker: Option<std::thread::JoinHandle<()>>,
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

/// One redirected progress line.
fn line(label: &str, done: u64, total: u64, unit: &str, elapsed: f64) -> String {
    let rate = done as f64 / elapsed.max(1e-9);
    let eta = if done == 0 {
        f64::NAN
    } else {
        total.saturating_sub(done) as f64 / rate
    };
    format!(
        "progress: {label} {done}/{total} {unit} ({:.1}%), {rate:.1} {unit}/s, {:.0}s elapsed, ETA {}",
        100.0 * done as f64 / total.max(1) as f64,
        elapsed,
        fmt_eta(eta),
    )
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
        let state = Arc::new(Mutex::new(State {
            done: 0,
            total,
            label: label.into(),
            layers: 0,
            rows_base: LAYER_ROWS.load(Ordering::Relaxed),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let ticker = enabled.then(|| {
            let (state, stop, bar, unit) =
                (state.clone(), stop.clone(), bar.clone(), unit.to_string());
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut last_line = started;
                while !stop.load(Ordering::Relaxed) {
                    std::thread::park_timeout(TICK);
                    let s = state.lock().unwrap_or_else(|e| e.into_inner());
                    let done = s.estimate();
                    match &bar {
                        Some(b) => b.set_position(done),
                        None if last_line.elapsed() >= EVERY => {
                            last_line = Instant::now();
                            let l = line(
                                &s.label,
                                done,
                                s.total,
                                &unit,
                                started.elapsed().as_secs_f64(),
                            );
                            drop(s);
                            eprintln!("{l}");
                        }
                        None => {}
                    }
                }
            })
        });
        ProgressLine {
            bar,
            state,
            stop,
            ticker,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the total once it is known.
    pub fn set_total(&mut self, total: u64) {
        self.state().total = total;
        if let Some(b) = &self.bar {
            b.set_length(total);
        }
    }

    /// The units are tokens the CPU model processes through `layers` layers: progress moves
    /// with every layer it finishes, not only with [`ProgressLine::update`].
    pub fn track_layers(&mut self, layers: usize) {
        let mut s = self.state();
        s.layers = layers as u64;
        s.rows_base = LAYER_ROWS.load(Ordering::Relaxed);
    }

    pub fn set_message(&mut self, msg: &str) {
        self.state().label = msg.to_string();
        if let Some(b) = &self.bar {
            b.set_message(msg.to_string());
        }
    }

    /// `done` units finished so far (over the whole run).
    pub fn update(&mut self, done: u64) {
        let mut s = self.state();
        s.done = done;
        if let Some(b) = &self.bar {
            b.set_position(s.estimate());
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
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            t.thread().unpark();
            let _ = t.join();
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_move_the_estimate_between_the_callers_counts() {
        let base = 1_000_000;
        let mut s = State {
            done: 100,
            total: 1000,
            label: "x".into(),
            layers: 4,
            rows_base: base,
        };
        assert_eq!(
            s.estimate_at(base),
            100,
            "no layer finished since: the caller's count"
        );
        assert_eq!(s.estimate_at(base + 4 * 300), 300);
        assert_eq!(
            s.estimate_at(base + 4 * 10_000),
            999,
            "short of the total until the caller says done"
        );
        s.done = 1000;
        assert_eq!(s.estimate_at(base + 4 * 10_000), 1000);
        s.done = 100;
        s.layers = 0;
        assert_eq!(s.estimate_at(base + 4 * 300), 100, "not tracking layers");
    }

    #[test]
    fn a_line_says_done_rate_elapsed_and_eta() {
        assert_eq!(
            line("en-1", 250, 1000, "tokens", 10.0),
            "progress: en-1 250/1000 tokens (25.0%), 25.0 tokens/s, 10s elapsed, ETA 30s"
        );
        assert!(line("en-1", 0, 1000, "tokens", 10.0).ends_with("ETA ?"));
    }
}
