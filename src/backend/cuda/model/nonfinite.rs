//! Where a pass met a non-finite value: the kernels record the first one per kind as a
//! packed `u64` (window, layer, part, flat index), decoded here into the error the CPU
//! reference reports for the same value (`model::error::ForwardError`), so both backends
//! fail a window with the same message. (The CPU checks in place:
//! `backend/cpu/model/attention.rs`, `delta_net.rs`.)

use crate::model::config::ModelConfig;
use crate::model::{ForwardError, Part};

/// Decodes the first non-finite K/V record written by `qkv_prep`:
/// window << 48 | layer << 40 | (value ? 1 : 0) << 39 | flat index within the window's
/// [positions, Hkv, D] tensor.
pub fn decode_nonfinite(key: u64, hkv: usize, hd: usize) -> (usize, ForwardError) {
    let window = (key >> 48) as usize;
    let layer = ((key >> 40) & 0xFF) as usize;
    let part = if (key >> 39) & 1 == 1 {
        Part::Value
    } else {
        Part::Key
    };
    let flat = (key & ((1u64 << 39) - 1)) as usize;
    let vec = flat / hd;
    (
        window,
        ForwardError::NonFinite {
            part,
            layer,
            pos: vec / hkv,
            head: vec % hkv,
        },
    )
}

/// What a Gated DeltaNet non-finite record names, in the order a layer computes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum StatePart {
    /// The projections q|k|v, z, b, a (`[rows, width]`).
    Input = 0,
    /// The decay g (`[rows, Hv]`).
    Decay = 1,
    /// The write strength beta (`[rows, Hv]`).
    Beta = 2,
    /// The State's read-out o (`[rows, Hv, Dv]`).
    State = 3,
}

/// Decodes the first non-finite Gated DeltaNet record written by `nonfinite_scan`:
/// window << 48 | layer << 40 | part << 37 | flat index within the window's tensor, into
/// the error the CPU reports (`backend/cpu/model/delta_net.rs`'s checks).
pub fn decode_state_nonfinite(key: u64, c: &ModelConfig) -> (usize, ForwardError) {
    let h = c
        .hybrid
        .as_ref()
        .expect("State records come from hybrid models");
    let hv = h.linear_num_value_heads;
    let window = (key >> 48) as usize;
    let layer = ((key >> 40) & 0xFF) as usize;
    let flat = (key & ((1u64 << 37) - 1)) as usize;
    let (part, heads, dim) = match (key >> 37) & 7 {
        0 => (
            Part::DeltaNetInput,
            1,
            h.conv_dim() + h.value_dim() + 2 * hv,
        ),
        1 | 2 => (Part::DeltaNetGate, hv, 1),
        _ => (Part::State, hv, h.linear_value_head_dim),
    };
    let vec = flat / dim;
    (
        window,
        ForwardError::NonFinite {
            part,
            layer,
            pos: vec / heads,
            head: vec % heads,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonfinite_records_decode_like_the_cpu_error() {
        let (hkv, hd) = (3, 64);
        let flat = ((5 * hkv + 2) * hd + 17) as u64;
        let key = (7u64 << 48) | (12u64 << 40) | (1u64 << 39) | flat;
        let (w, e) = decode_nonfinite(key, hkv, hd);
        assert_eq!(w, 7);
        assert_eq!(
            e,
            ForwardError::NonFinite {
                part: Part::Value,
                layer: 12,
                pos: 5,
                head: 2
            }
        );
        let (w, e) = decode_nonfinite(flat, hkv, hd);
        assert_eq!(w, 0);
        assert_eq!(
            e,
            ForwardError::NonFinite {
                part: Part::Key,
                layer: 0,
                pos: 5,
                head: 2
            }
        );
    }
}
