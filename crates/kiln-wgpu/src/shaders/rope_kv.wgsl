// Rotate q and k and write k and v into the caches at their positions, in their type
// (kv_cache.wgsl), in one dispatch (four on the plain path). The first workgroups take q,
// a lane an element; then a workgroup a token's KV head: its k read into workgroup
// memory, rotated there, and written back and into the cache (a q8_0 block needs 32
// rotated values, which one lane could not see if lanes rotated their own), v beside it.

struct KParams {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    half_rot: u32, // pairs rotated per head; 0: no rotation
    neox: u32,
    capacity: u32,
    groups_x: u32,
    q_groups: u32, // workgroups of q; the rest take a KV head each
    p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> kp: KParams;

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<i32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> k_cache: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<atomic<u32>>;

// A KV head as read (x) and rotated (y): heads of at most 256 dimensions.
var<workgroup> head_x: array<f32, 256>;
var<workgroup> head_y: array<f32, 256>;

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

// Write the low 16 bits of `bits` into half-word h of the k (which 0) or v cache.
fn store_half(which: u32, h: u32, bits: u32) {
    let shift = 16u * (h & 1u);
    let keep = ~(0xffffu << shift);
    let bits_at = (bits & 0xffffu) << shift;
    if which == 0u {
        atomicAnd(&k_cache[h / 2u], keep);
        atomicOr(&k_cache[h / 2u], bits_at);
    } else {
        atomicAnd(&v_cache[h / 2u], keep);
        atomicOr(&v_cache[h / 2u], bits_at);
    }
}

fn store_word(which: u32, w: u32, bits: u32) {
    if which == 0u {
        atomicStore(&k_cache[w], bits);
    } else {
        atomicStore(&v_cache[w], bits);
    }
}

// Store `x` as element e of a cache of `elements` values (not q8_0).
fn store_value(which: u32, e: u32, x: f32) {
    if KV == KV_F32 {
        store_word(which, e, bitcast<u32>(x));
    } else if KV == KV_F16 {
        store_half(which, e, f16_bits(x));
    } else {
        store_half(which, e, bf16_bits(x));
    }
}

// Store a q8_0 block of 32 values at elements e.. of a cache of `elements` values.
fn store_block(which: u32, e: u32, elements: u32, x: array<f32, 32>) {
    let b = q8_block(x);
    for (var w = 0u; w < 8u; w++) {
        store_word(which, e / 4u + w, b.qs[w]);
    }
    store_half(which, elements / 2u + e / 32u, b.d);
}

@compute @workgroup_size(WG)
fn rope_write_kv(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let g = group_index(wg, kp.groups_x);
    let hd = kp.head_dim;
    if g < kp.q_groups {
        // q rotates in place: the lane of a pair's first element rotates both, so that no
        // lane reads what another writes.
        let e = g * WG + lane.idx;
        if e >= kp.tokens * kp.heads * hd {
            return;
        }
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
    // A token's KV head: `row` = token · kv_heads + head. Every lane reaches the barriers;
    // only the writes depend on the position.
    let row = g - kp.q_groups;
    if row >= kp.tokens * kp.kv_heads {
        return;
    }
    let t = row / kp.kv_heads;
    let p = pos[t];
    let f = row * hd;
    for (var d = lane.idx; d < hd; d += WG) {
        head_x[d] = k[f + d];
    }
    workgroupBarrier();
    for (var d = lane.idx; d < hd; d += WG) {
        var y = head_x[d];
        if rotates(d) {
            y = rotated(head_x[d], head_x[partner_of(d)], d, p);
        }
        head_y[d] = y;
        k[f + d] = y;
    }
    workgroupBarrier();
    if p < 0 || u32(p) >= kp.capacity {
        return;
    }
    let elements = kp.capacity * kp.kv_heads * hd;
    let at = (u32(p) * kp.kv_heads + row % kp.kv_heads) * hd;
    if KV == KV_Q8_0 {
        // A lane a block, of k then of v.
        let blocks = hd / 32u;
        if lane.idx < 2u * blocks {
            let which = lane.idx / blocks;
            let b = lane.idx % blocks;
            var x: array<f32, 32>;
            for (var j = 0u; j < 32u; j++) {
                x[j] = select(v[f + 32u * b + j], head_y[32u * b + j], which == 0u);
            }
            store_block(which, at + 32u * b, elements, x);
        }
        return;
    }
    for (var d = lane.idx; d < hd; d += WG) {
        store_value(0u, at + d, head_y[d]);
        store_value(1u, at + d, v[f + d]);
    }
}
