// The prompts' tiled products (gemm_tiles.wgsl) over weights of any type (the override
// WTYPE), decoded to f32 two quads at a time (weights.wgsl) and rounded to f16, clamped to its
// range, as kiln-cuda and llama.cpp decode quantized blocks for their prompt GEMMs.

fn w_item(row: u32, c: u32) -> vec4<u32> {
    let pair = quad_pair(row, 2u * c);
    let lo = clamp(pair[0], vec4<f32>(-65504.0), vec4<f32>(65504.0));
    let hi = clamp(pair[1], vec4<f32>(-65504.0), vec4<f32>(65504.0));
    return vec4<u32>(pack2x16float(lo.xy), pack2x16float(lo.zw), pack2x16float(hi.xy),
                     pack2x16float(hi.zw));
}
