//! The paired drift gate for tiers whose re-runs are not bit-exact (GPUs: cuBLAS algorithm
//! choice, batch composition, rounding flips in quantized KV).
//!
//! A trial scores the same windows as its baseline, so it is judged on the paired per-window
//! difference `Δ = Σ (new_w − base_w) / Σ n_w` (nats per token) and its cluster-robust
//! standard error `se` over windows, exactly as `compare` computes them
//! ([`crate::score::paired`]). The registry states, per artifact and KV format, the smallest
//! drift that must be caught, θ (nats per token), the false-alarm rate α and the miss rate β.
//! The gate fails the trial when `|Δ| > T` with
//!
//! ```text
//! T = θ − t(1 − β, G − 1) · se        (any true drift ≥ θ fails with probability ≥ 1 − β)
//! T ≥ t(1 − α/2, G − 1) · se          (pure noise, Δ = 0, fails with probability ≤ α)
//! ```
//!
//! over `G` windows. When the two cannot both hold (`θ < (t_α + t_β) · se`) the trial cannot
//! tell θ from noise and is reported as underpowered, which fails it too: a gate that cannot
//! see θ must not pass silently. Drifts between `T` and θ are the grey zone every test with
//! finite data has; putting `T` as high as β allows keeps legitimate last-bit changes (far
//! below θ) from failing.
//!
//! θ is never typed in: [`propose_theta`] derives it from the standard errors measured over
//! repeated runs (the registry keeps them beside θ) as the smallest θ the gate can detect at
//! α and β, times a stated margin.

use crate::score::paired::{paired, Paired, WindowPair};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use statrs::distribution::{ContinuousCDF, StudentsT};

/// What the gate is asked to guarantee.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateSpec {
    /// Smallest drift to catch, nats per token.
    pub theta: f64,
    /// Largest false-alarm rate on pure noise (two-sided).
    pub alpha: f64,
    /// Largest miss rate at a drift of θ.
    pub beta: f64,
}

impl GateSpec {
    /// Refuses values the test cannot mean: θ positive and finite, α and β in (0, 0.5].
    pub fn validate(&self) -> Result<()> {
        if !(self.theta.is_finite() && self.theta > 0.0) {
            bail!(
                "theta must be a positive number of nats per token, not {}",
                self.theta
            );
        }
        for (name, v) in [("alpha", self.alpha), ("beta", self.beta)] {
            if !(v > 0.0 && v <= 0.5) {
                bail!("{name} must be in (0, 0.5], not {v}");
            }
        }
        Ok(())
    }
}

impl GateSpec {
    /// The spec each of `m` trials judged in one run is held to so that the run as a whole
    /// keeps α: α/m per trial (Bonferroni), β unchanged (the power against a drift of θ in
    /// any one trial).
    ///
    /// Why Bonferroni and not Holm or Benjamini–Hochberg: the harness's trials are separate
    /// tests, run in separate processes when nextest spreads them over runners, so a trial
    /// can know the family's size but not the other trials' p-values. Holm's first step is
    /// this same α/m; it gains power only once a trial has already failed, which changes no
    /// verdict of a run (it fails either way). BH would bound a false-discovery rate, a
    /// weaker promise than "pure noise fails nothing, with probability 1 − α".
    pub fn in_family(self, m: usize) -> GateSpec {
        GateSpec {
            alpha: self.alpha / m.max(1) as f64,
            ..self
        }
    }
}

/// One-sided Student-t quantile `t(p, df)`; the normal quantile when `df` is infinite.
fn t_quantile(p: f64, df: usize) -> f64 {
    let t = StudentsT::new(0.0, 1.0, df.max(1) as f64).expect("positive degrees of freedom");
    t.inverse_cdf(p)
}

/// The two critical multipliers of `se` for `windows` windows: (noise, power).
pub fn multipliers(spec: &GateSpec, windows: usize) -> (f64, f64) {
    let df = windows.saturating_sub(1).max(1);
    (
        t_quantile(1.0 - spec.alpha / 2.0, df),
        t_quantile(1.0 - spec.beta, df),
    )
}

