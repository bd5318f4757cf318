//! Deliberate perturbations of the CPU forward pass, for tests that prove the regression
//! harness catches drift (`tests/harness/gate.rs`) and for measuring how sensitive a KV
//! format's score is to harmless numerical changes (`eval/results/kv-effect.sh`).
//!
//! Only builds with the cargo feature `fault-injection` read the switch, the environment
//! variable `NINFER_TEST_FAULT`: `cargo test` enables the feature through the crate's
//! dev-dependency on itself, `eval/results/kv-effect.sh` builds with it, and ordinary builds
//! (`cargo build`, `cargo install`, use as a library) compile every perturbation out, so no
//! environment can change a user's numbers. When a fault is active the run says so on stderr
//! and records it in `report.json` (`settings.test_fault`).
//!
//! * `rope-shift`: layer 0's keys are rotated one position too far;
//! * `skip-final-norm`: the output head reads the un-normalized residual stream;
//! * `embed-scale=E`: the embeddings are multiplied by `1 + E` (E = 1e-7 is far below float32
//!   model noise);
//! * `embed-jitter=A`: every window's embedding row at position p is multiplied by
//!   `1 + A·u`, u uniform in [-1, 1) drawn from a process-wide call counter and p: each call
//!   (so each re-run, and each thread schedule) perturbs differently, an artificial stand-in
//!   for a GPU's run-to-run noise when measuring the harness's paired gate;
//! * `pitfall=NAME`: one of the classic mistakes in the hybrid (qwen3_5) math or in MoE
//!   routing ([`Pitfall`]), which the reference tests must catch.

/// The environment variable that selects a fault in `fault-injection` builds.
pub const ENV: &str = "NINFER_TEST_FAULT";

/// One perturbation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    RopeShift,
    SkipFinalNorm,
    EmbedScale(f32),
    EmbedJitter(f32),
    Pitfall(Pitfall),
}

/// Mistakes in the hybrid model's math that each move a tiny model's log-probabilities far
/// beyond the reference bound (`eval/generators/make_hybrid_fixtures.py --pitfalls` measures
/// them in transformers' terms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pitfall {
    /// Zero-centred norms read as the scale `w` instead of `1 + w`.
    NormPlain,
    /// SiLU instead of sigmoid on the attention output gate.
    GateSilu,
    /// q/k norm after RoPE instead of before.
    QkNormAfterRope,
    /// Key heads tiled (`j % Hk`) instead of repeat-interleaved (`j / (Hv/Hk)`).
    KeysTiled,
    /// The convolution's taps reversed.
    ConvReversed,
    /// No `Dk^-1/2` on the Gated DeltaNet queries.
    NoKeyScale,
    /// MoE: one expert fewer than `num_experts_per_tok` per token.
    TopKOffByOne,
    /// MoE: the chosen router probabilities are not renormalised where the family does.
    NoRenorm,
    /// MoE: SiLU instead of sigmoid on the shared expert's gate.
    SharedGateSilu,
}

impl Pitfall {
    pub const ALL: [Pitfall; 6] = [
        Pitfall::NormPlain,
        Pitfall::GateSilu,
        Pitfall::QkNormAfterRope,
        Pitfall::KeysTiled,
        Pitfall::ConvReversed,
        Pitfall::NoKeyScale,
    ];

    /// The routing mistakes of a mixture-of-experts model.
    pub const MOE: [Pitfall; 3] = [
        Pitfall::TopKOffByOne,
        Pitfall::NoRenorm,
        Pitfall::SharedGateSilu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Pitfall::TopKOffByOne => "topk-off-by-one",
            Pitfall::NoRenorm => "no-renorm",
            Pitfall::SharedGateSilu => "shared-gate-silu",
            Pitfall::NormPlain => "norm-plain",
            Pitfall::GateSilu => "gate-silu",
            Pitfall::QkNormAfterRope => "qk-norm-after-rope",
            Pitfall::KeysTiled => "keys-tiled",
            Pitfall::ConvReversed => "conv-reversed",
            Pitfall::NoKeyScale => "no-key-scale",
        }
    }
}

