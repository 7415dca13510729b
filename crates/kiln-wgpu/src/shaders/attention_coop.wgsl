// Prompts' attention on cooperative matrices (tensor cores; the module enables f16 and
// wgpu_cooperative_matrix) over one contiguous f16 cache: a workgroup of 4 subgroups takes
// 64 queries of one head, each subgroup 16 of them, over tiles of 32 keys and values. As
// kiln-cuda's tensor-core attention does, the queries and the probabilities go in as two
// f16 parts each (hi + lo), so that the results keep f32 accuracy (keys and values are f16
// already). Two passes over the keys: the first finds each query's largest score, the
// second sums exp(s - max) and the values weighted by it, so that the output's
// accumulators never need rescaling (a cooperative accumulator cannot be scaled row by
// row). Scores go through workgroup memory as f32, where two lanes a query apply the mask,
// the scale and the soft-cap. Heads of up to 128 dimensions, a multiple of 16 (`HD`), the
// queries' parts held as matrices for the whole kernel. Every choice around a cooperative
// operation depends on the workgroup alone (uniform control flow), and every index of one
// is a `let` (naga 30's SPIR-V writer panics on inline ones).

// The head's dimensions (a pipeline per size): the matrices a head needs are chosen when
// the pipeline is made, not by branches around them.
override HD: u32 = 128u;
const QP: u32 = 136u;   // a row of up to 128 dimensions, padded against bank conflicts
const TQA: u32 = 64u;   // queries a workgroup
const TKA: u32 = 32u;   // keys a tile
const PP: u32 = 40u;    // a row of a subgroup's probabilities, padded
const SR: u32 = 36u;    // a row of a subgroup's scores, padded (unpadded, every row shares a bank)
// The queries' parts in turn (TQA rows of QP), then a tile of keys (TKA rows) and one of
// values (TKA rows).
var<workgroup> kvq: array<f16, 8704>;
var<workgroup> ss: array<f32, 2304>; // a subgroup's 16 × SR scores (then 16 × 16 outputs)
var<workgroup> ps_hi: array<f16, 2560>; // a subgroup's 16 × PP probabilities, hi part
var<workgroup> ps_lo: array<f16, 2560>; // and lo part
var<workgroup> row_stat: array<f32, 128>; // a lane's share of its query's max, then sum

// Eight f16 values (four words of an f16 cache) into workgroup memory at `to`, exactly.
fn put8(to: u32, w: vec4<u32>) {
    kvq[to] = f16(f16_value(w.x & 0xffffu));
    kvq[to + 1u] = f16(f16_value(w.x >> 16u));
    kvq[to + 2u] = f16(f16_value(w.y & 0xffffu));
    kvq[to + 3u] = f16(f16_value(w.y >> 16u));
    kvq[to + 4u] = f16(f16_value(w.z & 0xffffu));
    kvq[to + 5u] = f16(f16_value(w.z >> 16u));
    kvq[to + 6u] = f16(f16_value(w.w & 0xffffu));
    kvq[to + 7u] = f16(f16_value(w.w >> 16u));
}

