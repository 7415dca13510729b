// Causal attention, one workgroup per (query, head): keys in tiles of WG, one lane per key
// for the scores, an online softmax across tiles, and the weighted sum of values split over
// WG / head_dim groups of lanes (a lane per dimension, each group a share of the tile's
// keys), summed at the end: with one group, 64-dimension heads left 3/4 of the lanes idle.
// The caches are of any KV type (kv_cache.wgsl; a pipeline per type), decoded to f32 as
// they are read (k_at, v_at); everything after is as for an f32 cache.

var<workgroup> q_row: array<f32, 256>;
var<workgroup> probs: array<f32, 256>;
var<workgroup> partial: array<f32, 256>;

const NO_ROW: u32 = 0xffffffffu;

// The cache row of position j for query i: j itself, or through the query's block table
// in a paged cache; NO_ROW for a table entry outside the pool (which the device cannot
// report mid-step: its keys are hidden).
fn kv_row(i: u32, j: u32) -> u32 {
    if ap.max_blocks == 0u {
        return j;
    }
    let b = j / ap.block;
    if b >= ap.max_blocks {
        return NO_ROW;
    }
    let e = tables[u32(seq[i]) * ap.max_blocks + b];
    if e < 0 || u32(e) >= ap.capacity / ap.block {
        return NO_ROW;
    }
    return u32(e) * ap.block + j % ap.block;
}

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
    var reach = ap.capacity;
    if ap.max_blocks > 0u {
        reach = ap.max_blocks * ap.block;
    }
    if p < 0 || u32(p) >= reach {
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
        var row = NO_ROW;
        if j <= last {
            row = kv_row(i, j);
        }
        let valid = row != NO_ROW;
        var s = LOWEST;
        if valid {
            let kb = row * stride + g * hd;
            var dot = 0.0;
            for (var c = 0u; c < hd; c++) {
                dot += q_row[c] * k_at(kb + c);
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
            for (var jj = grp; jj < count; jj += groups) {
                let r = kv_row(i, t0 + jj);
                if r != NO_ROW {
                    acc += probs[jj] * v_at(r * stride + g * hd + d);
                }
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

// Prompts: flash-style attention over tiles of 16 queries of one head (one workgroup),
// keys and values in tiles of 16 through workgroup memory, so each key is read once per
// 16 queries instead of once per query. Lane (qi, j) = (lane / 16, lane % 16) scores query
// qi against key j of the tile, keeps the online softmax of its query (every lane of the
// query the same m and l), and accumulates dimensions 4·j.. and 64 + 4·j.. of its query's
// output (heads of up to 128 dimensions, a multiple of 4). K rows are padded by one float
// so that the 16 lanes of a query, reading the same dimension of 16 keys, hit 16 banks.
const TQ: u32 = 16u;
const TK: u32 = 16u;
const MAX_HD: u32 = 128u;
var<workgroup> q_tile: array<f32, 2048>;     // TQ · MAX_HD
var<workgroup> k_tile: array<f32, 2064>;     // TK · (MAX_HD + 1)
var<workgroup> v_tile: array<vec4<f32>, 512>; // TK · MAX_HD / 4
var<workgroup> tile_p: array<f32, 256>;      // TQ · TK

// The output dimensions 4·j.. (`a`) and 64 + 4·j.. (`b`) of one query, where they exist.
fn v_quad(key: u32, d: u32) -> vec4<f32> {
    return v_tile[(key * ap.head_dim + d) / 4u];
}

@compute @workgroup_size(WG)
fn attention_tiles(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let tiles = (ap.n + TQ - 1u) / TQ;
    let task = group_index(wg, ap.groups_x);
    if task >= tiles * ap.heads {
        return;
    }
    let h = task % ap.heads;
    let i0 = (task / ap.heads) * TQ;
    let g = h / (ap.heads / ap.kv_heads);
    let hd = ap.head_dim;
    let stride = ap.kv_heads * hd;
    let qi = lane.idx / TK;
    let j = lane.idx % TK;
    let i = i0 + qi;
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
    // The tile's key range: the union of its queries' (positions of a prompt ascend, but
    // nothing here assumes it).
    var lo = 0xFFFFFFFFu;
    var hi = 0u;
    for (var t = 0u; t < TQ; t++) {
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
    for (var c = lane.idx; c < TQ * hd; c += WG) {
        let t = c / hd;
        var v = 0.0;
        if i0 + t < ap.n {
            v = q[((i0 + t) * ap.heads + h) * hd + c % hd];
        }
        q_tile[c] = v;
    }
    var m = LOWEST;
    var l = 0.0;
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    let da = 4u * j;
    let db = 64u + 4u * j;
    for (var t0 = lo; t0 < hi; t0 += TK) {
        workgroupBarrier();
        for (var c = lane.idx; c < TK * hd; c += WG) {
            let key = c / hd;
            let d = c % hd;
            var kv = 0.0;
            var vv = 0.0;
            if t0 + key < hi {
                let at = (t0 + key) * stride + g * hd + d;
                kv = k_at(at);
                vv = v_at(at);
            }
            k_tile[key * (hd + 1u) + d] = kv;
            v_tile[c / 4u][c % 4u] = vv;
        }
        workgroupBarrier();
        let t = t0 + j;
        let visible = first <= last && t >= first && t <= last;
        var s = LOWEST;
        if visible {
            var dot = 0.0;
            let qo = qi * hd;
            let ko = j * (hd + 1u);
            for (var c = 0u; c < hd; c++) {
                dot += q_tile[qo + c] * k_tile[ko + c];
            }
            s = dot * ap.scale;
            if ap.softcap > 0.0 {
                s = ap.softcap * tanh_stable(s / ap.softcap);
            }
        }
        tile_p[lane.idx] = s;
        workgroupBarrier();
        var m_tile = LOWEST;
        for (var jj = 0u; jj < TK; jj++) {
            m_tile = max(m_tile, tile_p[qi * TK + jj]);
        }
        let m_new = max(m, m_tile);
        var e = 0.0;
        if visible {
            e = exp(s - m_new);
        }
        var corr = 0.0;
        if m > LOWEST {
            corr = exp(m - m_new);
        }
        m = m_new;
        workgroupBarrier();
        tile_p[lane.idx] = e;
        workgroupBarrier();
        var sum = 0.0;
        acc_a *= corr;
        acc_b *= corr;
        for (var jj = 0u; jj < TK; jj++) {
            let p = tile_p[qi * TK + jj];
            sum += p;
            if da < hd {
                acc_a += p * v_quad(jj, da);
            }
            if db < hd {
                acc_b += p * v_quad(jj, db);
            }
        }
        l = l * corr + sum;
    }
    if i < ap.n {
        let o = (i * ap.heads + h) * hd;
        let inv = select(0.0, 1.0 / l, l > 0.0);
        if da < hd {
            out[o + da] = acc_a.x * inv;
            out[o + da + 1u] = acc_a.y * inv;
            out[o + da + 2u] = acc_a.z * inv;
            out[o + da + 3u] = acc_a.w * inv;
        }
        if db < hd {
            out[o + db] = acc_b.x * inv;
            out[o + db + 1u] = acc_b.y * inv;
            out[o + db + 2u] = acc_b.z * inv;
            out[o + db + 3u] = acc_b.w * inv;
        }
    }
}
