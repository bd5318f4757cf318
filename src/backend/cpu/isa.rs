//! Which instruction set the CPU kernels run, detected once per process.
//!
//! Every vector kernel (the GEMM tile, attention's two tiles, the `exp` slice loops) has a
//! portable twin that is its specification and gives the same bits, so the choice only
//! changes speed. One enum for all of them keeps the kernels in agreement about what the
//! CPU has, and lets the tests walk every level the machine runs, not only the fastest.

use std::sync::OnceLock;

/// A level of x86-64 vector support (only `Portable` elsewhere). Each level includes the
/// ones before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Scalar code with `mul_add`: the specification.
    Portable,
    /// AVX2 with FMA (256-bit registers).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F on top of AVX2 and FMA (512-bit registers).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The highest level this CPU runs (detected once, then cached).
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| Isa::all().into_iter().max().unwrap_or(Isa::Portable))
    }

    /// Every level this CPU runs, lowest first (the tests compare each with `Portable`).
    pub fn all() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                all.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f") {
                    all.push(Isa::Avx512);
                }
            }
        }
        all
    }

    /// Whether this CPU has AVX2 and FMA (true on an AVX-512 CPU too).
    pub fn has_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            Isa::detect() >= Isa::Avx2
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether this CPU has AVX-512F (with AVX2 and FMA).
    pub fn has_avx512() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            Isa::detect() >= Isa::Avx512
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_is_the_highest_of_all() {
        let all = Isa::all();
        assert_eq!(all[0], Isa::Portable);
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(Isa::detect(), *all.last().unwrap());
        assert_eq!(Isa::has_avx512(), all.len() == 3);
        assert_eq!(Isa::has_avx2(), all.len() >= 2);
    }
}