// The tile of keys (and values when `values`) from key t0 of KV head g into workgroup
// memory, eight values an item, up to four items a lane, every load issued before any is
// used (a loop of loads and stores ran one memory round trip after another); keys at or
// past `hi` as zeros (they are masked, and a value past them, multiplied by a zero
// probability, must not be a NaN), rows past the cache read as its last row.
fn load_kv(li: u32, t0: u32, hi: u32, g: u32, values: bool) {
    let hd = ap.head_dim;
    let items = hd / 8u;
    let total = TKA * items;
    let row_words = ap.kv_heads * hd / 2u;
    let head_word = g * hd / 2u;
    let c0 = li + 0u;
    let key0 = c0 / items;
    let keep0 = c0 < total && t0 + key0 < hi;
    let at0 = min(t0 + key0, ap.capacity - 1u) * row_words + head_word + (c0 % items) * 4u;
    let k0 = select(vec4<u32>(0u), vec4<u32>(k_cache[at0], k_cache[at0 + 1u], k_cache[at0 + 2u], k_cache[at0 + 3u]), keep0);
    var v0 = vec4<u32>(0u);
    if values {
        v0 = select(vec4<u32>(0u), vec4<u32>(v_cache[at0], v_cache[at0 + 1u], v_cache[at0 + 2u], v_cache[at0 + 3u]), keep0);
    }
    let c1 = li + 128u;
    let key1 = c1 / items;
    let keep1 = c1 < total && t0 + key1 < hi;
    let at1 = min(t0 + key1, ap.capacity - 1u) * row_words + head_word + (c1 % items) * 4u;
    let k1 = select(vec4<u32>(0u), vec4<u32>(k_cache[at1], k_cache[at1 + 1u], k_cache[at1 + 2u], k_cache[at1 + 3u]), keep1);
    var v1 = vec4<u32>(0u);
    if values {
        v1 = select(vec4<u32>(0u), vec4<u32>(v_cache[at1], v_cache[at1 + 1u], v_cache[at1 + 2u], v_cache[at1 + 3u]), keep1);
    }
    let c2 = li + 256u;
    let key2 = c2 / items;
    let keep2 = c2 < total && t0 + key2 < hi;
    let at2 = min(t0 + key2, ap.capacity - 1u) * row_words + head_word + (c2 % items) * 4u;
    let k2 = select(vec4<u32>(0u), vec4<u32>(k_cache[at2], k_cache[at2 + 1u], k_cache[at2 + 2u], k_cache[at2 + 3u]), keep2);
    var v2 = vec4<u32>(0u);
    if values {
        v2 = select(vec4<u32>(0u), vec4<u32>(v_cache[at2], v_cache[at2 + 1u], v_cache[at2 + 2u], v_cache[at2 + 3u]), keep2);
    }
    let c3 = li + 384u;
    let key3 = c3 / items;
    let keep3 = c3 < total && t0 + key3 < hi;
    let at3 = min(t0 + key3, ap.capacity - 1u) * row_words + head_word + (c3 % items) * 4u;
    let k3 = select(vec4<u32>(0u), vec4<u32>(k_cache[at3], k_cache[at3 + 1u], k_cache[at3 + 2u], k_cache[at3 + 3u]), keep3);
    var v3 = vec4<u32>(0u);
    if values {
        v3 = select(vec4<u32>(0u), vec4<u32>(v_cache[at3], v_cache[at3 + 1u], v_cache[at3 + 2u], v_cache[at3 + 3u]), keep3);
    }
    if c0 < total {
        let to = key0 * QP + (c0 % items) * 8u;
        put8(to, k0);
        if values {
            put8(TKA * QP + to, v0);
        }
    }
    if c1 < total {
        let to = key1 * QP + (c1 % items) * 8u;
        put8(to, k1);
        if values {
            put8(TKA * QP + to, v1);
        }
    }
    if c2 < total {
        let to = key2 * QP + (c2 % items) * 8u;
        put8(to, k2);
        if values {
            put8(TKA * QP + to, v2);
        }
    }
    if c3 < total {
        let to = key3 * QP + (c3 % items) * 8u;
        put8(to, k3);
        if values {
            put8(TKA * QP + to, v3);
        }
    }
}

// A value split into two f16 parts whose sum is within f32's rounding of it: the hi part
// rounded with integer operations (a driver may fold f32(f16(v)) back into v, which would
// leave the lo part zero), the lo part what it leaves.
fn split(v: f32) -> vec2<f32> {
    let hv = f16_value(f16_bits(clamp(v, -65504.0, 65504.0)));
    return vec2<f32>(hv, v - hv);
}

