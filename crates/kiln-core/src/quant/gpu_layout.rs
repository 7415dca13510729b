//! How quantized tensors sit in GPU memory (CUDA and wgpu): ggml's blocks split into two
//! regions, first the quant bytes of every block in order, then the rest of every block
//! (scales, mins) in order. Same bits and size as the file's; only the quants of each row
//! start at a 16-byte aligned address, so a lane loads 16 of them at once, and WGSL can read
//! them as `array<u32>` (the 18-, 34- and 210-byte ggml blocks are only 2-byte aligned).
//! kiln-cuda's `common.cuh` (`weight_row`) and kiln-wgpu's `common.wgsl` read this layout.

use crate::DType;

/// Where a block's quant bytes lie inside it: (offset, length); None for float types.
pub fn quant_span(dtype: DType) -> Option<(usize, usize)> {
    match dtype {
        DType::Q8_0 => Some((2, 32)),
        DType::Q4_0 => Some((2, 16)),
        DType::Q4_K => Some((16, 128)),
        DType::Q6_K => Some((0, 192)),
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 => None,
    }
}

/// The device bytes of a tensor whose file bytes are `bytes` (a whole number of blocks);
/// None when the dtype is stored as is.
pub fn split(dtype: DType, bytes: &[u8]) -> Option<Vec<u8>> {
    let (q_off, q_len) = quant_span(dtype)?;
    let block = dtype.block_bytes();
    let blocks = bytes.len() / block;
    let mut out = vec![0u8; bytes.len()];
    let (quants, meta) = out.split_at_mut(blocks * q_len);
    let meta_len = block - q_len;
    for (i, b) in bytes.chunks_exact(block).enumerate() {
        quants[i * q_len..(i + 1) * q_len].copy_from_slice(&b[q_off..q_off + q_len]);
        let m = &mut meta[i * meta_len..(i + 1) * meta_len];
        m[..q_off].copy_from_slice(&b[..q_off]);
        m[q_off..].copy_from_slice(&b[q_off + q_len..]);
    }
    Some(out)
}

/// The inverse of [`split`]: file bytes from device bytes.
pub fn join(dtype: DType, bytes: &[u8]) -> Option<Vec<u8>> {
    let (q_off, q_len) = quant_span(dtype)?;
    let block = dtype.block_bytes();
    let blocks = bytes.len() / block;
    let (quants, meta) = bytes.split_at(blocks * q_len);
    let meta_len = block - q_len;
    let mut out = vec![0u8; bytes.len()];
    for (i, b) in out.chunks_exact_mut(block).enumerate() {
        let m = &meta[i * meta_len..(i + 1) * meta_len];
        b[..q_off].copy_from_slice(&m[..q_off]);
        b[q_off..q_off + q_len].copy_from_slice(&quants[i * q_len..(i + 1) * q_len]);
        b[q_off + q_len..].copy_from_slice(&m[q_off..]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn split_puts_quants_first_and_join_undoes_it() {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K] {
            let (q_off, q_len) = quant_span(dtype).unwrap();
            let block = dtype.block_bytes();
            let blocks = 7;
            let file = bytes(block * blocks, block as u32);
            let dev = split(dtype, &file).unwrap();
            assert_eq!(dev.len(), file.len());
            for i in 0..blocks {
                let b = &file[i * block..(i + 1) * block];
                assert_eq!(&dev[i * q_len..(i + 1) * q_len], &b[q_off..q_off + q_len]);
                let meta = &dev[blocks * q_len + i * (block - q_len)..][..block - q_len];
                assert_eq!(&meta[..q_off], &b[..q_off], "{dtype:?} block {i}");
                assert_eq!(&meta[q_off..], &b[q_off + q_len..], "{dtype:?} block {i}");
            }
            // Every row's quants start 16-byte aligned when rows are whole blocks.
            assert_eq!(q_len % 16, 0);
            assert_eq!(join(dtype, &dev).unwrap(), file);
        }
        assert!(split(DType::F16, &[1, 2]).is_none());
    }
}
