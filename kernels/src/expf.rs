//! The constants of Cephes' single-precision exp, shared by the SIMD kernels.

// Cephes' expf: exp(x) = 2^n · e^r with |r| ≤ ln2/2 and a degree-7 polynomial for e^r;
// about 1e-7 relative error. Arguments below EXP_LO (including −∞, a mask) give exactly 0.
pub(crate) const EXP_HI: f32 = 88.376_26;
pub(crate) const EXP_LO: f32 = -87.336_55;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
