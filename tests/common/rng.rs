//! A small deterministic xorshift generator for test inputs.

use half::f16;

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// An f16 scale in a sane range (no NaN/inf), as little-endian bytes.
    pub fn scale(&mut self) -> [u8; 2] {
        let v = ((self.next() % 2000) as f32 - 1000.0) / 4096.0;
        f16::from_f32(v).to_le_bytes()
    }

    pub fn float(&mut self) -> f32 {
        ((self.next() % 20001) as f32 - 10000.0) / 7919.0
    }

    /// Uniform in [0, 1), 24 bits.
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1), 24 bits.
    pub fn sym(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym() * scale).collect()
    }
}
