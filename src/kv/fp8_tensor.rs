//! `fp8-tensor`: vLLM's default FP8 KV cache. E4M3 ("e4m3fn") codes with one f32 scale per
//! layer for all keys and one for all values, 1.0 unless calibrated scales are given; no
//! rotation.
//!
//! # The rule (vLLM's `scaled_convert` with a per-tensor scale)
//! - `q_i = e4m3_from_f32(x_i / scale)`: one f32 division, then the nearest e4m3fn value,
//!   ties to even, saturating at ±448 ([`super::fp8::e4m3_from_f32`]).
//! - Decoding: `x̂_i = e4m3_to_f32(q_i) · scale`, one f32 multiplication.
//!
//! With the default scale 1.0 this saturates every magnitude above 448 and flushes those
//! below 2^-10 to zero (2^-10 itself ties to zero); NInfer's `fp8` (one scale per row) does
//! neither. Calibrated scales (`--kv-scales FILE`, [`TensorScales`]) move that window per
//! layer.
//!
//! Stored layout per vector: `n` code bytes ([`bytes_per_vector`] = `n`); the two f32
//! scales per layer are not per-token storage.
//!
//! Inputs must be finite (the engine checks first); a scale must be positive and finite
//! ([`TensorScales::parse`] refuses anything else).

use super::fp8::{e4m3_from_f32, e4m3_round, e4m3_to_f32};
use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};

/// Bytes per stored vector of `n` values.
pub fn bytes_per_vector(n: usize) -> usize {
    n
}

/// The codes of `x` under `scale`.
pub fn encode(x: &[f32], scale: f32) -> Vec<u8> {
    x.iter().map(|&v| e4m3_from_f32(v / scale)).collect()
}

/// Decodes codes under `scale`.
pub fn decode(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = e4m3_to_f32(c) * scale;
    }
}

/// In place, bit for bit `decode(encode(x, scale), scale)` (fp8's code-free rounding, which
/// saturates an infinite quotient as the encoder does).
pub fn roundtrip(x: &mut [f32], scale: f32) {
    for v in x.iter_mut() {
        *v = e4m3_round(*v / scale) * scale;
    }
}

