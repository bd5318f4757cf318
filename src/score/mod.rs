//! Scoring: the window protocol ([`window`]), NLL accumulation ([`stats`]), paired
//! per-window differences of two runs ([`paired`]: `compare`, the gate, a reference pass) and the
//! calibration of the predictive distribution ([`calibration`]), saved references
//! ([`saved`]) and what a bounded top-K record of one would keep ([`topk`]).

pub mod calibration;
pub mod llama_logits;
pub mod paired;
pub mod reference;
pub mod saved;
pub mod stats;
pub mod topk;
pub mod window;

pub use calibration::Calibration;
pub use reference::{PositionPair, ReferenceAcc, ReferenceSummary};
pub use stats::{NllSum, StreamScore, WindowScore};
pub use window::{processed_tokens, windows, Protocol, ProtocolError, Window, WindowPlan};
