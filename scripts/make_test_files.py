#!/usr/bin/env python3
"""Make the small model files the tests and the README use, and the corpus of hostile
files every reader must reject cleanly.

    python3 scripts/make_test_files.py            # writes tests/data and tests/corpus

tests/data/tiny-llama.gguf is written by gguf-py (llama.cpp's own writer) so that kiln is
tested on a file it did not make. Safetensors files are written by hand from the format's
specification (an 8-byte header length, a JSON header, the data), which makes the hostile
variants easy to express. Output is deterministic (fixed seeds).
"""
import json
import os
import struct
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, quants

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
CORPUS = ROOT / "tests" / "corpus"


# --- valid files ---------------------------------------------------------------------

def tiny_llama_gguf(path):
    """A llama-shaped model of random weights (vocab 300, dim 256, 2 layers), in the mix of
    types llama-quantize's Q4_K_M produces, with the metadata llama.cpp expects."""
    rng = np.random.default_rng(0)
    vocab, dim, ffn, layers, heads, kv_heads = 300, 256, 512, 2, 4, 2
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("tiny-llama (random weights, kiln test data)")
    w.add_context_length(128)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"▁tok{i}" for i in range(vocab - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, shape, qtype):
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, x)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            # gguf-py cannot quantize the K formats: store random valid blocks.
            n_blocks = x.size // 256
            size = gguf.GGML_QUANT_SIZES[qtype][1]
            raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
            d = rng.uniform(0, 0.002, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
            if qtype == Q.Q4_K:
                raw[:, 0:4] = d
            else:
                raw[:, -2:] = d[:, 0:2]
            w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=qtype)
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, dim), Q.Q4_K)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (dim,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (dim, dim), Q.Q4_K)
        add(f"blk.{i}.attn_k.weight", (dim * kv_heads // heads, dim), Q.Q4_K)
        add(f"blk.{i}.attn_v.weight", (dim * kv_heads // heads, dim), Q.Q6_K)
        add(f"blk.{i}.attn_output.weight", (dim, dim), Q.Q4_K)
        add(f"blk.{i}.ffn_norm.weight", (dim,), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", (ffn, dim), Q.Q4_K)
        add(f"blk.{i}.ffn_up.weight", (ffn, dim), Q.Q4_K)
        add(f"blk.{i}.ffn_down.weight", (dim, ffn), Q.Q6_K)
    add("output_norm.weight", (dim,), Q.F32)
    add("output.weight", (vocab, dim), Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def safetensors_bytes(tensors, metadata=None, header_override=None):
    """tensors: list of (name, dtype string, shape, raw bytes)."""
    header, data, offset = {}, b"", 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    if header_override is not None:
        header = header_override(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text + data


def bf16_bytes(x):
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def tiny_hf_dir(path, sharded):
    rng = np.random.default_rng(1)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    t = lambda shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    tensors = [("model.embed_tokens.weight", "BF16", (64, 32), bf16_bytes(t((64, 32)))),
               ("model.norm.weight", "F32", (32,), np.ones(32, np.float32).tobytes()),
               ("model.layers.0.self_attn.q_proj.weight", "BF16", (32, 32), bf16_bytes(t((32, 32)))),
               ("model.layers.0.mlp.down_proj.weight", "F16", (32, 64), t((32, 64)).astype(np.float16).tobytes())]
    if not sharded:
        (path / "model.safetensors").write_bytes(safetensors_bytes(tensors, {"format": "pt"}))
        return
    shards = {"model-00001-of-00002.safetensors": tensors[:2], "model-00002-of-00002.safetensors": tensors[2:]}
    weight_map = {}
    for fname, ts in shards.items():
        (path / fname).write_bytes(safetensors_bytes(ts, {"format": "pt"}))
        weight_map.update({name: fname for name, *_ in ts})
    index = {"metadata": {"total_size": sum(len(r) for *_, r in tensors)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --- hostile GGUF files, byte by byte -------------------------------------------------

def s(text):
    b = text if isinstance(text, bytes) else text.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return s(key) + struct.pack("<I", vtype) + payload


def tinfo(name, dims, ttype, offset):
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<II", ttype, 0)[:4] + struct.pack("<Q", offset)


def gguf_file(kvs=(), tensors=(), data=b"", version=3, n_kv=None, n_tensors=None, align=32):
    head = b"GGUF" + struct.pack("<I", version)
    head += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    head += b"\0" * (-len(head) % align)
    return head + data


ARCH = kv("general.architecture", 8, s("llama"))
F32_4x8 = tinfo("w", [8, 4], 0, 0)  # 8 columns, 4 rows of f32 = 128 bytes
DATA_128 = bytes(range(128))


def hostile_gguf():
    valid = gguf_file([ARCH], [F32_4x8], DATA_128)
    cases = {
        "empty.gguf": b"",
        "bad_magic.gguf": b"GGML" + valid[4:],
        "text_file.gguf": b"this is not a model\n",
        "version_1.gguf": gguf_file([ARCH], [F32_4x8], DATA_128, version=1),
        "version_99.gguf": gguf_file([ARCH], [F32_4x8], DATA_128, version=99),
        "big_endian.gguf": b"GGUF" + struct.pack(">I", 3) + valid[8:],
        "truncated_in_header.gguf": valid[:13],
        "truncated_in_metadata.gguf": valid[:40],
        "truncated_in_tensor_info.gguf": valid[:len(gguf_file([ARCH], [], b"", align=1)) + 12],
        "truncated_in_data.gguf": valid[:-5],
        "huge_metadata_count.gguf": gguf_file([ARCH], [F32_4x8], DATA_128, n_kv=1 << 62),
        "huge_tensor_count.gguf": gguf_file([ARCH], [F32_4x8], DATA_128, n_tensors=(1 << 64) - 1),
        "huge_key_length.gguf": gguf_file([struct.pack("<Q", 1 << 60) + b"general"], [], b""),
        "huge_string_value.gguf": gguf_file([kv("general.name", 8, struct.pack("<Q", (1 << 63) + 9) + b"x")]),
        "huge_array_length.gguf": gguf_file([kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 1 << 61))]),
        "huge_u8_array.gguf": gguf_file([kv("x", 9, struct.pack("<IQ", 0, 1 << 40) + b"\0" * 64)]),
        "deeply_nested_arrays.gguf": gguf_file([kv("x", 9, struct.pack("<IQ", 9, 1) * 200 + struct.pack("<IQ", 0, 0))]),
        "unknown_value_type.gguf": gguf_file([kv("x", 13, b"\0" * 8)]),
        "unknown_array_type.gguf": gguf_file([kv("x", 9, struct.pack("<IQ", 77, 1) + b"\0" * 8)]),
        "invalid_bool.gguf": gguf_file([kv("x", 7, b"\x05")]),
        "invalid_utf8_key.gguf": gguf_file([kv("gen\xff".encode("latin-1"), 4, b"\1\0\0\0")]),
        "invalid_utf8_value.gguf": gguf_file([kv("general.name", 8, s(b"ab\xc3\x28cd"))]),
        "invalid_utf8_tensor_name.gguf": gguf_file([ARCH], [tinfo(b"w\xfe", [8, 4], 0, 0)], DATA_128),
        "duplicate_key.gguf": gguf_file([ARCH, ARCH]),
        "duplicate_tensor.gguf": gguf_file([ARCH], [F32_4x8, F32_4x8], DATA_128),
        "five_dimensions.gguf": gguf_file([ARCH], [tinfo("w", [2, 2, 2, 2, 2], 0, 0)], DATA_128),
        "dimension_overflow.gguf": gguf_file([ARCH], [tinfo("w", [1 << 32, 1 << 32, 1 << 8], 0, 0)], DATA_128),
        "dimension_product_over_int64.gguf": gguf_file([ARCH], [tinfo("w", [1 << 40, 1 << 30], 0, 0)], DATA_128),
        "unknown_tensor_type.gguf": gguf_file([ARCH], [tinfo("w", [8, 4], 4, 0)], DATA_128),
        "tensor_type_999.gguf": gguf_file([ARCH], [tinfo("w", [8, 4], 999, 0)], DATA_128),
        "offset_past_end.gguf": gguf_file([ARCH], [tinfo("w", [8, 4], 0, 1 << 20)], DATA_128),
        "offset_wraps_around.gguf": gguf_file([ARCH], [tinfo("w", [8, 4], 0, (1 << 64) - 32)], DATA_128),
        "size_past_end.gguf": gguf_file([ARCH], [tinfo("w", [8, 400], 0, 0)], DATA_128),
        "misaligned_offset.gguf": gguf_file([ARCH], [tinfo("w", [4, 4], 0, 4)], DATA_128),
        "overlapping_tensors.gguf": gguf_file([ARCH], [tinfo("a", [8, 4], 0, 0), tinfo("b", [8, 2], 0, 32)], DATA_128),
        "alignment_zero.gguf": gguf_file([ARCH, kv("general.alignment", 4, struct.pack("<I", 0))], [F32_4x8], DATA_128),
        "alignment_not_power_of_two.gguf": gguf_file([ARCH, kv("general.alignment", 4, struct.pack("<I", 48))], [F32_4x8], DATA_128, align=48),
        "alignment_wrong_type.gguf": gguf_file([ARCH, kv("general.alignment", 8, s("32"))], [F32_4x8], DATA_128),
        "block_row_mismatch.gguf": gguf_file([ARCH], [tinfo("w", [33, 1], 8, 0)], b"\0" * 64),
        "q4_k_row_of_100.gguf": gguf_file([ARCH], [tinfo("w", [100, 1], 12, 0)], b"\0" * 160),
    }
    return cases


def hostile_safetensors():
    good = [("w", "F32", (2, 4), np.arange(8, dtype=np.float32).tobytes())]
    cases = {
        "empty.safetensors": b"",
        "header_length_huge.safetensors": struct.pack("<Q", 1 << 60) + b"{}",
        "header_length_past_end.safetensors": struct.pack("<Q", 1000) + b'{"w":{}}',
        "header_not_json.safetensors": struct.pack("<Q", 8) + b"not json",
        "header_not_utf8.safetensors": struct.pack("<Q", 8) + b'{"\xff":1}  ',
        "offsets_past_end.safetensors": safetensors_bytes(good, header_override=lambda h: {
            "w": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 4096]}}),
        "offsets_reversed.safetensors": safetensors_bytes(good, header_override=lambda h: {
            "w": {"dtype": "F32", "shape": [2, 4], "data_offsets": [32, 0]}}),
        "shape_size_mismatch.safetensors": safetensors_bytes(good, header_override=lambda h: {
            "w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 32]}}),
        "shape_overflow.safetensors": safetensors_bytes(good, header_override=lambda h: {
            "w": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 32]}}),
        "overlapping.safetensors": safetensors_bytes(good, header_override=lambda h: {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [6], "data_offsets": [8, 32]}}),
        "unknown_dtype.safetensors": safetensors_bytes(good, header_override=lambda h: {
            "w": {"dtype": "F31", "shape": [2, 4], "data_offsets": [0, 32]}}),
        "truncated.safetensors": safetensors_bytes(good)[:-7],
    }
    return cases


def main():
    DATA.mkdir(parents=True, exist_ok=True)
    tiny_llama_gguf(str(DATA / "tiny-llama.gguf"))
    tiny_hf_dir(DATA / "tiny-hf", sharded=False)
    tiny_hf_dir(DATA / "tiny-hf-sharded", sharded=True)
    for sub, cases in (("gguf", hostile_gguf()), ("safetensors", hostile_safetensors())):
        d = CORPUS / sub
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():
            old.unlink()
        for name, data in cases.items():
            (d / name).write_bytes(data)
    print(f"wrote {DATA} and {CORPUS}")


if __name__ == "__main__":
    main()
