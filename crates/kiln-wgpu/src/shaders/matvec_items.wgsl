// One row of x (decode) by a weight whose rows are read in 16-byte items: x was rounded by
// quantize_row.wgsl to the type the weight's items meet it in (matvec_q8.wgsl: int8 for
// the quantized types; matvec_f16.wgsl: f16 for F16 weights), and the format's file
// declares x (`xq`, binding 0) and the weight's quants (`wq`, binding 1) as arrays of
// 16-byte items and gives `items_per_row` and `item_dot`. Each lane takes items of a row,
// neighbouring lanes neighbouring items, so that a subgroup reads whole lines.

// Up to three weights of one type in one dispatch (Q, K and V of a layer), since every
// dispatch costs a barrier on top of its work: weight j's quants and scales are bound at
// (1, 2), (5, 6) and (8, 9) and its results at 3, 7 and 10 (the format's file declares
// the quants, `w_item` picks them). Workgroups [0, wp.n) take weight 0, [wp.n,
// wp.out_stride) weight 1, the rest weight 2 (fields the item kernels use for nothing else). Weight 0 may be a chunk of a larger one (`wp.m`, `wp.q_base`,
// `wp.m_base`, `wp.row0`); weights 1 and 2 are whole, with p9 and p12 rows and their
// scales p11 and p13 bytes into their buffers. A dispatch of one weight binds it in all
// three places, with both bounds past every workgroup.
@group(0) @binding(6) var<storage, read> wm1: array<u32>;
@group(0) @binding(7) var<storage, read_write> out1: array<f32>;
@group(0) @binding(9) var<storage, read> wm2: array<u32>;
@group(0) @binding(10) var<storage, read_write> out2: array<f32>;

// The callers pass j as a constant (`rows_of(0u, ..)`), so that once inlined each copy of
// the loop reads its own buffers with no switch left in it.
fn w_rows(j: u32) -> u32 {
    switch j {
        case 1u: { return wp.p9; }
        case 2u: { return wp.p12; }
        default: { return wp.m; }
    }
}

fn w_q_base(j: u32) -> u32 {
    return select(0u, wp.q_base, j == 0u);
}

fn w_m_base(j: u32) -> u32 {
    switch j {
        case 1u: { return wp.p11; }
        case 2u: { return wp.p13; }
        default: { return wp.m_base; }
    }
}

fn w_word(j: u32, i: u32) -> u32 {
    switch j {
        case 1u: { return wm1[i]; }
        case 2u: { return wm2[i]; }
        default: { return wm[i]; }
    }
}

fn w_meta_byte(j: u32, i: u32) -> u32 {
    let b = w_m_base(j) + i;
    return (w_word(j, b >> 2u) >> ((b & 3u) * 8u)) & 0xFFu;
}

fn w_meta_half(j: u32, i: u32) -> f32 {
    let b = w_m_base(j) + i;
    return unpack2x16float(w_word(j, b >> 2u) >> ((b & 2u) * 8u)).x;
}

fn store_j(j: u32, i: u32, v: f32) {
    switch j {
        case 1u: { out1[i] = v; }
        case 2u: { out2[i] = v; }
        default: { store(wp.row0 + i, v); }
    }
}

// Row r of weight j dotted with x, a lane's share: four items in flight a lane
// (independent loads: one outstanding load a lane leaves HBM mostly idle).
fn row_part(j: u32, r: u32, lane: Lane) -> f32 {
    let items = items_per_row();
    let w = row_width(lane);
    var it = row_lane(lane);
    var acc = 0.0;
    for (; it + 3u * w < items; it += 4u * w) {
        acc += (item_dot(j, r, it) + item_dot(j, r, it + w))
            + (item_dot(j, r, it + 2u * w) + item_dot(j, r, it + 3u * w));
    }
    for (; it < items; it += w) {
        acc += item_dot(j, r, it);
    }
    return acc;
}

// Weight j's rows of workgroup g (counted from the weight's first), a row a row slot.
fn rows_of(j: u32, g: u32, lane: Lane) {
    let base = g * wp.rows_per_group;
    let m = w_rows(j);
    for (var i = 0u; i < wp.rows_per_group; i += row_slots(lane)) {
        let r = base + i + row_slot(lane);
        let live = r < m && (i + row_slot(lane)) < wp.rows_per_group;
        var acc = 0.0;
        if live {
            acc = row_part(j, r, lane);
        }
        let s = row_sum(acc, lane);
        if live && row_lane(lane) == 0u {
            store_j(j, r, s);
        }
    }
}

@compute @workgroup_size(WG)
fn matvec_items(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let g = group_index(wg, wp.groups_x);
    if g < wp.n {
        rows_of(0u, g, lane);
    } else if g < wp.out_stride {
        rows_of(1u, g - wp.n, lane);
    } else {
        rows_of(2u, g - wp.out_stride, lane);
    }
}

// The gated feed-forward's gate (weight 0) and up (weight 1) in one dispatch: each row
// slot takes row r of both, and `out` gets act(gate)·up (p10: 2 SiLU, 3 GELU). Both
// weights whole.
@compute @workgroup_size(WG)
fn matvec_items_gated(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let base = group_index(wg, wp.groups_x) * wp.rows_per_group;
    for (var i = 0u; i < wp.rows_per_group; i += row_slots(lane)) {
        let r = base + i + row_slot(lane);
        let live = r < wp.m && (i + row_slot(lane)) < wp.rows_per_group;
        var g = 0.0;
        var u = 0.0;
        if live {
            g = row_part(0u, r, lane);
            u = row_part(1u, r, lane);
        }
        let gs = row_sum(g, lane);
        let us = row_sum(u, lane);
        if live && row_lane(lane) == 0u {
            var a = gs / (1.0 + exp(-gs));
            if wp.p10 == 3u {
                a = gelu_tanh(gs);
            }
            out[r] = a * us;
        }
    }
}
