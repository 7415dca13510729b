//! A model's tensors by name, for training (its parameters and their gradients) and for
//! writing the model back out. Names are GGUF's (llama.cpp's), whatever file the model
//! came from; the rope frequencies are not parameters.

use crate::model::Model;
use crate::weights::{FfnWeights, GateUp, LayerWeights, Linear, ModelWeights, NormWeights, Qkv};
use kiln_core::Tensor;

/// Defines `$name(weights) -> Vec<(String, &[mut] Tensor)>`: every parameter, in one fixed
/// order. The body is written once; match ergonomics make it serve both borrows.
macro_rules! parameter_list {
    ($name:ident, $($mut:ident)?) => {
        fn $name(w: &$($mut)? ModelWeights) -> Vec<(String, &$($mut)? Tensor)> {
            type Out<'a> = Vec<(String, &'a $($mut)? Tensor)>;
            fn linear<'a>(out: &mut Out<'a>, name: &str, l: &'a $($mut)? Linear) {
                let Linear { w, b } = l;
                out.push((format!("{name}.weight"), w));
                if let Some(b) = b {
                    out.push((format!("{name}.bias"), b));
                }
            }
            fn norm<'a>(out: &mut Out<'a>, name: &str, n: &'a $($mut)? NormWeights) {
                let NormWeights { w, b } = n;
                out.push((format!("{name}.weight"), w));
                if let Some(b) = b {
                    out.push((format!("{name}.bias"), b));
                }
            }
            let ModelWeights { embed, pos_embed, layers, out_norm, output, inv_freq: _ } = w;
            let mut out: Out = vec![("token_embd.weight".into(), embed)];
            if let Some(pe) = pos_embed {
                out.push(("position_embd.weight".into(), pe));
            }
            for (l, lw) in layers.into_iter().enumerate() {
                let blk = |n: &str| format!("blk.{l}.{n}");
                let LayerWeights { attn_norm, qkv, o, post_attn_norm, ffn_norm, ffn, post_ffn_norm } = lw;
                norm(&mut out, &blk("attn_norm"), attn_norm);
                match qkv {
                    Qkv::Fused(qkv) => linear(&mut out, &blk("attn_qkv"), qkv),
                    Qkv::Split { q, k, v } => {
                        linear(&mut out, &blk("attn_q"), q);
                        linear(&mut out, &blk("attn_k"), k);
                        linear(&mut out, &blk("attn_v"), v);
                    }
                }
                linear(&mut out, &blk("attn_output"), o);
                if let Some(n) = post_attn_norm {
                    norm(&mut out, &blk("post_attention_norm"), n);
                }
                norm(&mut out, &blk("ffn_norm"), ffn_norm);
                match ffn {
                    FfnWeights::Gated { gate_up, down } => {
                        match gate_up {
                            // Phi-3's fused gate+up is stored as ffn_up with twice the rows.
                            GateUp::Fused(gu) => linear(&mut out, &blk("ffn_up"), gu),
                            GateUp::Split { gate, up } => {
                                linear(&mut out, &blk("ffn_gate"), gate);
                                linear(&mut out, &blk("ffn_up"), up);
                            }
                        }
                        linear(&mut out, &blk("ffn_down"), down);
                    }
                    FfnWeights::Plain { up, down } => {
                        linear(&mut out, &blk("ffn_up"), up);
                        linear(&mut out, &blk("ffn_down"), down);
                    }
                }
                if let Some(n) = post_ffn_norm {
                    norm(&mut out, &blk("post_ffw_norm"), n);
                }
            }
            norm(&mut out, "output_norm", out_norm);
            if let Some(o) = output {
                out.push(("output.weight".into(), o));
            }
            out
        }
    };
}

parameter_list!(list,);
parameter_list!(list_mut, mut);

impl Model {
    /// Every parameter with its GGUF name, in a fixed order (the embeddings first, then
    /// each layer, then the output norm and projection). Tied embeddings appear once.
    pub fn parameters(&self) -> Vec<(String, &Tensor)> {
        list(self.weights())
    }

    /// [`Model::parameters`], writable: the optimizer's updates go back through these.
    pub fn parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        list_mut(self.weights_mut())
    }
}
