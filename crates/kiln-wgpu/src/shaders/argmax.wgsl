// The index of each row's largest value (the first, on ties): one workgroup per row.
// Each lane keeps its best; the maximum is reduced, then the smallest index holding it.

struct NParams {
    cols: u32,
    eps: f32,
    rows: u32,
    groups_x: u32,
    p4: u32, p5: u32, p6: u32, p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> np: NParams;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<i32>;

@compute @workgroup_size(WG)
fn argmax(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let row = group_index(wg, np.groups_x);
    if row >= np.rows {
        return;
    }
    let o = row * np.cols;
    var best = -3.4028235e38;
    var at = np.cols;
    for (var c = lane.idx; c < np.cols; c += WG) {
        let v = x[o + c];
        // NaN never wins; -inf rows fall back to the first index below.
        if v > best {
            best = v;
            at = c;
        }
    }
    let mx = wg_max(best, lane);
    var mine = f32(np.cols);
    if best == mx && at < np.cols {
        mine = f32(at);
    }
    // Indices below 2^24 are exact in f32; vocabularies are far below that.
    let first = -wg_max(-mine, lane);
    if lane.idx == 0u {
        out[row] = select(i32(first), 0, first >= f32(np.cols));
    }
}
