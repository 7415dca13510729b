// The prompts' tiled products (gemm_tiles.wgsl) over F16 weights as stored, an item a
// 16-byte load (every chunk's first row on 16 bytes).

@group(0) @binding(1) var<storage, read> wh: array<vec4<u32>>;

fn w_item(row: u32, c: u32) -> vec4<u32> {
    return wh[wp.q_base / 4u + row * (wp.k / 8u) + c];
}