/// What the gate concluded.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// |Δ| ≤ T.
    Pass,
    /// |Δ| > T: a drift of θ or more is the likely explanation.
    Drift,
    /// θ cannot be told from noise with these windows (θ < (t_α + t_β) · se).
    Underpowered,
}

/// The gate's decision with everything its message prints.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub outcome: Outcome,
    pub spec: GateSpec,
    pub paired: Paired,
    /// The standard error used (0 when every window moved by the same per-token amount or
    /// not at all).
    pub se: f64,
    /// The threshold T on |Δ| (meaningful unless underpowered).
    pub threshold: f64,
    /// The smallest drift these windows can detect at α and β: `(t_α + t_β) · se`.
    pub detectable: f64,
}

impl Decision {
    pub fn passed(&self) -> bool {
        self.outcome == Outcome::Pass
    }

    /// One line: ΔNLL, its interval, θ, T and the verdict in words.
    pub fn message(&self) -> String {
        let p = &self.paired;
        let ci = p
            .delta_nll_ci95
            .map_or("no interval (one window)".to_string(), |c| {
                format!("95% CI [{:+.3e}, {:+.3e}]", c[0], c[1])
            });
        let s = &self.spec;
        let head = format!(
            "paired ΔNLL {:+.3e} nats/token over {} windows ({ci}, se {:.2e}); θ {:.3e}, α {}, β {}",
            p.delta_nll, p.windows, self.se, s.theta, s.alpha, s.beta
        );
        match self.outcome {
            Outcome::Pass => format!(
                "{head}: |ΔNLL| ≤ threshold {:.3e}: no drift of θ or more (a drift of θ would fail {:.0}% of the time)",
                self.threshold,
                100.0 * (1.0 - s.beta)
            ),
            Outcome::Drift => format!(
                "{head}: |ΔNLL| > threshold {:.3e}: drift detected (pure noise exceeds it less than {:.1}% of the time)",
                self.threshold,
                100.0 * s.alpha
            ),
            Outcome::Underpowered => format!(
                "{head}: underpowered: these windows detect only drifts of {:.3e} or more at α and β, above θ; measure the spread again or raise θ",
                self.detectable
            ),
        }
    }
}

/// Judges a trial's windows against its baseline's.
pub fn decide(windows: &[WindowPair], spec: GateSpec) -> Result<Decision> {
    spec.validate()?;
    let p = paired(windows)?;
    // One window has no spread estimate: only an exact repeat can be judged.
    let se = match p.delta_nll_std_err {
        Some(se) => se,
        None if p.delta_nll == 0.0 => 0.0,
        None => f64::INFINITY,
    };
    let (ta, tb) = multipliers(&spec, p.windows);
    let detectable = (ta + tb) * se;
    let threshold = spec.theta - tb * se;
    let outcome = if detectable > spec.theta {
        Outcome::Underpowered
    } else if p.delta_nll.abs() > threshold {
        Outcome::Drift
    } else {
        Outcome::Pass
    };
    Ok(Decision {
        outcome,
        spec,
        se,
        threshold,
        detectable,
        paired: p,
    })
}

