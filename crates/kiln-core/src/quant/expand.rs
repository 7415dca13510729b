//! ggml block formats kiln reads but does not compute with yet: GGUF files from
//! llama-quantize contain them (Q5_0 is its fallback for Q4_K rows that are not whole
//! 256-blocks; Q4_K_M's siblings use Q5_K). Loaders expand them to f32. Each decoder
//! performs ggml's float operations in ggml's order, so results are bit-identical to
//! `dequantize_row_*` and to the `gguf` Python package (checked by kiln-io's tests).

use super::{q4k_scale_min, QK, QK_K};
use crate::{Error, Result};
use half::f16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum ExpandedFormat {
    Q4_1,
    Q5_0,
    Q5_1,
    Q5_K,
}

impl ExpandedFormat {
    pub fn from_ggml_id(id: u32) -> Option<Self> {
        Some(match id {
            3 => ExpandedFormat::Q4_1,
            6 => ExpandedFormat::Q5_0,
            7 => ExpandedFormat::Q5_1,
            13 => ExpandedFormat::Q5_K,
            _ => return None,
        })
    }

    pub fn block_size(self) -> usize {
        match self {
            ExpandedFormat::Q5_K => QK_K,
            _ => QK,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            ExpandedFormat::Q4_1 => 20,
            ExpandedFormat::Q5_0 => 22,
            ExpandedFormat::Q5_1 => 24,
            ExpandedFormat::Q5_K => 176,
        }
    }

    /// Decode `src` into `dst` (whole blocks, lengths matching).
    pub fn dequantize(self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        let (bs, bb) = (self.block_size(), self.block_bytes());
        if !dst.len().is_multiple_of(bs) || src.len() != dst.len() / bs * bb {
            return Err(Error::shape(format!(
                "{} bytes of {self:?} do not hold {} values",
                src.len(),
                dst.len()
            )));
        }
        for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bs)) {
            match self {
                ExpandedFormat::Q4_1 => q4_1(b, y),
                ExpandedFormat::Q5_0 => q5(b, y, false),
                ExpandedFormat::Q5_1 => q5(b, y, true),
                ExpandedFormat::Q5_K => q5_k(b, y),
            }
        }
        Ok(())
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// d, m, 16 bytes of nibbles: `q·d + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for j in 0..QK / 2 {
        let q = b[4 + j];
        y[j] = (q & 0xF) as f32 * d + m;
        y[j + QK / 2] = (q >> 4) as f32 * d + m;
    }
}

/// Q5_0 (d, qh, qs: `(q - 16)·d`) and Q5_1 (d, m, qh, qs: `q·d + m`).
fn q5(b: &[u8], y: &mut [f32], with_min: bool) {
    let d = half(b, 0);
    let (m, at) = if with_min { (half(b, 2), 4) } else { (0.0, 2) };
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let qs = &b[at + 4..at + 20];
    for j in 0..QK / 2 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0xF) | h0) as i32;
        let x1 = ((qs[j] >> 4) | h1) as i32;
        if with_min {
            y[j] = x0 as f32 * d + m;
            y[j + QK / 2] = x1 as f32 * d + m;
        } else {
            y[j] = (x0 - 16) as f32 * d;
            y[j + QK / 2] = (x1 - 16) as f32 * d;
        }
    }
}

/// d, dmin, 12 bytes of 6-bit scales/mins, qh[32], qs[128].
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (half(b, 0), half(b, 2));
    let scales: &[u8; 12] = b[4..16].try_into().expect("12 bytes");
    let qh = &b[16..48];
    let ql = &b[48..176];
    let (mut u1, mut u2) = (1u8, 2u8);
    for g in 0..4 {
        let (sc1, m1) = q4k_scale_min(2 * g, scales);
        let (sc2, m2) = q4k_scale_min(2 * g + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let q = &ql[32 * g..32 * g + 32];
        let out = &mut y[64 * g..64 * g + 64];
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((q[l] & 0xF) + hi1) as f32 - m1;
            out[l + 32] = d2 * ((q[l] >> 4) + hi2) as f32 - m2;
        }
        u1 <<= 2;
        u2 <<= 2;
    }
}
