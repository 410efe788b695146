//! Times `weighted_sum` as attention sums a retrieved value block: runs of 15 rows of
//! d = 128 f16 values (a 4 KiB block's), on the CPU's best kernel path and on the scalar
//! path, over blocks that stay in cache and over 16 MiB of them that do not.
//!
//! `cargo run --release -p ctxfs-kernels --example weighted_sum`

use ctxfs_kernels::{active, weighted_sum_on, Isa};
use half::f16;
use std::time::Instant;

const DIM: usize = 128;
const ROWS: usize = 15;
/// Rows summed per timing.
const SUMMED: usize = 1 << 21;

fn main() {
    for blocks in [16, 4096] {
        let values: Vec<f16> =
            (0..blocks * ROWS * DIM).map(|i| f16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5)).collect();
        let weights: Vec<f32> = (0..ROWS).map(|i| (i + 1) as f32 / 16.0).collect();
        let mb = (values.len() * 2) >> 20;
        let time = |isa: Isa| {
            let mut acc = vec![0.0f32; DIM];
            // The median of 5.
            let mut ns: Vec<f64> = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    for i in 0..SUMMED / ROWS {
                        let b = i % blocks;
                        weighted_sum_on(isa, &mut acc, &weights, &values[b * ROWS * DIM..(b + 1) * ROWS * DIM]);
                    }
                    t.elapsed().as_secs_f64() * 1e9 / (SUMMED / ROWS * ROWS) as f64
                })
                .collect();
            ns.sort_by(f64::total_cmp);
            std::hint::black_box(&acc);
            ns[2]
        };
        let (best, scalar) = (time(active()), time(Isa::Scalar));
        println!(
            "{blocks} blocks ({mb} MiB): {:?} {best:.2} ns a row, scalar {scalar:.2} ns a row ({:.1}x)",
            active(),
            scalar / best
        );
    }
}
