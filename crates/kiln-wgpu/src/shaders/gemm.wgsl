// out[t, row0 + r] = x[t] · w[r] for many rows of x: tiles of 64 rows of x by 128 rows of
// w (more workgroups than square 128 tiles for a 512-token prompt: 0.5 of a wave on an
// H200 was latency-bound), 16-wide steps of k through workgroup memory, weights
// dequantized once per tile four at a time, 4×8 outputs per lane. The accumulators are
// named vec4 variables, not an array: drivers keep a dynamically indexed array in local
// memory, which made this kernel ~20x slower on an H200.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const TILE_X: u32 = 64u;
const TILE_W: u32 = 128u;
const STEP: u32 = 16u;
// k-major: [c][row / 4], so that a lane reads 4 neighbouring rows as one vec4.
var<workgroup> xs: array<vec4<f32>, 256>; // [STEP][TILE_X / 4]
var<workgroup> ws: array<vec4<f32>, 512>; // [STEP][TILE_W / 4]

fn store_row(t: u32, rb: u32, v: vec4<f32>) {
    if t >= wp.n {
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        if rb + j < wp.m {
            let at = t * wp.out_stride + wp.row0 + rb + j;
            // wp.p10 = 1: add to the output (a projection feeding the residual stream).
            if wp.p10 == 1u {
                out[at] += v[j];
            } else {
                out[at] = v[j];
            }
        }
    }
}

@compute @workgroup_size(256)
fn gemm(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let k = wp.k;
    let t0 = wg.y * TILE_X; // rows of x
    let r0 = wg.x * TILE_W; // rows of w
    // This lane's outputs: x rows ty·4 + {0..3}; w rows tx·4 + {0..3} and 64 + tx·4 +
    // {0..3}, so that a step's vec4 reads are contiguous across lanes.
    let ty = li / 16u;
    let tx = li % 16u;
    // Loading: x row li / 4, columns (li % 4) · 4 .. + 4; w row li / 2, columns
    // (li % 2) · 8 .. + 8.
    let xr = li / 4u;
    let xc = (li % 4u) * 4u;
    let wr = li / 2u;
    let wc = (li % 2u) * 8u;
    let by_quads = k % 4u == 0u;
    var c00 = vec4<f32>(0.0);
    var c01 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0);
    var c11 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0);
    var c21 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0);
    var c31 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < k; k0 += STEP) {
        for (var e = 0u; e < 4u; e++) {
            let c = k0 + xc + e;
            var xv = 0.0;
            if t0 + xr < wp.n && c < k {
                xv = x[(t0 + xr) * k + c];
            }
            xs[(xc + e) * (TILE_X / 4u) + xr / 4u][xr % 4u] = xv;
        }
        let c0 = k0 + wc;
        if by_quads && r0 + wr < wp.m && c0 + 8u <= k {
            let pair = quad_pair(r0 + wr, c0 / 4u);
            let lo = pair[0];
            let hi = pair[1];
            for (var e = 0u; e < 4u; e++) {
                ws[(wc + e) * (TILE_W / 4u) + wr / 4u][wr % 4u] = lo[e];
                ws[(wc + 4u + e) * (TILE_W / 4u) + wr / 4u][wr % 4u] = hi[e];
            }
        } else {
            for (var e = 0u; e < 8u; e++) {
                let c = c0 + e;
                var wv = 0.0;
                if r0 + wr < wp.m && c < k {
                    wv = weight_at(r0 + wr, c);
                }
                ws[(wc + e) * (TILE_W / 4u) + wr / 4u][wr % 4u] = wv;
            }
        }
        workgroupBarrier();
        for (var c = 0u; c < STEP; c++) {
            let a = xs[c * 16u + ty];
            let b0 = ws[c * 32u + tx];
            let b1 = ws[c * 32u + tx + 16u];
            c00 += a.x * b0;
            c01 += a.x * b1;
            c10 += a.y * b0;
            c11 += a.y * b1;
            c20 += a.z * b0;
            c21 += a.z * b1;
            c30 += a.w * b0;
            c31 += a.w * b1;
        }
        workgroupBarrier();
    }
    store_row(t0 + ty * 4u + 0u, r0 + tx * 4u, c00);
    store_row(t0 + ty * 4u + 0u, r0 + 64u + tx * 4u, c01);
    store_row(t0 + ty * 4u + 1u, r0 + tx * 4u, c10);
    store_row(t0 + ty * 4u + 1u, r0 + 64u + tx * 4u, c11);
    store_row(t0 + ty * 4u + 2u, r0 + tx * 4u, c20);
    store_row(t0 + ty * 4u + 2u, r0 + 64u + tx * 4u, c21);
    store_row(t0 + ty * 4u + 3u, r0 + tx * 4u, c30);
    store_row(t0 + ty * 4u + 3u, r0 + 64u + tx * 4u, c31);
}
