// Prompts' products on cooperative matrices (tensor cores), shared by the modules that
// read the weights (gemm_coop_f16.wgsl: F16 as stored; gemm_coop_q.wgsl: any type, decoded
// to f16): out[t, row0 + r] = x[t] · w[r], x already rounded to f16 (`row_to_f16` over the
// whole matrix, its rows padded to a multiple of 128). A workgroup of 4 subgroups takes 128
// rows of x by 128 rows of w, k in steps of 32 through workgroup memory (two buffers: one
// barrier a step; each step's loads issued before the products of the step before); each
// subgroup 64 × 64 of the results as 4 × 4 f32 accumulators, so that a step of 16 values
// of k loads 8 matrices from workgroup memory for 16 products. (On an H200 through Vulkan,
// products of matrices loaded from workgroup memory one load each ran at ~90 TFLOPS, from
// a storage buffer at ~36, held in registers at 266+: `examples/coop_rate.rs`.) The module
// gives `w_item(row, c)`: values 8·c .. 8·c + 7 of the chunk's row `row` as four words of
// f16 pairs.
// Cooperative operations need uniform control flow, so every choice below depends on the
// workgroup alone: a tile wholly inside the output is stored (or added) straight into it,
// an edge tile (or one whose rows are not 16-byte aligned) through workgroup memory,
// element by element. Every index and stride of a
// cooperative load or store is a `let`: naga 30's SPIR-V writer panics on one written
// inline (an expression it never emitted).

@group(0) @binding(0) var<storage, read> xh: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const TX: u32 = 128u;
const TW: u32 = 128u;
const PAD: u32 = 40u;   // a tile row of 32 values padded, so neighbouring rows' loads use other banks
const TILE: u32 = 5120u; // 128 rows of PAD
var<workgroup> cx: array<f16, 10240>; // two tiles of x
var<workgroup> cw: array<f16, 10240>; // two tiles of w
var<workgroup> stage: array<f32, 1024>; // a 16×16 block for each of 4 subgroups

// A subgroup's 16×16 block (staged at stage[base..]) into the output, within its bounds.
fn store_block(base: u32, t0: u32, r0: u32, sl: u32) {
    for (var e = sl; e < 256u; e += 32u) {
        let t = t0 + e / 16u;
        let r = r0 + e % 16u;
        if t < wp.n && r < wp.m {
            let at = t * wp.out_stride + wp.row0 + r;
            if wp.p10 == 1u {
                out[at] += stage[base + e];
            } else {
                out[at] = stage[base + e];
            }
        }
    }
}

// One step's 16-byte items of a lane: rows li / 4 + 32·j of each tile, item li % 4.
struct Step {
    x0: vec4<u32>, x1: vec4<u32>, x2: vec4<u32>, x3: vec4<u32>,
    w0: vec4<u32>, w1: vec4<u32>, w2: vec4<u32>, w3: vec4<u32>,
}

// Items of x rows t0 + li / 4 + 32·j and of w rows r0 + li / 4 + 32·j (past the chunk's
// last row: its last row, whose results are never stored), from value k0 + 8·(li % 4).
fn load_step(li: u32, t0: u32, r0: u32, k0: u32) -> Step {
    let items = wp.k / 8u;
    let c = k0 / 8u + li % 4u;
    let xr = (t0 + li / 4u) * items + c;
    let last = wp.m - 1u;
    var s: Step;
    s.x0 = xh[xr];
    s.x1 = xh[xr + 32u * items];
    s.x2 = xh[xr + 64u * items];
    s.x3 = xh[xr + 96u * items];
    s.w0 = w_item(min(r0 + li / 4u, last), c);
    s.w1 = w_item(min(r0 + li / 4u + 32u, last), c);
    s.w2 = w_item(min(r0 + li / 4u + 64u, last), c);
    s.w3 = w_item(min(r0 + li / 4u + 96u, last), c);
    return s;
}

fn put_x(at: u32, v: vec4<u32>) {
    let a = unpack2x16float(v.x);
    let b = unpack2x16float(v.y);
    let c = unpack2x16float(v.z);
    let d = unpack2x16float(v.w);
    cx[at] = f16(a.x);
    cx[at + 1u] = f16(a.y);
    cx[at + 2u] = f16(b.x);
    cx[at + 3u] = f16(b.y);
    cx[at + 4u] = f16(c.x);
    cx[at + 5u] = f16(c.y);
    cx[at + 6u] = f16(d.x);
    cx[at + 7u] = f16(d.y);
}

