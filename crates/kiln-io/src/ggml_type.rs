use kiln_core::DType;
use std::fmt;

/// A `ggml_type` as found in GGUF tensor infos. kiln knows the block layout of every type
/// ggml defines (so it can validate and describe any GGUF file) and computes with those
/// that map to a [`DType`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    /// Elements per block.
    pub block_size: u64,
    /// Bytes per block.
    pub block_bytes: u64,
}

const QK_K: u64 = 256;

/// ggml's types and block layouts (`ggml.c` type traits; gaps are removed types).
const TYPES: &[GgmlType] = &[
    t(0, "f32", 1, 4),
    t(1, "f16", 1, 2),
    t(2, "q4_0", 32, 18),
    t(3, "q4_1", 32, 20),
    t(6, "q5_0", 32, 22),
    t(7, "q5_1", 32, 24),
    t(8, "q8_0", 32, 34),
    t(9, "q8_1", 32, 36),
    t(10, "q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
    t(11, "q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
    t(12, "q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
    t(13, "q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
    t(14, "q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
    t(15, "q8_K", QK_K, 4 + QK_K + QK_K / 8),
    t(16, "iq2_xxs", QK_K, 2 + QK_K / 4),
    t(17, "iq2_xs", QK_K, 2 + QK_K / 4 + QK_K / 32),
    t(18, "iq3_xxs", QK_K, 2 + QK_K / 4 + QK_K / 8),
    t(19, "iq1_s", QK_K, 2 + QK_K / 8 + QK_K / 16),
    t(20, "iq4_nl", 32, 18),
    t(21, "iq3_s", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
    t(22, "iq2_s", QK_K, 2 + QK_K / 4 + QK_K / 16),
    t(23, "iq4_xs", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
    t(24, "i8", 1, 1),
    t(25, "i16", 1, 2),
    t(26, "i32", 1, 4),
    t(27, "i64", 1, 8),
    t(28, "f64", 1, 8),
    t(29, "iq1_m", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
    t(30, "bf16", 1, 2),
    t(34, "tq1_0", QK_K, 2 + 4 * 13),
    t(35, "tq2_0", QK_K, 2 + 64),
    t(39, "mxfp4", 32, 17),
    t(40, "nvfp4", 64, 36),
    t(41, "q1_0", 128, 18),
];

const fn t(id: u32, name: &'static str, block_size: u64, block_bytes: u64) -> GgmlType {
    GgmlType {
        id,
        name,
        block_size,
        block_bytes,
    }
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().copied().find(|t| t.id == id)
    }

    pub fn from_dtype(dtype: DType) -> GgmlType {
        Self::from_id(dtype.ggml_id()).expect("every DType is a ggml type")
    }

    /// The kiln dtype, when kiln computes with this type.
    pub fn dtype(self) -> Option<DType> {
        DType::from_ggml_id(self.id)
    }

    /// Bytes of `n` elements laid out as rows of `row_len`; `None` when a row is not a
    /// whole number of blocks or the size overflows.
    pub fn bytes_for(self, row_len: u64, rows: u64) -> Option<u64> {
        if !row_len.is_multiple_of(self.block_size) {
            return None;
        }
        (row_len / self.block_size)
            .checked_mul(self.block_bytes)?
            .checked_mul(rows)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_dtypes_agree_with_the_table() {
        for d in DType::ALL {
            let g = GgmlType::from_dtype(d);
            assert_eq!(
                (g.name, g.block_size, g.block_bytes),
                (d.name(), d.block_size() as u64, d.block_bytes() as u64)
            );
        }
        assert!(GgmlType::from_id(4).is_none());
    }
}