/// The smallest θ the gate detects at α and β given run-to-run standard errors measured on
/// `windows` windows (each the paired se of one repeated run against another), times
/// `margin` (≥ 1): `margin · (t_α + t_β) · max(se)`.
pub fn propose_theta(
    ses: &[f64],
    windows: usize,
    alpha: f64,
    beta: f64,
    margin: f64,
) -> Result<f64> {
    if ses.is_empty() {
        bail!("no repeated runs to measure the spread from");
    }
    if let Some(s) = ses.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
        bail!("a measured standard error is not a non-negative number: {s}");
    }
    if !(margin.is_finite() && margin >= 1.0) {
        bail!("the margin must be at least 1, not {margin}");
    }
    let spec = GateSpec {
        theta: 1.0,
        alpha,
        beta,
    };
    spec.validate()?;
    let (ta, tb) = multipliers(&spec, windows);
    let worst = ses.iter().copied().fold(0.0, f64::max);
    Ok(margin * (ta + tb) * worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::score::paired::tests::Rng;

    /// `g` windows of `n` scored tokens; the new run is the base plus a per-token drift
    /// `delta` and per-window noise of standard deviation `sd` nats (per window sum).
    fn windows(rng: &mut Rng, g: usize, n: u64, delta: f64, sd: f64) -> Vec<WindowPair> {
        (0..g)
            .map(|_| {
                let base = n as f64 * (2.0 + 0.5 * rng.normal());
                WindowPair {
                    scored: n,
                    base,
                    new: base + delta * n as f64 + sd * rng.normal(),
                }
            })
            .collect()
    }

    const SPEC: GateSpec = GateSpec {
        theta: 1e-3,
        alpha: 0.05,
        beta: 0.1,
    };

    #[test]
    fn an_exact_repeat_passes_and_any_drift_of_theta_fails() {
        let mut rng = Rng(1);
        let w = windows(&mut rng, 40, 256, 0.0, 0.0);
        let d = decide(&w, SPEC).unwrap();
        assert_eq!(d.outcome, Outcome::Pass, "{}", d.message());
        assert_eq!(d.threshold, SPEC.theta);
        // The whole run shifted by θ (no noise): caught.
        let w = windows(&mut Rng(1), 40, 256, 1e-3 * 1.0001, 0.0);
        let d = decide(&w, SPEC).unwrap();
        assert_eq!(d.outcome, Outcome::Drift, "{}", d.message());
        assert!(d.message().contains("drift detected"), "{}", d.message());
    }

    /// Pure noise fails at most α of the time, a planted drift of θ is caught at least 1 − β
    /// of the time (2000 simulated trials each, θ set as [`propose_theta`] sets it with a
    /// margin of 2: θ = 2 (t_α + t_β) · se). A trial's own se fluctuates, so an underpowered
    /// verdict is possible and counts as a failure here.
    #[test]
    fn false_alarms_and_misses_stay_within_alpha_and_beta() {
        let (g, n) = (60usize, 256u64);
        let (ta, tb) = multipliers(&SPEC, g);
        // se ≈ sd / (n · sqrt(g)) for equal windows.
        let se = SPEC.theta / (2.0 * (ta + tb));
        let sd = se * n as f64 * (g as f64).sqrt();
        let mut rng = Rng(7);
        let trials = 2000;
        let rate = |delta: f64, rng: &mut Rng| {
            let mut fails = 0;
            for _ in 0..trials {
                let d = decide(&windows(rng, g, n, delta, sd), SPEC).unwrap();
                fails += (!d.passed()) as usize;
            }
            fails as f64 / trials as f64
        };
        let false_alarm = rate(0.0, &mut rng);
        let power = rate(SPEC.theta, &mut rng);
        // Binomial sampling error of 2000 trials: about 0.5% at 5%, 0.7% at 90%.
        assert!(
            false_alarm <= SPEC.alpha + 0.015,
            "false alarms {false_alarm}"
        );
        assert!(power >= 1.0 - SPEC.beta - 0.02, "power {power}");
        eprintln!("false alarms {false_alarm:.4}, power at θ {power:.4}");
    }

    /// Runs of `m` = 96 gated trials (the GPU tier's matrix for one artifact: 16 streams ×
    /// 6 KV formats) of `g` = 60 windows, θ set by [`propose_theta`]'s rule with `margin` from
    /// the true se: (share of pure-noise runs where any trial fails with θ derived for one
    /// trial at α; the same with θ derived at α/m and every trial judged at α/m; the share of
    /// runs where a drift of θ planted in one trial is caught; the share where the one-trial θ
    /// judged in the family fails, as underpowered).
    fn family_rates(margin: f64) -> (f64, f64, f64, f64) {
        let (m, g, n, runs) = (96usize, 60usize, 256u64, 400usize);
        let sd = 1.0; // per window; se ≈ sd / (n · sqrt(g))
        let se = sd / (n as f64 * (g as f64).sqrt());
        let theta_for = |spec: GateSpec| {
            let (ta, tb) = multipliers(&spec, g);
            GateSpec {
                theta: margin * (ta + tb) * se,
                ..spec
            }
        };
        let single = theta_for(SPEC);
        let family = theta_for(SPEC.in_family(m));
        let mut rng = Rng(11);
        // (share of runs where a noise-only trial failed, share where trial 0 failed)
        let mut run = |spec: GateSpec, planted: f64| {
            let (mut any_noise, mut first) = (0usize, 0usize);
            for _ in 0..runs {
                let mut any = false;
                for t in 0..m {
                    let delta = if t == 0 { planted } else { 0.0 };
                    let failed = !decide(&windows(&mut rng, g, n, delta, sd), spec)
                        .unwrap()
                        .passed();
                    if t == 0 {
                        first += failed as usize;
                    }
                    if t > 0 || planted == 0.0 {
                        any |= failed;
                    }
                }
                any_noise += any as usize;
            }
            (any_noise as f64 / runs as f64, first as f64 / runs as f64)
        };
        let (uncorrected, _) = run(single, 0.0);
        let (fwer, _) = run(family, 0.0);
        let (_, power) = run(family, family.theta);
        let (_, stale) = run(
            GateSpec {
                theta: single.theta,
                ..family
            },
            0.0,
        );
        eprintln!(
            "margin {margin}, {m} trials on noise: a run fails somewhere {:.1}% with θ for one trial, {:.1}% with θ for the family; a drift of θ in one trial caught {:.1}%; a one-trial θ judged in the family fails {:.1}% (underpowered)",
            100.0 * uncorrected,
            100.0 * fwer,
            100.0 * power,
            100.0 * stale
        );
        (uncorrected, fwer, power, stale)
    }

    /// Without family control a thin margin lets pure noise fail some trial in far more than
    /// α of the runs; with it (θ derived at α/m, trials judged at α/m, the margin covering
    /// the se estimate's own noise) at most α of the runs fail anywhere, and a drift of θ is
    /// still caught at 1 − β.
    #[test]
    fn a_family_of_trials_keeps_its_false_alarm_rate_at_alpha() {
        let (uncorrected, ..) = family_rates(1.3);
        assert!(
            uncorrected > 3.0 * SPEC.alpha,
            "uncorrected family-wise rate {uncorrected}"
        );
        let (_, fwer, power, _) = family_rates(1.5);
        // Binomial sampling error of 400 runs: about 1.1 points at 5%, 1.5 at 90%.
        assert!(fwer <= SPEC.alpha + 0.03, "family-wise false alarms {fwer}");
        assert!(power >= 1.0 - SPEC.beta - 0.04, "power {power}");
    }

    #[test]
    fn noise_too_large_for_theta_is_underpowered_not_a_pass() {
        let mut rng = Rng(3);
        let w = windows(&mut rng, 10, 256, 0.0, 50.0);
        let d = decide(&w, SPEC).unwrap();
        assert_eq!(d.outcome, Outcome::Underpowered, "{}", d.message());
        assert!(!d.passed());
        assert!(d.message().contains("underpowered"), "{}", d.message());
        // One window that moved: no spread estimate, nothing can be concluded.
        let one = [WindowPair {
            scored: 10,
            base: 20.0,
            new: 20.001,
        }];
        assert_eq!(decide(&one, SPEC).unwrap().outcome, Outcome::Underpowered);
    }

    #[test]
    fn proposed_theta_is_just_detectable_and_bad_specs_are_refused() {
        let g = 60;
        let theta = propose_theta(&[1e-5, 3e-5, 2e-5], g, 0.05, 0.1, 1.5).unwrap();
        let (ta, tb) = multipliers(&SPEC, g);
        assert!((theta - 1.5 * (ta + tb) * 3e-5).abs() < 1e-15);
        assert!(propose_theta(&[], g, 0.05, 0.1, 1.5).is_err());
        assert!(propose_theta(&[f64::NAN], g, 0.05, 0.1, 1.5).is_err());
        assert!(propose_theta(&[1e-5], g, 0.05, 0.1, 0.5).is_err());
        for bad in [
            GateSpec { theta: 0.0, ..SPEC },
            GateSpec { alpha: 0.0, ..SPEC },
            GateSpec { beta: 0.7, ..SPEC },
            GateSpec {
                theta: f64::NAN,
                ..SPEC
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
