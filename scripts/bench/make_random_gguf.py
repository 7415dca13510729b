#!/usr/bin/env python3
"""Write a random-weight LLaMA GGUF of a real shape, for running kiln and llama.cpp side
by side on the same file: F16 (weights N(0, 0.02); quantize it with llama-quantize), or
Q4_K_M written directly as random Q4_K/Q6_K blocks (scales set so that weights are of
the F16 file's size), with llama.cpp's choice of tensor types for Q4_K_M: where
llama-quantize cannot be built, and in seconds rather than minutes for an 8B shape.

    python3 scripts/bench/make_random_gguf.py tinyllama-1.1b OUT.gguf [f16|q4_k_m]

Shapes as in ../shared/anchors.md. Needs numpy and the gguf package.
"""
import sys

import numpy as np
import gguf

SHAPES = {
    # vocab, dim, ffn, layers, heads, kv heads, rope theta, context
    "tinyllama-1.1b": (32000, 2048, 5632, 22, 32, 4, 10000.0, 2048),
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, 500000.0, 8192),
}


# Bytes of a block, and where its f16 scales sit with the values they are set to.
Q4_K = (144, [(0, 1.6e-4), (2, 6e-4)])  # d, dmin: 6-bit scales and mins are random
Q6_K = (210, [(208, 4e-5)])  # d: the 16 i8 scales are random


def blocks(rng, rows, cols, kind):
    """Random blocks of `kind` for a [rows, cols] tensor, as the uint8 rows gguf writes."""
    size, scales = kind
    pool = rng.integers(0, 256, (min(rows, 256), cols // 256, size), dtype=np.uint8)
    for at, value in scales:
        pool[:, :, at : at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return np.resize(pool.reshape(len(pool), -1), (rows, cols // 256 * size))


def more_bits(layer, layers):
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def main():
    name, out = sys.argv[1], sys.argv[2]
    quantized = (sys.argv[3] if len(sys.argv) > 3 else "f16") == "q4_k_m"
    vocab, dim, ffn, layers, heads, kv, theta, ctx = SHAPES[name]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(out, arch="llama")
    w.add_name(f"{name} (random weights)")
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(dim // heads)
    w.add_file_type(15 if quantized else 1)  # llama.cpp's MOSTLY_Q4_K_M, MOSTLY_F16
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"tok{i}" for i in range(vocab - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hd = dim // heads

    def mat(name, rows, cols, kind=Q4_K):
        if quantized:
            ty = gguf.GGMLQuantizationType.Q4_K if kind is Q4_K else gguf.GGMLQuantizationType.Q6_K
            w.add_tensor(name, blocks(rng, rows, cols, kind), raw_dtype=ty)
            return
        # One random pool of rows, tiled: writing GBs of fresh normals is slow, and
        # repetition does not change speed.
        pool = (rng.standard_normal((min(rows, 256), cols)) * 0.02).astype(np.float16)
        w.add_tensor(name, np.resize(pool, (rows, cols)))

    mat("token_embd.weight", vocab, dim)
    for i in range(layers):
        more = Q6_K if more_bits(i, layers) else Q4_K
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, np.float32))
        mat(f"blk.{i}.attn_q.weight", dim, dim)
        mat(f"blk.{i}.attn_k.weight", kv * hd, dim)
        mat(f"blk.{i}.attn_v.weight", kv * hd, dim, more)
        mat(f"blk.{i}.attn_output.weight", dim, dim)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, np.float32))
        mat(f"blk.{i}.ffn_gate.weight", ffn, dim)
        mat(f"blk.{i}.ffn_up.weight", ffn, dim)
        mat(f"blk.{i}.ffn_down.weight", dim, ffn, more)
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    mat("output.weight", vocab, dim, Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
