//! Intel AMX (Advanced Matrix Extensions): the tile registers and the two operations the
//! prompt kernels use, `C += A · B` over bf16 pairs into f32 (AMX-BF16) and over bytes
//! into i32 (AMX-INT8).
//!
//! A tile is up to 16 rows of up to 64 bytes. `tdpbf16ps` takes A as 16 rows of 32 bf16
//! and B as 16 rows of 16 pairs of bf16 (the "VNNI layout": pair c of B row j holds
//! elements 2j, 2j + 1 of column c), and adds to each f32 of C[r][c] the dot product of A's
//! row r with column c: 16 × 16 × 32 multiply-adds in one instruction, against 16 for one
//! AVX-512 FMA. `tdpbsud` is the same with 64 signed bytes per A row and quads of unsigned
//! bytes in B (quad c of B row j holds elements 4j..4j + 4 of column c): 16 × 16 × 64
//! multiply-adds into i32, against 64 for one `vpdpbusd`.
//!
//! Rust has no stable AMX intrinsics, so the instructions are inline assembly, with the
//! tile registers named by const parameters. Linux hands out the 8 KiB of tile state only
//! to processes that ask (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which [`granted`] does
//! once.

use crate::dot::{self, Isa};
use std::sync::OnceLock;

/// What this process may use: each needs AMX-TILE, the kernel's grant of the tile state,
/// and no instruction set forced with `KILN_CPU_ISA` (except `amx`), so that
/// `KILN_CPU_ISA=avx512` measures the same machine without AMX.
#[derive(Clone, Copy)]
struct Granted {
    bf16: bool,
    int8: bool,
}

fn granted() -> Granted {
    static OK: OnceLock<Granted> = OnceLock::new();
    *OK.get_or_init(|| {
        let forced = std::env::var("KILN_CPU_ISA")
            .is_ok_and(|name| !name.trim().eq_ignore_ascii_case("amx"));
        let none = Granted {
            bf16: false,
            int8: false,
        };
        if dot::isa() != Isa::Avx512Vnni || forced {
            return none;
        }
        #[cfg(target_arch = "x86_64")]
        return x86::enable().unwrap_or(none);
        #[cfg(not(target_arch = "x86_64"))]
        none
    })
}

/// Whether the AMX-BF16 kernels may run (see [`Granted`]).
pub(crate) fn bf16_available() -> bool {
    granted().bf16
}

/// Whether the AMX-INT8 kernels may run (see [`Granted`]).
pub(crate) fn int8_available() -> bool {
    granted().int8
}

