// The optimizer step (kiln_core::optim) over flat F32 buffers, after the gradients'
// statistics (optim_stats.wgsl): the update of every element in one pass, PyTorch's single-tensor formulas written out as the CPU backend
// writes them (crates/kiln-cpu/src/optim.rs), its fused multiply-adds as `fma`. The step's
// factors come from the host, which prepares them in double precision as the CPU does
// (WGSL has no f64).

struct OParams {
    n: u32,
    rule: u32,     // 0 SGD, 1 Adam/AdamW, 2 RMSprop, 3 Adagrad
    flags: u32,    // see the FLAG_ constants
    groups_x: u32,
    f0: f32, f1: f32, f2: f32, f3: f32, f4: f32, f5: f32, f6: f32, f7: f32,
    unscale: f32,  // the gradients' unscale factor (FLAG_UNSCALE)
    clip: f32,     // the clipping coefficient (FLAG_CLIP)
    copy: u32,     // the compute copy: 0 none, 1 BF16, 2 F16
    p15: u32,
}
@group(1) @binding(0) var<uniform> op: OParams;

const FLAG_UNSCALE: u32 = 1u;
const FLAG_CLIP: u32 = 2u;
// Per rule: SGD weight decay, momentum, first update, Nesterov; Adam decay, decoupled,
// AMSGrad; RMSprop weight decay, momentum, centered; Adagrad weight decay.
const FLAG_A: u32 = 4u;
const FLAG_B: u32 = 8u;
const FLAG_C: u32 = 16u;
const FLAG_D: u32 = 32u;

@group(0) @binding(0) var<storage, read_write> params: array<f32>;
@group(0) @binding(1) var<storage, read> grads: array<f32>;
@group(0) @binding(2) var<storage, read_write> s0: array<f32>;
@group(0) @binding(3) var<storage, read_write> s1: array<f32>;
@group(0) @binding(4) var<storage, read_write> s2: array<f32>;
// The compute copy, two 16-bit values a word.
@group(0) @binding(5) var<storage, read_write> copy_out: array<u32>;

fn on(flag: u32) -> bool {
    return (op.flags & flag) != 0u;
}

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// torch.lerp as PyTorch's CPU kernel computes it.
fn lerp_t(start: f32, end: f32, w: f32) -> f32 {
    if abs(w) < 0.5 {
        return fma(w, end - start, start);
    }
    return fma(w - 1.0, end - start, end);
}

// torch.maximum: NaN if either is NaN.
fn maximum(a: f32, b: f32) -> f32 {
    if is_nan(a) || is_nan(b) {
        return bitcast<f32>(0x7fc00000u);
    }
    return max(a, b);
}

