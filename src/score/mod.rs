//! Scoring: the window protocol ([`window`]) and NLL accumulation ([`stats`]).

pub mod stats;
pub mod window;

pub use stats::{NllSum, StreamScore, WindowScore};
pub use window::{processed_tokens, windows, Protocol, ProtocolError, Window};
