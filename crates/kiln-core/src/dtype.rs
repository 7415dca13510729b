use crate::{Error, Result};
use std::fmt;

/// Element types kiln computes with. Quantized types use ggml's block layouts byte for
/// byte (see [`crate::quant`]), so GGUF tensor data is used as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 values: f16 scale, 32 × i8.
    Q8_0,
    /// 32 values: f16 scale, 16 bytes of 4-bit values offset by 8.
    Q4_0,
    /// 256 values in 8 sub-blocks of 32: f16 d and dmin, 12 bytes of 6-bit scales and
    /// mins, 128 bytes of 4-bit values.
    Q4_K,
    /// 256 values in 16 sub-blocks of 16: 4 low bits, 2 high bits, i8 scales, f16 d.
    Q6_K,
    /// 32-bit signed integers: token ids and positions, never weights or activations.
    I32,
}

impl DType {
    /// The types weights and activations are stored in (every type but [`DType::I32`]).
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_K,
        DType::Q6_K,
    ];

    /// The types a KV cache may hold ([`crate::Backend::write_rows`] writes them,
    /// [`crate::Backend::attention`] reads them): plain floats, and Q8_0 for heads of a
    /// whole number of its blocks.
    pub const KV_CACHE: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::Q8_0];

    /// Elements per block (1 for plain floats).
    pub const fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
            DType::Q8_0 | DType::Q4_0 => 32,
            DType::Q4_K | DType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_K => 144,
            DType::Q6_K => 210,
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// The name ggml gives the type (`q4_K`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_K => "q4_K",
            DType::Q6_K => "q6_K",
            DType::I32 => "i32",
        }
    }

    /// ggml's `ggml_type` number, as stored in GGUF tensor infos.
    pub const fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q8_0 => 8,
            DType::Q4_K => 12,
            DType::Q6_K => 14,
            DType::BF16 => 30,
            DType::I32 => 26,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_id() == id)
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of one row of `n` elements; an error when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(Error::shape(format!(
                "a row of {n} elements is not a whole number of {} blocks of {}",
                self.name(),
                self.block_size()
            )));
        }
        (n / self.block_size())
            .checked_mul(self.block_bytes())
            .ok_or_else(|| Error::shape(format!("{n} elements of {} overflow", self.name())))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml_id(d.ggml_id()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::Q4_K.row_bytes(512).unwrap(), 288);
        assert!(DType::Q8_0.row_bytes(33).is_err());
    }
}
