// Workgroup reductions through subgroup operations: one partial per subgroup in workgroup
// memory, then every lane sums the partials. Subgroup sizes vary (4-128) by adapter and
// even by pipeline, so nothing here assumes one: only `subgroup_id` / `num_subgroups`.
// (Naga takes subgroup operations without an `enable`: the device feature allows them.)

struct Lane {
    @builtin(local_invocation_index) idx: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
}

const WG: u32 = 256u;
const HAS_SUBGROUPS: bool = true;
var<workgroup> red_part: array<f32, 64>;

fn wg_sum(v: f32, lane: Lane) -> f32 {
    let s = subgroupAdd(v);
    workgroupBarrier();
    if lane.sg_lane == 0u {
        red_part[lane.sg] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    for (var i = 0u; i < lane.nsg; i++) {
        t += red_part[i];
    }
    return t;
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    let s = subgroupMax(v);
    workgroupBarrier();
    if lane.sg_lane == 0u {
        red_part[lane.sg] = s;
    }
    workgroupBarrier();
    var t = red_part[0];
    for (var i = 1u; i < lane.nsg; i++) {
        t = max(t, red_part[i]);
    }
    return t;
}

// Rows of a matrix-vector product: one subgroup per row.
fn row_lane(lane: Lane) -> u32 { return lane.sg_lane; }
fn row_width(lane: Lane) -> u32 { return lane.sg_size; }
fn row_slot(lane: Lane) -> u32 { return lane.sg; }
fn row_slots(lane: Lane) -> u32 { return lane.nsg; }
fn row_sum(v: f32, lane: Lane) -> f32 { return subgroupAdd(v); }
