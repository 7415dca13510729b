// Rotary position embedding in place: one lane per rotated pair of one head of one token.

struct RParams {
    tokens: u32,
    heads: u32,
    head_dim: u32,
    half_rot: u32, // pairs rotated per head (rot_dim / 2)
    neox: u32,
    groups_x: u32,
    p6: u32, p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> rp: RParams;

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> pos: array<i32>;
@group(0) @binding(2) var<storage, read> inv_freq: array<f32>;

@compute @workgroup_size(WG)
fn rope(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = group_index(wg, rp.groups_x) * WG + lane.idx;
    if e >= rp.tokens * rp.heads * rp.half_rot {
        return;
    }
    let i = e % rp.half_rot;
    let th = e / rp.half_rot; // token · heads + head
    let t = th / rp.heads;
    let base = th * rp.head_dim;
    var a: u32;
    var b: u32;
    if rp.neox == 1u {
        a = base + i;
        b = base + i + rp.half_rot;
    } else {
        a = base + 2u * i;
        b = a + 1u;
    }
    // The angle in f32 as transformers forms it, then reduced to [-π, π] in two steps
    // (2π = 6.28125 + 0.0019353…, the first exact in few bits): GPU sin and cos are only
    // accurate there, and positions reach thousands of radians.
    let angle = f32(pos[t]) * inv_freq[i];
    let turns = round(angle * 0.15915494309189535);
    let r = (angle - turns * 6.28125) - turns * 0.0019353071795864769;
    let c = cos(r);
    let s = sin(r);
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}
