//! Shared by the kernel tests: a small deterministic generator (the tests must not depend on
//! another crate's RNG).
#![allow(dead_code)]

use half::f16;

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// Mostly ordinary values, some `huge`, some `tiny` (f16 subnormals), some zero.
    pub fn wild(&mut self, huge: f32, tiny: f32) -> f32 {
        match self.next() % 16 {
            0 => huge * self.f32().signum(),
            1 => tiny * self.f32(),
            2 => 0.0,
            _ => self.f32() * 4.0,
        }
    }
    pub fn halves(&mut self, n: usize, mut f: impl FnMut(&mut Rng) -> f32) -> Vec<f16> {
        (0..n).map(|_| f16::from_f32(f(self))).collect()
    }
}
