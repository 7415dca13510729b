// The KV cache's element types (kiln_core::DType::KV_CACHE), shared by the kernels that
// write the cache (kv_rows.wgsl, rope_kv.wgsl) and read it (attention.wgsl). A pipeline
// is made per type: the override KV (0 f32, 1 f16, 2 bf16, 3 q8_0).
//
// A cache of `elements` values is bound as words: f32 one a word; f16 and bf16 two a word,
// element e in the low half of word e / 2 when e is even; q8_0 split as every quantized
// tensor is on the GPU (kiln_core::quant::gpu_layout): the quant of element e in byte e,
// then the f16 scale of each block of 32, block b's in half b of the words from
// elements / 4 on. Writers store into `array<atomic<u32>>` (a half-word with atomicAnd and
// atomicOr, so that two lanes may write the two halves of a word, as rows of an odd
// length and q8_0 rows of an odd number of blocks do). f16 is encoded and decoded with
// integer operations here, rounding to nearest even (WGSL leaves f32 -> f16 rounding to
// the device, and unpack2x16float may flush subnormals), so that every device stores and
// reads the bits the CPU does; bf16 as ggml rounds it.

override KV: u32 = 0u;
const KV_F32: u32 = 0u;
const KV_F16: u32 = 1u;
const KV_BF16: u32 = 2u;
const KV_Q8_0: u32 = 3u;

// The f16 with bits `h` (the low 16), exactly.
fn f16_value(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let exp = (h >> 10u) & 0x1fu;
    let man = h & 0x3ffu;
    if exp == 0u {
        // Zero or subnormal: man · 2^-24, a normal f32.
        return bitcast<f32>(sign | bitcast<u32>(f32(man) * 5.9604645e-8));
    }
    if exp == 31u {
        return bitcast<f32>(sign | 0x7f800000u | (man << 13u));
    }
    return bitcast<f32>(sign | ((exp + 112u) << 23u) | (man << 13u));
}

// The bits of x as f16, rounded to nearest even (beyond f16's range, ±inf).
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return sign | 0x7e00u; // NaN
    }
    if a >= 0x477ff000u {
        return sign | 0x7c00u; // 65520 and up round to infinity
    }
    if a >= 0x38800000u {
        // Normal: the exponent rebased (-112), 13 bits rounded off (a carry moves into the
        // exponent, as it should).
        let r = a - 0x38000000u;
        return sign | ((r + 0xfffu + ((r >> 13u) & 1u)) >> 13u);
    }
    // Below 2^-14: a subnormal m · 2^-24, m the significand shifted right by s.
    let s = 126u - (a >> 23u);
    if s >= 25u {
        return sign;
    }
    let mant = (a & 0x7fffffu) | 0x800000u;
    let m = mant >> s;
    let rest = mant & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    let up = u32(rest > half || (rest == half && (m & 1u) == 1u));
    return sign | (m + up);
}

// The bits of x as bf16, as ggml rounds (nearest even; NaN made quiet).
fn bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if (b & 0x7fffffffu) > 0x7f800000u {
        return (b >> 16u) | 64u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// The word holding element e (its quant, for q8_0).
fn kv_word(e: u32) -> u32 {
    if KV == KV_F32 {
        return e;
    }
    if KV == KV_Q8_0 {
        return e / 4u;
    }
    return e / 2u;
}

// The word holding the q8_0 scale of element e's block, in a cache of `elements` values.
fn kv_scale_word(e: u32, elements: u32) -> u32 {
    return elements / 4u + e / 64u;
}

// Element e's value from its word `w` and, for q8_0, the word `s` with its block's scale.
fn kv_value(e: u32, w: u32, s: u32) -> f32 {
    if KV == KV_F32 {
        return bitcast<f32>(w);
    }
    let hi = (e & 1u) == 1u;
    if KV == KV_F16 {
        return f16_value(select(w, w >> 16u, hi));
    }
    if KV == KV_BF16 {
        return bitcast<f32>(select(w << 16u, w & 0xffff0000u, hi));
    }
    let q = f32(extractBits(bitcast<i32>(w), 8u * (e & 3u), 8u));
    return q * f16_value(select(s, s >> 16u, ((e / 32u) & 1u) == 1u));
}

// ggml's quantize_row_q8_0 for one block: the quants packed four to a word, and the
// scale's f16 bits. Scale max|x| / 127, each value round(x · (1/scale)), ties away from
// zero (WGSL's round() takes ties to even).
struct Q8Block {
    qs: array<u32, 8>,
    d: u32,
}

fn q8_block(x: array<f32, 32>) -> Q8Block {
    var amax = 0.0;
    for (var i = 0u; i < 32u; i++) {
        amax = max(amax, abs(x[i]));
    }
    let d = amax / 127.0;
    let id = select(0.0, 1.0 / d, d != 0.0);
    var out: Q8Block;
    for (var w = 0u; w < 8u; w++) {
        var word = 0u;
        for (var j = 0u; j < 4u; j++) {
            let v = x[4u * w + j] * id;
            let t = trunc(v);
            let q = select(round(v), t + sign(v), abs(v - t) == 0.5);
            word |= (u32(i32(q)) & 0xffu) << (8u * j);
        }
        out.qs[w] = word;
    }
    out.d = f16_bits(d);
    return out;
}
