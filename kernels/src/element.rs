//! The element types vectors are stored in.

use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementKind {
    F16,
    Bf16,
    F32,
}

/// A stored vector element. Sealed: the kernels have a SIMD path for each of these.
pub trait Element: bytemuck::Pod + Send + Sync + private::Sealed {
    const KIND: ElementKind;
    fn to_f32(self) -> f32;
}

impl Element for f16 {
    const KIND: ElementKind = ElementKind::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Element for bf16 {
    const KIND: ElementKind = ElementKind::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Element for f32 {
    const KIND: ElementKind = ElementKind::F32;
    fn to_f32(self) -> f32 {
        self
    }
}

mod private {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}
