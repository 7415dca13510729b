//! The KV cache's types on wgpu (shaders/kv_cache.wgsl) and writing rows into a cache
//! (shaders/kv_rows.wgsl): F32 rows converted to the cache's type, or rows of its own
//! type copied as stored.

use crate::elementwise::count;
use crate::kernels::{COPY_ROWS, WRITE_ROWS};
use crate::stream::Binding;
use crate::{f32_tensor, i32_tensor, storage, WgpuBackend};
use kiln_core::{DType, Error, Result, Tensor};

/// The override constant `KV` of the kernels that read or write a cache of `dtype` (its
/// index in [`DType::KV_CACHE`]), or an error for a type a cache cannot have.
pub(crate) fn kv_constant(dtype: DType) -> Result<f64> {
    DType::KV_CACHE
        .iter()
        .position(|&d| d == dtype)
        .map(|i| i as f64)
        .ok_or_else(|| {
            Error::unsupported(format!(
                "a KV cache of {dtype} (the KV cache types are f32, f16, bf16 and q8_0)"
            ))
        })
}

/// A cache's binding, and the kernels' `KV` for it.
pub(crate) fn kv_tensor<'a>(t: &'a Tensor, what: &str) -> Result<(Binding<'a>, f64)> {
    let kv = kv_constant(t.dtype())?;
    Ok((storage(t, what)?.binding(), kv))
}

/// The kernels' parameters (shaders/kv_rows.wgsl, `RParams`), less the grid.
struct RowParams {
    units: usize,
    row_len: usize,
    dst_rows: usize,
    elements: usize,
    src_at: usize,
    dst_at: usize,
}

fn launch(
    b: &WgpuBackend,
    spec: &crate::kernels::KernelSpec,
    kv: f64,
    bindings: &[Binding],
    p: RowParams,
) -> Result<()> {
    let what = "write_rows";
    let (groups, groups_x) = b.grid(p.units.div_ceil(256))?;
    let kernel = b.kernel(spec, &[("KV", kv)])?;
    b.stream.dispatch(
        &kernel,
        bindings,
        &[
            count(p.units, what)?,
            count(p.row_len, what)?,
            count(p.dst_rows, what)?,
            count(p.elements, what)?,
            count(p.src_at, what)?,
            count(p.dst_at, what)?,
            groups_x,
        ],
        groups,
    )
}

pub(crate) fn write_rows(
    b: &WgpuBackend,
    src: &Tensor,
    dst: &mut Tensor,
    pos: &Tensor,
) -> Result<()> {
    let rows = src.dims().first().copied().unwrap_or(0);
    let dst_rows = dst.dims().first().copied().unwrap_or(0);
    let row = src.shape().numel().checked_div(rows).unwrap_or(0);
    if dst_rows == 0 || dst.shape().numel() / dst_rows != row || src.shape().numel() != rows * row {
        return Err(Error::shape(format!(
            "write_rows: rows of {} do not fit rows of {}",
            src.shape(),
            dst.shape()
        )));
    }
    let dtype = dst.dtype();
    if src.dtype() != DType::F32 && src.dtype() != dtype {
        return Err(Error::unsupported(format!(
            "write_rows: {} rows into a {dtype} cache (from f32 or its own type)",
            src.dtype()
        )));
    }
    let (dst_binding, kv) = kv_tensor(dst, "write_rows destination")?;
    if rows * row == 0 {
        return Ok(());
    }
    let positions = i32_tensor(pos, rows, "write_rows positions")?;
    let elements = dst_rows * row;
    if src.dtype() == DType::F32 {
        let bindings = [
            f32_tensor(src, "write_rows source")?,
            dst_binding,
            positions,
        ];
        // A lane a value; for q8_0 a block of 32 (rows are whole blocks: a tensor of a
        // block type holds whole blocks a row).
        let p = RowParams {
            units: rows * row / dtype.block_size(),
            row_len: row,
            dst_rows,
            elements,
            src_at: 0,
            dst_at: 0,
        };
        return launch(b, &WRITE_ROWS, kv, &bindings, p);
    }
    // Copied as stored, in half-words: the whole rows, or a q8_0 cache's quants (a byte a
    // value) and then its scales.
    let bindings = [
        storage(src, "write_rows source")?.binding(),
        dst_binding,
        positions,
    ];
    let row_bytes = dtype.row_bytes(row)?;
    let quant_bytes = if dtype == DType::Q8_0 { row } else { row_bytes };
    let mut regions = vec![(0, 0, quant_bytes)];
    if quant_bytes != row_bytes {
        regions.push((rows * row, elements, row_bytes - quant_bytes));
    }
    for (src_at, dst_at, bytes) in regions {
        let p = RowParams {
            units: rows * bytes / 2,
            row_len: bytes / 2,
            dst_rows,
            elements,
            src_at: src_at / 2,
            dst_at: dst_at / 2,
        };
        launch(b, &COPY_ROWS, kv, &bindings, p)?;
    }
    Ok(())
}
