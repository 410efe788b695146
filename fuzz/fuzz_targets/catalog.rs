//! Catalog, context record, allocator directory and extent block decoders never panic, and decode(encode(x)) == x.
#![no_main]

use ctxfs_vfs::format::records::{decode_alloc_dir, decode_catalog, encode_alloc_dir, encode_catalog, ExtentBlock};
use ctxfs_vfs::ContextRecord;
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = decode_catalog(data) {
        assert_eq!(decode_catalog(&encode_catalog(&entries)).unwrap(), entries);
    }
    if let Ok(rec) = ContextRecord::decode(data) {
        assert_eq!(ContextRecord::decode(&rec.encode()).unwrap(), rec);
    }
    if let Ok((total, chunks)) = decode_alloc_dir(data) {
        let again = decode_alloc_dir(&encode_alloc_dir(total, &chunks)).unwrap();
        assert_eq!(again, (total, chunks));
    }
    for total_blocks in [64, 1 << 20, u64::MAX] {
        if let Ok(ext) = ExtentBlock::decode(data, total_blocks) {
            assert_eq!(ExtentBlock::decode(&ext.encode(), total_blocks).unwrap(), ext);
        }
    }
});