/// The per-layer scales of a run: `k[layer]` for keys, `v[layer]` for values. Empty lists
/// mean 1.0 for every layer (vLLM's default).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TensorScales {
    /// Where they came from (`--kv-scales FILE`), `None` for the default.
    pub source: Option<String>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl TensorScales {
    /// The key scale of `layer` (1.0 by default).
    pub fn k(&self, layer: usize) -> f32 {
        self.k.get(layer).copied().unwrap_or(1.0)
    }

    /// The value scale of `layer` (1.0 by default).
    pub fn v(&self, layer: usize) -> f32 {
        self.v.get(layer).copied().unwrap_or(1.0)
    }

    /// Reads `{"k_scale": S | [S per layer], "v_scale": S | [S per layer]}` (a number applies
    /// to every layer; vLLM checkpoints keep one `k_scale` and `v_scale` per attention layer).
    /// Every scale must be a positive, finite f32; a list must have one per layer
    /// (`layers`: the layers of the model, Gated DeltaNet layers included, whose entries are
    /// not used).
    pub fn parse(text: &str, layers: usize, source: &str) -> Result<TensorScales> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| anyhow!("not JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("expected an object with `k_scale` and `v_scale`"))?;
        if let Some(k) = obj.keys().find(|k| *k != "k_scale" && *k != "v_scale") {
            bail!("unknown field `{k}` (expected `k_scale` and `v_scale`)");
        }
        let list = |name: &str| -> Result<Vec<f32>> {
            let x = obj
                .get(name)
                .ok_or_else(|| anyhow!("missing field `{name}`"))?;
            let one = |x: &serde_json::Value, at: String| -> Result<f32> {
                let f = x
                    .as_f64()
                    .ok_or_else(|| anyhow!("`{at}` is not a number"))?;
                let s = f as f32;
                if !(s.is_finite() && s > 0.0) || s.is_subnormal() {
                    bail!("`{at}` = {f} is not a positive, finite, normal f32");
                }
                Ok(s)
            };
            match x {
                serde_json::Value::Array(a) => {
                    if a.len() != layers {
                        bail!(
                            "`{name}` has {} entries; the model has {layers} layers",
                            a.len()
                        );
                    }
                    a.iter()
                        .enumerate()
                        .map(|(i, x)| one(x, format!("{name}[{i}]")))
                        .collect()
                }
                x => Ok(vec![one(x, name.to_string())?; layers]),
            }
        };
        Ok(TensorScales {
            source: Some(source.to_string()),
            k: list("k_scale")?,
            v: list("v_scale")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed values under scale 1.0 and 2.0: saturation at 448, the flush below
    /// 2^-10, ties to even, sign kept, and "divide, then convert".
    #[test]
    fn hand_computed_vectors() {
        let mut x = [
            500.0,
            -1e6,
            448.0,
            0.3,
            2f32.powi(-10),
            3.0 * 2f32.powi(-10),
            -0.0,
            1.0,
        ];
        roundtrip(&mut x, 1.0);
        // 0.3 lies between 0.28125 and 0.3125 (step 2^-5 in [0.25, 0.5)): nearer 0.3125? No:
        // |0.3 - 0.28125| = 0.01875 > |0.3125 - 0.3| = 0.0125, so 0.3125.
        assert_eq!(
            x,
            [
                448.0,
                -448.0,
                448.0,
                0.3125,
                0.0,
                2.0 * 2f32.powi(-9),
                -0.0,
                1.0
            ]
        );
        assert!(x[6].is_sign_negative());
        // Scale 2: 600 / 2 = 300 -> 288 (|300 - 288| = 12 < 20) -> 576; 1000 / 2 saturates.
        let mut y = [600.0, 1000.0, 2f32.powi(-9)];
        roundtrip(&mut y, 2.0);
        assert_eq!(y, [576.0, 896.0, 0.0]);
        // Ties to even: 17 lies between 16 and 18 (step 2 in [16, 32)); 17 -> 16 (even
        // mantissa), 19 -> 20.
        let mut t = [17.0, 19.0];
        roundtrip(&mut t, 1.0);
        assert_eq!(t, [16.0, 20.0]);
    }

    #[test]
    fn encode_then_decode_is_the_roundtrip() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 7.25e-2).collect();
        for s in [1.0, 0.0123, 3.5] {
            let codes = encode(&x, s);
            assert_eq!(codes.len(), bytes_per_vector(x.len()));
            let mut d = vec![0.0; x.len()];
            decode(&codes, s, &mut d);
            let mut r = x.clone();
            roundtrip(&mut r, s);
            assert_eq!(
                d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                r.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn scales_parse_and_refuse() {
        let s = TensorScales::parse(r#"{"k_scale": 0.5, "v_scale": [1, 2, 3]}"#, 3, "f").unwrap();
        assert_eq!((s.k(2), s.v(0), s.v(2)), (0.5, 1.0, 3.0));
        assert_eq!(TensorScales::default().k(7), 1.0);
        let bad = |t: &str, needle: &str| {
            let e = TensorScales::parse(t, 3, "f").unwrap_err().to_string();
            assert!(e.contains(needle), "`{needle}` not in {e}");
        };
        bad(r#"{"k_scale": 1}"#, "missing field `v_scale`");
        bad(
            r#"{"k_scale": 1, "v_scale": [1, 2]}"#,
            "has 2 entries; the model has 3",
        );
        bad(
            r#"{"k_scale": 0, "v_scale": 1}"#,
            "`k_scale` = 0 is not a positive",
        );
        bad(
            r#"{"k_scale": 1e39, "v_scale": 1}"#,
            "not a positive, finite",
        );
        bad(r#"{"k_scale": 1, "v_scale": [1, -2, 1]}"#, "`v_scale[1]`");
        bad(
            r#"{"k_scale": 1, "v_scale": 1, "q_scale": 1}"#,
            "unknown field `q_scale`",
        );
        bad(r#"[1]"#, "expected an object");
    }
}
