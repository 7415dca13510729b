use super::{BlockQ8_0, QK};
use half::f16;

/// ggml `quantize_row_q8_0_ref`: scale = absmax / 127, values rounded half away from zero.
pub(super) fn quantize_block(x: &[f32; QK]) -> BlockQ8_0 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

pub(super) fn dequantize_block(b: &BlockQ8_0, y: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (o, &q) in y.iter_mut().zip(&b.qs) {
        *o = q as f32 * d;
    }
}
