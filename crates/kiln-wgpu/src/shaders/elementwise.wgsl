// One lane per element. `e` runs over a grid of (x, y) workgroups of WG lanes.

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

@group(0) @binding(0) var<storage, read_write> dst: array<f32>;
@group(0) @binding(1) var<storage, read> src: array<f32>;

fn element(lane: Lane, wg: vec3<u32>) -> u32 {
    return group_index(wg, ep.groups_x) * WG + lane.idx;
}

@compute @workgroup_size(WG)
fn fill(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = element(lane, wg);
    if e < ep.n {
        dst[e] = ep.a;
    }
}

// op 0: dst += src, op 1: dst *= src; src repeats every `len` elements (one row broadcast).
@compute @workgroup_size(WG)
fn binary(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = element(lane, wg);
    if e >= ep.n {
        return;
    }
    let v = src[e % ep.len];
    if ep.op == 0u {
        dst[e] += v;
    } else {
        dst[e] *= v;
    }
}

// op 0: dst *= a, op 1: gelu, op 2: a·tanh(dst / a).
@compute @workgroup_size(WG)
fn unary(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = element(lane, wg);
    if e >= ep.n {
        return;
    }
    let v = dst[e];
    switch ep.op {
        case 0u: { dst[e] = v * ep.a; }
        case 1u: { dst[e] = gelu_tanh(v); }
        default: { dst[e] = ep.a * tanh_stable(v / ep.a); }
    }
}
