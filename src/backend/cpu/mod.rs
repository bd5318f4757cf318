//! CPU reference kernels: f32 activations, fixed reduction orders, and parallelism only
//! over independent outputs (rows, heads), so results are bit-identical for any thread
//! count.

pub mod attention;
pub mod delta_rule;
pub mod exp;
pub mod head;
pub mod head_pair;
pub mod head_pair_js;
pub mod isa;
pub mod matmul;
pub mod model;
pub mod norm;
pub mod operand;
pub mod rope;
pub mod sgemm16;

/// An output pointer shared by parallel tasks that each write a disjoint part of it (every
/// use says which part in its `// SAFETY:` comment).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: the pointer is only written through by tasks that own disjoint ranges, and only
// while the buffer it came from is borrowed mutably by the caller that spawned them.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// Through a method, so closures capture the `Sync` wrapper rather than the raw field.
    pub(crate) fn get(&self) -> *mut f32 {
        self.0
    }
}
