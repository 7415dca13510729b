// Softmax of each row in place: one workgroup per row.

struct NParams {
    cols: u32,
    eps: f32,
    rows: u32,
    groups_x: u32,
    p4: u32, p5: u32, p6: u32, p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> np: NParams;

@group(0) @binding(0) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(WG)
fn softmax(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let row = group_index(wg, np.groups_x);
    if row >= np.rows {
        return;
    }
    let o = row * np.cols;
    var m = -3.4028235e38;
    for (var c = lane.idx; c < np.cols; c += WG) {
        m = max(m, x[o + c]);
    }
    let mx = wg_max(m, lane);
    var s = 0.0;
    for (var c = lane.idx; c < np.cols; c += WG) {
        let e = exp(x[o + c] - mx);
        x[o + c] = e;
        s += e;
    }
    let inv = 1.0 / wg_sum(s, lane);
    for (var c = lane.idx; c < np.cols; c += WG) {
        x[o + c] *= inv;
    }
}
