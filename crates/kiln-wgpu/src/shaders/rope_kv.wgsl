// Rotate q and k and write k and v into the caches at their positions, in one dispatch
// (four on the plain path). One lane per element of q, then of k (and v).

struct KParams {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    half_rot: u32, // pairs rotated per head; 0: no rotation
    neox: u32,
    capacity: u32,
    groups_x: u32,
    p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> kp: KParams;

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<i32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;

// Element d of a head (value x0, its pair's other element `partner`) rotated at position p.
fn rotated(x0: f32, partner: f32, d: u32, p: i32) -> f32 {
    var i: u32;
    var first: bool;
    if kp.neox == 1u {
        first = d < kp.half_rot;
        i = select(d - kp.half_rot, d, first);
    } else {
        first = d % 2u == 0u;
        i = d / 2u;
    }
    let angle = f32(p) * inv_freq[i];
    let turns = round(angle * 0.15915494309189535);
    let r = (angle - turns * 6.28125) - turns * 0.0019353071795864769;
    let c = cos(r);
    let s = sin(r);
    if first {
        return x0 * c - partner * s;
    }
    return partner * s + x0 * c;
}

fn partner_of(d: u32) -> u32 {
    if kp.neox == 1u {
        return select(d - kp.half_rot, d + kp.half_rot, d < kp.half_rot);
    }
    return d ^ 1u;
}

fn rotates(d: u32) -> bool {
    return d < 2u * kp.half_rot;
}

@compute @workgroup_size(WG)
fn rope_write_kv(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = group_index(wg, kp.groups_x) * WG + lane.idx;
    let hd = kp.head_dim;
    let nq = kp.tokens * kp.heads * hd;
    let nk = kp.tokens * kp.kv_heads * hd;
    if e < nq {
        // q rotates in place: the lane of a pair's first element rotates both, so that no
        // lane reads what another writes.
        let d = e % hd;
        if rotates(d) && partner_of(d) > d {
            let t = e / (kp.heads * hd);
            let other = e - d + partner_of(d);
            let x0 = q[e];
            let x1 = q[other];
            q[e] = rotated(x0, x1, d, pos[t]);
            q[other] = rotated(x1, x0, partner_of(d), pos[t]);
        }
        return;
    }
    let f = e - nq;
    if f >= nk {
        return;
    }
    let d = f % hd;
    let row = f / hd; // token · kv_heads + head
    let t = row / kp.kv_heads;
    let p = pos[t];
    if p < 0 || u32(p) >= kp.capacity {
        return;
    }
    let at = u32(p) * kp.kv_heads * hd + f % (kp.kv_heads * hd);
    v_cache[at] = v[f];
    if !rotates(d) {
        k_cache[at] = k[f];
    } else if partner_of(d) > d {
        // As for q: the pair's first lane rotates both elements, in k and in the cache.
        let other = partner_of(d) - d;
        let x0 = k[f];
        let x1 = k[f + other];
        let y0 = rotated(x0, x1, d, p);
        let y1 = rotated(x1, x0, partner_of(d), p);
        k[f] = y0;
        k[f + other] = y1;
        k_cache[at] = y0;
        k_cache[at + other] = y1;
    }
}
