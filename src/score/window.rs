//! The fixed-window, strided, truncated-context protocol, and two plans other tools publish
//! numbers with.
//!
//! The seed's plan ([`WindowPlan::Sliding`]): for a stream of `n` tokens, every target
//! `x[1..n)` is scored exactly once. The first window covers `[0, min(C, n))` and scores
//! `[1, min(C, n))`; each later window scores the next `S` targets `[s, min(s + S, n))`,
//! where `s` is the previous window's end, and begins `C - S` tokens earlier (never before
//! 0). Windows share no state: each starts with an empty KV cache at position 0, so a target
//! sees at most `C - 1` tokens of history.
//!
//! [`WindowPlan::Disjoint`] (stride equal to the context, as lm-eval's rolling
//! log-likelihood and vLLM's CI score): windows `[kC, min(kC + C, n))`, each scoring every
//! token but its first; a token that starts a window is never scored. [`WindowPlan::KldChunks`]
//! (`llama-perplexity`'s, for its perplexity and its KL divergence alike): `floor(n / C)`
//! chunks `[kC, kC + C)`, each scoring its last `C - 1 - C/2` tokens, so every target has
//! at least `C/2` tokens of history; the `n mod C` tokens after the last chunk are dropped,
//! and, as there, a stream needs at least `2C` tokens. (llama.cpp also overwrites each
//! chunk's first token with BOS when the model adds one; here the tokens are the stream's,
//! which starts with BOS when the tokenizer adds one.)

use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("stride must be at least 1 (got --stride {stride})")]
    ZeroStride { stride: usize },
    #[error("stride must be smaller than the context (got --context {context} --stride {stride})")]
    StrideNotBelowContext { context: usize, stride: usize },
    #[error("a stream needs at least 2 tokens to score anything (it has {tokens})")]
    TooFewTokens { tokens: usize },
    #[error(
        "--window-plan {plan}: the windows have no stride (each is a whole context); drop --stride"
    )]
    StrideGiven { plan: &'static str },
    #[error(
        "--window-plan {plan} needs a context of at least {least} tokens (got --context {context})"
    )]
    ContextTooSmall {
        plan: &'static str,
        least: usize,
        context: usize,
    },
    #[error("--window-plan kld-chunks needs at least 2 x --context tokens in a stream, as llama-perplexity does (a stream of {tokens} tokens, context {context})")]
    TooFewForChunks { tokens: usize, context: usize },
}

/// How a stream is cut into windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WindowPlan {
    /// The seed's strided windows: every target once, up to `C - 1` tokens of history.
    #[default]
    Sliding,
    /// Non-overlapping windows of the context, each scoring all but its first token.
    Disjoint,
    /// `llama-perplexity`'s whole chunks, each scoring its last `C - 1 - C/2` tokens.
    KldChunks,
}

impl WindowPlan {
    pub const ALL: [WindowPlan; 3] = [
        WindowPlan::Sliding,
        WindowPlan::Disjoint,
        WindowPlan::KldChunks,
    ];

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            WindowPlan::Sliding => "sliding",
            WindowPlan::Disjoint => "disjoint",
            WindowPlan::KldChunks => "kld-chunks",
        }
    }

    pub fn parse(s: &str) -> Option<WindowPlan> {
        WindowPlan::ALL.into_iter().find(|p| p.name() == s)
    }

    fn is_sliding(&self) -> bool {
        *self == WindowPlan::Sliding
    }
}

/// Context, stride and plan, validated: for the sliding plan `1 <= stride < context` (so
/// `context >= 2`); the other plans' stride is the context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Protocol {
    pub context: usize,
    pub stride: usize,
    #[serde(default, skip_serializing_if = "WindowPlan::is_sliding")]
    pub plan: WindowPlan,
}

impl Protocol {
    pub fn new(context: usize, stride: usize) -> Result<Protocol, ProtocolError> {
        if stride == 0 {
            return Err(ProtocolError::ZeroStride { stride });
        }
        if stride >= context {
            return Err(ProtocolError::StrideNotBelowContext { context, stride });
        }
        Ok(Protocol {
            context,
            stride,
            plan: WindowPlan::Sliding,
        })
    }

    /// A protocol of `plan`: `stride` is the sliding plan's (`None`: refused there) and must
    /// be absent for the others, whose windows are whole contexts.
    pub fn with_plan(
        plan: WindowPlan,
        context: usize,
        stride: Option<usize>,
    ) -> Result<Protocol, ProtocolError> {
        match (plan, stride) {
            (WindowPlan::Sliding, Some(s)) => Protocol::new(context, s),
            (WindowPlan::Sliding, None) => Err(ProtocolError::ZeroStride { stride: 0 }),
            (p, Some(_)) => Err(ProtocolError::StrideGiven { plan: p.name() }),
            (p, None) => {
                // A window must score something: 2 tokens for disjoint windows, and
                // C - 1 - C/2 >= 1 for a chunk.
                let least = if p == WindowPlan::Disjoint { 2 } else { 3 };
                if context < least {
                    return Err(ProtocolError::ContextTooSmall {
                        plan: p.name(),
                        least,
                        context,
                    });
                }
                Ok(Protocol {
                    context,
                    stride: context,
                    plan: p,
                })
            }
        }
    }

