//! Quantized weights in a layout of the CPU backend's own: rows interleaved in panels of
//! [`P`], made once at upload and read by the decode and prompt kernels alike.
//!
//! A GGUF file stores a weight row after row, each block beside its scale. Kernels reading
//! that layout pay per row and block for what does not move memory: a weight row's scales
//! are gathered from 18-byte strides, each row's sum ends in a horizontal reduction, and
//! sharing an activation load between rows takes several streams a thread. Here lane `r`
//! of a register is row `r` of a panel: one load brings the same four quants of 16 rows
//! (8 on AVX2), the 16 rows' scales of a block are one load, each lane ends holding its
//! row's product (no horizontal sums), and a thread reads each task's panels (up to 4
//! consecutive ones, claimed from the pool's counter) front to back as one sequential
//! stream. Decode (one activation row) and prompts (a register tile of several
//! activation rows per weight load) read the same panels.
//!
//! The layout is chosen per tensor at upload ([`Format::for_dtype`]) on CPUs whose kernels
//! read it (AVX2, AVX-512), and is invisible outside this crate: shapes and dtypes stay
//! the file's, `download` returns the file's bytes, and the embedding lookup reads rows
//! out of the panels. `KILN_CPU_LAYOUT=file` (or [`crate::CpuBackend::file_layout`])
//! keeps the file's layout.
//!
//! Q4_0, a panel of `nb` blocks a row ([`Format::Q4_0`]):
//! - `nb × 32` bytes: block `b`'s 16 f16 scales, row `r` at `32b + 2r`;
//! - then `nb × 256` bytes: block `b`'s quants in 4 chunks of 64 bytes, chunk `c` holding
//!   bytes `4c..4c+4` of row `r`'s `qs` at `256b + 64c + 4r`: low nibbles are elements
//!   `4c..4c+4` of the row's block, high nibbles `16+4c..16+4c+4`, as unsigned `q + 8`.
//!
//! Q4_K, a panel of `nb` super-blocks a row ([`Format::Q4K`]):
//! - `nb × 256` bytes of headers: super-block `b`'s 16 `d` (f16) at `256b + 2r`, 16
//!   `dmin` at `256b + 32 + 2r`, then its 12 bytes of packed scales and mins in 3 chunks
//!   of 64, chunk `w` holding bytes `4w..4w+4` of row `r`'s `scales` at
//!   `256b + 64 + 64w + 4r` (unpacked in registers, 16 rows at a time);
//! - then `nb × 2048` bytes: super-block `b`'s quants in 32 chunks of 64 bytes, chunk `c`
//!   holding bytes `4c..4c+4` of row `r`'s `qs` at `2048b + 64c + 4r`.
//!
//! Scales and quants live apart so that the quant loads are 64-byte aligned (panels start
//! on 64-byte lines when `nb` is even, as in every real model); a panel holds exactly the
//! bytes of its 16 rows in the file. The last panel is padded with zero rows, whose
//! products are computed and not stored.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use crate::dot::{self, Isa};
use crate::pool::Pool;
use crate::stream::{Ahead, Plan, Stream};
use kiln_core::quant::{BlockQ4K, BlockQ4_0, BlockQ8K, BlockQ8_0, QK, QK_K};
use kiln_core::{DType, Error, Result};

/// Weight rows per panel.
pub(crate) const P: usize = 16;

/// An interleaved layout, one per weight dtype that has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Q4_0,
    Q4K,
}

impl Format {
    /// The layout this CPU's kernels read for weights of `dtype`, if any (none without
    /// AVX2).
    pub(crate) fn for_dtype(dtype: DType) -> Option<Format> {
        if !matches!(dot::isa(), Isa::Avx2 | Isa::Avx512Vnni) {
            return None;
        }
        match dtype {
            DType::Q4_0 => Some(Format::Q4_0),
            DType::Q4_K => Some(Format::Q4K),
            _ => None,
        }
    }

    fn dtype(self) -> DType {
        match self {
            Format::Q4_0 => DType::Q4_0,
            Format::Q4K => DType::Q4_K,
        }
    }

