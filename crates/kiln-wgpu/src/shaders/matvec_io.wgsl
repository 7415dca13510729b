// x of the float matrix-vector kernels (matvec.wgsl) and the RMS norm fused in front of a
// one-row product.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(5) var<storage, read> norm_w: array<f32>;
@group(0) @binding(6) var<storage, read_write> normed: array<f32>;

// The RMS norm fused in front (wp.p11 = 1, one row of x only): x read as x·inv·norm_w,
// inv found by each workgroup (`find_norm`); wp.p13 = 1: workgroup 0 also writes the
// normed row.
var<private> norm_inv: f32 = 1.0;

fn find_norm(lane: Lane, group: u32) {
    if wp.p11 != 1u {
        return;
    }
    var ss = 0.0;
    for (var c = lane.idx; c < wp.k; c += WG) {
        ss += x[c] * x[c];
    }
    norm_inv = 1.0 / sqrt(wg_sum(ss, lane) / f32(wp.k) + bitcast<f32>(wp.p12));
    if wp.p13 == 1u && group == 0u {
        for (var c = lane.idx; c < wp.k; c += WG) {
            normed[c] = x[c] * norm_inv * norm_w[c];
        }
    }
}

// x[o .. o + 4] of the first row, normed when the norm is fused.
fn x4(o: u32) -> vec4<f32> {
    let v = vec4<f32>(x[o], x[o + 1u], x[o + 2u], x[o + 3u]);
    if wp.p11 == 1u {
        return v * norm_inv * vec4<f32>(norm_w[o], norm_w[o + 1u], norm_w[o + 2u], norm_w[o + 3u]);
    }
    return v;
}
