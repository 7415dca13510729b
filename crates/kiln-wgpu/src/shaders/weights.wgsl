// Weights read a word at a time, for any row length: the float types, the prompt GEMM,
// embeddings and the float matrix-vector products. Quantized layouts:
// kiln_core::quant::gpu_layout.

@group(0) @binding(1) var<storage, read> wq: array<u32>;

fn qword(i: u32) -> u32 {
    return wq[wp.q_base + i];
}

fn nibbles(w: u32, shift: u32) -> vec4<f32> {
    return vec4<f32>(
        f32((w >> shift) & 15u),
        f32((w >> (shift + 8u)) & 15u),
        f32((w >> (shift + 16u)) & 15u),
        f32((w >> (shift + 24u)) & 15u),
    );
}

// Q4_K's 6-bit scale and min of sub-block s (ggml's get_scale_min_k4); `sb`: the byte
// offset of the block's 12 scale bytes in `wm`.
fn q4k_scale_min(s: u32, sb: u32) -> vec2<f32> {
    if s < 4u {
        return vec2<f32>(f32(meta_byte(sb + s) & 63u), f32(meta_byte(sb + s + 4u) & 63u));
    }
    let a = meta_byte(sb + s + 4u);
    return vec2<f32>(
        f32((a & 15u) | ((meta_byte(sb + s - 4u) >> 6u) << 4u)),
        f32((a >> 4u) | ((meta_byte(sb + s) >> 6u) << 4u)),
    );
}

// The integers of quad qd (elements 4·qd .. 4·qd+3) of row r of a quantized type, and
// (`quad_scale`) the scale and offset they take: the values are raw · scale − offset.
// Every type's scale covers an aligned pair of quads (a block or sub-block of 32 values,
// Q6_K's 16), which `quad_pair` reads once.
fn quad_raw(r: u32, qd: u32) -> vec4<f32> {
    let k = wp.k;
    switch WTYPE {
        case 3u: {
            let blk = r * (k / 32u) + qd / 8u;
            return vec4<f32>(unpack4xI8(qword(blk * 8u + qd % 8u)));
        }
        case 4u: {
            let blk = r * (k / 32u) + qd / 8u;
            let j = qd % 8u;
            return nibbles(qword(blk * 4u + j % 4u), (j / 4u) * 4u) - 8.0;
        }
        case 5u: {
            let blk = r * (k / 256u) + qd / 64u;
            let sub = (qd / 8u) % 8u;
            return nibbles(qword(blk * 32u + (sub / 2u) * 8u + qd % 8u), (sub % 2u) * 4u);
        }
        default: {
            let blk = r * (k / 256u) + qd / 64u;
            let c = (qd / 8u) % 8u;
            let j = qd % 8u;
            let h = c / 4u;
            let quarter = c % 4u;
            let lo = qword(blk * 48u + 16u * h + 8u * (quarter & 1u) + j);
            let hi = qword(blk * 48u + 32u + 8u * h + j);
            let ls = (quarter / 2u) * 4u;
            let hs = 2u * quarter;
            var q: vec4<f32>;
            for (var t = 0u; t < 4u; t++) {
                let v = ((lo >> (8u * t + ls)) & 15u) | (((hi >> (8u * t + hs)) & 3u) << 4u);
                q[t] = f32(i32(v) - 32);
            }
            return q;
        }
    }
}

fn quad_scale(r: u32, qd: u32) -> vec2<f32> {
    let k = wp.k;
    switch WTYPE {
        case 3u, 4u: {
            let blk = r * (k / 32u) + qd / 8u;
            return vec2<f32>(meta_half(blk * 2u), 0.0);
        }
        case 5u: {
            let blk = r * (k / 256u) + qd / 64u;
            let sub = (qd / 8u) % 8u;
            let mb = blk * 16u;
            let sm = q4k_scale_min(sub, mb + 4u);
            return vec2<f32>(meta_half(mb) * sm.x, meta_half(mb + 2u) * sm.y);
        }
        default: {
            let blk = r * (k / 256u) + qd / 64u;
            let c = (qd / 8u) % 8u;
            let j = qd % 8u;
            let mb = blk * 18u;
            let sc = meta_byte(mb + 8u * (c / 4u) + j / 4u + 2u * (c % 4u));
            return vec2<f32>(meta_half(mb + 16u) * f32(bitcast<i32>(sc << 24u) >> 24u), 0.0);
        }
    }
}

// Elements 4·qd .. 4·qd+3 of row r (k a multiple of 4).
fn quad(r: u32, qd: u32) -> vec4<f32> {
    let k = wp.k;
    switch WTYPE {
        case 0u: {
            let i = r * k + 4u * qd;
            return vec4<f32>(bitcast<f32>(qword(i)), bitcast<f32>(qword(i + 1u)),
                             bitcast<f32>(qword(i + 2u)), bitcast<f32>(qword(i + 3u)));
        }
        case 1u: {
            let i = (r * k + 4u * qd) / 2u;
            return vec4<f32>(unpack2x16float(qword(i)), unpack2x16float(qword(i + 1u)));
        }
        case 2u: {
            let i = (r * k + 4u * qd) / 2u;
            let a = qword(i);
            let b = qword(i + 1u);
            return vec4<f32>(bitcast<f32>(a << 16u), bitcast<f32>(a & 0xFFFF0000u),
                             bitcast<f32>(b << 16u), bitcast<f32>(b & 0xFFFF0000u));
        }
        default: {
            let s = quad_scale(r, qd);
            return quad_raw(r, qd) * s.x - s.y;
        }
    }
}

// Quads qd and qd + 1 of row r (qd even), a quantized type's scale read once.
fn quad_pair(r: u32, qd: u32) -> array<vec4<f32>, 2> {
    if WTYPE <= 2u {
        return array<vec4<f32>, 2>(quad(r, qd), quad(r, qd + 1u));
    }
    let s = quad_scale(r, qd);
    return array<vec4<f32>, 2>(quad_raw(r, qd) * s.x - s.y, quad_raw(r, qd + 1u) * s.x - s.y);
}

// Element c of row r, for any k (float types) or k a multiple of the block.
fn weight_at(r: u32, c: u32) -> f32 {
    switch WTYPE {
        case 0u: {
            return bitcast<f32>(qword(r * wp.k + c));
        }
        case 1u: {
            let i = r * wp.k + c;
            return unpack2x16float(qword(i / 2u))[i % 2u];
        }
        case 2u: {
            let i = r * wp.k + c;
            let w = qword(i / 2u);
            return bitcast<f32>(select(w << 16u, w & 0xFFFF0000u, (i % 2u) == 1u));
        }
        default: {
            return quad(r, c / 4u)[c % 4u];
        }
    }
}
