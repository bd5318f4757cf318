//! CPU reference kernels: f32 activations, fixed reduction orders, and parallelism only
//! over independent outputs (rows, heads), so results are bit-identical for any thread
//! count.

pub mod attention;
pub mod exp;
pub mod head;
pub mod matmul;
pub mod norm;
pub mod rope;
