// Workgroup reductions through workgroup memory, for adapters without subgroups (or with
// KILN_WGPU_NO_SUBGROUPS=1): a tree over 256 slots.
struct Lane {
    @builtin(local_invocation_index) idx: u32,
}

const WG: u32 = 256u;
const HAS_SUBGROUPS: bool = false;
var<workgroup> red_buf: array<f32, 256>;

fn wg_sum(v: f32, lane: Lane) -> f32 {
    workgroupBarrier();
    red_buf[lane.idx] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if lane.idx < s {
            red_buf[lane.idx] += red_buf[lane.idx + s];
        }
        workgroupBarrier();
    }
    return red_buf[0];
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    workgroupBarrier();
    red_buf[lane.idx] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if lane.idx < s {
            red_buf[lane.idx] = max(red_buf[lane.idx], red_buf[lane.idx + s]);
        }
        workgroupBarrier();
    }
    return red_buf[0];
}

// Rows of a matrix-vector product: 32 lanes per row, 8 rows per workgroup, reduced by a
// tree within each row's 32 slots.
fn row_lane(lane: Lane) -> u32 { return lane.idx % 32u; }
fn row_width(lane: Lane) -> u32 { return 32u; }
fn row_slot(lane: Lane) -> u32 { return lane.idx / 32u; }
fn row_slots(lane: Lane) -> u32 { return 8u; }
fn row_sum(v: f32, lane: Lane) -> f32 {
    workgroupBarrier();
    red_buf[lane.idx] = v;
    workgroupBarrier();
    let base = lane.idx & ~31u;
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane.idx & 31u) < s {
            red_buf[lane.idx] += red_buf[lane.idx + s];
        }
        workgroupBarrier();
    }
    return red_buf[base];
}