// Element i updated; returns its new value.
fn update(i: u32) -> f32 {
    var p = params[i];
    var g = grads[i];
    if on(FLAG_UNSCALE) {
        g *= op.unscale;
    }
    if on(FLAG_CLIP) {
        g *= op.clip;
    }
    switch op.rule {
        case 0u: {
            // SGD: [weight_decay, momentum, 1 - dampening, -lr, first].
            if on(FLAG_A) {
                g = fma(p, op.f0, g);
            }
            if on(FLAG_B) {
                var buf = g;
                if !on(FLAG_C) {
                    buf = fma(g, op.f2, s0[i] * op.f1);
                }
                s0[i] = buf;
                if on(FLAG_D) {
                    g = fma(buf, op.f1, g);
                } else {
                    g = buf;
                }
            }
            p = fma(g, op.f3, p);
        }
        case 1u: {
            // Adam: [1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps, -lr/(1 - beta1^t),
            // decay].
            if on(FLAG_A) {
                if on(FLAG_B) {
                    p *= op.f6;
                } else {
                    g = fma(p, op.f6, g);
                }
            }
            let m = lerp_t(s0[i], g, op.f0);
            s0[i] = m;
            var v = fma(op.f2 * g, g, s1[i] * op.f1);
            s1[i] = v;
            if on(FLAG_C) {
                v = maximum(s2[i], v);
                s2[i] = v;
            }
            let denom = sqrt(v) / op.f3 + op.f4;
            p += (op.f5 * m) / denom;
        }
        case 2u: {
            // RMSprop: [weight_decay, alpha, 1 - alpha, eps, momentum, -lr]; states
            // square_avg, then momentum_buffer if any, then grad_avg if centered.
            if on(FLAG_A) {
                g = fma(p, op.f0, g);
            }
            let sq = fma(op.f2 * g, g, s0[i] * op.f1);
            s0[i] = sq;
            var avg = 0.0;
            if on(FLAG_C) {
                var ga = 0.0;
                if on(FLAG_B) {
                    ga = lerp_t(s2[i], g, op.f2);
                    s2[i] = ga;
                } else {
                    ga = lerp_t(s1[i], g, op.f2);
                    s1[i] = ga;
                }
                // An infinite average stays infinite (a fused multiply-add never makes
                // the square overflow; a driver may not fuse it).
                avg = select(sqrt(fma(-ga, ga, sq)), sq, sq == bitcast<f32>(0x7f800000u));
            } else {
                avg = sqrt(sq);
            }
            avg += op.f3;
            if on(FLAG_B) {
                let buf = s1[i] * op.f4 + g / avg;
                s1[i] = buf;
                p = fma(buf, op.f5, p);
            } else {
                p += (op.f5 * g) / avg;
            }
        }
        default: {
            // Adagrad: [weight_decay, eps, -lr/(1 + (t - 1)·lr_decay)].
            if on(FLAG_A) {
                g = fma(p, op.f0, g);
            }
            let sum = fma(g, g, s0[i]);
            s0[i] = sum;
            p += (op.f2 * g) / (sqrt(sum) + op.f1);
        }
    }
    params[i] = p;
    return p;
}

// f32 to bf16 bits, to nearest even (NaN stays NaN), as half::bf16::from_f32.
fn to_bf16(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    if is_nan(v) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// f32 to f16 bits, to nearest even (overflow to inf, NaN stays NaN, subnormals kept), as
// half::f16::from_f32, in integers so that no driver's conversion decides the rounding.
fn to_f16(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    let sign = (b >> 16u) & 0x8000u;
    let mag = b & 0x7fffffffu;
    if mag >= 0x7f800000u {
        return sign | 0x7c00u | select(0u, 0x200u | ((mag >> 13u) & 0x3ffu), mag > 0x7f800000u);
    }
    let e = i32(mag >> 23u) - 127;
    if e > 15 {
        return sign | 0x7c00u;
    }
    if e >= -14 {
        // Normal: drop 13 bits to nearest even; a carry may reach the exponent (and inf).
        let r = mag + 0xfffu + ((mag >> 13u) & 1u);
        let h = (r >> 13u) - (112u << 10u);
        return sign | min(h, 0x7c00u);
    }
    if e < -25 {
        return sign;
    }
    // Subnormal: the significand with its hidden bit, shifted to units of 2^-24.
    let m = (mag & 0x7fffffu) | 0x800000u;
    let shift = u32(-e - 1);
    let half_ulp = 1u << (shift - 1u);
    let q = m >> shift;
    let rest = m & ((1u << shift) - 1u);
    var h = q;
    if rest > half_ulp || (rest == half_ulp && (q & 1u) == 1u) {
        h += 1u;
    }
    return sign | h;
}

fn to_copy(v: f32) -> u32 {
    if op.copy == 1u {
        return to_bf16(v);
    }
    return to_f16(v);
}

// Two neighbouring elements a lane (so that a lane writes a whole word of the copy).
@compute @workgroup_size(WG)
fn optim_update(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let pair = group_index(wg, op.groups_x) * WG + lane.idx;
    let i = 2u * pair;
    if i >= op.n {
        return;
    }
    let a = update(i);
    var b = 0.0;
    let second = i + 1u < op.n;
    if second {
        b = update(i + 1u);
    }
    if op.copy != 0u {
        var word = to_copy(a);
        if second {
            word |= to_copy(b) << 16u;
        }
        copy_out[pair] = word;
    }
}
