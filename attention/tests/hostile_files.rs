//! Context files (`SafetensorsKv`) and query files (`QueryFile`) whose header lies about
//! offsets, shapes or sizes are refused with an input error, never a panic or an allocation
//! the file's bytes do not back (what the `safetensors_import` and `query_file` fuzz targets
//! check).

use ctxfs_attention::queries::QueryFile;
use ctxfs_attention::{Error, KvSource, SafetensorsKv};
use ctxfs_vfs::DType;

/// A safetensors file: the header as given (JSON text), then `data`.
fn file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn open(bytes: &[u8]) -> Result<SafetensorsKv, Error> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.safetensors");
    std::fs::write(&path, bytes).unwrap();
    SafetensorsKv::open(&path, DType::F16)
}

/// Keys and values of 1 head, 2 tokens, dimension 2, f16: 8 bytes each.
const KV: &str = r#""layers.0.k":{"dtype":"F16","shape":[1,2,2],"data_offsets":[0,8]},"layers.0.v":{"dtype":"F16","shape":[1,2,2],"data_offsets":[8,16]}"#;

#[test]
fn a_well_formed_context_file_reads() {
    let kv = open(&file(&format!("{{{KV}}}"), &[0x3c; 16])).unwrap();
    kv.check_values(|_| {}).unwrap();
    let keys = kv.keys(0, 0).unwrap();
    assert_eq!(keys.len(), 4);
    assert!(keys.iter().all(|&k| k == half::f16::from_bits(0x3c3c).to_f32()));
    assert_eq!(kv.token_ids().unwrap(), vec![0, 1]);
}

#[test]
fn a_layer_beyond_a_gap_is_refused_not_dropped() {
    let gap = format!(
        r#"{{{KV},"layers.2.k":{{"dtype":"F16","shape":[1,2,2],"data_offsets":[16,24]}},"layers.2.v":{{"dtype":"F16","shape":[1,2,2],"data_offsets":[24,32]}}}}"#
    );
    match open(&file(&gap, &[0x3c; 32])) {
        Err(Error::Input(why)) => assert!(why.contains("layer 2") && why.contains("layers.1.k"), "{why}"),
        other => panic!("a file of layers 0 and 2 must be refused: {:?}", other.map(|kv| kv.shape())),
    }
}

#[test]
fn context_files_whose_header_lies_are_input_errors() {
    let q = |shape: &str, offsets: &str| {
        format!(r#"{{{KV},"layers.0.q":{{"dtype":"F32","shape":{shape},"data_offsets":{offsets}}}}}"#)
    };
    let cases = [
        // Offsets backwards: the byte count underflowed when values were checked.
        q("[1,1,2]", "[16,8]"),
        // A query count whose byte count overflows usize: reading the training queries
        // multiplied past it.
        q("[1,4611686018427387904,2]", "[16,24]"),
        // Shapes that claim more (or fewer) elements than the offsets hold.
        q("[1,1000000,2]", "[16,24]"),
        q("[1,0,2]", "[16,24]"),
        r#"{"layers.0.k":{"dtype":"F16","shape":[1,2,2],"data_offsets":[0,4]},"layers.0.v":{"dtype":"F16","shape":[1,2,2],"data_offsets":[8,16]}}"#.to_string(),
        // Data beyond the end of the file.
        q("[1,1,2]", "[16,4000]"),
    ];
    for header in cases {
        let bytes = file(&header, &[0x3c; 24]);
        match open(&bytes) {
            Err(Error::Input(_)) => {}
            Err(e) => panic!("{header}: {e}"),
            Ok(kv) => panic!("{header}: opened a {:?} context", kv.shape()),
        }
    }
}

#[test]
fn query_files_whose_shapes_lie_are_input_errors() {
    // Zero-sized dimensions pass safetensors' own check (no data), and a step count near
    // usize::MAX once overflowed q_heads × steps × d when reading the layer.
    let empty = file(r#"{"layers.0.q":{"dtype":"F32","shape":[0,4611686018427387904,0],"data_offsets":[0,0]}}"#, &[]);
    let f = QueryFile::parse(&empty).unwrap();
    assert!(f.has_layer(0));
    assert!(matches!(f.layer(0, 4, 64), Err(Error::Input(_))));
    // Another head count or dimension than the context's.
    let two = file(r#"{"layers.0.q":{"dtype":"F32","shape":[2,1,2],"data_offsets":[0,16]}}"#, &[0; 16]);
    let f = QueryFile::parse(&two).unwrap();
    assert!(matches!(f.layer(0, 1, 4), Err(Error::Input(_))));
    assert!(matches!(f.layer(1, 2, 2), Err(Error::Input(_))));
    let q = f.layer(0, 2, 2).unwrap();
    assert_eq!((q.steps, q.step(0)), (1, vec![0.0; 4]));
    // A header longer than the file, and sizes that disagree with the data.
    assert!(QueryFile::parse(&file(
        r#"{"layers.0.q":{"dtype":"F32","shape":[2,1,2],"data_offsets":[0,16]}}"#,
        &[0; 8]
    ))
    .is_err());
    let mut long = two.clone();
    long[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(QueryFile::parse(&long).is_err());
    // Said in words, not the parser's variant names.
    for (bytes, says) in [(&b""[..], "shorter than"), (&two[..two.len() - 4], "do not cover its data")] {
        let err = QueryFile::parse(bytes).err().expect("refused").to_string();
        assert!(err.contains(says), "{err}");
    }
}
