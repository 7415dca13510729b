// The gated activations of the feed-forward block, one lane per element.

struct EParams {
    n: u32,      // elements to write
    op: u32,     // which variant (per kernel)
    a: f32,      // a scalar operand
    len: u32,    // binary: elements of the right operand; rows: row length
    cols: u32,   // slice_cols: source columns; write_rows: destination rows
    col0: u32,   // slice_cols: first source column
    groups_x: u32,
    p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> ep: EParams;

fn element(lane: Lane, wg: vec3<u32>) -> u32 {
    return group_index(wg, ep.groups_x) * WG + lane.idx;
}

@group(0) @binding(0) var<storage, read> gate: array<f32>;
@group(0) @binding(1) var<storage, read> up: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

// op 0: silu(gate)·up, op 1: gelu(gate)·up.
@compute @workgroup_size(WG)
fn gated(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = element(lane, wg);
    if e >= ep.n {
        return;
    }
    let g = gate[e];
    var act: f32;
    if ep.op == 0u {
        act = g / (1.0 + exp(-g));
    } else {
        act = gelu_tanh(g);
    }
    out[e] = act * up[e];
}
