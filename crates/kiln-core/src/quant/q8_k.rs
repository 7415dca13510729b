use super::{nearest_int, BlockQ8K, QK_K};
use crate::{Error, Result};

/// ggml `quantize_row_q8_K_ref`: the activation side of K-format dot products.
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) -> Result<()> {
    if x.len() != out.len() * QK_K {
        return Err(Error::shape(format!(
            "{} values do not fill {} Q8_K blocks",
            x.len(),
            out.len()
        )));
    }
    for (x, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = bytemuck::Zeroable::zeroed();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, group) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = group.iter().map(|&q| q as i16).sum();
        }
        y.d = 1.0 / iscale;
    }
    Ok(())
}
