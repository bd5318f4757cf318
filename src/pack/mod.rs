//! Packers: turn models people already have into `.ninfer` artifacts.
//!
//! Every reader produces a [`PackSource`]: a normalized config, a Hugging Face
//! `tokenizer.json`, and f32 tensors under Hugging Face names in the rotate-half RoPE
//! layout (or, for a checkpoint that is already quantized, the matrices as it holds them).
//! The artifact writer then stores them in the requested weight format.

pub mod gguf;
pub mod gguf_tokenizer;
pub mod hf;
pub mod hf_quant;
pub mod moe;
pub mod qwen3_5;
pub mod rows;

pub mod random;

// What every reader produces is the artifact writer's input, defined beside the writer.
pub use crate::artifact::source::{PackSource, SourceFile, SourceTensor, TensorData};