    /// The most input tokens `w` windows of this protocol can come from (merge's check of
    /// recorded counts).
    pub fn most_tokens(&self, w: usize) -> usize {
        match self.plan {
            WindowPlan::Sliding => w
                .saturating_sub(1)
                .saturating_mul(self.stride)
                .saturating_add(self.context),
            WindowPlan::Disjoint => w.saturating_mul(self.context),
            WindowPlan::KldChunks => w
                .saturating_add(1)
                .saturating_mul(self.context)
                .saturating_sub(1),
        }
    }
}

/// One forward pass: tokens `[begin, end)` are fed, targets `[first_target, end)` are
/// scored (`start` in report.json).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub begin: usize,
    #[serde(rename = "start")]
    pub first_target: usize,
    pub end: usize,
}

impl Window {
    /// Tokens fed to the model.
    pub fn len(&self) -> usize {
        self.end - self.begin
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.begin
    }

    /// Targets scored.
    pub fn scored(&self) -> usize {
        self.end - self.first_target
    }
}

/// All windows for a stream of `n` tokens, in order.
pub fn windows(n: usize, p: Protocol) -> Result<Vec<Window>, ProtocolError> {
    if n < 2 {
        return Err(ProtocolError::TooFewTokens { tokens: n });
    }
    let c = p.context;
    match p.plan {
        WindowPlan::Sliding => {}
        WindowPlan::Disjoint => {
            return Ok((0..n)
                .step_by(c)
                .map(|b| Window {
                    begin: b,
                    first_target: b + 1,
                    end: (b + c).min(n),
                })
                .filter(|w| w.end > w.first_target)
                .collect())
        }
        WindowPlan::KldChunks => {
            // llama-perplexity refuses fewer than two chunks' worth of tokens.
            if n < 2 * c {
                return Err(ProtocolError::TooFewForChunks {
                    tokens: n,
                    context: c,
                });
            }
            return Ok((0..n / c)
                .map(|k| Window {
                    begin: k * c,
                    first_target: k * c + c / 2 + 1,
                    end: (k + 1) * c,
                })
                .collect());
        }
    }
    let first_end = p.context.min(n);
    let mut out = vec![Window {
        begin: 0,
        first_target: 1,
        end: first_end,
    }];
    let mut s = first_end;
    while s < n {
        let end = (s + p.stride).min(n);
        let begin = s.saturating_sub(p.context - p.stride);
        out.push(Window {
            begin,
            first_target: s,
            end,
        });
        s = end;
    }
    Ok(out)
}

