use super::{BlockQ4_0, QK};
use half::f16;

/// ggml `quantize_row_q4_0_ref`: the value of largest magnitude (the first, on ties) maps
/// to -8, so the scale carries its sign.
pub(super) fn quantize_block(x: &[f32; QK]) -> BlockQ4_0 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        // `as i8` truncates toward zero like C's (int8_t) cast; the sum is always >= 0.5.
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
        *q = lo | (hi << 4);
    }
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs,
    }
}

pub(super) fn dequantize_block(b: &BlockQ4_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (j, &q) in b.qs.iter().enumerate() {
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}
