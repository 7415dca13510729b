use crate::{DType, Device, Error, Result, Shape};
use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Host bytes shared without copying: a region of a memory-mapped file, or an owned vector.
/// Weights go from file to backend through this, so that the CPU backend can use mapped
/// tensor data in place and a GPU backend can upload it straight from the mapping.
#[derive(Clone)]
pub struct HostBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
    /// How the owner lets go of bytes nobody will read again (see [`HostBytes::release`]).
    release: Option<fn(&[u8])>,
}

impl HostBytes {
    /// `range` of the bytes `owner` holds; an error if it reaches past them.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Result<Self> {
        let len = (*owner).as_ref().len();
        if range.start > range.end || range.end > len {
            return Err(Error::format(format!(
                "byte range {range:?} is outside a buffer of {len} bytes"
            )));
        }
        Ok(HostBytes {
            owner,
            range,
            release: None,
        })
    }

    /// These bytes, with `release` as the way to let go of them: a file mapping's owner
    /// drops the pages from the process's memory (they are read back from the file if
    /// touched again).
    pub fn with_release(mut self, release: fn(&[u8])) -> Self {
        self.release = Some(release);
        self
    }

    /// Tell the owner that this process will not read these bytes again (a backend that
    /// keeps its own copy of a weight): for a mapped file, its pages leave the process's
    /// resident memory. Bytes still read later stay correct; other owners do nothing.
    pub fn release(&self) {
        if let Some(release) = self.release {
            release(self.as_slice());
        }
    }

    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let range = 0..bytes.len();
        HostBytes {
            owner: Arc::new(bytes),
            range,
            release: None,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// Bytes `range` of these (relative to their start), sharing the owner: a part of a
    /// mapped tensor without a copy. An error if `range` reaches past them.
    pub fn slice(&self, range: Range<usize>) -> Result<HostBytes> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::format(format!(
                "byte range {range:?} is outside {} bytes",
                self.len()
            )));
        }
        Ok(HostBytes {
            owner: self.owner.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
            release: self.release,
        })
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len())
    }
}

/// A backend's buffer. Each backend downcasts to its own storage type and refuses others,
/// which is how a tensor on the wrong device is caught.
pub trait Storage: Any + Send + Sync + fmt::Debug {
    fn device(&self) -> Device;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A typed, shaped buffer on some device. Created by a [`crate::Backend`].
#[derive(Debug)]
pub struct Tensor {
    storage: Box<dyn Storage>,
    dtype: DType,
    shape: Shape,
    /// Products compute each row as if alone (see [`Tensor::set_exact_rows`]).
    exact_rows: bool,
}

impl Tensor {
    /// For backends: wrap storage that holds exactly `shape` elements of `dtype`.
    pub fn from_storage(storage: Box<dyn Storage>, dtype: DType, shape: Shape) -> Self {
        Tensor {
            storage,
            dtype,
            shape,
            exact_rows: false,
        }
    }

    /// Whether products that read this tensor compute each row as a product of that row
    /// alone would (see [`Tensor::set_exact_rows`]).
    pub fn exact_rows(&self) -> bool {
        self.exact_rows
    }

    /// Ask products (matmul and the fused ops around it) that read this tensor to compute
    /// each row exactly as a product of that row alone would. A kernel's rounding may
    /// depend on the rows it is given (which tile a row falls in, whether a one-row or a
    /// tiled kernel runs), so a server stepping many sequences together could give the same
    /// request other tokens at temperature 0 depending on what else runs; with exact rows
    /// it cannot. Backends that cannot honour it compute the same values with the rounding
    /// of a batched product (the CPU honours it).
    pub fn set_exact_rows(&mut self, on: bool) {
        self.exact_rows = on;
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn device(&self) -> Device {
        self.storage.device()
    }

    pub fn storage(&self) -> &dyn Storage {
        self.storage.as_ref()
    }

    pub fn storage_mut(&mut self) -> &mut dyn Storage {
        self.storage.as_mut()
    }

    /// Bytes the data takes in its stored encoding.
    pub fn size_bytes(&self) -> usize {
        // Validated when the tensor was made: rows are whole blocks.
        self.shape.rows() * self.dtype.row_bytes(self.shape.row_len()).unwrap_or(0)
    }

    /// Give the same data another shape with the same element count (and row length,
    /// for block types).
    pub fn reshape(&mut self, shape: Shape) -> Result<()> {
        if shape.numel() != self.shape.numel()
            || (self.dtype.is_quantized() && shape.row_len() != self.shape.row_len())
        {
            return Err(Error::shape(format!(
                "cannot view {} of {} as {}",
                self.shape, self.dtype, shape
            )));
        }
        self.shape = shape;
        Ok(())
    }
}
