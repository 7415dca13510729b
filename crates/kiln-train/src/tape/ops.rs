//! Each op of the [`Backend`] contract as the tape records it: what it reads, what its
//! backward needs saved, the value it writes, and then the op itself on the backend the
//! tape wraps.

use super::{key, Recorder, Tape};
use crate::backward::{Node, Read, Saved};
use kiln_core::{
    AttentionParams, Backend, DType, Device, Error, HostBytes, KernelTime, Pages, Result,
    RopeLayout, SampleParams, Shape, Tensor,
};
/// The output `t` of an op is recorded as a value with no gradient (ids, sampled tokens).
fn constant_output(rec: &mut Recorder, t: &Tensor) -> Result<()> {
    rec.write(t, false);
    Ok(())
}

impl Backend for Tape {
    fn device(&self) -> Device {
        self.inner.device()
    }

    fn describe(&self) -> String {
        format!("{} (recording)", self.inner.describe())
    }

    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        let t = self.inner.zeros(dtype, shape)?;
        // A new buffer may reuse a dropped one's address: it starts as a new value.
        self.record(|rec| constant_output(rec, &t))?;
        Ok(t)
    }

    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor> {
        let t = self.inner.upload(dtype, shape, data)?;
        self.record(|rec| constant_output(rec, &t))?;
        Ok(t)
    }

    fn download(&self, t: &Tensor) -> Result<Vec<u8>> {
        self.inner.download(t)
    }

    fn write(&self, t: &mut Tensor, data: &[u8]) -> Result<()> {
        self.record(|rec| constant_output(rec, t))?;
        self.inner.write(t, data)
    }

    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        self.record(|rec| constant_output(rec, t))?;
        self.inner.fill(t, value)
    }

    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
        self.matmul_recorded(x, w, out)?;
        let adapters = self.adapters();
        let Some(&i) = adapters.by_weight.get(&key(w)) else {
            return Ok(());
        };
        // out += scale · (x · Aᵀ) · Bᵀ, each step an op of the record.
        let ad = &adapters.list[i];
        let rank = ad.a.dims()[0];
        let mut low = self.zeros(DType::F32, Shape::new(vec![x.shape().rows(), rank])?)?;
        self.matmul_recorded(x, &ad.a, &mut low)?;
        let mut update = self.zeros(DType::F32, out.shape().clone())?;
        self.matmul_recorded(&low, &ad.b, &mut update)?;
        self.scale(&mut update, ad.scale)?;
        self.add_assign(out, &update)
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
        self.record(|rec| {
            let (tr, ir) = (rec.read(table), rec.read(ids));
            let grad = rec.needs(&tr);
            let ids = match grad {
                true => Some(rec.save(&ir, ids)?),
                false => None,
            };
            let out = rec.write(out, grad);
            if let Some(ids) = ids {
                rec.push(Node::Embedding {
                    table: tr,
                    ids,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.embedding(table, ids, out)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        let mut done = false;
        self.record(|rec| {
            let (xr, wr) = (rec.read(x), rec.read(weight));
            let grad = rec.needs(&xr) || rec.needs(&wr);
            if !grad {
                rec.write(out, false);
                return Ok(());
            }
            // Under 16-bit products the norm keeps its input and its rounded output from
            // its own pass where the backend has one (the products then read the copy).
            let kept = rec.rms_norm_saving((x, &xr), weight, eps, out)?;
            let sx = match kept {
                Some((sx, _)) => sx,
                None => rec.save(&xr, x)?,
            };
            let sw = rec.save(&wr, weight)?;
            let written = rec.write(out, grad);
            if let Some((_, rounded)) = kept {
                rec.note_rounded(written.id, rounded);
                done = true;
            }
            rec.push(Node::RmsNorm {
                x: xr,
                w: wr,
                eps,
                sx,
                sw,
                out: written,
            });
            Ok(())
        })?;
        match done {
            true => Ok(()),
            false => self.inner.rms_norm(x, weight, eps, out),
        }
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        self.record(|rec| {
            let (xr, wr, br) = (rec.read(x), rec.read(weight), rec.read(bias));
            let grad = rec.needs(&xr) || rec.needs(&wr) || rec.needs(&br);
            let saved = match grad {
                true => Some((rec.save(&xr, x)?, rec.save(&wr, weight)?)),
                false => None,
            };
            let out = rec.write(out, grad);
            if let Some((sx, sw)) = saved {
                rec.push(Node::LayerNorm {
                    x: xr,
                    w: wr,
                    b: br,
                    eps,
                    sx,
                    sw,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.layer_norm(x, weight, bias, eps, out)
    }

    fn softmax(&self, x: &mut Tensor) -> Result<()> {
        // Backward needs the output: recorded after the op runs.
        let mut st = self.state();
        if !st.recording {
            drop(st);
            return self.inner.softmax(x);
        }
        let xr = st.read(x);
        let grad = st.needs_grad(&xr);
        self.inner.softmax(x)?;
        let mut rec = Recorder {
            st: &mut st,
            tape: self,
        };
        let out = rec.write(x, grad);
        if grad {
            let y = rec.save(&Read::value(&out), x)?;
            rec.push(Node::Softmax { x: xr, y, out });
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        self.record(|rec| {
            let (xr, _, out) = rec.in_place(x, false)?;
            if out.grad {
                let (pr, fr) = (rec.read(pos), rec.read(inv_freq));
                let pos = rec.save(&pr, pos)?;
                let inv_freq = rec.save(&fr, inv_freq)?;
                rec.push(Node::Rope {
                    x: xr,
                    pos,
                    inv_freq,
                    layout,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.rope(x, pos, inv_freq, layout)
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        self.record(|rec| {
            let xr = rec.read(x);
            let broadcast = x.shape() != acc.shape();
            let ar = rec.read(acc);
            let grad = rec.needs(&ar) || rec.needs(&xr);
            let out = rec.write(acc, grad);
            if grad {
                rec.push(Node::Add {
                    acc: ar,
                    x: xr,
                    broadcast,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.add_assign(acc, x)
    }

    fn mul_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        self.record(|rec| {
            let (ar, xr) = (rec.read(acc), rec.read(x));
            let broadcast = x.shape() != acc.shape();
            let grad = rec.needs(&ar) || rec.needs(&xr);
            let saved = match grad {
                true => Some((rec.save(&ar, acc)?, rec.save(&xr, x)?)),
                false => None,
            };
            let out = rec.write(acc, grad);
            if let Some((sa, sx)) = saved {
                rec.push(Node::Mul {
                    acc: ar,
                    x: xr,
                    sa,
                    sx,
                    broadcast,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.mul_assign(acc, x)
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        self.record(|rec| {
            let (xr, _, out) = rec.in_place(x, false)?;
            if out.grad {
                rec.push(Node::Scale { x: xr, s, out });
            }
            Ok(())
        })?;
        self.inner.scale(x, s)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        let mut done = false;
        self.record(|rec| record_gated(rec, gate, up, false, out).map(|d| done = d))?;
        match done {
            true => Ok(()),
            false => self.inner.silu_mul(gate, up, out),
        }
    }

    fn gelu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        let mut done = false;
        self.record(|rec| record_gated(rec, gate, up, true, out).map(|d| done = d))?;
        match done {
            true => Ok(()),
            false => self.inner.gelu_mul(gate, up, out),
        }
    }

    fn gelu(&self, x: &mut Tensor) -> Result<()> {
        self.record(|rec| {
            let (xr, sx, out) = rec.in_place(x, true)?;
            if let Some(sx) = sx {
                rec.push(Node::Gelu { x: xr, sx, out });
            }
            Ok(())
        })?;
        self.inner.gelu(x)
    }

    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        // Backward needs the output: recorded after the op runs.
        let mut st = self.state();
        if !st.recording {
            drop(st);
            return self.inner.softcap(x, cap);
        }
        let xr = st.read(x);
        let grad = st.needs_grad(&xr);
        self.inner.softcap(x, cap)?;
        let mut rec = Recorder {
            st: &mut st,
            tape: self,
        };
        let out = rec.write(x, grad);
        if grad {
            let y = rec.save(&Read::value(&out), x)?;
            rec.push(Node::Softcap { x: xr, y, cap, out });
        }
        Ok(())
    }

    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
        self.record(|rec| {
            let (sr, dr) = (rec.read(src), rec.read(dst));
            let grad = rec.needs(&dr) || rec.needs(&sr);
            if grad && dst.dtype() != DType::F32 {
                // Backward reads the rows as written: rounded ones have no gradient here.
                return Err(Error::unsupported(format!(
                    "training through a {} KV cache (train over an F32 cache)",
                    dst.dtype()
                )));
            }
            let out = rec.write(dst, grad);
            if grad {
                let pr = rec.read(pos);
                let pos = rec.save(&pr, pos)?;
                rec.push(Node::WriteRows {
                    src: sr,
                    dst: dr,
                    pos,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.write_rows(src, dst, pos)
    }

    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
        self.record(|rec| {
            let sr = rec.read(src);
            let grad = rec.needs(&sr);
            let out = rec.write(dst, grad);
            if grad {
                rec.push(Node::SliceCols { src: sr, col0, out });
            }
            Ok(())
        })?;
        self.inner.slice_cols(src, col0, dst)
    }

    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.record(|rec| {
            let (qr, kr, vr) = (rec.read(q), rec.read(k_cache), rec.read(v_cache));
            let grad = rec.needs(&qr) || rec.needs(&kr) || rec.needs(&vr);
            let saved = match grad {
                true => {
                    let pr = rec.read(pos);
                    Some([
                        rec.save(&qr, q)?,
                        rec.save(&kr, k_cache)?,
                        rec.save(&vr, v_cache)?,
                        rec.save(&pr, pos)?,
                    ])
                }
                false => None,
            };
            let out = rec.write(out, grad);
            if let Some(saved) = saved {
                rec.push(Node::Attention {
                    q: qr,
                    k: kr,
                    v: vr,
                    saved,
                    params: *params,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.attention(q, k_cache, v_cache, pos, params, out)
    }

    fn paged_attention(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        pages: &Pages,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        let mut done = false;
        self.record(|rec| {
            let (qr, kr, vr) = (rec.read(q), rec.read(k_pool), rec.read(v_pool));
            let grad = rec.needs(&qr) || rec.needs(&kr) || rec.needs(&vr);
            let saved = match grad {
                true => {
                    let (pr, sr, tr) = (rec.read(pos), rec.read(pages.seq), rec.read(pages.tables));
                    // Kept as the backward's products read them (rounded under 16-bit
                    // products), as a matmul's input is.
                    Some([
                        rec.save_rounded(&qr, q)?,
                        rec.save_rounded(&kr, k_pool)?,
                        rec.save_rounded(&vr, v_pool)?,
                        rec.save(&pr, pos)?,
                        rec.save(&sr, pages.seq)?,
                        rec.save(&tr, pages.tables)?,
                    ])
                }
                false => None,
            };
            let written = rec.write(out, grad);
            if let Some(saved) = saved {
                // The forward over the kept operands, keeping what its backward uses.
                let kept = rec.attention_saving(
                    [q, k_pool, v_pool],
                    &saved,
                    pos,
                    pages,
                    params,
                    out,
                    written.id,
                )?;
                done = kept.is_some();
                rec.push(Node::PagedAttention {
                    q: qr,
                    k: kr,
                    v: vr,
                    saved,
                    kept,
                    runs: pages.runs.to_vec(),
                    block: pages.block,
                    params: *params,
                    out: written,
                });
            }
            Ok(())
        })?;
        if done {
            return Ok(());
        }
        self.inner
            .paged_attention(q, k_pool, v_pool, pos, pages, params, out)
    }

    fn argmax(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        self.record(|rec| constant_output(rec, out))?;
        self.inner.argmax(x, out)
    }

    fn sample(
        &self,
        logits: &mut Tensor,
        penalized: &[u32],
        params: &SampleParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.record(|rec| {
            // The repetition penalty may change the logits: they are no longer what
            // produced them.
            constant_output(rec, logits)?;
            constant_output(rec, out)
        })?;
        self.inner.sample(logits, penalized, params, out)
    }

    fn free_memory(&self) -> Result<Option<usize>> {
        self.inner.free_memory()
    }

    fn kernel_profile(&self) -> Option<Vec<KernelTime>> {
        self.inner.kernel_profile()
    }
}

fn record_gated(
    rec: &mut Recorder,
    gate: &Tensor,
    up: &Tensor,
    gelu: bool,
    out: &mut Tensor,
) -> Result<bool> {
    let (gr, ur) = (rec.read(gate), rec.read(up));
    let grad = rec.needs(&gr) || rec.needs(&ur);
    if !grad {
        rec.write(out, false);
        return Ok(false);
    }
    // Under 16-bit products gate and up are kept rounded (half an F32 copy's bytes, as
    // autocast keeps them), with the output's rounded copy for the down projection, from
    // the op's own pass where the backend has one.
    let fused = rec.gated_saving([(gate, &gr), (up, &ur)], gelu, out)?;
    let (sg, su) = match fused {
        Some([g, u, _]) => (Saved::Copy(g), Saved::Copy(u)),
        None => (rec.save_rounded(&gr, gate)?, rec.save_rounded(&ur, up)?),
    };
    let written = rec.write(out, true);
    if let Some([_, _, o]) = fused {
        rec.note_rounded(written.id, o);
    }
    rec.push(Node::Gated {
        gate: gr,
        up: ur,
        sg,
        su,
        gelu,
        out: written,
    });
    Ok(fused.is_some())
}
