#!/usr/bin/env python3
"""Write a random-weight LLaMA GGUF of a real shape (F16, weights N(0, 0.02)), for running
kiln and llama.cpp side by side on the same file (quantize it with llama-quantize).

    python3 scripts/bench/make_random_gguf.py tinyllama-1.1b OUT.gguf

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


def main():
    name, out = sys.argv[1], sys.argv[2]
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
    w.add_file_type(1)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"tok{i}" for i in range(vocab - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hd = dim // heads

    def mat(rows, cols):
        # One random pool of rows, tiled: writing GBs of fresh normals is slow, and
        # repetition does not change speed.
        pool = (rng.standard_normal((min(rows, 256), cols)) * 0.02).astype(np.float16)
        return np.resize(pool, (rows, cols))

    w.add_tensor("token_embd.weight", mat(vocab, dim))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(dim, dim))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(kv * hd, dim))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(kv * hd, dim))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(dim, dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(ffn, dim))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(ffn, dim))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(dim, ffn))
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("output.weight", mat(vocab, dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
