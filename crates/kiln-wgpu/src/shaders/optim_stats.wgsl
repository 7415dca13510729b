// The gradients' statistics for the optimizer step (optim.wgsl), a workgroup per
// STATS_CHUNK elements: Σ (g·unscale)² (each square an f32) and whether any g is inf/NaN,
// into stats[2·w] and stats[2·w + 1]; the host sums the workgroups' partials in f64, in
// order, as the CPU sums its chunks'.

struct SParams {
    n: u32,
    unscaled: u32, // 1: multiply by `unscale` first
    unscale: f32,
    groups_x: u32,
    p4: u32, p5: u32, p6: u32, p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> sp: SParams;

@group(0) @binding(0) var<storage, read> grads: array<f32>;
@group(0) @binding(1) var<storage, read_write> stats: array<f32>;

const STATS_CHUNK: u32 = 4096u;

@compute @workgroup_size(WG)
fn grad_stats(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let w = group_index(wg, sp.groups_x);
    let start = w * STATS_CHUNK;
    var sum = 0.0;
    var bad = 0.0;
    for (var i = start + lane.idx; i < min(start + STATS_CHUNK, sp.n); i += WG) {
        var g = grads[i];
        if (bitcast<u32>(g) & 0x7f800000u) == 0x7f800000u {
            bad = 1.0;
        }
        if sp.unscaled == 1u {
            g *= sp.unscale;
        }
        sum += g * g;
    }
    let total = wg_sum(sum, lane);
    let any_bad = wg_max(bad, lane);
    if lane.idx == 0u {
        stats[2u * w] = total;
        stats[2u * w + 1u] = any_bad;
    }
}
