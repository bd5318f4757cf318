//! The text model: configuration, weights and the CPU reference forward pass.
pub mod config;
