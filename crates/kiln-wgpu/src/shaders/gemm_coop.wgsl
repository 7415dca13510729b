// out[t, row0 + r] = x[t] · w[r] for many rows of x through cooperative matrices (tensor
// cores), where the adapter offers 16×16×16 f16 products into f32 (the module is built
// with `enable f16; enable wgpu_cooperative_matrix;`): tiles of 64 rows of x by 128 rows
// of w as gemm.wgsl, k in steps of 32 through workgroup memory as f16 (x rounded and
// clamped to f16's range, weights dequantized; each step's loads issued during the one
// before), each of the 8 subgroups of 32 lanes
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

// What a lane loads for one step of k: 8 values of its x row and 16 of its w row, read
// from memory one step ahead of the products (so that the loads of step k + 1 are in
// flight while the tensor cores take step k).
struct Step {
    x0: vec4<f32>,
    x1: vec4<f32>,
    w0: vec4<f32>,
    w1: vec4<f32>,
    w2: vec4<f32>,
    w3: vec4<f32>,
}

fn x_at(t: u32, c: u32) -> f32 {
    if t < wp.n && c < wp.k {
        return clamp(x[t * wp.k + c], -65504.0, 65504.0);
    }
    return 0.0;
}

fn w_at(r: u32, c: u32) -> f32 {
    if r < wp.m && c < wp.k {
        return weight_at(r, c);
    }
    return 0.0;
}

// Lane `li`'s share of step k0: x row li / 4, 8 values from (li % 4) · 8; w row li / 2,
// 16 values from (li % 2) · 16.
fn load_step(li: u32, t0: u32, r0: u32, k0: u32) -> Step {
    var s: Step;
    let xt = t0 + li / 4u;
    let xc = k0 + (li % 4u) * 8u;
    for (var e = 0u; e < 4u; e++) {
        s.x0[e] = x_at(xt, xc + e);
        s.x1[e] = x_at(xt, xc + 4u + e);
    }
    let wr = r0 + li / 2u;
    let wc = k0 + (li % 2u) * 16u;
    if wp.k % 4u == 0u && wr < wp.m && wc + 16u <= wp.k {
        s.w0 = quad(wr, wc / 4u);
        s.w1 = quad(wr, wc / 4u + 1u);
        s.w2 = quad(wr, wc / 4u + 2u);
        s.w3 = quad(wr, wc / 4u + 3u);
    } else {
        for (var e = 0u; e < 4u; e++) {
            s.w0[e] = w_at(wr, wc + e);
            s.w1[e] = w_at(wr, wc + 4u + e);
            s.w2[e] = w_at(wr, wc + 8u + e);
            s.w3[e] = w_at(wr, wc + 12u + e);
        }
    }
    return s;
}

fn put4(at: u32, v: vec4<f32>, to_w: bool) {
    let h = vec4<f16>(v);
    if to_w {
        cw[at] = h.x;
        cw[at + 1u] = h.y;
        cw[at + 2u] = h.z;
        cw[at + 3u] = h.w;
    } else {
        cx[at] = h.x;
        cx[at + 1u] = h.y;
        cx[at + 2u] = h.z;
        cx[at + 3u] = h.w;
    }
}

@compute @workgroup_size(256)
fn gemm_coop(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let t0 = wg.y * CT_X;
    let r0 = wg.x * CT_W;
    // Subgroup s (32 lanes) takes x rows 32·(s / 4) .. + 32 and w rows 32·(s % 4) .. + 32.
    let s = li / 32u;
    let sl = li % 32u;
    let st = (s / 4u) * 32u;
    let sr = (s % 4u) * 32u;
    let xo = (li / 4u) * CT_PAD + (li % 4u) * 8u;
    let wo = (li / 2u) * CT_PAD + (li % 2u) * 16u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var next = load_step(li, t0, r0, 0u);
    for (var k0 = 0u; k0 < wp.k; k0 += CT_K) {
        put4(xo, next.x0, false);
        put4(xo + 4u, next.x1, false);
        put4(wo, next.w0, true);
        put4(wo + 4u, next.w1, true);
        put4(wo + 8u, next.w2, true);
        put4(wo + 12u, next.w3, true);
        workgroupBarrier();
        if k0 + CT_K < wp.k {
            next = load_step(li, t0, r0, k0 + CT_K);
        }
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
