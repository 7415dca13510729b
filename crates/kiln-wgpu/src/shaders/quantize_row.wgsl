// One row of x rounded for decode's products (matvec_items.wgsl): for quantized weights to
// int8 per 32 values, an f32 scale amax/127 and 32 int8 (round half to even, as CUDA's
// __float2int_rn), as kiln-cuda's quantize_x_q8, llama.cpp's q8_1 and kiln's CPU path
// round it; for F16 weights to f16 (`row_to_f16`). The RMS norm
// goes in front when asked (and the normed row is written for the residual stream's
// users). A workgroup a WG quads of the row (every workgroup finds the norm itself, the
// row's loads two in flight a lane), a lane a quad, eight lanes a 32-value unit: every
// load is a neighbour's, and the products that read the row need no prologue. (One
// workgroup for the whole row took 19 µs for llama3-8b's rows on an H200: a round trip
// to memory per 256 quads.)

struct QParams {
    k: u32,            // values in the row, a multiple of 32
    norm: u32,         // 1: x·inv·norm_w
    eps: f32,
    write_normed: u32, // 1: also write that row to `normed`
    groups_x: u32, p5: u32, p6: u32, p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> qp: QParams;

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> normed: array<vec4<f32>>;
// int8: k / 4 words of quads, then k / 32 scales (as f32 bits); f16: k / 2 words of pairs.
@group(0) @binding(3) var<storage, read_write> xq: array<u32>;

var<workgroup> unit_max: array<f32, WG>;

// 1 / rms of the row when the norm is fused (1 otherwise), found by each workgroup alone,
// the row's loads two in flight a lane.
fn row_inv_rms(lane: Lane) -> f32 {
    if qp.norm != 1u {
        return 1.0;
    }
    let quads = qp.k / 4u;
    var s0 = 0.0;
    var s1 = 0.0;
    var i = lane.idx;
    for (; i + WG < quads; i += 2u * WG) {
        let a = x[i];
        let b = x[i + WG];
        s0 += dot(a, a);
        s1 += dot(b, b);
    }
    if i < quads {
        let a = x[i];
        s0 += dot(a, a);
    }
    return 1.0 / sqrt(wg_sum(s0 + s1, lane) / f32(qp.k) + qp.eps);
}

// Quad q of the row, normed when the norm is fused (and written out when asked).
fn row_quad(q: u32, inv_rms: f32) -> vec4<f32> {
    var v = x[q];
    if qp.norm == 1u {
        v *= inv_rms * norm_w[q];
        if qp.write_normed == 1u {
            normed[q] = v;
        }
    }
    return v;
}

@compute @workgroup_size(WG)
fn quantize_row(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let quads = qp.k / 4u;
    let inv_rms = row_inv_rms(lane);
    let q = group_index(wg, qp.groups_x) * WG + lane.idx;
    var v = vec4<f32>(0.0);
    if q < quads {
        v = row_quad(q, inv_rms);
    }
    // The unit's largest magnitude from its eight lanes (past the end: zeros, never read).
    let a = abs(v);
    unit_max[lane.idx] = max(max(a.x, a.y), max(a.z, a.w));
    workgroupBarrier();
    let first = lane.idx & ~7u;
    var amax = 0.0;
    for (var j = 0u; j < 8u; j++) {
        amax = max(amax, unit_max[first + j]);
    }
    let d = amax / 127.0;
    let inv = select(0.0, 1.0 / d, d > 0.0);
    if q < quads {
        xq[q] = pack4xI8(vec4<i32>(round(v * inv)));
        if (q & 7u) == 0u {
            xq[quads + q / 8u] = bitcast<u32>(d);
        }
    }
}

// The row rounded to f16 (k / 2 words of pairs) for F16 weights, clamped to f16's range.
@compute @workgroup_size(WG)
fn row_to_f16(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let inv_rms = row_inv_rms(lane);
    let q = group_index(wg, qp.groups_x) * WG + lane.idx;
    if q < qp.k / 4u {
        let v = clamp(row_quad(q, inv_rms), vec4<f32>(-65504.0), vec4<f32>(65504.0));
        xq[2u * q] = pack2x16float(v.xy);
        xq[2u * q + 1u] = pack2x16float(v.zw);
    }
}
