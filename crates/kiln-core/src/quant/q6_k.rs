use super::{nearest_int, BlockQ6K, QK_K};
use half::f16;

/// Largest |x| below which ggml treats a group as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml `make_qx_quants` with `rmse_type = 1` and no importance weights: signed levels in
/// `-nmax..nmax`, stored offset by `nmax`; the scale is refined over 18 candidates by
/// weighted least squares (weight x²). Returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = quant(iscale, v);
        l_out[i] = (l + nmax) as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = quant(iscale, v);
            let w = v * v;
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l_out.iter_mut().zip(x) {
                *o = (nmax + quant(iscale, v)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml `quantize_row_q6_K_ref`.
pub(super) fn quantize_block(x: &[f32; QK_K]) -> BlockQ6K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for ib in 0..QK_K / 16 {
        let scale = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    let mut block: BlockQ6K = bytemuck::Zeroable::zeroed();
    if max_abs_scale < GROUP_MAX_EPS {
        return block;
    }
    let iscale = -128.0 / max_scale;
    block.d = f16::from_f32(1.0 / iscale);
    for (s, &scale) in block.scales.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * scale).min(127) as i8;
    }
    for j in 0..QK_K / 16 {
        let d = block.d.to_f32() * block.scales[j] as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    for h in 0..2 {
        let (l, ql, qh) = (
            &l[128 * h..128 * h + 128],
            &mut block.ql[64 * h..64 * h + 64],
            &mut block.qh[32 * h..32 * h + 32],
        );
        for i in 0..32 {
            let q = |k: usize| l[i + 32 * k] as u8;
            ql[i] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            ql[i + 32] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            qh[i] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    block
}

pub(super) fn dequantize_block(b: &BlockQ6K, y: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for h in 0..2 {
        let (ql, qh, sc) = (
            &b.ql[64 * h..64 * h + 64],
            &b.qh[32 * h..32 * h + 32],
            &b.scales[8 * h..8 * h + 8],
        );
        let out = &mut y[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * sc[is] as f32 * q1 as f32;
            out[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
            out[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
            out[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
        }
    }
}
