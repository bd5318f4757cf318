//! IEEE half-precision storage (the values of the `bf16` representation, as NInfer stores
//! them): round to nearest, ties to even, subnormals kept (what `half` implements).
//! Magnitudes from 65520 up overflow to infinity, which the engine then reports as a
//! non-finite error: FP16 values are exact only inside the FP16 range.

/// Rounds every value to the nearest FP16 and widens it back.
pub fn roundtrip(x: &mut [f32]) {
    for v in x {
        *v = half::f16::from_f32(*v).to_f32();
    }
}
