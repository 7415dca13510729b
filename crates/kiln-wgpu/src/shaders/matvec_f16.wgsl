// F16 weights meeting x in f16 arithmetic (the module is built with `enable f16;`, where
// the adapter has SHADER_F16): an item is 8 values of a row and the same 8 of x, rounded to
// f16 by quantize_row.wgsl; each half of the item is summed in f16 and the two sums
// added in f32. (The float kernel of matvec.wgsl converts every weight to f32 and reads
// 4-byte x, twice the weights' own bytes.)

// Eight f16 values: one 16-byte item.
struct Halves8 {
    lo: vec4<f16>,
    hi: vec4<f16>,
}

@group(0) @binding(0) var<storage, read> xq: array<Halves8>;
@group(0) @binding(1) var<storage, read> wq: array<Halves8>;
@group(0) @binding(5) var<storage, read> wq1: array<Halves8>;
@group(0) @binding(8) var<storage, read> wq2: array<Halves8>;

// Item i of weight j (see matvec_items.wgsl).
fn w_item(j: u32, i: u32) -> Halves8 {
    switch j {
        case 1u: { return wq1[i]; }
        case 2u: { return wq2[i]; }
        default: { return wq[i]; }
    }
}

fn items_per_row() -> u32 {
    return wp.k / 8u;
}

fn item_dot(j: u32, r: u32, i: u32) -> f32 {
    let w = w_item(j, w_q_base(j) / 4u + r * items_per_row() + i);
    let x = xq[i];
    return f32(dot(w.lo, x.lo)) + f32(dot(w.hi, x.hi));
}