/// Tokens processed (fed through the model) for a stream of `n` tokens.
pub fn processed_tokens(n: usize, p: Protocol) -> Result<usize, ProtocolError> {
    Ok(windows(n, p)?.iter().map(|w| w.len()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(n: usize, p: Protocol) {
        let ws = windows(n, p).unwrap();
        let mut next = 1;
        for w in &ws {
            assert_eq!(w.first_target, next, "targets contiguous, each once");
            assert!(w.begin < w.first_target && w.first_target < w.end && w.end <= n);
            assert!(w.len() <= p.context, "window longer than the context");
            next = w.end;
        }
        assert_eq!(next, n, "every target up to n-1 scored");
        for w in &ws[1..] {
            assert!(w.scored() <= p.stride);
            assert_eq!(w.begin, w.first_target.saturating_sub(p.context - p.stride));
        }
    }

    #[test]
    fn disjoint_windows_tile_the_stream_and_skip_each_first_token() {
        let p = Protocol::with_plan(WindowPlan::Disjoint, 4, None).unwrap();
        assert_eq!(p.stride, 4);
        let ws = windows(10, p).unwrap();
        let b: Vec<(usize, usize, usize)> = ws
            .iter()
            .map(|w| (w.begin, w.first_target, w.end))
            .collect();
        assert_eq!(b, vec![(0, 1, 4), (4, 5, 8), (8, 9, 10)]);
        // A last window of one token scores nothing and is left out.
        assert_eq!(windows(9, p).unwrap().len(), 2);
        let scored: usize = windows(1000, p).unwrap().iter().map(|w| w.scored()).sum();
        assert_eq!(scored, 1000 - 250);
        assert!(windows(1000, p).unwrap().len() <= 250);
        assert!(1000 <= p.most_tokens(250));
    }

    #[test]
    fn kld_chunks_are_llama_perplexity_s_second_halves() {
        let p = Protocol::with_plan(WindowPlan::KldChunks, 8, None).unwrap();
        // n_ctx 8: first = 4, scored positions 5..8 (n_ctx - 1 - first = 3 per chunk).
        let ws = windows(21, p).unwrap();
        let b: Vec<(usize, usize, usize)> = ws
            .iter()
            .map(|w| (w.begin, w.first_target, w.end))
            .collect();
        assert_eq!(b, vec![(0, 5, 8), (8, 13, 16)]);
        assert!(ws.iter().all(|w| w.scored() == 8 - 1 - 8 / 2));
        assert!(21 <= p.most_tokens(2) && 24 > p.most_tokens(2));
        assert_eq!(
            windows(15, p).unwrap_err(),
            ProtocolError::TooFewForChunks {
                tokens: 15,
                context: 8
            }
        );
        assert_eq!(windows(16, p).unwrap().len(), 2);
        // Odd contexts: C/2 rounds down, as llama.cpp's integer division.
        let p = Protocol::with_plan(WindowPlan::KldChunks, 5, None).unwrap();
        assert_eq!(windows(10, p).unwrap()[0].first_target, 3);
    }

    #[test]
    fn plans_refuse_what_they_cannot_do() {
        for plan in [WindowPlan::Disjoint, WindowPlan::KldChunks] {
            assert_eq!(
                Protocol::with_plan(plan, 8, Some(4)).unwrap_err(),
                ProtocolError::StrideGiven { plan: plan.name() }
            );
            assert!(Protocol::with_plan(plan, 1, None).is_err());
            assert_eq!(WindowPlan::parse(plan.name()), Some(plan));
        }
        assert!(Protocol::with_plan(WindowPlan::KldChunks, 2, None).is_err());
        assert!(Protocol::with_plan(WindowPlan::Disjoint, 2, None).is_ok());
        assert_eq!(
            Protocol::with_plan(WindowPlan::Sliding, 8, Some(4)).unwrap(),
            Protocol::new(8, 4).unwrap()
        );
        // The default plan stays out of serialized protocols (old reports read the same).
        let j = serde_json::to_string(&Protocol::new(8, 4).unwrap()).unwrap();
        assert_eq!(j, r#"{"context":8,"stride":4}"#);
        let d: Protocol = serde_json::from_str(&j).unwrap();
        assert_eq!(d.plan, WindowPlan::Sliding);
    }

    #[test]
    fn short_stream_is_one_window() {
        let p = Protocol::new(8, 4).unwrap();
        assert_eq!(
            windows(5, p).unwrap(),
            vec![Window {
                begin: 0,
                first_target: 1,
                end: 5
            }]
        );
        assert_eq!(
            windows(8, p).unwrap(),
            vec![Window {
                begin: 0,
                first_target: 1,
                end: 8
            }]
        );
    }

    #[test]
    fn one_past_context_adds_a_one_target_window() {
        let p = Protocol::new(8, 4).unwrap();
        assert_eq!(
            windows(9, p).unwrap(),
            vec![
                Window {
                    begin: 0,
                    first_target: 1,
                    end: 8
                },
                Window {
                    begin: 4,
                    first_target: 8,
                    end: 9
                }
            ]
        );
    }

    #[test]
    fn stride_one_and_stride_c_minus_one() {
        let p = Protocol::new(4, 1).unwrap();
        let ws = windows(7, p).unwrap();
        assert_eq!(
            ws[1],
            Window {
                begin: 1,
                first_target: 4,
                end: 5
            }
        );
        assert_eq!(ws.len(), 4);
        let p = Protocol::new(4, 3).unwrap();
        let ws = windows(11, p).unwrap();
        assert_eq!(
            ws[1],
            Window {
                begin: 3,
                first_target: 4,
                end: 7
            }
        );
        assert_eq!(
            ws.last().unwrap(),
            &Window {
                begin: 9,
                first_target: 10,
                end: 11
            }
        );
    }

    #[test]
    fn last_window_is_partial() {
        let p = Protocol::new(64, 32).unwrap();
        let ws = windows(100, p).unwrap();
        assert_eq!(ws.len(), 3);
        assert_eq!(
            ws[2],
            Window {
                begin: 64,
                first_target: 96,
                end: 100
            }
        );
        check(100, p);
    }

    #[test]
    fn invalid_protocols_and_streams_are_errors() {
        assert_eq!(
            Protocol::new(8, 0),
            Err(ProtocolError::ZeroStride { stride: 0 })
        );
        assert_eq!(
            Protocol::new(8, 8),
            Err(ProtocolError::StrideNotBelowContext {
                context: 8,
                stride: 8
            })
        );
        assert!(Protocol::new(1, 1).is_err(), "C < 2 leaves no valid stride");
        assert!(Protocol::new(0, 0).is_err());
        let p = Protocol::new(8, 4).unwrap();
        assert_eq!(
            windows(1, p),
            Err(ProtocolError::TooFewTokens { tokens: 1 })
        );
        assert_eq!(
            windows(0, p),
            Err(ProtocolError::TooFewTokens { tokens: 0 })
        );
        assert!(windows(2, p).is_ok());
    }

    #[test]
    fn error_text_names_the_flags() {
        let e = Protocol::new(16, 16).unwrap_err().to_string();
        assert!(e.contains("--context 16 --stride 16"), "{e}");
    }

    proptest! {
        #[test]
        fn every_target_exactly_once(n in 2usize..3000, c in 2usize..600, s_frac in 0.0f64..1.0) {
            let s = 1 + ((c - 1) as f64 * s_frac) as usize;
            let s = s.min(c - 1);
            check(n, Protocol::new(c, s).unwrap());
        }
    }
}
