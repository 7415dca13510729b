// out[t, row0 + r] = x[t] · w[r] for a few rows of x (n ≤ 8), weights read once. One row of
// the weight per subgroup (or per 32 lanes without subgroups); each lane strides over the
// row four elements at a time, so neighbouring lanes read neighbouring words.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> aux: array<f32>;
@group(0) @binding(5) var<storage, read> norm_w: array<f32>;
@group(0) @binding(6) var<storage, read_write> normed: array<f32>;

const MAX_N: u32 = 8u;

// What a result becomes (wp.p10): 0 the output, 1 added to it (a projection feeding the
// residual stream), 2 silu(aux)·result and 3 gelu(aux)·result (the gated feed-forward's
// up projection, `aux` holding the gate's).
fn store(i: u32, v: f32) {
    switch wp.p10 {
        case 1u: { out[i] += v; }
        case 2u: {
            let g = aux[i];
            out[i] = g / (1.0 + exp(-g)) * v;
        }
        case 3u: { out[i] = gelu_tanh(aux[i]) * v; }
        default: { out[i] = v; }
    }
}

// The RMS norm fused in front (wp.p11 = 1, matvec1 only): x read as x·inv·norm_w, inv
// found by each workgroup; wp.p13 = 1: workgroup 0 also writes the normed row.
var<private> norm_inv: f32 = 1.0;

fn x4(o: u32) -> vec4<f32> {
    let v = vec4<f32>(x[o], x[o + 1u], x[o + 2u], x[o + 3u]);
    if wp.p11 == 1u {
        return v * norm_inv * vec4<f32>(norm_w[o], norm_w[o + 1u], norm_w[o + 2u], norm_w[o + 3u]);
    }
    return v;
}

// One row of x (decode), k a multiple of 4: one accumulator a lane, neighbouring lanes on
// neighbouring quads, so that both the weights and x are read in whole lines. (A lane per
// 32-element block read x 128 bytes apart across lanes and ran 2.4x slower on an H200.)
@compute @workgroup_size(WG)
fn matvec1(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let quads = wp.k / 4u;
    let group = group_index(wg, wp.groups_x);
    let base = group * wp.rows_per_group;
    if wp.p11 == 1u {
        var ss = 0.0;
        for (var c = lane.idx; c < wp.k; c += WG) {
            ss += x[c] * x[c];
        }
        norm_inv = 1.0 / sqrt(wg_sum(ss, lane) / f32(wp.k) + bitcast<f32>(wp.p12));
        if wp.p13 == 1u && group == 0u {
            for (var c = lane.idx; c < wp.k; c += WG) {
                normed[c] = x[c] * norm_inv * norm_w[c];
            }
        }
    }
    for (var i = 0u; i < wp.rows_per_group; i += row_slots(lane)) {
        let r = base + i + row_slot(lane);
        let live = r < wp.m && (i + row_slot(lane)) < wp.rows_per_group;
        var acc = 0.0;
        if live {
            // Four quads in flight a lane: their loads are independent, and a lane with
            // one load outstanding leaves HBM mostly idle.
            let w = row_width(lane);
            var qd = row_lane(lane);
            for (; qd + 3u * w < quads; qd += 4u * w) {
                let a = dot(quad(r, qd), x4(4u * qd));
                let b = dot(quad(r, qd + w), x4(4u * (qd + w)));
                let c = dot(quad(r, qd + 2u * w), x4(4u * (qd + 2u * w)));
                let d = dot(quad(r, qd + 3u * w), x4(4u * (qd + 3u * w)));
                acc += (a + b) + (c + d);
            }
            for (; qd < quads; qd += w) {
                acc += dot(quad(r, qd), x4(4u * qd));
            }
        }
        let s = row_sum(acc, lane);
        if live && row_lane(lane) == 0u {
            store(wp.row0 + r, s);
        }
    }
}

@compute @workgroup_size(WG)
fn matvec(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let k = wp.k;
    let n = wp.n;
    let base = group_index(wg, wp.groups_x) * wp.rows_per_group;
    let quads = k / 4u;
    let by_quads = (k % 4u) == 0u;
    for (var i = 0u; i < wp.rows_per_group; i += row_slots(lane)) {
        let r = base + i + row_slot(lane);
        let live = r < wp.m && (i + row_slot(lane)) < wp.rows_per_group;
        var acc: array<f32, MAX_N>;
        if live {
            if by_quads {
                for (var qd = row_lane(lane); qd < quads; qd += row_width(lane)) {
                    let w = quad(r, qd);
                    for (var t = 0u; t < n; t++) {
                        let xo = t * k + 4u * qd;
                        acc[t] += dot(w, vec4<f32>(x[xo], x[xo + 1u], x[xo + 2u], x[xo + 3u]));
                    }
                }
            } else {
                for (var c = row_lane(lane); c < k; c += row_width(lane)) {
                    let w = weight_at(r, c);
                    for (var t = 0u; t < n; t++) {
                        acc[t] += w * x[t * k + c];
                    }
                }
            }
        }
        for (var t = 0u; t < n; t++) {
            let s = row_sum(acc[t], lane);
            if live && row_lane(lane) == 0u {
                store(t * wp.out_stride + wp.row0 + r, s);
            }
        }
    }
}
