//! Hugging Face safetensors checkpoints through the `safetensors` crate, memory-mapped:
//! one file, or shards listed by `model.safetensors.index.json`.

use crate::FileBytes;
use kiln_core::{DType, Error, HostBytes, Result, Shape};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Index into [`SafetensorsModel::files`].
    pub file: usize,
    range: Range<usize>,
}

impl TensorEntry {
    /// The dtype kiln computes with, for F32, F16 and BF16.
    pub fn kiln_dtype(&self) -> Option<DType> {
        match self.dtype {
            Dtype::F32 => Some(DType::F32),
            Dtype::F16 => Some(DType::F16),
            Dtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }

    /// The type's name as ggml writes names (`bf16`, `f32`, `i64`, ...).
    pub fn dtype_name(&self) -> String {
        format!("{:?}", self.dtype).to_lowercase()
    }

    pub fn shape(&self) -> Result<Shape> {
        Shape::new(self.shape.clone())
    }

    pub fn size_bytes(&self) -> usize {
        self.range.len()
    }
}

/// One or more safetensors files seen as one set of tensors.
pub struct SafetensorsModel {
    pub files: Vec<PathBuf>,
    /// `__metadata__` of the (first) file.
    pub metadata: BTreeMap<String, String>,
    /// Sorted by name.
    pub tensors: Vec<TensorEntry>,
    index: HashMap<String, usize>,
    maps: Vec<FileBytes>,
}

impl SafetensorsModel {
    /// A single `.safetensors` file.
    pub fn open_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let bytes = crate::file::map(&path)?;
        Self::from_parts(vec![(path, bytes)], None)
    }

    /// A safetensors image held in memory; `name` stands for the path in messages.
    pub fn from_bytes(name: impl AsRef<Path>, bytes: Vec<u8>) -> Result<Self> {
        Self::from_parts(vec![(name.as_ref().to_path_buf(), Arc::new(bytes))], None)
    }

