use ctxfs_vfs::*;
use std::sync::Arc;
#[test]
fn roundtrip_mem() {
    let dev: Arc<dyn BlockDevice> = Arc::new(device::MemDevice::new(4096, 512));
    let store = format(dev.clone()).unwrap();
    let shape = ModelShape { layers: 2, q_heads: 4, kv_heads: 2, head_dim: 8, dtype: DType::F16 };
    let toks: Vec<u32> = (0..3000).collect();
    let mut t = store.begin().unwrap();
    t.create_context("a", shape, &toks).unwrap();
    for i in 0..20u8 { t.append_block("a", 1, 1, FileStream::Data, &vec![i; 4000]).unwrap(); }
    t.commit().unwrap();
    drop(store);
    let store = Store::open(dev.clone()).unwrap();
    let snap = store.snapshot();
    let c = snap.context("a").unwrap();
    assert_eq!(c.tokens().unwrap(), toks);
    let s = c.stream(1, 1, FileStream::Data).unwrap();
    assert_eq!(s.blocks(), 20);
    assert_eq!(s.read(7).unwrap().payload(), &vec![7u8; 4000][..]);
    let mut t = store.begin().unwrap();
    t.append_tokens("a", &[9, 9, 9]).unwrap();
    t.commit().unwrap();
    let mut t = store.begin().unwrap();
    t.delete_context("a").unwrap();
    t.commit().unwrap();
    println!("{:?} gen {}", store.space(), store.snapshot().generation());
}