fn put_w(at: u32, v: vec4<u32>) {
    let a = unpack2x16float(v.x);
    let b = unpack2x16float(v.y);
    let c = unpack2x16float(v.z);
    let d = unpack2x16float(v.w);
    cw[at] = f16(a.x);
    cw[at + 1u] = f16(a.y);
    cw[at + 2u] = f16(b.x);
    cw[at + 3u] = f16(b.y);
    cw[at + 4u] = f16(c.x);
    cw[at + 5u] = f16(c.y);
    cw[at + 6u] = f16(d.x);
    cw[at + 7u] = f16(d.y);
}

// A step's items into tile buffer `buf`.
fn put_step(li: u32, buf: u32, s: Step) {
    let at = buf * TILE + (li / 4u) * PAD + (li % 4u) * 8u;
    put_x(at, s.x0);
    put_x(at + 32u * PAD, s.x1);
    put_x(at + 64u * PAD, s.x2);
    put_x(at + 96u * PAD, s.x3);
    put_w(at, s.w0);
    put_w(at + 32u * PAD, s.w1);
    put_w(at + 64u * PAD, s.w2);
    put_w(at + 96u * PAD, s.w3);
}

@compute @workgroup_size(128)
fn gemm_tiles(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let k = wp.k;
    let t0 = wg.y * TX;
    let r0 = wg.x * TW;
    // Subgroup s takes rows 64·(s / 2) .. + 64 of the x tile and 64·(s % 2) .. + 64 of w's.
    let s = li / 32u;
    let sl = li % 32u;
    let sy = (s / 2u) * 64u;
    let sx = (s % 2u) * 64u;
    let st = t0 + sy;
    let sr = r0 + sx;
    // A tile is stored straight into the output when wholly inside it and its rows start
    // on 16 bytes. (`&`, not `&&`: naga reads a short-circuit as a branch on a local, which
    // cooperative operations reject as non-uniform.)
    let inside = (t0 + TX <= wp.n) & (r0 + TW <= wp.m) & (wp.out_stride % 4u == 0u)
        & (wp.row0 % 4u == 0u);
    let os = wp.out_stride;
    let o00 = st * os + wp.row0 + sr;
    let o01 = o00 + 0u * os + 16u;
    let o02 = o00 + 0u * os + 32u;
    let o03 = o00 + 0u * os + 48u;
    let o10 = o00 + 16u * os + 0u;
    let o11 = o00 + 16u * os + 16u;
    let o12 = o00 + 16u * os + 32u;
    let o13 = o00 + 16u * os + 48u;
    let o20 = o00 + 32u * os + 0u;
    let o21 = o00 + 32u * os + 16u;
    let o22 = o00 + 32u * os + 32u;
    let o23 = o00 + 32u * os + 48u;
    let o30 = o00 + 48u * os + 0u;
    let o31 = o00 + 48u * os + 16u;
    let o32 = o00 + 48u * os + 32u;
    let o33 = o00 + 48u * os + 48u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c22 = coop_mat16x16<f32, C>();
    var c23 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();
    var c32 = coop_mat16x16<f32, C>();
    var c33 = coop_mat16x16<f32, C>();
    // wp.p10 = 1: add to the output (a projection feeding the residual stream); inside
    // the output the sums start from it.
    if inside & (wp.p10 == 1u) {
        c00 = coopLoadT<coop_mat16x16<f32, C>>(&out[o00], os);
        c01 = coopLoadT<coop_mat16x16<f32, C>>(&out[o01], os);
        c02 = coopLoadT<coop_mat16x16<f32, C>>(&out[o02], os);
        c03 = coopLoadT<coop_mat16x16<f32, C>>(&out[o03], os);
        c10 = coopLoadT<coop_mat16x16<f32, C>>(&out[o10], os);
        c11 = coopLoadT<coop_mat16x16<f32, C>>(&out[o11], os);
        c12 = coopLoadT<coop_mat16x16<f32, C>>(&out[o12], os);
        c13 = coopLoadT<coop_mat16x16<f32, C>>(&out[o13], os);
        c20 = coopLoadT<coop_mat16x16<f32, C>>(&out[o20], os);
        c21 = coopLoadT<coop_mat16x16<f32, C>>(&out[o21], os);
        c22 = coopLoadT<coop_mat16x16<f32, C>>(&out[o22], os);
        c23 = coopLoadT<coop_mat16x16<f32, C>>(&out[o23], os);
        c30 = coopLoadT<coop_mat16x16<f32, C>>(&out[o30], os);
        c31 = coopLoadT<coop_mat16x16<f32, C>>(&out[o31], os);
        c32 = coopLoadT<coop_mat16x16<f32, C>>(&out[o32], os);
        c33 = coopLoadT<coop_mat16x16<f32, C>>(&out[o33], os);
    }
    put_step(li, 0u, load_step(li, t0, r0, 0u));
    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < k; k0 += 32u) {
        let more = k0 + 32u < k;
        var next: Step;
        if more {
            next = load_step(li, t0, r0, k0 + 32u);
        }
        for (var kk = 0u; kk < 32u; kk += 16u) {
            let ra = buf * TILE + sy * PAD + kk;
            let rb = buf * TILE + sx * PAD + kk;
            let ia0 = ra + 0u;
            let ia1 = ra + 640u;
            let ia2 = ra + 1280u;
            let ia3 = ra + 1920u;
            let ib0 = rb + 0u;
            let ib1 = rb + 640u;
            let ib2 = rb + 1280u;
            let ib3 = rb + 1920u;
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&cx[ia0], PAD);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&cx[ia1], PAD);
            let a2 = coopLoadT<coop_mat16x16<f16, A>>(&cx[ia2], PAD);
            let a3 = coopLoadT<coop_mat16x16<f16, A>>(&cx[ia3], PAD);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&cw[ib0], PAD);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&cw[ib1], PAD);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&cw[ib2], PAD);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&cw[ib3], PAD);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c22 = coopMultiplyAdd(a2, b2, c22);
            c23 = coopMultiplyAdd(a2, b3, c23);
            c30 = coopMultiplyAdd(a3, b0, c30);
            c31 = coopMultiplyAdd(a3, b1, c31);
            c32 = coopMultiplyAdd(a3, b2, c32);
            c33 = coopMultiplyAdd(a3, b3, c33);
        }
        if more {
            put_step(li, 1u - buf, next);
        }
        workgroupBarrier();
        buf = 1u - buf;
    }
    if inside {
        coopStoreT(c00, &out[o00], os);
        coopStoreT(c01, &out[o01], os);
        coopStoreT(c02, &out[o02], os);
        coopStoreT(c03, &out[o03], os);
        coopStoreT(c10, &out[o10], os);
        coopStoreT(c11, &out[o11], os);
        coopStoreT(c12, &out[o12], os);
        coopStoreT(c13, &out[o13], os);
        coopStoreT(c20, &out[o20], os);
        coopStoreT(c21, &out[o21], os);
        coopStoreT(c22, &out[o22], os);
        coopStoreT(c23, &out[o23], os);
        coopStoreT(c30, &out[o30], os);
        coopStoreT(c31, &out[o31], os);
        coopStoreT(c32, &out[o32], os);
        coopStoreT(c33, &out[o33], os);
        return;
    }
    // An edge tile: each block staged and stored within the bounds (rows and columns
    // relative to the chunk).
    let base = s * 256u;
    coopStoreT(c00, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 0u, sr + 0u, sl);
    workgroupBarrier();
    coopStoreT(c01, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 0u, sr + 16u, sl);
    workgroupBarrier();
    coopStoreT(c02, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 0u, sr + 32u, sl);
    workgroupBarrier();
    coopStoreT(c03, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 0u, sr + 48u, sl);
    workgroupBarrier();
    coopStoreT(c10, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 16u, sr + 0u, sl);
    workgroupBarrier();
    coopStoreT(c11, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 16u, sr + 16u, sl);
    workgroupBarrier();
    coopStoreT(c12, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 16u, sr + 32u, sl);
    workgroupBarrier();
    coopStoreT(c13, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 16u, sr + 48u, sl);
    workgroupBarrier();
    coopStoreT(c20, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 32u, sr + 0u, sl);
    workgroupBarrier();
    coopStoreT(c21, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 32u, sr + 16u, sl);
    workgroupBarrier();
    coopStoreT(c22, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 32u, sr + 32u, sl);
    workgroupBarrier();
    coopStoreT(c23, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 32u, sr + 48u, sl);
    workgroupBarrier();
    coopStoreT(c30, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 48u, sr + 0u, sl);
    workgroupBarrier();
    coopStoreT(c31, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 48u, sr + 16u, sl);
    workgroupBarrier();
    coopStoreT(c32, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 48u, sr + 32u, sl);
    workgroupBarrier();
    coopStoreT(c33, &stage[base], 16u);
    workgroupBarrier();
    store_block(base, st + 48u, sr + 48u, sl);
    workgroupBarrier();
}
