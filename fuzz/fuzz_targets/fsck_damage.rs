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

struct Pristine {
    image: Vec<u8>,
    /// For each block, where the pristine image carries its CRC: (block, byte offset) of the
    /// references and extent entries that name it.
    crc_at: Vec<Vec<(usize, usize)>>,
}

fn pristine() -> &'static Pristine {
    static P: OnceLock<Pristine> = OnceLock::new();
    P.get_or_init(|| {
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
        let image = mem.current_image();
        let blocks = image.len() / BS;
        let block = |b: usize| &image[b * BS..(b + 1) * BS];
        let sealed: Vec<usize> = (0..blocks).filter(|&b| block(b)[..4] == *b"CXFB").collect();
        let mut crc_at = vec![Vec::new(); blocks];
        for &b in &sealed {
            let crc = &block(b)[4..8];
            for &o in sealed.iter().filter(|&&o| o != b) {
                crc_at[b].extend((8..BS - 3).filter(|&i| block(o)[i..i + 4] == *crc).map(|i| (o, i)));
            }
        }
        Pristine { image, crc_at }
    })
}

/// Recomputes a block's CRC after all edits and patches the new CRC where the pristine image
/// carried this block's CRC (references, extent entries) and the bytes there still hold the
/// old one, re-sealing those blocks in turn. (The places are found once, in `pristine`: a
/// search of the image for each input would be most of the target's time, every compare
/// traced by the fuzzer.)
fn reseal(image: &mut [u8], crc_at: &[Vec<(usize, usize)>], block: usize) {
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
        for &(other, i) in &crc_at[b] {
            let place = &mut image[other * BS + i..other * BS + i + 4];
            if *place == old {
                place.copy_from_slice(&new);
                todo.push(other);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Pristine { image: base, crc_at } = pristine();
    let mut image = base.clone();
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
        reseal(&mut image, crc_at, b);
    }
    let unchanged = image == *base;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::from_image(image, BS));
    let report = fsck::check(dev.as_ref());
    if unchanged {
        let report = report.expect("check of the pristine image");
        assert!(report.is_clean(), "pristine image not clean: {:?}", report.problems);
    }
    let _ = fsck::repair(dev.clone(), true);
    let _ = Store::open(dev);
});
