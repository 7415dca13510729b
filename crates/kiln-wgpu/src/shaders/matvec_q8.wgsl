// Quantized weights' items for matvec_items.wgsl: x rounded to int8 per 32 values by
// quantize_row.wgsl (an f32 scale and 32 int8); each 16-byte item of a weight row meets x
// in dot4I8Packed: four byte products an instruction where
// the adapter has integer dot products, and no conversion to float per weight. (The float
// kernel of matvec.wgsl spends its time converting nibbles and reading f32 x: an 8B
// model's Q4_K products ran at ~8% of an H200's bandwidth; rounding x inside each
// workgroup instead cost every product ~10 µs of serial prologue.)

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> wq1: array<vec4<u32>>;
@group(0) @binding(8) var<storage, read> wq2: array<vec4<u32>>;

// Item i of weight j's quants (see matvec_items.wgsl).
fn w_item(j: u32, i: u32) -> vec4<u32> {
    switch j {
        case 1u: { return wq1[i]; }
        case 2u: { return wq2[i]; }
        default: { return wq[i]; }
    }
}

// x's 16-value item i and the scale of 32-value unit u.
fn x_item(i: u32) -> vec4<u32> {
    return xq[i];
}

fn x_scale(u: u32) -> f32 {
    let at = wp.k / 16u + u / 4u;
    return bitcast<f32>(xq[at][u % 4u]);
}

fn block_len() -> u32 {
    return select(32u, 256u, WTYPE >= 5u);
}

fn items_per_row() -> u32 {
    return wp.k / block_len() * items_per_block();
}

// 16-byte items a block: its quants (Q6_K: its 128 bytes of low nibbles; the 64 bytes of
// high bits are read beside them).
fn items_per_block() -> u32 {
    switch WTYPE {
        case 3u: { return 2u; }
        case 4u: { return 1u; }
        default: { return 8u; }
    }
}

fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return (dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y))
        + (dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w));
}

fn sum16(b: vec4<u32>) -> i32 {
    return dot16(vec4<u32>(0x01010101u), b);
}

fn low_nibbles(q: vec4<u32>) -> vec4<u32> {
    return q & vec4<u32>(0x0F0F0F0Fu);
}

fn high_nibbles(q: vec4<u32>) -> vec4<u32> {
    return (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
}

// Item i of row r of weight j dotted with x.
fn item_dot(j: u32, r: u32, i: u32) -> f32 {
    let blocks = wp.k / block_len();
    let qb = w_q_base(j) / 4u;
    switch WTYPE {
        case 3u: {
            // Q8_0: 16 values an item, two a block.
            let q = w_item(j, qb + r * blocks * 2u + i);
            let u = i / 2u;
            let d = w_meta_half(j, 2u * (r * blocks + i / 2u));
            return d * x_scale(u) * f32(dot16(q, x_item(2u * u + i % 2u)));
        }
        case 4u: {
            // Q4_0: low nibbles are values 0..15, high nibbles 16..31.
            let q = w_item(j, qb + r * blocks + i);
            let u = i;
            let xa = x_item(2u * u);
            let xb = x_item(2u * u + 1u);
            let s = dot16(low_nibbles(q), xa) + dot16(high_nibbles(q), xb)
                - 8 * (sum16(xa) + sum16(xb));
            return w_meta_half(j, 2u * (r * blocks + i)) * x_scale(u) * f32(s);
        }
        case 5u: {
            // Q4_K: item e of a block lies in chunk c = e / 2 of 32 bytes, whose low
            // nibbles are sub-block 2c and high nibbles 2c + 1, at offset 16 (e % 2) in both.
            let blk = i / 8u;
            let e = i % 8u;
            let c = e / 2u;
            let q = w_item(j, qb + r * blocks * 8u + i);
            let ua = blk * 8u + 2u * c;
            let xa = x_item(2u * ua + e % 2u);
            let xb = x_item(2u * (ua + 1u) + e % 2u);
            // d, dmin and the 12 scale bytes in four words; the 6-bit scales and mins of
            // sub-blocks 2c and 2c + 1 (ggml's get_scale_min_k4), both forms computed and
            // one kept so that lanes do not diverge.
            let mw = w_m_base(j) / 4u + 4u * (r * blocks + blk);
            let dm = unpack2x16float(w_word(j, mw));
            let sh = 16u * (c & 1u);
            let s0 = w_word(j, mw + 1u) >> sh;
            let s1 = w_word(j, mw + 2u) >> sh;
            let s2 = w_word(j, mw + 3u) >> sh;
            let high = c >= 2u;
            let scs = select(s0 & 0x3F3Fu, (s2 & 0x0F0Fu) | ((s0 >> 2u) & 0x3030u), high);
            let mns = select(s1 & 0x3F3Fu, ((s2 >> 4u) & 0x0F0Fu) | ((s1 >> 2u) & 0x3030u), high);
            let da = dm.x * f32(scs & 0xFFu);
            let db = dm.x * f32((scs >> 8u) & 0xFFu);
            let ma = dm.y * f32(mns & 0xFFu);
            let mb = dm.y * f32((mns >> 8u) & 0xFFu);
            return x_scale(ua) * (da * f32(dot16(low_nibbles(q), xa)) - ma * f32(sum16(xa)))
                + x_scale(ua + 1u) * (db * f32(dot16(high_nibbles(q), xb)) - mb * f32(sum16(xb)));
        }
        default: {
            // Q6_K: item i % 8 is 16 bytes of the 128 bytes of low nibbles. Byte L of
            // them (half h = L / 64, l = L % 64) gives value 128h + l in its low nibble
            // (quarter t = l / 32) and 128h + 64 + l in its high one (quarter t + 2); the
            // top two bits come from byte 32h + l % 32 of the 64 high-bit bytes, at bit 2t
            // (and 2t + 4).
            let blk = i / 8u;
            let L = 16u * (i % 8u);
            let h = L / 64u;
            let t = (L % 64u) / 32u;
            let off = L % 32u;
            let base = qb + (r * blocks + blk) * 12u;
            let ql = w_item(j, base + i % 8u);
            let qh = w_item(j, base + 8u + 2u * h + off / 16u);
            let sh = vec4<u32>(2u * t);
            let m3 = vec4<u32>(0x03030303u);
            let qa = low_nibbles(ql) | (((qh >> sh) & m3) << vec4<u32>(4u));
            let qc = high_nibbles(ql) | (((qh >> (sh + vec4<u32>(4u))) & m3) << vec4<u32>(4u));
            let mb = 18u * (r * blocks + blk);
            let d = w_meta_half(j, mb + 16u);
            let si = mb + 8u * h + off / 16u + 2u * t;
            let sa = d * f32(bitcast<i32>(w_meta_byte(j, si) << 24u) >> 24u);
            let sb = d * f32(bitcast<i32>(w_meta_byte(j, si + 4u) << 24u) >> 24u);
            let ua = blk * 8u + 4u * h + t;
            let xa = x_item(2u * ua + off / 16u);
            let xb = x_item(2u * (ua + 2u) + off / 16u);
            return x_scale(ua) * sa * f32(dot16(qa, xa) - 32 * sum16(xa))
                + x_scale(ua + 2u) * sb * f32(dot16(qc, xb) - 32 * sum16(xb));
        }
    }
}
