//! Wall-clock time per phase of the CPU forward pass, printed to stderr when the environment
//! variable `NINFER_PROFILE` is `1` as the model is built.
//!
//! This is the profile of the real pipeline, buffers and all, which `benches/ops.rs` (each op
//! alone) cannot give. Off, it costs one branch per phase. It never changes a result.

use crate::backend::cpu::matmul::Picker;
use std::time::Instant;

/// The phases a window's time is charged to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Norms,
    Qkv,
    /// Embedding gather, the q/k/v split, q/k norm, RoPE and the KV representation.
    QkvPrep,
    Attention,
    OProj,
    GateUp,
    Swiglu,
    Down,
    Head,
}

impl Phase {
    const ALL: [Phase; 9] = [
        Phase::Norms,
        Phase::Qkv,
        Phase::QkvPrep,
        Phase::Attention,
        Phase::OProj,
        Phase::GateUp,
        Phase::Swiglu,
        Phase::Down,
        Phase::Head,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Norms => "norms",
            Phase::Qkv => "qkv",
            Phase::QkvPrep => "embed/split/rope/kv",
            Phase::Attention => "attention",
            Phase::OProj => "o-proj",
            Phase::GateUp => "gate/up",
            Phase::Swiglu => "swiglu",
            Phase::Down => "down",
            Phase::Head => "head",
        }
    }
}

/// Whether `NINFER_PROFILE=1` is set.
pub fn enabled_by_env() -> bool {
    std::env::var("NINFER_PROFILE").is_ok_and(|v| v == "1")
}

/// Accumulated time per phase of one window (or one part of a split window).
pub struct Laps {
    on: bool,
    last: Instant,
    acc: [f64; Phase::ALL.len()],
}

impl Laps {
    pub fn new(on: bool) -> Laps {
        Laps {
            on,
            last: Instant::now(),
            acc: [0.0; Phase::ALL.len()],
        }
    }

    /// Charges the time since the previous lap to `phase`.
    pub fn lap(&mut self, phase: Phase) {
        if self.on {
            let now = Instant::now();
            self.acc[phase as usize] += (now - self.last).as_secs_f64();
            self.last = now;
        }
    }

    /// Prints the phases under `label` (what was timed).
    pub fn report(&self, label: &str) {
        if self.on {
            let total: f64 = self.acc.iter().sum();
            let parts: Vec<String> = Phase::ALL
                .iter()
                .zip(&self.acc)
                .map(|(p, s)| format!("{} {:.0} ms", p.name(), s * 1e3))
                .collect();
            eprintln!(
                "profile: {label}, {:.0} ms: {}",
                total * 1e3,
                parts.join(", ")
            );
            eprintln!("profile: GEMM runs so far, {}", Picker::summary());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_index_their_own_slot() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{}", p.name());
        }
    }
}
