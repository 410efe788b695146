//! Reading tensors of a safetensors file (memory-mapped) as f16 or f32, with the checks an
//! import needs: known dtype, expected shape, finite values.

use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

/// Elements `range` of a tensor as f32.
pub fn f32s(st: &SafeTensors<'_>, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let t = st.tensor(name).with_context(|| format!("missing tensor {name}"))?;
    let data = t.data();
    let size = match t.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => bail!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16"),
    };
    ensure!(range.end * size <= data.len(), "tensor {name} is shorter than its shape says");
    let bytes = &data[range.start * size..range.end * size];
    let out: Vec<f32> = match t.dtype() {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    };
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        bail!("tensor {name} holds a non-finite value ({}) at element {}", out[i], range.start + i);
    }
    Ok(out)
}

/// Elements `range` of a tensor as f16, refusing values f16 cannot hold.
pub fn f16s(st: &SafeTensors<'_>, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f16>> {
    let start = range.start;
    let v = f32s(st, name, range)?;
    if let Some(i) = v.iter().position(|x| x.abs() > f16::MAX.to_f32()) {
        bail!("tensor {name} element {} = {} is out of the f16 range", start + i, v[i]);
    }
    Ok(v.into_iter().map(f16::from_f32).collect())
}

/// A tensor's shape, checked against what is expected (`None` matches any size).
pub fn shape(st: &SafeTensors<'_>, name: &str, expect: &[Option<usize>]) -> Result<Vec<usize>> {
    let t = st.tensor(name).with_context(|| format!("missing tensor {name}"))?;
    let shape = t.shape().to_vec();
    let fits = shape.len() == expect.len() && shape.iter().zip(expect).all(|(s, e)| e.is_none_or(|e| e == *s));
    ensure!(fits, "tensor {name} has shape {shape:?}, expected {}", describe(expect));
    Ok(shape)
}

fn describe(expect: &[Option<usize>]) -> String {
    let dims: Vec<String> = expect.iter().map(|e| e.map_or("_".into(), |v| v.to_string())).collect();
    format!("[{}]", dims.join(", "))
}

/// Token ids, as u32.
pub fn tokens(st: &SafeTensors<'_>, n: usize) -> Result<Vec<u32>> {
    let t = st.tensor("tokens")?;
    ensure!(t.shape() == [n], "tensor tokens has shape {:?}, expected [{n}]", t.shape());
    let data = t.data();
    let ids: Vec<i64> = match t.dtype() {
        Dtype::I64 => data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
        Dtype::I32 => data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect(),
        Dtype::U32 => data.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect(),
        other => bail!("tensor tokens has dtype {other:?}; expected I64, I32 or U32"),
    };
    ids.into_iter()
        .enumerate()
        .map(|(i, t)| u32::try_from(t).map_err(|_| anyhow::anyhow!("token {i} has id {t}, outside 0..2^32")))
        .collect()
}
