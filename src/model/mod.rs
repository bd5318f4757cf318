//! The text model: configuration, tensor layout, weights and the CPU reference forward pass.
//!
//! The forward pass knows nothing about corpora or windows beyond "score these targets of
//! this token sequence": the window protocol lives in [`crate::score`]. Its helpers each have
//! a module of their own so that [`forward`] reads as the model and nothing else: how a
//! window is split between threads (`split`), where keys and values are stored
//! ([`kv_store`]), the phase timer ([`profile`]) and the test-only perturbations ([`fault`]).

pub mod config;
pub mod delta_net;
pub mod error;
pub mod fault;
pub mod flops;
pub mod forward;
pub mod kv_store;
pub mod layout;
pub mod moe;
pub mod profile;
pub(crate) mod split;
pub mod weights;

#[cfg(test)]
pub(crate) mod synthetic;

pub use config::{Family, ModelConfig};
pub use error::{ForwardError, Part};
pub use forward::CpuModel;