// The workgroup's queries into workgroup memory: their hi parts, or (`lo`) what the hi
// parts leave (queries past the prompt as zeros), four items of four values a lane at a
// time, loaded before they are stored.
fn load_q(li: u32, i0: u32, h: u32, lo: bool) {
    let hd = ap.head_dim;
    let items = hd / 4u;
    let total = TQA * items;
    let part = select(0u, 1u, lo);
    for (var base = li; base < total; base += 512u) {
        let c0 = base;
        let t0 = c0 / items;
        let at0 = (min(i0 + t0, ap.n - 1u) * ap.heads + h) * hd + (c0 % items) * 4u;
        let x0 = select(vec4<f32>(0.0), vec4<f32>(q[at0], q[at0 + 1u], q[at0 + 2u], q[at0 + 3u]), i0 + t0 < ap.n);
        let c1 = base + 128u;
        let t1 = c1 / items;
        let at1 = (min(i0 + t1, ap.n - 1u) * ap.heads + h) * hd + (c1 % items) * 4u;
        let x1 = select(vec4<f32>(0.0), vec4<f32>(q[at1], q[at1 + 1u], q[at1 + 2u], q[at1 + 3u]), c1 < total && i0 + t1 < ap.n);
        let c2 = base + 256u;
        let t2 = c2 / items;
        let at2 = (min(i0 + t2, ap.n - 1u) * ap.heads + h) * hd + (c2 % items) * 4u;
        let x2 = select(vec4<f32>(0.0), vec4<f32>(q[at2], q[at2 + 1u], q[at2 + 2u], q[at2 + 3u]), c2 < total && i0 + t2 < ap.n);
        let c3 = base + 384u;
        let t3 = c3 / items;
        let at3 = (min(i0 + t3, ap.n - 1u) * ap.heads + h) * hd + (c3 % items) * 4u;
        let x3 = select(vec4<f32>(0.0), vec4<f32>(q[at3], q[at3 + 1u], q[at3 + 2u], q[at3 + 3u]), c3 < total && i0 + t3 < ap.n);
        let to = t0 * QP + (c0 % items) * 4u;
        kvq[to] = f16(split(x0.x)[part]);
        kvq[to + 1u] = f16(split(x0.y)[part]);
        kvq[to + 2u] = f16(split(x0.z)[part]);
        kvq[to + 3u] = f16(split(x0.w)[part]);
        if c1 < total {
            let to = t1 * QP + (c1 % items) * 4u;
            kvq[to] = f16(split(x1.x)[part]);
            kvq[to + 1u] = f16(split(x1.y)[part]);
            kvq[to + 2u] = f16(split(x1.z)[part]);
            kvq[to + 3u] = f16(split(x1.w)[part]);
        }
        if c2 < total {
            let to = t2 * QP + (c2 % items) * 4u;
            kvq[to] = f16(split(x2.x)[part]);
            kvq[to + 1u] = f16(split(x2.y)[part]);
            kvq[to + 2u] = f16(split(x2.z)[part]);
            kvq[to + 3u] = f16(split(x2.w)[part]);
        }
        if c3 < total {
            let to = t3 * QP + (c3 % items) * 4u;
            kvq[to] = f16(split(x3.x)[part]);
            kvq[to + 1u] = f16(split(x3.y)[part]);
            kvq[to + 2u] = f16(split(x3.z)[part]);
            kvq[to + 3u] = f16(split(x3.w)[part]);
        }
    }
}

// Score of the lane's query against key `key` from the stored dot product: scaled,
// soft-capped, and LOWEST where the key is not visible to the query.
fn score(dot: f32, key: u32, first: u32, last: u32) -> f32 {
    if first > last || key < first || key > last {
        return LOWEST;
    }
    var s = dot * ap.scale;
    if ap.softcap > 0.0 {
        s = ap.softcap * tanh_stable(s / ap.softcap);
    }
    return s;
}

// A subgroup's 16 × 16 block of outputs (staged at ss[sbase..]), dimensions d0.. of head
// h, divided by each query's sum.
fn write_out(sbase: u32, s: u32, sl: u32, i0: u32, h: u32, d0: u32) {
    for (var e = sl; e < 256u; e += 32u) {
        let r = e / 16u;
        let i = i0 + s * 16u + r;
        if i < ap.n {
            let l = row_stat[s * 32u + 2u * r] + row_stat[s * 32u + 2u * r + 1u];
            out[(i * ap.heads + h) * ap.head_dim + d0 + e % 16u] =
                select(0.0, ss[sbase + e] / l, l > 0.0);
        }
    }
}

