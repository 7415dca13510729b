use crate::{f32s, f32s_mut, indices};
use kiln_core::{Error, Result, RopeLayout, Tensor};

pub(crate) fn rope(
    x: &mut Tensor,
    pos: &Tensor,
    inv_freq: &Tensor,
    layout: RopeLayout,
) -> Result<()> {
    let &[tokens, heads, head_dim] = x.dims() else {
        return Err(Error::shape(format!(
            "rope takes [tokens, heads, head_dim], got {}",
            x.shape()
        )));
    };
    let freqs = f32s(inv_freq)?;
    let half = freqs.len();
    if 2 * half > head_dim {
        return Err(Error::shape(format!(
            "rope: {half} frequencies rotate {} dimensions, heads have {head_dim}",
            2 * half
        )));
    }
    let positions = indices(pos, tokens, usize::MAX, "rope positions", |p| {
        Error::shape(format!("rope: negative position {p}"))
    })?;
    let v = f32s_mut(x)?;
    let mut cos_sin = vec![(0f32, 0f32); half];
    for (t, &pos) in positions.iter().enumerate() {
        // Angles in f32 as transformers computes them; cos and sin in double then rounded.
        let pos = pos as f32;
        for (cs, &f) in cos_sin.iter_mut().zip(freqs) {
            let theta = (pos * f) as f64;
            *cs = (theta.cos() as f32, theta.sin() as f32);
        }
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            let head = &mut v[base..base + head_dim];
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = match layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
    Ok(())
}
