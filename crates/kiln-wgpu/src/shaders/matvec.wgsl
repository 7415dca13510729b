// out[t, row0 + r] = x[t] · w[r] for a few rows of x (n ≤ 8), weights read once. One row of
// the weight per subgroup (or per 32 lanes without subgroups); each lane strides over the
// row four elements at a time, so neighbouring lanes read neighbouring words.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const MAX_N: u32 = 8u;

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
                out[t * wp.out_stride + wp.row0 + r] = s;
            }
        }
    }
}
