// Moving columns: slices of fused projections (rows into a KV cache: kv_rows.wgsl).

struct EParams {
    n: u32,      // elements to write
    op: u32,     // which variant (per kernel)
    a: f32,      // a scalar operand
    len: u32,    // binary: elements of the right operand; slice_cols: row length
    cols: u32,   // slice_cols: source columns
    col0: u32,   // slice_cols: first source column
    groups_x: u32,
    p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> ep: EParams;

fn element(lane: Lane, wg: vec3<u32>) -> u32 {
    return group_index(wg, ep.groups_x) * WG + lane.idx;
}

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;

// dst[i, c] = src[i, col0 + c], dst rows of `len`, src rows of `cols`.
@compute @workgroup_size(WG)
fn slice_cols(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = element(lane, wg);
    if e >= ep.n {
        return;
    }
    let i = e / ep.len;
    dst[e] = src[i * ep.cols + ep.col0 + e % ep.len];
}
