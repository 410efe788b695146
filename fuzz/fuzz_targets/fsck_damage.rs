//! fsck check/repair and Store::open never panic on a small store with arbitrary byte edits; an unedited store checks clean.
//! The store holds three live contexts, one of them the child of a retired one, and its older state.
//! Input: 5-byte edits (u32 LE offset modulo the image length, u8 value). An offset with bit 31
//! set also re-seals the block it lands in (see `reseal`), so damage can get past the checksums.
#![no_main]

use ctxfs_vfs::device::MemDevice;
use ctxfs_vfs::{fsck, BlockDevice, DType, FileStream, ModelShape, Store};
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

const BS: usize = 4096;

fn pristine() -> &'static [u8] {
    static IMAGE: OnceLock<Vec<u8>> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let mem = Arc::new(MemDevice::new(BS, 256));
        let store = ctxfs_vfs::format(mem.clone()).unwrap();
        let shape =
            |kv_heads| ModelShape { layers: 1, q_heads: 2 * kv_heads, kv_heads, head_dim: 16, dtype: DType::F16 };
        let mut t = store.begin().unwrap();
        t.create_context("c", shape(1), &[1, 2, 3]).unwrap();
        t.append_block("c", 0, 0, FileStream::Data, &[7u8; 100]).unwrap();
        t.append_block("c", 0, 0, FileStream::Index, &[8u8; 100]).unwrap();
        t.create_context("e", shape(2), &[4, 5]).unwrap();
        t.append_block_pair("e", 0, 1, &[9u8; 60], &[10u8; 60]).unwrap();
        t.commit().unwrap();
        // A family: "p" retired, its child "k" reading its first two tokens.
        let mut t = store.begin().unwrap();
        t.create_context("p", shape(1), &[6, 7, 8]).unwrap();
        t.append_block("p", 0, 0, FileStream::Data, &[11u8; 80]).unwrap();
        t.commit().unwrap();
        let mut t = store.begin().unwrap();
        t.create_child_context("k", "p", 2, &[12]).unwrap();
        t.append_block("k", 0, 0, FileStream::Data, &[13u8; 40]).unwrap();
        t.delete_context("p").unwrap();
        t.commit().unwrap();
        drop(store);
        mem.current_image()
    })
}

/// Recomputes a block's CRC after all edits and patches that CRC wherever another sealed block
/// carries the old value (references, extent entries), re-sealing those blocks in turn.
fn reseal(image: &mut [u8], block: usize) {
    let mut todo = vec![block];
    for _ in 0..64 {
        let Some(b) = todo.pop() else { return };
        let at = b * BS;
        let old: [u8; 4] = image[at + 4..at + 8].try_into().unwrap();
        let new = crc32fast::hash(&image[at + 8..at + BS]).to_le_bytes();
        if old == new {
            continue;
        }
        image[at + 4..at + 8].copy_from_slice(&new);
        for (other, blk) in image.chunks_exact_mut(BS).enumerate() {
            if other == b || blk[..4] != *b"CXFB" {
                continue;
            }
            let mut hit = false;
            for i in 8..BS - 3 {
                if blk[i..i + 4] == old {
                    blk[i..i + 4].copy_from_slice(&new);
                    hit = true;
                }
            }
            if hit {
                todo.push(other);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let base = pristine();
    let mut image = base.to_vec();
    let mut to_reseal = Vec::new();
    for edit in data.chunks_exact(5) {
        let raw = u32::from_le_bytes(edit[..4].try_into().unwrap());
        let at = raw as usize % image.len();
        image[at] = edit[4];
        if raw & 1 << 31 != 0 {
            to_reseal.push(at / BS);
        }
    }
    for b in to_reseal {
        reseal(&mut image, b);
    }
    let unchanged = image == base;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::from_image(image, BS));
    let report = fsck::check(dev.as_ref());
    if unchanged {
        let report = report.expect("check of the pristine image");
        assert!(report.is_clean(), "pristine image not clean: {:?}", report.problems);
    }
    let _ = fsck::repair(dev.clone(), true);
    let _ = Store::open(dev);
});
