// out[i, c] = table[ids[i], c], dequantized; ids outside this chunk's rows are left to the
// chunk that holds them, and ids outside the table give zeros (written by the first chunk).

@group(0) @binding(0) var<storage, read> ids: array<i32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn embedding(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = group_index(wg, wp.groups_x) * WG + lane.idx;
    let k = wp.k;
    if e >= wp.n * k {
        return;
    }
    let i = e / k;
    let c = e % k;
    let id = ids[i];
    // p9: rows of the whole table.
    if id < 0 || u32(id) >= wp.p9 {
        if wp.row0 == 0u {
            out[e] = 0.0;
        }
        return;
    }
    let r = u32(id);
    if r >= wp.row0 && r < wp.row0 + wp.m {
        out[e] = weight_at(r - wp.row0, c);
    }
}
