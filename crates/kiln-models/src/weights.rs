//! The tensors of a model, by role, whatever file they came from.

use kiln_core::Tensor;

pub struct Linear {
    pub w: Tensor,
    pub b: Option<Tensor>,
}

pub struct NormWeights {
    /// F32, with Gemma's `1 +` already folded in.
    pub w: Tensor,
    /// LayerNorm only.
    pub b: Option<Tensor>,
}

/// Attention input projections: one fused matrix (Phi-3, GPT-2) or three.
pub enum Qkv {
    Fused(Linear),
    Split { q: Linear, k: Linear, v: Linear },
}

pub enum FfnWeights {
    /// gate and up feed an activation product: fused in one matrix (Phi-3), or two.
    Gated { gate_up: GateUp, down: Linear },
    /// GPT-2: up, activation, down.
    Plain { up: Linear, down: Linear },
}

pub enum GateUp {
    /// Rows `0..ffn` are the gate, `ffn..2·ffn` the up projection.
    Fused(Linear),
    Split {
        gate: Linear,
        up: Linear,
    },
}

pub struct LayerWeights {
    pub attn_norm: NormWeights,
    pub qkv: Qkv,
    pub o: Linear,
    pub post_attn_norm: Option<NormWeights>,
    pub ffn_norm: NormWeights,
    pub ffn: FfnWeights,
    pub post_ffn_norm: Option<NormWeights>,
}

pub struct ModelWeights {
    pub embed: Tensor,
    /// Learned absolute positions (GPT-2).
    pub pos_embed: Option<Tensor>,
    pub layers: Vec<LayerWeights>,
    pub out_norm: NormWeights,
    /// `None` when the output projection is the embedding (tied).
    pub output: Option<Tensor>,
    /// Inverse rope frequencies, on the device.
    pub inv_freq: Option<Tensor>,
}

impl Linear {
    fn bytes(&self) -> usize {
        self.w.size_bytes() + self.b.as_ref().map_or(0, Tensor::size_bytes)
    }
}

impl NormWeights {
    fn bytes(&self) -> usize {
        self.w.size_bytes() + self.b.as_ref().map_or(0, Tensor::size_bytes)
    }
}

impl ModelWeights {
    /// Bytes a one-token step reads: every tensor but the embedding table, of which it
    /// reads one row (unless the output projection is the table). What bounds decode
    /// from below, at the device's bandwidth.
    pub fn decode_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let qkv = match &l.qkv {
                    Qkv::Fused(f) => f.bytes(),
                    Qkv::Split { q, k, v } => q.bytes() + k.bytes() + v.bytes(),
                };
                let ffn = match &l.ffn {
                    FfnWeights::Gated { gate_up, down } => {
                        down.bytes()
                            + match gate_up {
                                GateUp::Fused(f) => f.bytes(),
                                GateUp::Split { gate, up } => gate.bytes() + up.bytes(),
                            }
                    }
                    FfnWeights::Plain { up, down } => up.bytes() + down.bytes(),
                };
                let norms = [&l.post_attn_norm, &l.post_ffn_norm]
                    .into_iter()
                    .flatten()
                    .map(NormWeights::bytes)
                    .sum::<usize>();
                l.attn_norm.bytes() + l.ffn_norm.bytes() + norms + qkv + l.o.bytes() + ffn
            })
            .sum();
        let output = self.output.as_ref().unwrap_or(&self.embed).size_bytes();
        layers + self.out_norm.bytes() + output
    }
}