    /// Bytes of one file block (one row's share of a panel block).
    fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            Format::Q4K => std::mem::size_of::<BlockQ4K>(),
        }
    }

    /// Elements of one block.
    fn block_len(self) -> usize {
        match self {
            Format::Q4_0 => QK,
            Format::Q4K => QK_K,
        }
    }

    /// Copy file block `src` (its bytes) into lane `r` of block `b` of `panel` (`nb`
    /// blocks a row).
    fn put(self, panel: &mut [u8], nb: usize, b: usize, r: usize, src: &[u8]) {
        match self {
            Format::Q4_0 => {
                // A BlockQ4_0: the f16 scale, then 16 bytes of quants.
                panel[32 * b + 2 * r..][..2].copy_from_slice(&src[..2]);
                let q = &mut panel[32 * nb + 256 * b + 4 * r..];
                for (c, four) in src[2..18].chunks_exact(4).enumerate() {
                    q[64 * c..][..4].copy_from_slice(four);
                }
            }
            Format::Q4K => {
                // A BlockQ4K: d, dmin, 12 bytes of scales and mins, 128 bytes of quants.
                let h = &mut panel[256 * b..][..256];
                h[2 * r..][..2].copy_from_slice(&src[..2]);
                h[32 + 2 * r..][..2].copy_from_slice(&src[2..4]);
                for (w, four) in src[4..16].chunks_exact(4).enumerate() {
                    h[64 + 64 * w + 4 * r..][..4].copy_from_slice(four);
                }
                let q = &mut panel[256 * nb + 2048 * b + 4 * r..];
                for (c, four) in src[16..144].chunks_exact(4).enumerate() {
                    q[64 * c..][..4].copy_from_slice(four);
                }
            }
        }
    }

    /// The bytes of file block `b` of lane `r` of `panel` into `dst` (inverse of
    /// [`Format::put`]).
    fn get(self, panel: &[u8], nb: usize, b: usize, r: usize, dst: &mut [u8]) {
        match self {
            Format::Q4_0 => {
                dst[..2].copy_from_slice(&panel[32 * b + 2 * r..][..2]);
                let q = &panel[32 * nb + 256 * b + 4 * r..];
                for (c, four) in dst[2..18].chunks_exact_mut(4).enumerate() {
                    four.copy_from_slice(&q[64 * c..][..4]);
                }
            }
            Format::Q4K => {
                let h = &panel[256 * b..][..256];
                dst[..2].copy_from_slice(&h[2 * r..][..2]);
                dst[2..4].copy_from_slice(&h[32 + 2 * r..][..2]);
                for (w, four) in dst[4..16].chunks_exact_mut(4).enumerate() {
                    four.copy_from_slice(&h[64 + 64 * w + 4 * r..][..4]);
                }
                let q = &panel[256 * nb + 2048 * b + 4 * r..];
                for (c, four) in dst[16..144].chunks_exact_mut(4).enumerate() {
                    four.copy_from_slice(&q[64 * c..][..4]);
                }
            }
        }
    }
}

/// 64 bytes on a 64-byte boundary: the unit panels are stored in.
#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Line([u8; 64]);

/// A weight of `rows × cols` in an interleaved [`Format`].
pub struct Panels {
    lines: Vec<Line>,
    format: Format,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for Panels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Panels({:?}, {} × {})",
            self.format, self.rows, self.cols
        )
    }
}

impl Panels {
    /// Zeroed panels for `rows × cols` weights; an error when the size cannot be held.
    pub(crate) fn zeroed(format: Format, rows: usize, cols: usize) -> Result<Panels> {
        let bs = format.block_len();
        if !cols.is_multiple_of(bs) {
            return Err(Error::shape(format!(
                "{} rows of {cols} are not whole blocks of {bs}",
                format.dtype()
            )));
        }
        let bytes = rows
            .div_ceil(P)
            .checked_mul(P * (cols / bs) * format.block_bytes())
            .ok_or_else(|| Error::shape(format!("{rows} × {cols} does not fit in memory")))?;
        let mut lines = Vec::new();
        lines
            .try_reserve_exact(bytes.div_ceil(64))
            .map_err(|_| Error::Device(format!("cannot allocate {bytes} bytes of CPU memory")))?;
        lines.resize(bytes.div_ceil(64), Line([0; 64]));
        Ok(Panels {
            lines,
            format,
            rows,
            cols,
        })
    }

