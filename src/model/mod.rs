//! The text model: configuration, weights and the CPU reference forward pass.
//!
//! The forward pass knows nothing about corpora or windows beyond "score these targets of
//! this token sequence": the window protocol lives in [`crate::score`].

pub mod config;
pub mod forward;
pub mod weights;

pub use config::{Family, ModelConfig};
pub use forward::CpuModel;