    /// The weights of a Hugging Face model directory: the shards its index names, or its
    /// single `model.safetensors`.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let index_path = dir.join(INDEX_FILE);
        // `exists`, not `is_file`: an index that is not a regular file is an error to
        // report, not a reason to look for a single file instead.
        if index_path.exists() {
            let (files, weight_map) = read_index(&index_path)?;
            let parts = files
                .into_iter()
                .map(|f| {
                    let path = dir.join(f);
                    crate::file::map(&path).map(|bytes| (path, bytes))
                })
                .collect::<Result<Vec<_>>>()?;
            return Self::from_parts(parts, Some((index_path, weight_map)));
        }
        let single = dir.join(SINGLE_FILE);
        if single.exists() {
            return Self::open_file(single);
        }
        Err(Error::format(format!(
            "{}: no {SINGLE_FILE} or {INDEX_FILE} in this directory",
            dir.display()
        )))
    }

    fn from_parts(
        parts: Vec<(PathBuf, FileBytes)>,
        index: Option<(PathBuf, BTreeMap<String, String>)>,
    ) -> Result<Self> {
        let mut maps = Vec::with_capacity(parts.len());
        let mut files = Vec::with_capacity(parts.len());
        let mut tensors = Vec::new();
        let mut metadata = BTreeMap::new();
        for (file_idx, (path, map)) in parts.into_iter().enumerate() {
            let bytes: &[u8] = (*map).as_ref();
            let st = SafeTensors::deserialize(bytes).map_err(|e| {
                Error::format(format!("{}: invalid safetensors file: {e}", path.display()))
            })?;
            if file_idx == 0 {
                let (_, header) = SafeTensors::read_metadata(bytes)
                    .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
                if let Some(m) = header.metadata() {
                    metadata = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                }
            }
            let base = bytes.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let start = view.data().as_ptr() as usize - base;
                tensors.push(TensorEntry {
                    name,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    file: file_idx,
                    range: start..start + view.data().len(),
                });
            }
            maps.push(map.clone());
            files.push(path);
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut index_by_name = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if index_by_name.insert(t.name.clone(), i).is_some() {
                return Err(Error::format(format!(
                    "tensor '{}' appears in more than one shard ({})",
                    t.name,
                    files[t.file].display()
                )));
            }
        }
        if let Some((index_path, weight_map)) = index {
            for (name, file) in &weight_map {
                let found = index_by_name.get(name).map(|&i| &files[tensors[i].file]);
                if found.and_then(|p| p.file_name()) != Some(std::ffi::OsStr::new(file)) {
                    return Err(Error::format(format!(
                        "{}: tensor '{name}' should be in {file}, but is not there",
                        index_path.display()
                    )));
                }
            }
        }
        Ok(SafetensorsModel {
            files,
            metadata,
            tensors,
            index: index_by_name,
            maps,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn tensor_data(&self, t: &TensorEntry) -> &[u8] {
        &(*self.maps[t.file]).as_ref()[t.range.clone()]
    }

    pub fn tensor_bytes(&self, t: &TensorEntry) -> Result<HostBytes> {
        HostBytes::new(self.maps[t.file].clone(), t.range.clone())
    }
}

/// The shard names of an index and its tensor → shard map. Shard names must be plain
/// file names in the same directory.
fn read_index(path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = crate::file::read_to_string(path, crate::file::FileKind::SAFETENSORS_INDEX)?;
    let index: Index = serde_json::from_str(&text)
        .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
    let mut files: Vec<String> = index.weight_map.values().cloned().collect();
    files.sort();
    files.dedup();
    if let Some(bad) = files
        .iter()
        .find(|f| f.is_empty() || f.contains('/') || f.contains('\\') || *f == ".." || *f == ".")
    {
        return Err(Error::format(format!(
            "{}: shard name {bad:?} is not a file name in this directory",
            path.display()
        )));
    }
    Ok((files, index.weight_map))
}

/// Write a safetensors file of F32 tensors `(name, shape outermost first)` to `w`, each
/// tensor's values made by `values(i)` when its turn comes: one tensor in memory at a
/// time, whatever the model's size.
pub fn write_f32(
    w: &mut impl Write,
    tensors: &[(String, Vec<usize>)],
    values: impl Fn(usize) -> Result<Vec<f32>>,
) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    let mut lens = Vec::with_capacity(tensors.len());
    for (name, shape) in tensors {
        let len = shape
            .iter()
            .try_fold(4usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                std::io::Error::other(format!("tensor {name} {shape:?} is too large"))
            })?;
        let entry = serde_json::json!({
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len],
        });
        if header.insert(name.clone(), entry).is_some() {
            return Err(std::io::Error::other(format!("tensor {name} given twice")));
        }
        lens.push(len);
        offset += len;
    }
    let mut text = serde_json::to_vec(&header)?;
    // The data starts 8-aligned, as the format's own writer pads it.
    text.resize(text.len().next_multiple_of(8), b' ');
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(&text)?;
    for (i, ((name, _), &len)) in tensors.iter().zip(&lens).enumerate() {
        let v = values(i).map_err(|e| std::io::Error::other(format!("tensor {name}: {e}")))?;
        if v.len() * 4 != len {
            return Err(std::io::Error::other(format!(
                "tensor {name}: {} values made, {} wanted",
                v.len(),
                len / 4
            )));
        }
        let mut bytes = Vec::with_capacity(v.len().min(1 << 14) * 4);
        for chunk in v.chunks(1 << 14) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
            w.write_all(&bytes)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// `write_f32` reads back through the format's own parser: names, shapes and values
    /// (a header whose length is not a multiple of 8 padded, an empty tensor among them);
    /// values of the wrong count and a name given twice fail the write.
    #[test]
    fn f32_tensors_written_one_at_a_time_read_back() {
        let tensors = vec![
            ("b.weight".to_string(), vec![3, 5]),
            ("a".to_string(), vec![7]),
            ("empty".to_string(), vec![0, 4]),
        ];
        let values = |i: usize| -> Vec<f32> {
            let n: usize = tensors[i].1.iter().product();
            (0..n).map(|j| (i * 100 + j) as f32 * 0.5 - 3.0).collect()
        };
        let mut bytes = Vec::new();
        write_f32(&mut bytes, &tensors, |i| Ok(values(i))).unwrap();
        let m = SafetensorsModel::from_bytes("t.safetensors", bytes).unwrap();
        for (i, (name, shape)) in tensors.iter().enumerate() {
            let t = m.tensor(name).unwrap();
            assert_eq!(
                (t.kiln_dtype(), &t.shape),
                (Some(DType::F32), shape),
                "{name}"
            );
            let got: Vec<f32> = m
                .tensor_data(t)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(got, values(i), "{name}");
        }
        let err = write_f32(&mut Vec::new(), &tensors, |i| Ok(values(i)[1..].to_vec()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("b.weight"), "{err}");
        let twice = vec![("a".to_string(), vec![1]), ("a".to_string(), vec![1])];
        assert!(write_f32(&mut Vec::new(), &twice, |_| Ok(vec![0.0])).is_err());
    }

    #[test]
    fn single_and_sharded_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let a: Vec<u8> = (0..24u8).collect();
        write_st(
            &dir.path().join("s1.safetensors"),
            &[("a", Dtype::F32, vec![2, 3], a.clone())],
        );
        write_st(
            &dir.path().join("s2.safetensors"),
            &[("b", Dtype::BF16, vec![4], vec![1; 8])],
        );
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"metadata":{},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"#,
        )
        .unwrap();
        let m = SafetensorsModel::open_dir(dir.path()).unwrap();
        assert_eq!(m.tensors.len(), 2);
        let ta = m.tensor("a").unwrap();
        assert_eq!(
            (ta.kiln_dtype(), ta.shape.as_slice()),
            (Some(DType::F32), &[2usize, 3][..])
        );
        assert_eq!(m.tensor_data(ta), &a[..]);
        assert_eq!(m.tensor("b").unwrap().dtype_name(), "bf16");

        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"weight_map":{"a":"s1.safetensors","c":"s2.safetensors"}}"#,
        )
        .unwrap();
        let err = SafetensorsModel::open_dir(dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("'c'"), "{err}");
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"weight_map":{"a":"../x.safetensors"}}"#,
        )
        .unwrap();
        assert!(SafetensorsModel::open_dir(dir.path()).is_err());
    }
}