    /// `file` (the weight's bytes in the file's layout, checked by the caller to be
    /// `rows × cols` of the format's dtype) as panels, repacked over the pool.
    pub(crate) fn from_file(
        pool: &Pool,
        format: Format,
        rows: usize,
        cols: usize,
        file: &[u8],
    ) -> Result<Panels> {
        let mut p = Panels::zeroed(format, rows, cols)?;
        p.write_file(pool, file);
        Ok(p)
    }

    pub(crate) fn format(&self) -> Format {
        self.format
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Blocks a row.
    fn blocks(&self) -> usize {
        self.cols / self.format.block_len()
    }

    /// Bytes of one panel.
    fn panel_bytes(&self) -> usize {
        P * self.blocks() * self.format.block_bytes()
    }

    fn bytes(&self) -> &[u8] {
        let len = self.rows.div_ceil(P) * self.panel_bytes();
        &bytemuck::cast_slice(&self.lines)[..len]
    }

    /// Panel `p`'s bytes.
    pub(crate) fn panel(&self, p: usize) -> &[u8] {
        &self.bytes()[p * self.panel_bytes()..][..self.panel_bytes()]
    }

    /// Overwrite every row from `file`, the weight in the file's layout (exactly
    /// `rows × cols` of the format's dtype: checked by the caller).
    pub(crate) fn write_file(&mut self, pool: &Pool, file: &[u8]) {
        let (format, nb, rows) = (self.format, self.blocks(), self.rows);
        let (bb, panel_bytes) = (format.block_bytes(), self.panel_bytes());
        assert_eq!(
            file.len(),
            rows * nb * bb,
            "file bytes of a {rows} × {} weight",
            self.cols
        );
        if panel_bytes == 0 {
            return;
        }
        let len = rows.div_ceil(P) * panel_bytes;
        let bytes = &mut bytemuck::cast_slice_mut::<Line, u8>(&mut self.lines)[..len];
        pool.for_chunks_mut(bytes, panel_bytes, |p, panel| {
            panel.fill(0);
            for r in 0..P.min(rows - p * P) {
                let row = &file[(p * P + r) * nb * bb..][..nb * bb];
                for (b, blk) in row.chunks_exact(bb).enumerate() {
                    format.put(panel, nb, b, r, blk);
                }
            }
        });
    }

    /// The weight in the file's layout.
    pub(crate) fn to_file(&self) -> Vec<u8> {
        let (nb, bb) = (self.blocks(), self.format.block_bytes());
        let mut out = vec![0u8; self.rows * nb * bb];
        if bb * nb == 0 {
            return out;
        }
        for (r, row) in out.chunks_exact_mut(nb * bb).enumerate() {
            self.file_row(r, row);
        }
        out
    }

    /// Row `r` in the file's layout into `dst` (`blocks × block_bytes` bytes).
    fn file_row(&self, r: usize, dst: &mut [u8]) {
        let (nb, bb) = (self.blocks(), self.format.block_bytes());
        let panel = self.panel(r / P);
        for (b, blk) in dst.chunks_exact_mut(bb).enumerate().take(nb) {
            self.format.get(panel, nb, b, r % P, blk);
        }
    }

    /// Row `r` dequantized into `dst` (`cols` values), exactly as the file's row would be.
    pub(crate) fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<()> {
        let bb = self.format.block_bytes();
        let mut row = vec![0u8; self.blocks() * bb];
        self.file_row(r, &mut row);
        kiln_core::quant::dequantize(self.format.dtype(), &row, dst)
    }
}

/// One activation block's share of the kernels' work that does not depend on the weight:
/// its scale, and the correction for the weights' unsigned offset (`−8 · Σx`: the
/// nibbles are stored as `q + 8`).
#[derive(Clone, Copy)]
struct XBlock {
    d: f32,
    corr: i32,
}

fn x_blocks(x: &[BlockQ8_0]) -> Vec<XBlock> {
    x.iter()
        .map(|b| XBlock {
            d: b.d.to_f32(),
            corr: -8 * b.qs.iter().map(|&q| q as i32).sum::<i32>(),
        })
        .collect()
}

/// `out[n, m] = x · wᵀ` for Q4_0 panels `w` (`m × k`) and `x` the `n` activation rows as
/// Q8_0 (`k / 32` blocks each).
pub(crate) fn matmul_q4_0(
    pool: &Pool,
    w: &Panels,
    x: &[BlockQ8_0],
    out: &mut [f32],
    n: usize,
) -> Result<()> {
    matmul_q4_0_on(dot::isa(), pool, w, x, out, n)
}

/// [`matmul_q4_0`] with the kernels of `isa` (which this CPU must run).
fn matmul_q4_0_on(
    isa: Isa,
    pool: &Pool,
    w: &Panels,
    x: &[BlockQ8_0],
    out: &mut [f32],
    n: usize,
) -> Result<()> {
    let (m, nb) = (w.rows(), w.blocks());
    assert!(w.format() == Format::Q4_0 && x.len() >= n * nb && out.len() >= n * m);
    if !isa.available() || !matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) {
        return Err(Error::Device(format!(
            "Q4_0 panels need AVX2 or AVX-512 kernels; this CPU runs {}",
            isa.name()
        )));
    }
    let xb = x_blocks(&x[..n * nb]);
    let x = &x[..n * nb];
    if n == 1 {
        by_panels_one_row(pool, w, out, |p, ahead| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is available (checked above), with every feature its kernels
            // enable.
            unsafe {
                if isa == Isa::Avx512Vnni {
                    avx512::q4_0_panel(w.panel(p), nb, x, &xb, ahead)
                } else {
                    avx2::q4_0_panel(w.panel(p), nb, x, &xb, ahead)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("panels are made on x86_64 only: {p} {ahead:?}")
        });
        return Ok(());
    }
    by_panels(pool, out, n, m, |p, o| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            if isa == Isa::Avx512Vnni {
                avx512::q4_0_rows(w.panel(p), nb, x, &xb, o)
            } else {
                avx2::q4_0_rows(w.panel(p), nb, x, &xb, o)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("panels are made on x86_64 only: {p} {}", o.len())
    });
    Ok(())
}

/// One Q8_K activation block's share of the Q4_K kernels' work that does not depend on
/// the weight: its scale, and its sums of 32 paired as the kernels pair the weights' mins
/// (sub-blocks 0 and 2, 1 and 3, 4 and 6, 5 and 7, as two i16 in an i32).
#[derive(Clone, Copy)]
struct KXBlock {
    d: f32,
    sums: [i32; 4],
}

fn k_x_blocks(x: &[BlockQ8K]) -> Vec<KXBlock> {
    x.iter()
        .map(|b| {
            let sum = |s: usize| (b.bsums[2 * s] as i32 + b.bsums[2 * s + 1] as i32) & 0xFFFF;
            KXBlock {
                d: b.d,
                sums: [0, 1, 4, 5].map(|s| sum(s) | sum(s + 2) << 16),
            }
        })
        .collect()
}

/// `out[n, m] = x · wᵀ` for Q4_K panels `w` (`m × k`) and `x` the `n` activation rows as
/// Q8_K (`k / 256` blocks each).
pub(crate) fn matmul_q4_k(
    pool: &Pool,
    w: &Panels,
    x: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
) -> Result<()> {
    matmul_q4_k_on(dot::isa(), pool, w, x, out, n)
}

/// [`matmul_q4_k`] with the kernels of `isa` (which this CPU must run). Prompts on
/// AVX-512 go to the register-tiled kernels of [`crate::kgemm`] (AMX-INT8 where present),
/// which read the panels' rows directly (`KRows::Panels`).
fn matmul_q4_k_on(
    isa: Isa,
    pool: &Pool,
    w: &Panels,
    x: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
) -> Result<()> {
    let (m, nb) = (w.rows(), w.blocks());
    assert!(w.format() == Format::Q4K && x.len() >= n * nb && out.len() >= n * m);
    if !isa.available() || !matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) {
        return Err(Error::Device(format!(
            "Q4_K panels need AVX2 or AVX-512 kernels; this CPU runs {}",
            isa.name()
        )));
    }
    let x = &x[..n * nb];
    if isa == Isa::Avx512Vnni && n > 1 {
        let (rows, k) = (crate::kgemm::KRows::Panels(w), nb * QK_K);
        if n >= crate::kgemm::amx::MIN_ROWS && crate::amx::int8_available() {
            crate::kgemm::amx::matmul(pool, rows, x, out, n, m, k);
            return Ok(());
        }
        if n >= crate::qgemm::MIN_ROWS {
            crate::kgemm::matmul::<BlockQ4K>(pool, rows, x, out, n, m, k);
            return Ok(());
        }
    }
    let xb = k_x_blocks(x);
    let one_row = |p: usize, i: usize, ahead: Ahead| -> [f32; P] {
        let (xi, xbi) = (&x[i * nb..][..nb], &xb[i * nb..][..nb]);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is available (checked above), with every feature its kernels
        // enable.
        unsafe {
            if isa == Isa::Avx512Vnni {
                avx512::q4_k_panel(w.panel(p), nb, xi, xbi, ahead)
            } else {
                avx2::q4_k_panel(w.panel(p), nb, xi, xbi, ahead)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "panels are made on x86_64 only: {p} {} {} {ahead:?}",
            xi.len(),
            xbi.len()
        )
    };
    if n == 1 {
        by_panels_one_row(pool, w, out, |p, ahead| one_row(p, 0, ahead));
    } else if isa == Isa::Avx2 {
        by_panels(pool, out, n, m, |p, o| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            unsafe {
                avx2::q4_k_rows(w.panel(p), nb, x, &xb, o)
            }
        });
    } else {
        // Two or three rows on AVX-512: the decode kernel once per row.
        by_panels(pool, out, n, m, |p, o| {
            o.iter_mut()
                .enumerate()
                .for_each(|(i, o)| *o = one_row(p, i, Ahead::NONE))
        });
    }
    Ok(())
}

