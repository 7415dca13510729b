#!/usr/bin/env python3
"""Cross-checks between kiln and the `gguf` Python package (gguf-py, llama.cpp's own).

Run by kiln-io's `gguf_py` integration test, in both directions:

  write OUT.gguf OUT.json [--seed N]
      gguf-py writes a GGUF with metadata of every value type and tensors of every type
      kiln computes with (quantized by gguf-py where it can quantize, random valid blocks
      where it cannot). OUT.json records each metadata value and gguf-py's dequantization
      of each tensor (float32 bytes, hex), for kiln to compare with its own.

  check IN.gguf IN.json
      gguf-py reads a GGUF that kiln wrote: metadata must equal IN.json; each quantized
      tensor `T.<type>` must dequantize (gguf-py) to exactly kiln's `deq.<type>`; and for the
      types gguf-py can quantize, gguf-py's quantization of `src` must equal kiln's bytes.
"""
import argparse
import json
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V
from gguf import quants

TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
         "q4_K": Q.Q4_K, "q6_K": Q.Q6_K}
# gguf-py quantizes these; the K types it only dequantizes.
PY_QUANTIZES = ["f16", "bf16", "q8_0", "q4_0"]
# Formats kiln only decodes (expanding them to f32 at load): random valid blocks.
EXPANDED = {"q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q5_K": Q.Q5_K}

SCALARS = [
    ("test.u8", V.UINT8, 200), ("test.i8", V.INT8, -100), ("test.u16", V.UINT16, 60000),
    ("test.i16", V.INT16, -30000), ("test.u32", V.UINT32, 4000000000),
    ("test.i32", V.INT32, -2000000000), ("test.f32", V.FLOAT32, 0.1),
    ("test.bool", V.BOOL, True), ("test.string", V.STRING, "héllo wörld 🙂\nline two"),
    ("test.u64", V.UINT64, 2**63 + 5), ("test.i64", V.INT64, -(2**62)), ("test.f64", V.FLOAT64, 1e-300),
]
ARRAYS = [
    ("test.arr_i32", V.INT32, [1, -2, 3, 2**31 - 1]),
    ("test.arr_f32", V.FLOAT32, [0.5, -1.25, 3e38]),
    ("test.arr_str", V.STRING, ["a", "", "ü", "<0x0A>", "日本語"]),
    ("test.arr_bool", V.BOOL, [True, False, True]),
    ("test.arr_u8", V.UINT8, list(range(0, 256, 17))),
]
VNAME = {V.UINT8: "u8", V.INT8: "i8", V.UINT16: "u16", V.INT16: "i16", V.UINT32: "u32",
         V.INT32: "i32", V.FLOAT32: "f32", V.BOOL: "bool", V.STRING: "string", V.UINT64: "u64",
         V.INT64: "i64", V.FLOAT64: "f64", V.ARRAY: "array"}


def f32_hex(a: np.ndarray) -> str:
    return np.ascontiguousarray(a, dtype="<f4").tobytes().hex()


