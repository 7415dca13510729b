// out[t, row0 + r] = x[t] · w[r] for many rows of x through cooperative matrices (tensor
// cores), where the adapter offers 16×16×16 f16 products into f32 (the module is built
// with `enable f16; enable wgpu_cooperative_matrix;`): tiles of 64 rows of x by 128 rows
// of w as gemm.wgsl, k in steps of 32 through workgroup memory as f16 (x rounded and
// clamped to f16's range, weights dequantized), each of the 8 subgroups of 32 lanes
// 32×32 outputs as four f32 accumulators. Rows of the tiles are padded to 40 values so
// that the matrix loads of neighbouring rows do not share banks.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const CT_X: u32 = 64u;
const CT_W: u32 = 128u;
const CT_K: u32 = 32u;
const CT_PAD: u32 = 40u;
var<workgroup> cx: array<f16, 2560>;    // [CT_X][CT_PAD]
var<workgroup> cw: array<f16, 5120>;    // [CT_W][CT_PAD]
var<workgroup> cstage: array<f32, 2048>; // a 16×16 block for each of 8 subgroups

// A subgroup's 16×16 block of results (staged at cstage[base..]) into the output.
fn store_block(base: u32, t0: u32, r0: u32, sl: u32) {
    for (var e = sl; e < 256u; e += 32u) {
        let t = t0 + e / 16u;
        let r = r0 + e % 16u;
        if t < wp.n && r < wp.m {
            let at = t * wp.out_stride + wp.row0 + r;
            // wp.p10 = 1: add to the output (a projection feeding the residual stream).
            if wp.p10 == 1u {
                out[at] += cstage[base + e];
            } else {
                out[at] = cstage[base + e];
            }
        }
    }
}

@compute @workgroup_size(256)
fn gemm_coop(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let k = wp.k;
    let t0 = wg.y * CT_X;
    let r0 = wg.x * CT_W;
    // Subgroup s (32 lanes) takes x rows 32·(s / 4) .. + 32 and w rows 32·(s % 4) .. + 32.
    let s = li / 32u;
    let sl = li % 32u;
    let st = (s / 4u) * 32u;
    let sr = (s % 4u) * 32u;
    // Loading: x row li / 4, 8 values from (li % 4) · 8; w row li / 2, 16 values from
    // (li % 2) · 16.
    let xr = li / 4u;
    let xc = (li % 4u) * 8u;
    let wr = li / 2u;
    let wc = (li % 2u) * 16u;
    let by_quads = k % 4u == 0u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < k; k0 += CT_K) {
        for (var e = 0u; e < 8u; e++) {
            let c = k0 + xc + e;
            var v = 0.0;
            if t0 + xr < wp.n && c < k {
                v = clamp(x[(t0 + xr) * k + c], -65504.0, 65504.0);
            }
            cx[xr * CT_PAD + xc + e] = f16(v);
        }
        let c0 = k0 + wc;
        if by_quads && r0 + wr < wp.m && c0 + 16u <= k {
            for (var qd = 0u; qd < 4u; qd++) {
                let v = quad(r0 + wr, c0 / 4u + qd);
                let at = wr * CT_PAD + wc + 4u * qd;
                cw[at] = f16(v.x);
                cw[at + 1u] = f16(v.y);
                cw[at + 2u] = f16(v.z);
                cw[at + 3u] = f16(v.w);
            }
        } else {
            for (var e = 0u; e < 16u; e++) {
                let c = c0 + e;
                var v = 0.0;
                if r0 + wr < wp.m && c < k {
                    v = weight_at(r0 + wr, c);
                }
                cw[wr * CT_PAD + wc + e] = f16(v);
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < CT_K; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&cx[st * CT_PAD + kk], CT_PAD);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&cx[(st + 16u) * CT_PAD + kk], CT_PAD);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&cw[sr * CT_PAD + kk], CT_PAD);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&cw[(sr + 16u) * CT_PAD + kk], CT_PAD);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
        workgroupBarrier();
    }
    let base = s * 256u;
    coopStoreT(c00, &cstage[base], 16u);
    workgroupBarrier();
    store_block(base, t0 + st, r0 + sr, sl);
    workgroupBarrier();
    coopStoreT(c01, &cstage[base], 16u);
    workgroupBarrier();
    store_block(base, t0 + st, r0 + sr + 16u, sl);
    workgroupBarrier();
    coopStoreT(c10, &cstage[base], 16u);
    workgroupBarrier();
    store_block(base, t0 + st + 16u, r0 + sr, sl);
    workgroupBarrier();
    coopStoreT(c11, &cstage[base], 16u);
    workgroupBarrier();
    store_block(base, t0 + st + 16u, r0 + sr + 16u, sl);
}
