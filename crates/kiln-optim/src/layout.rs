//! Where each tensor lies in the flat buffers.

use kiln_core::{Error, Result};

/// Tensors start at multiples of this many elements (256 bytes of F32), so that a
/// tensor's slice of a flat buffer is as aligned as a buffer of its own for the kernels
/// that read it (vector loads, cuBLAS). The gaps are zeros and stay zeros: every rule
/// leaves a zero parameter with zero gradients at zero.
pub const ALIGN: usize = 64;

/// One tensor's place in the flat buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// First element, a multiple of [`ALIGN`].
    pub offset: usize,
    /// Elements (the product of `shape`).
    pub len: usize,
}

/// The tensors of a flat buffer, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    numel: usize,
}

impl ParamLayout {
    /// Tensors placed one after another in the given order; names must be distinct.
    pub fn new<S: Into<String>>(
        tensors: impl IntoIterator<Item = (S, Vec<usize>)>,
    ) -> Result<Self> {
        let mut entries: Vec<ParamEntry> = Vec::new();
        let mut at = 0usize;
        let overflow = |name: &str| Error::shape(format!("parameter layout: {name} overflows"));
        for (name, shape) in tensors {
            let name = name.into();
            if entries.iter().any(|e| e.name == name) {
                return Err(Error::shape(format!(
                    "parameter layout: {name} appears twice"
                )));
            }
            let len = shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| overflow(&name))?;
            let offset = at
                .checked_next_multiple_of(ALIGN)
                .ok_or_else(|| overflow(&name))?;
            at = offset.checked_add(len).ok_or_else(|| overflow(&name))?;
            entries.push(ParamEntry {
                name,
                shape,
                offset,
                len,
            });
        }
        Ok(ParamLayout { entries, numel: at })
    }

    /// Elements of each flat buffer, gaps included.
    pub fn numel(&self) -> usize {
        self.numel
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// A flat buffer's values from each tensor's (`values[i]` for entry `i`), gaps zero.
    pub fn flatten(&self, values: &[&[f32]]) -> Result<Vec<f32>> {
        if values.len() != self.entries.len() {
            return Err(Error::shape(format!(
                "parameter layout: {} tensors given for {} entries",
                values.len(),
                self.entries.len()
            )));
        }
        let mut flat = vec![0.0f32; self.numel];
        for (e, v) in self.entries.iter().zip(values) {
            if v.len() != e.len {
                return Err(Error::shape(format!(
                    "parameter layout: {} has {} values, its shape {:?} takes {}",
                    e.name,
                    v.len(),
                    e.shape,
                    e.len
                )));
            }
            flat[e.offset..e.offset + e.len].copy_from_slice(v);
        }
        Ok(flat)
    }

    /// Each tensor's values from a flat buffer.
    pub fn split<'a>(&self, flat: &'a [f32]) -> Result<Vec<&'a [f32]>> {
        if flat.len() != self.numel {
            return Err(Error::shape(format!(
                "parameter layout: a flat buffer of {} elements, the layout has {}",
                flat.len(),
                self.numel
            )));
        }
        Ok(self
            .entries
            .iter()
            .map(|e| &flat[e.offset..e.offset + e.len])
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_aligned_and_round_trip() {
        let l =
            ParamLayout::new([("a", vec![3]), ("empty", vec![0, 4]), ("b", vec![2, 65])]).unwrap();
        let offsets: Vec<usize> = l.entries().iter().map(|e| e.offset).collect();
        assert_eq!(offsets, [0, 64, 64]);
        assert_eq!(l.numel(), 64 + 130);
        let a = [1.0, 2.0, 3.0];
        let b: Vec<f32> = (0..130).map(|i| i as f32).collect();
        let flat = l.flatten(&[&a, &[], &b]).unwrap();
        assert_eq!(flat[3..64], [0.0; 61]);
        assert_eq!(l.split(&flat).unwrap(), vec![&a[..], &[], &b[..]]);
    }

    #[test]
    fn bad_layouts_are_errors() {
        assert!(ParamLayout::new([("a", vec![3]), ("a", vec![2])]).is_err());
        assert!(ParamLayout::new([("huge", vec![usize::MAX, 2])]).is_err());
        let l = ParamLayout::new([("a", vec![3])]).unwrap();
        assert!(l.flatten(&[&[1.0, 2.0]]).is_err());
        assert!(l.split(&[0.0; 2]).is_err());
    }
}
