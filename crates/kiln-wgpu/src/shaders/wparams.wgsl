// Reading weights in their stored format. The tensor is bound twice: `wq` from its quant
// region (float types: its values; declared by the reader, weights.wgsl as words,
// matvec_q8.wgsl as 16-byte items), `wm` from its scale region, each at an offset that the
// adapter's alignment allowed; `wp.q_base` (words) and `wp.m_base` (bytes) step over the
// rest. Rows are relative to the bound chunk. Quantized layouts: kiln_core::quant::gpu_layout.

override WTYPE: u32 = 0u; // 0 F32, 1 F16, 2 BF16, 3 Q8_0, 4 Q4_0, 5 Q4_K, 6 Q6_K

@group(0) @binding(2) var<storage, read> wm: array<u32>;

struct WParams {
    k: u32,          // row length of the weight
    m: u32,          // weight rows in this chunk
    n: u32,          // rows of x (or ids)
    q_base: u32,     // words of `wq` before this chunk's first row
    m_base: u32,     // bytes of `wm` before this chunk's first row's scales
    row0: u32,       // the chunk's first row in the whole weight
    out_stride: u32, // elements per output row
    rows_per_group: u32,
    groups_x: u32,
    p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> wp: WParams;

fn meta_byte(i: u32) -> u32 {
    let b = wp.m_base + i;
    return (wm[b >> 2u] >> ((b & 3u) * 8u)) & 0xFFu;
}

fn meta_half(i: u32) -> f32 {
    let b = wp.m_base + i;
    return unpack2x16float(wm[b >> 2u] >> ((b & 2u) * 8u)).x;
}