@compute @workgroup_size(128)
fn attention_coop(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let hd = ap.head_dim;
    let tiles = (ap.n + TQA - 1u) / TQA;
    // (Written out, not group_index(): naga counts a call's result as non-uniform.)
    let task = wg.y * ap.groups_x + wg.x;
    if task >= tiles * ap.heads {
        return;
    }
    let h = task % ap.heads;
    let i0 = (task / ap.heads) * TQA;
    let g = h / (ap.heads / ap.kv_heads);
    let s = li / 32u;
    let sl = li % 32u;
    let r = sl / 2u;
    let half = sl % 2u;
    let i = i0 + s * 16u + r;
    // This lane's query: its last and first visible keys (none when outside the cache).
    var last = 0u;
    var first = 1u;
    if i < ap.n {
        let p = pos[i];
        if p >= 0 && u32(p) < ap.capacity {
            last = u32(p);
            first = 0u;
            if ap.window > 0u && last + 1u > ap.window {
                first = last + 1u - ap.window;
            }
        }
    }
    // The workgroup's key range: the union of its queries'.
    var lo = 0xFFFFFFFFu;
    var hi = 0u;
    for (var t = 0u; t < TQA; t++) {
        let it = i0 + t;
        if it < ap.n {
            let p = pos[it];
            if p >= 0 && u32(p) < ap.capacity {
                var f = 0u;
                if ap.window > 0u && u32(p) + 1u > ap.window {
                    f = u32(p) + 1u - ap.window;
                }
                lo = min(lo, f);
                hi = max(hi, u32(p) + 1u);
            }
        }
    }
    let qa = s * 16u * QP;
    var qh0 = coop_mat16x16<f16, A>();
    var ql0 = coop_mat16x16<f16, A>();
    var qh1 = coop_mat16x16<f16, A>();
    var ql1 = coop_mat16x16<f16, A>();
    var qh2 = coop_mat16x16<f16, A>();
    var ql2 = coop_mat16x16<f16, A>();
    var qh3 = coop_mat16x16<f16, A>();
    var ql3 = coop_mat16x16<f16, A>();
    var qh4 = coop_mat16x16<f16, A>();
    var ql4 = coop_mat16x16<f16, A>();
    var qh5 = coop_mat16x16<f16, A>();
    var ql5 = coop_mat16x16<f16, A>();
    var qh6 = coop_mat16x16<f16, A>();
    var ql6 = coop_mat16x16<f16, A>();
    var qh7 = coop_mat16x16<f16, A>();
    var ql7 = coop_mat16x16<f16, A>();
    load_q(li, i0, h, false);
    workgroupBarrier();
    if HD > 0u {
        let iq0 = qa + 0u;
        qh0 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq0], QP);
    }
    if HD > 16u {
        let iq1 = qa + 16u;
        qh1 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq1], QP);
    }
    if HD > 32u {
        let iq2 = qa + 32u;
        qh2 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq2], QP);
    }
    if HD > 48u {
        let iq3 = qa + 48u;
        qh3 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq3], QP);
    }
    if HD > 64u {
        let iq4 = qa + 64u;
        qh4 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq4], QP);
    }
    if HD > 80u {
        let iq5 = qa + 80u;
        qh5 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq5], QP);
    }
    if HD > 96u {
        let iq6 = qa + 96u;
        qh6 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq6], QP);
    }
    if HD > 112u {
        let iq7 = qa + 112u;
        qh7 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq7], QP);
    }
    workgroupBarrier();
    load_q(li, i0, h, true);
    workgroupBarrier();
    if HD > 0u {
        let iq0 = qa + 0u;
        ql0 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq0], QP);
    }
    if HD > 16u {
        let iq1 = qa + 16u;
        ql1 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq1], QP);
    }
    if HD > 32u {
        let iq2 = qa + 32u;
        ql2 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq2], QP);
    }
    if HD > 48u {
        let iq3 = qa + 48u;
        ql3 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq3], QP);
    }
    if HD > 64u {
        let iq4 = qa + 64u;
        ql4 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq4], QP);
    }
    if HD > 80u {
        let iq5 = qa + 80u;
        ql5 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq5], QP);
    }
    if HD > 96u {
        let iq6 = qa + 96u;
        ql6 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq6], QP);
    }
    if HD > 112u {
        let iq7 = qa + 112u;
        ql7 = coopLoadT<coop_mat16x16<f16, A>>(&kvq[iq7], QP);
    }
    let sbase = s * 16u * SR;
    let sbase1 = sbase + 16u;
    let srow = sbase + r * SR + half * 16u;
    // Pass 1: the largest score of each query.
    var m = LOWEST;
    for (var t0 = lo; t0 < hi; t0 += TKA) {
        workgroupBarrier();
        load_kv(li, t0, hi, g, false);
        workgroupBarrier();
        var c0 = coop_mat16x16<f32, C>();
        var c1 = coop_mat16x16<f32, C>();
        if HD > 0u {
            let ik0a = 0u;
            let ik0b = 16u * QP + 0u;
            let k0a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik0a], QP);
            let k0b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik0b], QP);
            c0 = coopMultiplyAdd(qh0, k0a, c0);
            c0 = coopMultiplyAdd(ql0, k0a, c0);
            c1 = coopMultiplyAdd(qh0, k0b, c1);
            c1 = coopMultiplyAdd(ql0, k0b, c1);
        }
        if HD > 16u {
            let ik1a = 16u;
            let ik1b = 16u * QP + 16u;
            let k1a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik1a], QP);
            let k1b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik1b], QP);
            c0 = coopMultiplyAdd(qh1, k1a, c0);
            c0 = coopMultiplyAdd(ql1, k1a, c0);
            c1 = coopMultiplyAdd(qh1, k1b, c1);
            c1 = coopMultiplyAdd(ql1, k1b, c1);
        }
        if HD > 32u {
            let ik2a = 32u;
            let ik2b = 16u * QP + 32u;
            let k2a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik2a], QP);
            let k2b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik2b], QP);
            c0 = coopMultiplyAdd(qh2, k2a, c0);
            c0 = coopMultiplyAdd(ql2, k2a, c0);
            c1 = coopMultiplyAdd(qh2, k2b, c1);
            c1 = coopMultiplyAdd(ql2, k2b, c1);
        }
        if HD > 48u {
            let ik3a = 48u;
            let ik3b = 16u * QP + 48u;
            let k3a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik3a], QP);
            let k3b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik3b], QP);
            c0 = coopMultiplyAdd(qh3, k3a, c0);
            c0 = coopMultiplyAdd(ql3, k3a, c0);
            c1 = coopMultiplyAdd(qh3, k3b, c1);
            c1 = coopMultiplyAdd(ql3, k3b, c1);
        }
        if HD > 64u {
            let ik4a = 64u;
            let ik4b = 16u * QP + 64u;
            let k4a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik4a], QP);
            let k4b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik4b], QP);
            c0 = coopMultiplyAdd(qh4, k4a, c0);
            c0 = coopMultiplyAdd(ql4, k4a, c0);
            c1 = coopMultiplyAdd(qh4, k4b, c1);
            c1 = coopMultiplyAdd(ql4, k4b, c1);
        }
        if HD > 80u {
            let ik5a = 80u;
            let ik5b = 16u * QP + 80u;
            let k5a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik5a], QP);
            let k5b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik5b], QP);
            c0 = coopMultiplyAdd(qh5, k5a, c0);
            c0 = coopMultiplyAdd(ql5, k5a, c0);
            c1 = coopMultiplyAdd(qh5, k5b, c1);
            c1 = coopMultiplyAdd(ql5, k5b, c1);
        }
        if HD > 96u {
            let ik6a = 96u;
            let ik6b = 16u * QP + 96u;
            let k6a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik6a], QP);
            let k6b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik6b], QP);
            c0 = coopMultiplyAdd(qh6, k6a, c0);
            c0 = coopMultiplyAdd(ql6, k6a, c0);
            c1 = coopMultiplyAdd(qh6, k6b, c1);
            c1 = coopMultiplyAdd(ql6, k6b, c1);
        }
        if HD > 112u {
            let ik7a = 112u;
            let ik7b = 16u * QP + 112u;
            let k7a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik7a], QP);
            let k7b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik7b], QP);
            c0 = coopMultiplyAdd(qh7, k7a, c0);
            c0 = coopMultiplyAdd(ql7, k7a, c0);
            c1 = coopMultiplyAdd(qh7, k7b, c1);
            c1 = coopMultiplyAdd(ql7, k7b, c1);
        }
        coopStoreT(c0, &ss[sbase], SR);
        coopStoreT(c1, &ss[sbase1], SR);
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            m = max(m, score(ss[srow + kk], t0 + half * 16u + kk, first, last));
        }
    }
    row_stat[li] = m;
    workgroupBarrier();
    m = max(m, row_stat[li ^ 1u]);
    // Pass 2: the sums of exp(s - m) and of the values weighted by them.
    var l = 0.0;
    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    var o4 = coop_mat16x16<f32, C>();
    var o5 = coop_mat16x16<f32, C>();
    var o6 = coop_mat16x16<f32, C>();
    var o7 = coop_mat16x16<f32, C>();
    let prow = s * 16u * PP + r * PP + half * 16u;
    for (var t0 = lo; t0 < hi; t0 += TKA) {
        workgroupBarrier();
        load_kv(li, t0, hi, g, true);
        workgroupBarrier();
        var c0 = coop_mat16x16<f32, C>();
        var c1 = coop_mat16x16<f32, C>();
        if HD > 0u {
            let ik0a = 0u;
            let ik0b = 16u * QP + 0u;
            let k0a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik0a], QP);
            let k0b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik0b], QP);
            c0 = coopMultiplyAdd(qh0, k0a, c0);
            c0 = coopMultiplyAdd(ql0, k0a, c0);
            c1 = coopMultiplyAdd(qh0, k0b, c1);
            c1 = coopMultiplyAdd(ql0, k0b, c1);
        }
        if HD > 16u {
            let ik1a = 16u;
            let ik1b = 16u * QP + 16u;
            let k1a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik1a], QP);
            let k1b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik1b], QP);
            c0 = coopMultiplyAdd(qh1, k1a, c0);
            c0 = coopMultiplyAdd(ql1, k1a, c0);
            c1 = coopMultiplyAdd(qh1, k1b, c1);
            c1 = coopMultiplyAdd(ql1, k1b, c1);
        }
        if HD > 32u {
            let ik2a = 32u;
            let ik2b = 16u * QP + 32u;
            let k2a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik2a], QP);
            let k2b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik2b], QP);
            c0 = coopMultiplyAdd(qh2, k2a, c0);
            c0 = coopMultiplyAdd(ql2, k2a, c0);
            c1 = coopMultiplyAdd(qh2, k2b, c1);
            c1 = coopMultiplyAdd(ql2, k2b, c1);
        }
        if HD > 48u {
            let ik3a = 48u;
            let ik3b = 16u * QP + 48u;
            let k3a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik3a], QP);
            let k3b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik3b], QP);
            c0 = coopMultiplyAdd(qh3, k3a, c0);
            c0 = coopMultiplyAdd(ql3, k3a, c0);
            c1 = coopMultiplyAdd(qh3, k3b, c1);
            c1 = coopMultiplyAdd(ql3, k3b, c1);
        }
        if HD > 64u {
            let ik4a = 64u;
            let ik4b = 16u * QP + 64u;
            let k4a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik4a], QP);
            let k4b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik4b], QP);
            c0 = coopMultiplyAdd(qh4, k4a, c0);
            c0 = coopMultiplyAdd(ql4, k4a, c0);
            c1 = coopMultiplyAdd(qh4, k4b, c1);
            c1 = coopMultiplyAdd(ql4, k4b, c1);
        }
        if HD > 80u {
            let ik5a = 80u;
            let ik5b = 16u * QP + 80u;
            let k5a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik5a], QP);
            let k5b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik5b], QP);
            c0 = coopMultiplyAdd(qh5, k5a, c0);
            c0 = coopMultiplyAdd(ql5, k5a, c0);
            c1 = coopMultiplyAdd(qh5, k5b, c1);
            c1 = coopMultiplyAdd(ql5, k5b, c1);
        }
        if HD > 96u {
            let ik6a = 96u;
            let ik6b = 16u * QP + 96u;
            let k6a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik6a], QP);
            let k6b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik6b], QP);
            c0 = coopMultiplyAdd(qh6, k6a, c0);
            c0 = coopMultiplyAdd(ql6, k6a, c0);
            c1 = coopMultiplyAdd(qh6, k6b, c1);
            c1 = coopMultiplyAdd(ql6, k6b, c1);
        }
        if HD > 112u {
            let ik7a = 112u;
            let ik7b = 16u * QP + 112u;
            let k7a = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik7a], QP);
            let k7b = coopLoad<coop_mat16x16<f16, B>>(&kvq[ik7b], QP);
            c0 = coopMultiplyAdd(qh7, k7a, c0);
            c0 = coopMultiplyAdd(ql7, k7a, c0);
            c1 = coopMultiplyAdd(qh7, k7b, c1);
            c1 = coopMultiplyAdd(ql7, k7b, c1);
        }
        coopStoreT(c0, &ss[sbase], SR);
        coopStoreT(c1, &ss[sbase1], SR);
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            let sc = score(ss[srow + kk], t0 + half * 16u + kk, first, last);
            var p = 0.0;
            if sc > LOWEST {
                p = exp(sc - m);
            }
            l += p;
            let parts = split(p);
            ps_hi[prow + kk] = f16(parts.x);
            ps_lo[prow + kk] = f16(parts.y);
        }
        workgroupBarrier();
        for (var k0 = 0u; k0 < TKA; k0 += 16u) {
            let ip = s * 16u * PP + k0;
            let ph = coopLoadT<coop_mat16x16<f16, A>>(&ps_hi[ip], PP);
            let pl = coopLoadT<coop_mat16x16<f16, A>>(&ps_lo[ip], PP);
            let kv0 = (TKA + k0) * QP;
            if HD > 0u {
                let iv0 = kv0 + 0u;
                let v0 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv0], QP);
                o0 = coopMultiplyAdd(ph, v0, o0);
                o0 = coopMultiplyAdd(pl, v0, o0);
            }
            if HD > 16u {
                let iv1 = kv0 + 16u;
                let v1 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv1], QP);
                o1 = coopMultiplyAdd(ph, v1, o1);
                o1 = coopMultiplyAdd(pl, v1, o1);
            }
            if HD > 32u {
                let iv2 = kv0 + 32u;
                let v2 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv2], QP);
                o2 = coopMultiplyAdd(ph, v2, o2);
                o2 = coopMultiplyAdd(pl, v2, o2);
            }
            if HD > 48u {
                let iv3 = kv0 + 48u;
                let v3 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv3], QP);
                o3 = coopMultiplyAdd(ph, v3, o3);
                o3 = coopMultiplyAdd(pl, v3, o3);
            }
            if HD > 64u {
                let iv4 = kv0 + 64u;
                let v4 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv4], QP);
                o4 = coopMultiplyAdd(ph, v4, o4);
                o4 = coopMultiplyAdd(pl, v4, o4);
            }
            if HD > 80u {
                let iv5 = kv0 + 80u;
                let v5 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv5], QP);
                o5 = coopMultiplyAdd(ph, v5, o5);
                o5 = coopMultiplyAdd(pl, v5, o5);
            }
            if HD > 96u {
                let iv6 = kv0 + 96u;
                let v6 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv6], QP);
                o6 = coopMultiplyAdd(ph, v6, o6);
                o6 = coopMultiplyAdd(pl, v6, o6);
            }
            if HD > 112u {
                let iv7 = kv0 + 112u;
                let v7 = coopLoadT<coop_mat16x16<f16, B>>(&kvq[iv7], QP);
                o7 = coopMultiplyAdd(ph, v7, o7);
                o7 = coopMultiplyAdd(pl, v7, o7);
            }
        }
    }
    workgroupBarrier();
    row_stat[li] = l;
    workgroupBarrier();
    if HD > 0u {
        coopStoreT(o0, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 0u);
        workgroupBarrier();
    }
    if HD > 16u {
        coopStoreT(o1, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 16u);
        workgroupBarrier();
    }
    if HD > 32u {
        coopStoreT(o2, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 32u);
        workgroupBarrier();
    }
    if HD > 48u {
        coopStoreT(o3, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 48u);
        workgroupBarrier();
    }
    if HD > 64u {
        coopStoreT(o4, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 64u);
        workgroupBarrier();
    }
    if HD > 80u {
        coopStoreT(o5, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 80u);
        workgroupBarrier();
    }
    if HD > 96u {
        coopStoreT(o6, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 96u);
        workgroupBarrier();
    }
    if HD > 112u {
        coopStoreT(o7, &ss[sbase], 16u);
        workgroupBarrier();
        write_out(sbase, s, sl, i0, h, 112u);
        workgroupBarrier();
    }
}
