// Row norms: one workgroup per row. rms_norm binds its weight as `bias` too (unused).

struct NParams {
    cols: u32,
    eps: f32,
    rows: u32,
    groups_x: u32,
    p4: u32, p5: u32, p6: u32, p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> np: NParams;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn rms_norm(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let row = group_index(wg, np.groups_x);
    if row >= np.rows {
        return;
    }
    let o = row * np.cols;
    var ss = 0.0;
    for (var c = lane.idx; c < np.cols; c += WG) {
        let v = x[o + c];
        ss += v * v;
    }
    let total = wg_sum(ss, lane);
    let inv = 1.0 / sqrt(total / f32(np.cols) + np.eps);
    for (var c = lane.idx; c < np.cols; c += WG) {
        out[o + c] = x[o + c] * inv * weight[c];
    }
}

@compute @workgroup_size(WG)
fn layer_norm(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let row = group_index(wg, np.groups_x);
    if row >= np.rows {
        return;
    }
    let o = row * np.cols;
    var s = 0.0;
    for (var c = lane.idx; c < np.cols; c += WG) {
        s += x[o + c];
    }
    let mean = wg_sum(s, lane) / f32(np.cols);
    var ss = 0.0;
    for (var c = lane.idx; c < np.cols; c += WG) {
        let d = x[o + c] - mean;
        ss += d * d;
    }
    let inv = 1.0 / sqrt(wg_sum(ss, lane) / f32(np.cols) + np.eps);
    for (var c = lane.idx; c < np.cols; c += WG) {
        out[o + c] = (x[o + c] - mean) * inv * weight[c] + bias[c];
    }
}
