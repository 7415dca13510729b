// One row of x (decode) by a weight whose rows are read in 16-byte items: x was rounded by
// quantize_row.wgsl to the type the weight's items meet it in (matvec_q8.wgsl: int8 for
// the quantized types; matvec_f16.wgsl: f16 for F16 weights), and the format's file
// declares x (`xq`, binding 0) and the weight's quants (`wq`, binding 1) as arrays of
// 16-byte items and gives `items_per_row` and `item_dot`. Each lane takes items of a row,
// neighbouring lanes neighbouring items, so that a subgroup reads whole lines.

// A row a row slot; four items in flight a lane (independent loads: one outstanding load
// a lane leaves HBM mostly idle).
@compute @workgroup_size(WG)
fn matvec_items(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let base = group_index(wg, wp.groups_x) * wp.rows_per_group;
    let items = items_per_row();
    for (var i = 0u; i < wp.rows_per_group; i += row_slots(lane)) {
        let r = base + i + row_slot(lane);
        let live = r < wp.m && (i + row_slot(lane)) < wp.rows_per_group;
        var acc = 0.0;
        if live {
            let w = row_width(lane);
            var it = row_lane(lane);
            for (; it + 3u * w < items; it += 4u * w) {
                acc += (item_dot(r, it) + item_dot(r, it + w))
                    + (item_dot(r, it + 2u * w) + item_dot(r, it + 3u * w));
            }
            for (; it < items; it += w) {
                acc += item_dot(r, it);
            }
        }
        let s = row_sum(acc, lane);
        if live && row_lane(lane) == 0u {
            store(wp.row0 + r, s);
        }
    }
}
