//! Block header unseal/verify never panic on any bytes, and an unsealed header re-seals to the same header.
#![no_main]

use ctxfs_vfs::format::header::{payload, seal, unseal, verify};
use ctxfs_vfs::format::{BlockKind, Expect, Owner, StreamTag};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

fn roundtrip(block: &[u8]) {
    if let Ok((h, _crc)) = unseal(block) {
        let mut fresh = vec![0u8; block.len()];
        let crc = seal(&mut fresh, &h, payload(block, &h));
        assert_eq!(unseal(&fresh).expect("sealed block unseals"), (h, crc));
    }
}

fuzz_target!(|data: &[u8]| {
    roundtrip(data);
    let mut padded = vec![0u8; 4096.max(data.len())];
    padded[..data.len()].copy_from_slice(data);
    roundtrip(&padded[..4096]);
    // Re-sealed copies (magic and CRC fixed up) reach the checks behind the checksum.
    let mut resealed = data.to_vec();
    if resealed.len() >= 8 {
        resealed[..4].copy_from_slice(b"CXFB");
        let crc = crc32fast::hash(&resealed[8..]);
        resealed[4..8].copy_from_slice(&crc.to_le_bytes());
        roundtrip(&resealed);
    }

    // An Expect from the input's first bytes (zero where the input is short).
    let mut f = [0u8; 32];
    f[..data.len().min(32)].copy_from_slice(&data[..data.len().min(32)]);
    let u16_at = |i: usize| u16::from_le_bytes([f[i], f[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes(f[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(f[i..i + 8].try_into().unwrap());
    let expect = Expect {
        kind: BlockKind::from_u8(f[0] % 6 + 1).unwrap(),
        stream: StreamTag::from_u8(f[1] % 4).unwrap(),
        owner: Owner { context: u32_at(2), layer: u16_at(6), head: u16_at(8) },
        logical: u64_at(10),
        crc: u32_at(18),
        max_generation: u64_at(22),
    };
    for block in [data, &padded[..4096], &resealed] {
        if let Ok(h) = verify(block, &expect) {
            assert_eq!(unseal(block).unwrap().0, h);
        }
    }
});
