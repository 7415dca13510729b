// out[t, row0 + r] = x[t] · w[r] for many rows of x: 64×64 output tiles, 32-wide steps of k
// through workgroup memory (weights dequantized once per tile), 4×4 outputs per lane.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const TILE: u32 = 64u;
const STEP: u32 = 32u;
var<workgroup> xs: array<f32, 2048>; // [TILE][STEP]
var<workgroup> ws: array<f32, 2048>; // [TILE][STEP]

@compute @workgroup_size(16, 16)
fn gemm(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let k = wp.k;
    let t0 = wg.y * TILE; // rows of x
    let r0 = wg.x * TILE; // rows of w
    let ty = li / 16u;
    let tx = li % 16u;
    var acc: array<array<f32, 4>, 4>;
    for (var k0 = 0u; k0 < k; k0 += STEP) {
        // 256 lanes load 2048 values of each tile: 8 each, one row's 8 neighbours.
        let lr = li / 4u;
        let lc = (li % 4u) * 8u;
        for (var e = 0u; e < 8u; e++) {
            let c = k0 + lc + e;
            var xv = 0.0;
            if t0 + lr < wp.n && c < k {
                xv = x[(t0 + lr) * k + c];
            }
            xs[lr * STEP + lc + e] = xv;
            var wv = 0.0;
            if r0 + lr < wp.m && c < k {
                wv = weight_at(r0 + lr, c);
            }
            ws[lr * STEP + lc + e] = wv;
        }
        workgroupBarrier();
        for (var c = 0u; c < STEP; c++) {
            var a: array<f32, 4>;
            var b: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = xs[(ty * 4u + i) * STEP + c];
                b[i] = ws[(tx * 4u + i) * STEP + c];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i][j] += a[i] * b[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = t0 + ty * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let r = r0 + tx * 4u + j;
            if t < wp.n && r < wp.m {
                out[t * wp.out_stride + wp.row0 + r] = acc[i][j];
            }
        }
    }
}
