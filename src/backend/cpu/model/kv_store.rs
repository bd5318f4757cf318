//! Writing a layer's keys and values through the Main KV representation.
//!
//! Every (token, KV head) vector of `head_dim` values is rotated where the representation
//! rotates it ([`KvDtype::rotation`]: keys in every quantized one, values in `nvfp4` and
//! `k8v4`), then replaced by what the representation stores and gives back
//! ([`KvDtype::roundtrip_k`] / [`KvDtype::roundtrip_v`]), so attention reads exactly what a
//! KV cache in that format would hold, in the rotated basis (queries are rotated the same way
//! and the output back by the attention block). Quantized formats
//! are defined for finite input only, so a non-finite value is an error naming where it is
//! (a broken model must not be silently quantized into finite numbers).

use crate::kv::{hadamard, KvDtype};
use crate::model::error::{check_finite, ForwardError, Part};
use rayon::prelude::*;

/// Which of the two stored tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    Key,
    Value,
}

/// Passes `x[T, Hkv, D]` through `kv`'s representation of `part`, rotated first where the
/// representation rotates it (the check for non-finite values comes after the rotation, as
/// on the device). `first` is the window position of the first row and `layer` the layer,
/// for the error.
pub fn store(
    x: &mut [f32],
    kv_heads: usize,
    head_dim: usize,
    kv: KvDtype,
    part: Stored,
    layer: usize,
    first: usize,
) -> Result<(), ForwardError> {
    let checked = match part {
        Stored::Key => Part::Key,
        Stored::Value => Part::Value,
    };
    let rotation = kv.rotation(head_dim);
    let rotated = match part {
        Stored::Key => rotation.keys,
        Stored::Value => rotation.values,
    };
    if rotated {
        x.par_chunks_mut(head_dim).for_each(hadamard::rotate);
    }
    check_finite(x, kv_heads, head_dim, checked, layer, first)?;
    x.par_chunks_mut(head_dim).for_each(|vec| match part {
        Stored::Key => kv.roundtrip_k(layer, vec),
        Stored::Value => kv.roundtrip_v(layer, vec),
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_kv_is_an_error_naming_layer_position_and_head() {
        // x[T=3, Hkv=2, D=4]: a NaN at position 2, head 1.
        let mut x = vec![0.5f32; 3 * 2 * 4];
        x[(2 * 2 + 1) * 4 + 3] = f32::NAN;
        let e = store(&mut x, 2, 4, KvDtype::Int8, Stored::Key, 7, 0).unwrap_err();
        assert_eq!(
            e,
            ForwardError::NonFinite {
                part: Part::Key,
                layer: 7,
                pos: 2,
                head: 1
            }
        );
        assert_eq!(
            e.to_string(),
            "non-finite key at layer 7, window position 2, KV head 1"
        );
        let mut y = vec![1.0f32; 8];
        y[0] = f32::INFINITY;
        let e = store(&mut y, 1, 8, KvDtype::Nvfp4, Stored::Value, 0, 5).unwrap_err();
        assert_eq!(
            e.to_string(),
            "non-finite value at layer 0, window position 5, KV head 0"
        );
        let mut ok = vec![0.25f32; 8];
        assert!(store(&mut ok, 1, 8, KvDtype::Fp8, Stored::Value, 0, 0).is_ok());
    }
}
