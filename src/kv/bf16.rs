//! bfloat16 storage: round to nearest, ties to even (what `half` implements).

/// Rounds every value to the nearest bfloat16 and widens it back.
pub fn roundtrip(x: &mut [f32]) {
    for v in x {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}
