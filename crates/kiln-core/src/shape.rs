use crate::{Error, Result};
use std::fmt;

/// Dimensions, outermost first (PyTorch order): a weight of `m` rows of `k` elements is
/// `[m, k]`. GGUF stores dimensions innermost first; its reader reverses them.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape whose element count fits in `usize` (so that later products cannot overflow).
    pub fn new(dims: impl Into<Vec<usize>>) -> Result<Self> {
        let dims = dims.into();
        dims.iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                Error::shape(format!("{dims:?} has more elements than fit in memory"))
            })?;
        Ok(Shape(dims))
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// The innermost dimension (the length of a row); 1 for a scalar.
    pub fn row_len(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }

    /// Number of rows: every dimension but the innermost, multiplied.
    pub fn rows(&self) -> usize {
        match self.0.split_last() {
            Some((_, outer)) => outer.iter().product(),
            None => 1,
        }
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|d| d.to_string()).collect();
        write!(f, "[{}]", parts.join(", "))
    }
}

impl TryFrom<&[usize]> for Shape {
    type Error = Error;
    fn try_from(dims: &[usize]) -> Result<Self> {
        Shape::new(dims.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflowing_shape_is_an_error() {
        assert!(Shape::new(vec![usize::MAX, 2]).is_err());
        let s = Shape::new(vec![3, 5, 7]).unwrap();
        assert_eq!((s.numel(), s.rows(), s.row_len()), (105, 15, 7));
    }
}
