//! ggml's block formats: layouts, reference quantization and dequantization.
//!
//! The layouts are ggml's byte for byte (`ggml-common.h`). Quantization follows ggml's
//! reference functions (`quantize_row_*_ref`, which `llama-quantize` uses when no importance
//! matrix is given), including its rounding helper, so that files kiln writes match files
//! llama.cpp writes. Dequantization performs the same float operations in the same order as
//! ggml and the `gguf` Python package, so results are bit-identical; the test suite checks
//! this against `gguf.quants`.

mod expand;
mod float;
pub mod gpu_layout;
mod q4_0;
mod q4_k;
mod q6_k;
mod q8_0;
mod q8_k;

use crate::{DType, Error, Result};
use bytemuck::{Pod, Zeroable};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::borrow::Cow;

pub use expand::ExpandedFormat;
pub use float::{bf16_to_f32, f32_to_bf16};
pub use q8_k::quantize_q8_k;

/// Elements in one super-block of the K formats.
pub const QK_K: usize = 256;
/// Elements in one block of Q8_0 and Q4_0.
pub const QK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    /// Element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble.
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    /// Eight 6-bit scales and eight 6-bit mins, packed (see [`q4k_scale_min`]).
    pub scales: [u8; 12],
    /// Four groups of 64 elements: element `l` of a group in the low nibble of byte `l`,
    /// element `l + 32` in its high nibble.
    pub qs: [u8; QK_K / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// Activations quantized for dot products with the K formats (never stored in files).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    /// Sum of each group of 16 values.
    pub bsums: [i16; QK_K / 16],
}

const _: () = {
    assert!(std::mem::size_of::<BlockQ8_0>() == 34);
    assert!(std::mem::size_of::<BlockQ4_0>() == 18);
    assert!(std::mem::size_of::<BlockQ4K>() == 144);
    assert!(std::mem::size_of::<BlockQ6K>() == 210);
    assert!(std::mem::size_of::<BlockQ8K>() == 292);
};

/// Scale and min `j` (0..8) of a Q4_K block, each 6 bits.
#[inline]
pub fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's `nearest_int`: round half to even through the float adder (valid for |v| < 2^22).
#[inline]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let x = v + 12_582_912.0;
    (x.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// View bytes as blocks, copying only when the bytes are not aligned for the block type.
pub fn as_blocks<B: Pod>(bytes: &[u8]) -> Result<Cow<'_, [B]>> {
    let size = std::mem::size_of::<B>();
    if !bytes.len().is_multiple_of(size) {
        return Err(Error::shape(format!(
            "{} bytes is not a whole number of {size}-byte blocks",
            bytes.len()
        )));
    }
    Ok(match bytemuck::try_cast_slice(bytes) {
        Ok(blocks) => Cow::Borrowed(blocks),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    })
}

fn check_lengths(dtype: DType, elements: usize, bytes: usize) -> Result<()> {
    let want = dtype.row_bytes(elements)?;
    if want != bytes {
        return Err(Error::shape(format!(
            "{elements} {dtype} elements take {want} bytes, buffer has {bytes}"
        )));
    }
    Ok(())
}

/// Quantize (or convert) `src` to `dtype`, returning the encoded bytes.
pub fn quantize(dtype: DType, src: &[f32]) -> Result<Vec<u8>> {
    let mut out = vec![0u8; dtype.row_bytes(src.len())?];
    quantize_into(dtype, src, &mut out)?;
    Ok(out)
}

/// Quantize (or convert) `src` into `dst`, which must hold exactly its encoding.
pub fn quantize_into(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_lengths(dtype, src.len(), dst.len())?;
    match dtype {
        DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        DType::F16 => {
            // Whole slices through the vectorised conversion (F16C) where the bytes line
            // up as f16, as `dequantize` reads them; both round to nearest even.
            match bytemuck::try_cast_slice_mut::<u8, f16>(dst) {
                Ok(halves) if cfg!(target_endian = "little") => halves.convert_from_f32_slice(src),
                _ => {
                    for (o, &x) in dst.chunks_exact_mut(2).zip(src) {
                        o.copy_from_slice(&f16::from_f32(x).to_le_bytes());
                    }
                }
            }
        }
        DType::BF16 => {
            for (o, &x) in dst.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&f32_to_bf16(x).to_le_bytes());
            }
        }
        DType::Q8_0 => for_blocks(src, dst, q8_0::quantize_block),
        DType::Q4_0 => for_blocks(src, dst, q4_0::quantize_block),
        DType::Q4_K => for_blocks(src, dst, q4_k::quantize_block),
        DType::Q6_K => for_blocks(src, dst, q6_k::quantize_block),
        DType::I32 => return Err(Error::unsupported("i32 holds ids, not quantized values")),
    }
    Ok(())
}

/// Decode `src` (encoded as `dtype`) into `dst`, which must have room for exactly its values.
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_lengths(dtype, dst.len(), src.len())?;
    match dtype {
        DType::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            // Whole slices through the vectorised conversion (F16C, 8 at a time) where the
            // bytes line up as f16; one at a time otherwise.
            match bytemuck::try_cast_slice::<u8, f16>(src) {
                Ok(halves) if cfg!(target_endian = "little") => {
                    halves.convert_to_f32_slice(&mut dst[..halves.len()])
                }
                _ => {
                    for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                }
            }
        }
        DType::BF16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        DType::Q8_0 => dequantize_blocks(src, dst, q8_0::dequantize_block)?,
        DType::Q4_0 => dequantize_blocks(src, dst, q4_0::dequantize_block)?,
        DType::Q4_K => dequantize_blocks(src, dst, q4_k::dequantize_block)?,
        DType::Q6_K => dequantize_blocks(src, dst, q6_k::dequantize_block)?,
        DType::I32 => return Err(Error::unsupported("i32 holds ids, not quantized values")),
    }
    Ok(())
}

/// Decode into a new vector.
pub fn dequantize_to_vec(dtype: DType, src: &[u8], elements: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; elements];
    dequantize(dtype, src, &mut out)?;
    Ok(out)
}

fn for_blocks<B: Pod, const N: usize>(src: &[f32], dst: &mut [u8], f: fn(&[f32; N]) -> B) {
    let size = std::mem::size_of::<B>();
    for (x, out) in src.chunks_exact(N).zip(dst.chunks_exact_mut(size)) {
        let block = f(x.try_into().expect("chunk of N"));
        out.copy_from_slice(bytemuck::bytes_of(&block));
    }
}

fn dequantize_blocks<B: Pod, const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    f: fn(&B, &mut [f32; N]),
) -> Result<()> {
    let blocks = as_blocks::<B>(src)?;
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(N)) {
        f(b, y.try_into().expect("chunk of N"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