/// Fill `out[..m]` of `w`'s rows panel by panel over the pool: `panel(p, ahead)` returns
/// the products of panel `p`'s rows, prefetching as `ahead` says. Each task takes a run of
/// consecutive panels: one stream through memory, prefetched up to the run's end.
fn by_panels_one_row(
    pool: &Pool,
    w: &Panels,
    out: &mut [f32],
    panel: impl Fn(usize, Ahead) -> [f32; P] + Sync,
) {
    let m = w.rows();
    let (panels, bytes) = (m.div_ceil(P), w.panel_bytes());
    let per_task = match Plan::get().long_tasks {
        // Two long runs of panels a thread: the prefetch follows each from end to end
        // (see `ahead_at`), and a thread that wakes late still finds work.
        true => panels.div_ceil(2 * pool.threads()).max(1),
        // Enough rows per task to amortise scheduling, few enough to balance the pool.
        false => (m / (pool.threads() * 8)).clamp(P, 64) / P,
    };
    pool.for_chunks_mut(&mut out[..m], per_task * P, |t, o| {
        let end = ((t + 1) * per_task).min(panels);
        for (j, o) in o.chunks_mut(P).enumerate() {
            let p = t * per_task + j;
            let sums = panel(p, Ahead::new(Stream::Quant, (end - p) * bytes));
            o.copy_from_slice(&sums[..o.len()]);
        }
    });
}

/// Where a decode kernel prefetches, as an offset from its panel's start: `pos` bytes into
/// one region of each panel (its scales, headers or quants: `len` bytes from `start`),
/// and past that region's end the same region of the next panel (panels lie one after
/// another, `panel` bytes each), whose first lines would otherwise be asked for only once
/// that panel had begun: a stall at every panel's start.
#[inline(always)]
pub(super) fn ahead_at(start: usize, len: usize, panel: usize, pos: usize) -> usize {
    if pos < len {
        start + pos
    } else {
        panel + start + (pos - len)
    }
}

/// Fill `out[n, m]` over the pool, one panel a task: `panel(p, o)` writes activation row
/// `i`'s products with panel `p`'s rows into `o[i]`.
fn by_panels(
    pool: &Pool,
    out: &mut [f32],
    n: usize,
    m: usize,
    panel: impl Fn(usize, &mut [[f32; P]]) + Sync,
) {
    let mut t = vec![[0f32; P]; m.div_ceil(P) * n];
    pool.for_chunks_mut(&mut t, n, |p, o| panel(p, o));
    crate::qgemm::panels_to_rows(pool, &t, out, n, m);
}

#[cfg(test)]
mod tests;
