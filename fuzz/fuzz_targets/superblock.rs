//! Superblock::decode never panics on any 4096-byte slot, and what it accepts round-trips through encode_into.
#![no_main]

use ctxfs_vfs::format::Superblock;
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

const BS: usize = 4096;

fn check(block: &[u8]) {
    for slot in 0..2 {
        if let Ok(sb) = Superblock::decode(block, slot) {
            let mut again = vec![0u8; BS];
            sb.encode_into(&mut again);
            let back = Superblock::decode(&again, slot).expect("re-encoded superblock decodes");
            assert_eq!(back, sb);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut block = vec![0u8; BS];
    let n = data.len().min(BS);
    block[..n].copy_from_slice(&data[..n]);
    check(&block);
    // The same bytes with block and superblock magic, format version 1 and a correct CRC, so
    // decoding gets past the checksum to the field checks.
    block[..4].copy_from_slice(b"CXFB");
    block[40..48].copy_from_slice(b"ctxfs-sb");
    block[48..52].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32fast::hash(&block[8..]);
    block[4..8].copy_from_slice(&crc.to_le_bytes());
    check(&block);
});