/// A tile configuration (the 64-byte operand of `ldtilecfg`).
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Tile `t` (tmm`t`) is `shapes[t].0` rows of `shapes[t].1` bytes; the rest are unused.
    pub(crate) fn new(shapes: &[(usize, usize)]) -> TileConfig {
        assert!(shapes.len() <= 8, "eight tile registers");
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, &(rows, bytes)) in shapes.iter().enumerate() {
            assert!((1..=16).contains(&rows) && bytes % 4 == 0 && (4..=64).contains(&bytes));
            cfg.rows[t] = rows as u8;
            cfg.colsb[t] = bytes as u16;
        }
        cfg
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Granted, TileConfig};
    use std::arch::asm;

    /// CPUID, XCR0 and the kernel's permission must all agree to use the tiles; `None`
    /// where they do not.
    pub(super) fn enable() -> Option<Granted> {
        use std::arch::x86_64::__cpuid_count;
        // Leaf 7 exists on every CPU with AVX-512 (checked by the caller first).
        let edx = __cpuid_count(7, 0).edx;
        let (bf16, tile, int8) = (edx >> 22 & 1 == 1, edx >> 24 & 1 == 1, edx >> 25 & 1 == 1);
        // OSXSAVE (CPUID.1:ECX bit 27) makes XGETBV legal.
        let osxsave = __cpuid_count(1, 0).ecx >> 27 & 1 == 1;
        if !(tile && osxsave) {
            return None;
        }
        let xcr0: u64;
        // SAFETY: XGETBV with ECX = 0 is legal when OSXSAVE is set (checked).
        unsafe {
            let (lo, hi): (u32, u32);
            asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi, options(nomem, nostack));
            xcr0 = (hi as u64) << 32 | lo as u64;
        }
        // Bits 17 (XTILECFG) and 18 (XTILEDATA).
        (xcr0 >> 17 & 3 == 3 && request_permission()).then_some(Granted { bf16, int8 })
    }

    #[cfg(target_os = "linux")]
    fn request_permission() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only changes this process's permission
        // to use the tile state; it reads and writes no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_permission() -> bool {
        // Other systems are not known to need (or offer) the request; stay on AVX-512.
        false
    }

    /// Load a tile configuration.
    ///
    /// # Safety
    /// [`super::bf16_available`] or [`super::int8_available`] must hold. Pair with [`release`] on the same thread.
    #[inline(always)]
    pub(crate) unsafe fn configure(cfg: &TileConfig) {
        // SAFETY: the caller guarantees AMX; `cfg` is a valid 64-byte configuration.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) cfg as *const TileConfig, options(nostack, readonly))
        }
    }

    /// Give the tile state back (tiles in use make every context switch save 8 KiB).
    ///
    /// # Safety
    /// [`super::bf16_available`] or [`super::int8_available`] must hold.
    #[inline(always)]
    pub(crate) unsafe fn release() {
        // SAFETY: the caller guarantees AMX.
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }

    /// Tile `T` = 0.
    ///
    /// # Safety
    /// A configuration from [`configure`] must be loaded that defines tile `T`.
    #[inline(always)]
    pub(crate) unsafe fn zero<const T: usize>() {
        // SAFETY: the caller guarantees a loaded configuration.
        unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }

    /// Load tile `T`: its configured rows of its configured width, `stride` bytes apart
    /// from `p`.
    ///
    /// # Safety
    /// A configuration defining tile `T` must be loaded, and every row must be readable.
    #[inline(always)]
    pub(crate) unsafe fn load<const T: usize>(p: *const u8, stride: usize) {
        // SAFETY: the caller guarantees the configuration and the memory.
        unsafe {
            asm!("tileloadd tmm{t}, [{p} + {s} * 1]", t = const T, p = in(reg) p,
                 s = in(reg) stride, options(nostack, readonly))
        }
    }

    /// Tile `C` += tile `A` · tile `B`: A as rows of bf16, B as bf16 pairs in the VNNI
    /// layout, C as f32.
    ///
    /// # Safety
    /// A configuration must be loaded in which the three shapes agree.
    #[inline(always)]
    pub(crate) unsafe fn dot_bf16<const C: usize, const A: usize, const B: usize>() {
        // SAFETY: the caller guarantees the tile state.
        unsafe {
            asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                 options(nostack, nomem))
        }
    }

    /// Tile `C` += tile `A` · tile `B`: A as rows of signed bytes, B as quads of unsigned
    /// bytes in the VNNI layout, C as i32.
    ///
    /// # Safety
    /// A configuration must be loaded in which the three shapes agree.
    #[inline(always)]
    pub(crate) unsafe fn dot_s8u8<const C: usize, const A: usize, const B: usize>() {
        // SAFETY: the caller guarantees the tile state.
        unsafe {
            asm!("tdpbsud tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                 options(nostack, nomem))
        }
    }

    /// Store tile `T` (configured as rows of 16 f32 or i32) into `out`.
    ///
    /// # Safety
    /// A configuration must be loaded that defines tile `T` with 64-byte rows.
    #[inline(always)]
    pub(crate) unsafe fn store<const T: usize, E: bytemuck::Pod>(out: &mut [[E; 16]; 16]) {
        const { assert!(size_of::<E>() == 4, "tile rows are 16 four-byte values") };
        // SAFETY: the caller guarantees the configuration; `out` holds 16 rows of 64 bytes,
        // at least the configured count.
        unsafe {
            asm!("tilestored [{p} + {s} * 1], tmm{t}", t = const T, p = in(reg) out.as_mut_ptr(),
                 s = in(reg) 64usize, options(nostack))
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn bf16(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16
    }

    /// One `C = A · B` through the tiles against the definition (small integers, so the
    /// f32 sums are exact whatever their order), for several row counts, with A read at a
    /// stride wider than its rows, on two sets of registers.
    #[test]
    fn tile_product_matches_definition() {
        if !bf16_available() {
            eprintln!("no AMX-BF16 (or not granted): tile product not testable here");
            return;
        }
        let mut rng = StdRng::seed_from_u64(0xa3);
        for rows in [1usize, 5, 16] {
            let stride = 40; // u16 elements per A row, of which 32 are read
            let a: Vec<u16> = (0..16 * stride)
                .map(|_| bf16(rng.random_range(-8i32..8) as f32))
                .collect();
            let b: Vec<u16> = (0..16 * 32)
                .map(|_| bf16(rng.random_range(-8i32..8) as f32))
                .collect();
            let mut c = [[f32::NAN; 16]; 16];
            let mut c1 = [[f32::NAN; 16]; 16];
            // SAFETY: `bf16_available()` holds; A has `rows` rows of 64 bytes at an 80-byte
            // stride, B 16 rows of 64 bytes, C is 16 × 16 f32.
            unsafe {
                let (cs, ts) = ((rows, 64), (16, 64));
                x86::configure(&TileConfig::new(&[cs, (rows, 64), ts, cs, (rows, 64), ts]));
                x86::zero::<0>();
                x86::zero::<3>();
                x86::load::<1>(a.as_ptr() as *const u8, 2 * stride);
                x86::load::<4>(a.as_ptr() as *const u8, 2 * stride);
                x86::load::<2>(b.as_ptr() as *const u8, 64);
                x86::load::<5>(b.as_ptr() as *const u8, 64);
                x86::dot_bf16::<3, 4, 5>();
                x86::dot_bf16::<0, 1, 2>();
                x86::store::<0, f32>(&mut c);
                x86::store::<3, f32>(&mut c1);
                x86::release();
            }
            let f = |v: u16| f32::from_bits((v as u32) << 16);
            for (r, row) in c.iter().enumerate().take(rows) {
                for (col, &got) in row.iter().enumerate() {
                    let want: f32 = (0..32)
                        .map(|k| f(a[r * stride + k]) * f(b[k / 2 * 32 + 2 * col + k % 2]))
                        .sum();
                    assert_eq!(got, want, "rows={rows} c[{r}][{col}]");
                    assert_eq!(c1[r][col], got, "two tile registers differ");
                }
            }
            assert!(
                c[rows..].iter().flatten().all(|v| v.is_nan()),
                "stored past rows"
            );
        }
    }
}
