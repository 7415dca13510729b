// What a product's result becomes, shared by the matrix-vector kernels (matvec.wgsl,
// matvec_q8.wgsl).

@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> aux: array<f32>;

// What a result becomes (wp.p10): 0 the output, 1 added to it (a projection feeding the
// residual stream), 2 silu(aux)·result and 3 gelu(aux)·result (the gated feed-forward's
// up projection, `aux` holding the gate's).
fn store(i: u32, v: f32) {
    switch wp.p10 {
        case 1u: { out[i] += v; }
        case 2u: {
            let g = aux[i];
            out[i] = g / (1.0 + exp(-g)) * v;
        }
        case 3u: { out[i] = gelu_tanh(aux[i]) * v; }
        default: { out[i] = v; }
    }
}