impl Fault {
    /// Parses `rope-shift`, `skip-final-norm` or `embed-scale=E` (E finite).
    pub fn parse(s: &str) -> Result<Fault, String> {
        if let Some(p) = s.strip_prefix("pitfall=") {
            return Pitfall::ALL
                .into_iter()
                .chain(Pitfall::MOE)
                .find(|x| x.name() == p)
                .map(Fault::Pitfall)
                .ok_or_else(|| {
                    let names: Vec<&str> = Pitfall::ALL
                        .iter()
                        .chain(&Pitfall::MOE)
                        .map(|x| x.name())
                        .collect();
                    format!("{ENV}={s:?}: unknown pitfall (valid: {})", names.join(", "))
                });
        }
        match s {
            "rope-shift" => Ok(Fault::RopeShift),
            "skip-final-norm" => Ok(Fault::SkipFinalNorm),
            _ => {
                let num = |p: &str| {
                    s.strip_prefix(p)
                        .and_then(|e| e.parse::<f32>().ok())
                        .filter(|e| e.is_finite())
                };
                num("embed-scale=")
                    .map(Fault::EmbedScale)
                    .or_else(|| num("embed-jitter=").map(Fault::EmbedJitter))
                    .ok_or_else(|| {
                        format!("{ENV}={s:?}: expected rope-shift, skip-final-norm, embed-scale=E or embed-jitter=A")
                    })
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Fault::RopeShift => "rope-shift".into(),
            Fault::SkipFinalNorm => "skip-final-norm".into(),
            Fault::EmbedScale(e) => format!("embed-scale={e:e}"),
            Fault::EmbedJitter(a) => format!("embed-jitter={a:e}"),
            Fault::Pitfall(p) => format!("pitfall={}", p.name()),
        }
    }
}

/// The fault a model runs with: always none unless the build has `fault-injection`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults(Option<Fault>);

impl Faults {
    /// No perturbation.
    pub const NONE: Faults = Faults(None);

    /// `NINFER_TEST_FAULT` in a `fault-injection` build; none otherwise. A value that names
    /// no fault is an error, so a typo never runs the clean model under a fault's label.
    pub fn from_env() -> Result<Faults, String> {
        if !cfg!(feature = "fault-injection") {
            return Ok(Faults::NONE);
        }
        match std::env::var(ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Faults::NONE),
            Err(std::env::VarError::NotUnicode(v)) => Err(format!("{ENV}={v:?}: not UTF-8")),
            Ok(v) => Fault::parse(v.trim()).map(|f| Faults(Some(f))),
        }
    }

    /// A given fault (tests of this crate).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn of(f: Fault) -> Faults {
        Faults(Some(f))
    }

    /// The active fault, for logs and reports.
    pub fn active(&self) -> Option<Fault> {
        if cfg!(feature = "fault-injection") || cfg!(test) {
            self.0
        } else {
            None
        }
    }

    pub fn rope_shift(&self) -> bool {
        self.active() == Some(Fault::RopeShift)
    }

    pub fn skip_final_norm(&self) -> bool {
        self.active() == Some(Fault::SkipFinalNorm)
    }

    pub fn pitfall(&self, p: Pitfall) -> bool {
        self.active() == Some(Fault::Pitfall(p))
    }

    pub fn embed_scale(&self) -> Option<f32> {
        match self.active() {
            Some(Fault::EmbedScale(e)) => Some(e),
            _ => None,
        }
    }

    /// `embed-jitter`'s factors for one call over `len` positions (a fresh draw per call).
    pub fn embed_jitter(&self, len: usize) -> Option<Vec<f32>> {
        let Some(Fault::EmbedJitter(a)) = self.active() else {
            return None;
        };
        static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(
            (0..len as u64)
                .map(|p| {
                    let mut z = (call << 32 ^ p).wrapping_add(0x9E37_79B9_7F4A_7C15);
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    let u = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                    1.0 + a * u
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_typos_are_refused() {
        assert_eq!(Fault::parse("rope-shift"), Ok(Fault::RopeShift));
        assert_eq!(Fault::parse("skip-final-norm"), Ok(Fault::SkipFinalNorm));
        assert_eq!(
            Fault::parse("embed-scale=1e-7"),
            Ok(Fault::EmbedScale(1e-7))
        );
        for bad in ["rope_shift", "embed-scale=", "embed-scale=inf", ""] {
            let e = Fault::parse(bad).unwrap_err();
            assert!(
                e.contains("NINFER_TEST_FAULT") && e.contains("rope-shift"),
                "{e}"
            );
        }
        assert_eq!(Fault::EmbedScale(1e-7).describe(), "embed-scale=1e-7");
        assert_eq!(
            Fault::parse("embed-jitter=1e-4"),
            Ok(Fault::EmbedJitter(1e-4))
        );
        // Each call draws anew, within 1 ± A.
        let f = Faults::of(Fault::EmbedJitter(0.5));
        let (a, b) = (f.embed_jitter(64).unwrap(), f.embed_jitter(64).unwrap());
        assert_ne!(a, b);
        assert!(a.iter().chain(&b).all(|x| (0.5..1.5).contains(x)));
        assert!(Faults::NONE.embed_jitter(4).is_none());
        assert_eq!(
            Fault::parse("pitfall=keys-tiled"),
            Ok(Fault::Pitfall(Pitfall::KeysTiled))
        );
        assert!(Fault::parse("pitfall=nope")
            .unwrap_err()
            .contains("keys-tiled"));
    }
}
