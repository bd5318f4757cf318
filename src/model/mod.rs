//! What a text model is, independent of where it runs: its configuration ([`config`]), the
//! tree of its parts and the artifact tensors they are made of ([`layout`]), the FLOPs a
//! window costs ([`flops`]), and how a forward pass fails ([`error`], the same on every
//! backend).
//!
//! The forward passes themselves are the backends': the CPU reference in
//! `backend/cpu/model/` (the numerical specification) and its CUDA twin in
//! `backend/cuda/model/`, file for file.

pub mod config;
pub mod error;
pub mod flops;
pub mod layout;
pub mod pass;
pub mod presets;

pub use config::{Family, ModelConfig};
pub use error::{ForwardError, Part};
