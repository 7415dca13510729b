// Causal attention, one workgroup per (query, head): keys in tiles of WG, one lane per key
// for the scores, an online softmax across tiles, and the weighted sum of values split over
// WG / head_dim groups of lanes (a lane per dimension, each group a share of the tile's
// keys), summed at the end: with one group, 64-dimension heads left 3/4 of the lanes idle.

struct AParams {
    n: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    scale: f32,
    softcap: f32, // 0: none
    window: u32,  // 0: none
    groups_x: u32,
    p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> ap: AParams;

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<f32>;
@group(0) @binding(2) var<storage, read> v_cache: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<i32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

// A finite "minus infinity": WGSL leaves arithmetic on infinities undefined.
const LOWEST: f32 = -3.4028235e38;
var<workgroup> q_row: array<f32, 256>;
var<workgroup> probs: array<f32, 256>;
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(WG)
fn attention(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let task = group_index(wg, ap.groups_x);
    if task >= ap.n * ap.heads {
        return;
    }
    let i = task / ap.heads;
    let h = task % ap.heads;
    let g = h / (ap.heads / ap.kv_heads);
    let hd = ap.head_dim;
    let stride = ap.kv_heads * hd;
    let groups = max(WG / hd, 1u);
    let d = lane.idx % hd;
    let grp = lane.idx / hd;
    let o = task * hd;
    let p = pos[i];
    if p < 0 || u32(p) >= ap.capacity {
        // Outside the cache: reported by the host where it can be; zeros here.
        if lane.idx < hd {
            out[o + lane.idx] = 0.0;
        }
        return;
    }
    let last = u32(p);
    var first = 0u;
    if ap.window > 0u && last + 1u > ap.window {
        first = last + 1u - ap.window;
    }
    if lane.idx < hd {
        q_row[lane.idx] = q[o + lane.idx];
    }
    workgroupBarrier();
    var m = LOWEST;
    var l = 0.0;
    var acc = 0.0;
    for (var t0 = first; t0 <= last; t0 += WG) {
        let j = t0 + lane.idx;
        let valid = j <= last;
        var s = LOWEST;
        if valid {
            let kb = j * stride + g * hd;
            var dot = 0.0;
            for (var c = 0u; c < hd; c++) {
                dot += q_row[c] * k_cache[kb + c];
            }
            s = dot * ap.scale;
            if ap.softcap > 0.0 {
                s = ap.softcap * tanh_stable(s / ap.softcap);
            }
        }
        let m_new = max(m, wg_max(s, lane));
        var e = 0.0;
        if valid {
            e = exp(s - m_new);
        }
        probs[lane.idx] = e;
        var corr = 0.0;
        if m > LOWEST {
            corr = exp(m - m_new);
        }
        l = l * corr + wg_sum(e, lane);
        m = m_new;
        if grp < groups {
            acc *= corr;
            let count = min(WG, last + 1u - t0);
            let vb = t0 * stride + g * hd + d;
            for (var jj = grp; jj < count; jj += groups) {
                acc += probs[jj] * v_cache[vb + jj * stride];
            }
        }
        workgroupBarrier();
    }
    partial[lane.idx] = acc;
    workgroupBarrier();
    if lane.idx < hd {
        var sum = 0.0;
        for (var i = 0u; i < groups; i++) {
            sum += partial[i * hd + lane.idx];
        }
        out[o + lane.idx] = sum / l;
    }
}
