//! The fixed-window, strided, truncated-context protocol.
//!
//! For a stream of `n` tokens, every target `x[1..n)` is scored exactly once. The first
//! window covers `[0, min(C, n))` and scores `[1, min(C, n))`; each later window scores
//! the next `S` targets `[s, min(s + S, n))`, where `s` is the previous window's end, and
//! begins `C - S` tokens earlier (never before 0). Windows share no state: each starts
//! with an empty KV cache at position 0, so a target sees at most `C - 1` tokens of history.

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
}

/// Context and stride, validated: `1 <= stride < context` (so `context >= 2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Protocol {
    pub context: usize,
    pub stride: usize,
}

impl Protocol {
    pub fn new(context: usize, stride: usize) -> Result<Protocol, ProtocolError> {
        if stride == 0 {
            return Err(ProtocolError::ZeroStride { stride });
        }
        if stride >= context {
            return Err(ProtocolError::StrideNotBelowContext { context, stride });
        }
        Ok(Protocol { context, stride })
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
