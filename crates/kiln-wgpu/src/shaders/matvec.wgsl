// out[t, row0 + r] = x[t] · w[r] for a few rows of x (n ≤ 8), weights read once. One row of
// the weight per subgroup (or per 32 lanes without subgroups); each lane strides over the
// row four elements at a time, so neighbouring lanes read neighbouring words.

const MAX_N: u32 = 8u;

// One row of x (decode), k a multiple of 4: one accumulator a lane, neighbouring lanes on
// neighbouring quads, so that both the weights and x are read in whole lines. (A lane per
// 32-element block read x 128 bytes apart across lanes and ran 2.4x slower on an H200.)
@compute @workgroup_size(WG)
fn matvec1(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let quads = wp.k / 4u;
    let group = group_index(wg, wp.groups_x);
    let base = group * wp.rows_per_group;
    find_norm(lane, group);
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
                // Four quads of the weight row in flight a lane, as in matvec1 (one load
                // outstanding leaves HBM mostly idle), each used for all n rows of x.
                let w = row_width(lane);
                var qd = row_lane(lane);
                for (; qd + 3u * w < quads; qd += 4u * w) {
                    let w0 = quad(r, qd);
                    let w1 = quad(r, qd + w);
                    let w2 = quad(r, qd + 2u * w);
                    let w3 = quad(r, qd + 3u * w);
                    for (var t = 0u; t < n; t++) {
                        let xo = t * k;
                        let a = dot(w0, x_quad(xo + 4u * qd));
                        let b = dot(w1, x_quad(xo + 4u * (qd + w)));
                        let c = dot(w2, x_quad(xo + 4u * (qd + 2u * w)));
                        let d = dot(w3, x_quad(xo + 4u * (qd + 3u * w)));
                        acc[t] += (a + b) + (c + d);
                    }
                }
                for (; qd < quads; qd += w) {
                    let wq = quad(r, qd);
                    for (var t = 0u; t < n; t++) {
                        acc[t] += dot(wq, x_quad(t * k + 4u * qd));
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

// x[o .. o + 4], any row (no norm: that is one row's, matvec1's).
fn x_quad(o: u32) -> vec4<f32> {
    return vec4<f32>(x[o], x[o + 1u], x[o + 2u], x[o + 3u]);
}