def random_k_blocks(rng, qtype, n_blocks):
    """Random bytes with finite f16 scales in the places the format keeps them."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # d at the end
        raw[:, -2:] = scales[:, 0:2]
    elif qtype == Q.Q5_0:  # d only
        raw[:, 0:2] = scales[:, 0:2]
    else:  # Q4_K, Q5_K, Q4_1, Q5_1: two f16 at the start
        raw[:, 0:4] = scales
    return raw


def cmd_write(out_gguf, out_json, seed):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out_gguf, arch="llama")
    meta = {"general.architecture": {"type": "string", "value": "llama"}}
    for key, vt, val in SCALARS:
        w.add_key_value(key, val, vt)
        meta[key] = {"type": VNAME[vt], "value": val}
    for key, vt, val in ARRAYS:
        w.add_key_value(key, val, V.ARRAY, sub_type=vt)
        meta[key] = {"type": "array", "element": VNAME[vt], "value": val}

    src = (rng.standard_normal((3, 512)) * 0.7).astype(np.float32)
    src[1, 5] = 0.0
    src[2, 32:64] = 0.0  # an all-zero block
    w.add_tensor("src", src)
    tensors = {"src": {"type": "f32", "shape": [3, 512], "values": f32_hex(src)}}
    for name, qt in TYPES.items():
        if name == "f32":
            continue
        if name in PY_QUANTIZES:
            data = quants.quantize(src, qt)
        else:
            data = random_k_blocks(rng, qt, 3 * 512 // 256).reshape(3, -1)
        w.add_tensor(f"t.{name}", data, raw_dtype=qt)
        deq = quants.dequantize(data, qt)
        tensors[f"t.{name}"] = {"type": name, "shape": [3, 512], "values": f32_hex(deq)}
    for name, qt in EXPANDED.items():
        block = gguf.GGML_QUANT_SIZES[qt][0]
        data = random_k_blocks(rng, qt, 3 * 512 // block).reshape(3, -1)
        w.add_tensor(f"x.{name}", data, raw_dtype=qt)
        tensors[f"x.{name}"] = {"type": name, "shape": [3, 512], "values": f32_hex(quants.dequantize(data, qt))}
    cube = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w.add_tensor("cube", cube)
    tensors["cube"] = {"type": "f32", "shape": [2, 3, 64], "values": f32_hex(cube)}

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(out_json, "w") as f:
        json.dump({"metadata": meta, "tensors": tensors, "py_quantizes": PY_QUANTIZES}, f)


def same(expect, got, vtype):
    if vtype == "f32":
        return np.float32(expect) == np.float32(got)
    return expect == got


def cmd_check(in_gguf, in_json):
    expect = json.load(open(in_json))
    r = gguf.GGUFReader(in_gguf)
    failures, checks = [], 0
    for key, e in expect["metadata"].items():
        field = r.get_field(key)
        if field is None:
            failures.append(f"metadata {key}: missing")
            continue
        got = field.contents()
        vtype = e.get("element", e["type"])
        if e["type"] == "array":
            ok = len(got) == len(e["value"]) and all(same(a, b, vtype) for a, b in zip(e["value"], got))
        else:
            ok = same(e["value"], got, vtype)
        checks += 1
        if not ok:
            failures.append(f"metadata {key}: expected {e['value']!r}, gguf-py read {got!r}")

    tensors = {t.name: t for t in r.tensors}
    src = tensors["src"]
    src_values = np.array(src.data, dtype=np.float32).reshape(-1, int(src.shape[0]))
    for name in TYPES:
        if name == "f32":
            continue
        t, deq = tensors.get(f"t.{name}"), tensors.get(f"deq.{name}")
        if t is None or deq is None:
            failures.append(f"tensor t.{name} or deq.{name}: missing")
            continue
        if t.tensor_type != TYPES[name]:
            failures.append(f"tensor t.{name}: gguf-py read type {t.tensor_type.name}")
            continue
        py = quants.dequantize(np.array(t.data), TYPES[name]).reshape(-1)
        kiln = np.array(deq.data, dtype=np.float32).reshape(-1)
        checks += 1
        if py.view(np.uint32).tobytes() != kiln.view(np.uint32).tobytes():
            bad = int(np.flatnonzero(py.view(np.uint32) != kiln.view(np.uint32))[0])
            failures.append(f"dequantize {name}: element {bad}: gguf-py {py[bad]!r}, kiln {kiln[bad]!r}")
        if name in PY_QUANTIZES:
            py_q = quants.quantize(src_values, TYPES[name]).tobytes()
            checks += 1
            if py_q != np.array(t.data).tobytes():
                kb = np.array(t.data).tobytes()
                bad = next(i for i in range(min(len(kb), len(py_q))) if kb[i] != py_q[i])
                failures.append(f"quantize {name}: byte {bad} differs (gguf-py {py_q[bad]}, kiln {kb[bad]})")
    for f in failures:
        print("MISMATCH", f)
    print(f"gguf-py cross-check: {checks - len(failures)} of {checks} checks agree")
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pw = sub.add_parser("write")
    pw.add_argument("gguf")
    pw.add_argument("json")
    pw.add_argument("--seed", type=int, default=0)
    pc = sub.add_parser("check")
    pc.add_argument("gguf")
    pc.add_argument("json")
    a = p.parse_args()
    if a.cmd == "write":
        cmd_write(a.gguf, a.json, a.seed)
        return 0
    return cmd_check(a.gguf, a.json)


if __name__ == "__main__":
    sys.exit(main())
