#!/usr/bin/env python3
"""Make tests/corpus/hostile: inputs beyond file headers that kiln must refuse cleanly (or
run, where they are valid): arguments, contexts too large for memory, model configs,
chat templates, tokenizers, and special files.

    python3 scripts/make_hostile_corpus.py       # rewrites tests/corpus/hostile

Each case is a directory holding case.json and the files of the case. The harness
(crates/kiln-cli/tests/hostile.rs) copies the case into a temporary directory (first the
directory named by "base", as model/, then the case's own files over it), makes the
copies of shared files ("copy": [source, destination] pairs), special
files ("fifo", or "dev-zero": a link to /dev/zero) at run time, runs
`kiln ARGS` there with "{tmp}" replaced by that directory, under a time and memory
limit, and checks the exit status, stderr and that no file changed.

case.json: args, expect ("error" or "ok"), cls, why; optional base, copy, remove (files
of the base left out), special, expect_any (either outcome, cleanly),
stdout_empty (nothing printed before the error), message (a substring of the error
line), max_stderr (bytes). Standard library only; output is deterministic.
"""
import json
import random
import shutil
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "corpus" / "hostile"
LLAMA_HF = "tests/fixtures/llama/hf"
LLAMA_CONFIG = json.loads((ROOT / LLAMA_HF / "config.json").read_text())

CASES = []


def case(name, args, expect, cls, why, files=None, **extra):
    CASES.append(dict(name=name, args=args, expect=expect, cls=cls, why=why, files=files or {}, **extra))


# --- a tiny GGUF writer (llama, f32 weights, SentencePiece-style vocabulary) -----------

def gstr(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def gvalue(v):
    """(type id, payload) of a Python value in GGUF's encoding."""
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return (4, struct.pack("<I", v)) if 0 <= v < 2**32 else (10, struct.pack("<Q", v % 2**64))
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, gstr(v)
    if isinstance(v, list):
        t, _ = gvalue(v[0])
        return 9, struct.pack("<IQ", t, len(v)) + b"".join(gvalue(x)[1] for x in v)
    raise TypeError(v)


def gguf_bytes(kvs, tensors):
    """kvs: dict; tensors: list of (name, shape as ggml ne, float list)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, v in kvs.items():
        t, payload = gvalue(v)
        out += gstr(k) + struct.pack("<I", t) + payload
    data, offset = b"", 0
    for name, ne, values in tensors:
        out += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        out += struct.pack("<IQ", 0, offset)
        raw = struct.pack(f"<{len(values)}f", *values)
        raw += b"\0" * (-len(raw) % 32)
        data += raw
        offset += len(raw)
    out += b"\0" * (-len(out) % 32)
    return out + data


def tiny_gguf(embed_rows=None, **overrides):
    """A one-layer llama of random f32 weights (dim 32, 4 heads, 2 KV heads), 128 positions;
    `overrides` replace or (with None) remove metadata keys; `embed_rows` makes the
    embedding smaller than the vocabulary."""
    rng = random.Random(7)
    dim, ffn, heads, kv_heads = 32, 64, 4, 2
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁", "▁the", "▁a", "▁of", "▁and", "▁to", "e", "t"]
    vocab = len(tokens)
    kvs = {
        "general.architecture": "llama",
        "general.name": "hostile-corpus tiny llama",
        "general.alignment": 32,
        "llama.context_length": 128,
        "llama.embedding_length": dim,
        "llama.block_count": 1,
        "llama.feed_forward_length": ffn,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(vocab - 259)],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (vocab - 259),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    for k, v in overrides.items():
        if v is None:
            kvs.pop(k, None)
        else:
            kvs[k] = v

    def w(rows, cols):
        return [rng.gauss(0, 0.1) for _ in range(rows * cols)]
    kvd = dim * kv_heads // heads
    rows = embed_rows or vocab
    tensors = [("token_embd.weight", [dim, rows], w(rows, dim)),
               ("blk.0.attn_norm.weight", [dim], [1.0] * dim),
               ("blk.0.attn_q.weight", [dim, dim], w(dim, dim)),
               ("blk.0.attn_k.weight", [dim, kvd], w(kvd, dim)),
               ("blk.0.attn_v.weight", [dim, kvd], w(kvd, dim)),
               ("blk.0.attn_output.weight", [dim, dim], w(dim, dim)),
               ("blk.0.ffn_norm.weight", [dim], [1.0] * dim),
               ("blk.0.ffn_gate.weight", [dim, ffn], w(ffn, dim)),
               ("blk.0.ffn_up.weight", [dim, ffn], w(ffn, dim)),
               ("blk.0.ffn_down.weight", [ffn, dim], w(dim, ffn)),
               ("output_norm.weight", [dim], [1.0] * dim)]
    return gguf_bytes(kvs, tensors)


def hf_config(**changes):
    c = dict(LLAMA_CONFIG)
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return json.dumps(c, indent=2) + "\n"


TINY = tiny_gguf()
RUN = ["run", "--device", "cpu", "-t", "1", "--temp", "0", "-n", "4"]
PROMPT = ["-p", "Permission is hereby granted"]
RUN_HF = RUN + ["-m", "{tmp}/model"] + PROMPT
RUN_GGUF = RUN + ["-m", "{tmp}/model.gguf"] + PROMPT


# --- arguments -------------------------------------------------------------------------

def argument_cases():
    case("bench_kernels_rows_zero", ["bench", "--kernels", "--rows", "0"], "error", "args",
         "an empty matrix: was a division by zero", message="--rows 0")
    case("bench_kernels_terabytes", ["bench", "--kernels", "--rows", "1000000", "--cols", "1000000"],
         "error", "args", "a 4 TB weight: was an abort in the allocator")
    case("bench_kernels_cols_not_blocks", ["bench", "--kernels", "--rows", "8", "--cols", "100"],
         "error", "args", "columns that quantized blocks cannot split", message="--cols 100")
    case("bench_prompt_too_long", ["bench", "-m", "{tmp}/model.gguf", "--device", "cpu", "-p", "3000000000",
                                   "-n", "0", "-r", "1"],
         "error", "args", "a prompt past what positions can address", files={"model.gguf": TINY})
    case("bench_kernels_billion_reps", ["bench", "--kernels", "-r", "1000000000"], "error", "args",
         "a billion repetitions: a run that never ends, and a table of a billion times", message="1000000000")
    case("bench_unknown_synthetic", ["bench", "--synthetic", "gpt5", "--device", "cpu"], "error", "args",
         "an unknown synthetic shape", message="--synthetic gpt5")
    case("ctx_wraps_u64", RUN + ["-c", "18446744073709551615"] + PROMPT, "error", "args",
         "a context that wrapped", stdout_empty=True, message="18446744073709551615")
    case("ctx_not_a_number", RUN + ["-c", "-5"] + PROMPT, "error", "args", "a negative context",
         stdout_empty=True)
    case("ctx_zero_is_the_models", RUN + ["-c", "0"] + PROMPT, "ok", "args",
         "0 means the model's own context")
    case("ctx_above_trained_warns", RUN + ["-m", "{tmp}/model.gguf", "-c", "200"] + PROMPT, "ok", "args",
         "above the 128 trained positions: a warning, as llama.cpp", files={"model.gguf": TINY},
         stderr_has="trained for")
    case("ctx_smaller_than_prompt", RUN + ["-c", "3", "-p", "Permission is hereby granted, free of charge"],
         "error", "args", "the prompt is not echoed before a context error", stdout_empty=True,
         message="--ctx-size 3")
    case("ctx_unknown_model_length", RUN + ["-m", "{tmp}/model.gguf", "-c", "0"] + PROMPT, "ok", "args",
         "a model that does not say its context: -c 0 is refused or a default is used",
         files={"model.gguf": tiny_gguf(**{"llama.context_length": None})}, expect_any=True)
    case("temp_negative", RUN + ["--temp", "-1"] + PROMPT, "error", "args", "clap's error, one line")
    case("top_p_above_one", RUN + ["--top-p", "2"] + PROMPT, "error", "args", "a probability above 1")
    case("threads_zero", ["run", "--device", "cpu", "-t", "0", "-n", "2"] + PROMPT, "error", "args",
         "no threads", message="-t 0")
    case("threads_huge", ["run", "--device", "cpu", "-t", "100000", "-n", "2"] + PROMPT, "error", "args",
         "100000 threads would take gigabytes of stacks", message="-t 100000")
    case("missing_model_file", RUN + ["-m", "{tmp}/absent.gguf"] + PROMPT, "error", "args",
         "a model path that does not exist")
    case("unknown_subcommand", ["frobnicate"], "error", "args", "clap's error, one line")
    case("empty_prompt", RUN + ["-m", "{tmp}/model.gguf", "-p", ""], "ok", "args",
         "an empty prompt still has BOS", files={"model.gguf": TINY})
    case("n_predict_zero", ["run", "--device", "cpu", "-n", "0"] + PROMPT, "ok", "args", "nothing to generate")
    text = (ROOT / "tests" / "fixtures" / "ppl.txt").read_text()
    ppl = ["perplexity", "--device", "cpu", "-t", "1"]
    case("perplexity_tiny_chunks_bounded_stderr", ppl + ["-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt", "-c", "4"],
         "ok", "args", "thousands of 4-token chunks: progress must not grow with their number",
         files={"model.gguf": TINY, "text.txt": text[:6000]}, max_stderr=4096)
    case("perplexity_ctx_too_small", ppl + ["-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt", "-c", "2"],
         "error", "args", "chunks of 2 tokens", files={"model.gguf": TINY, "text.txt": text[:2000]},
         message="--ctx-size 2")
    case("perplexity_text_too_short", ppl + ["-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt", "-c", "64"],
         "error", "args", "one prefix, not two", files={"model.gguf": TINY, "text.txt": "short"},
         message="needs at least 128")
    case("perplexity_not_utf8", ppl + ["-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt"], "error", "args",
         "invalid UTF-8", files={"model.gguf": TINY, "text.txt": b"abc\xff\xfe"})
    case("perplexity_chunks_zero", ppl + ["-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt", "--chunks", "0"],
         "error", "args", "zero chunks", files={"model.gguf": TINY, "text.txt": text[:2000]})


# --- memory ----------------------------------------------------------------------------

def memory_cases():
    case("ctx_hundred_million", RUN + ["-m", "{tmp}/model.gguf", "-c", "100000000"] + PROMPT, "error", "memory",
         "a KV cache of 12.8 GB asked on a 128-position model: refused with the largest context that fits "
         "(the harness limits address space to 1 GiB)", files={"model.gguf": TINY},
         stdout_empty=True, message="largest context that fits")
    case("ctx_max_i32_default_model", RUN + ["-c", "2147483647"] + PROMPT, "error", "memory",
         "the largest addressable context on the default model", stdout_empty=True,
         message="largest context that fits")
    case("perplexity_ctx_huge", ["perplexity", "--device", "cpu", "-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt",
                                 "-c", "100000000"], "error", "memory", "a chunk of 100M tokens",
         files={"model.gguf": TINY, "text.txt": "text " * 100})


# --- configs (validated in kiln-models' config code) ------------------------------------

def config_cases():
    hf = lambda name, why, **changes: case(  # noqa: E731
        f"config_{name}", RUN_HF, "error", "config", why, base=LLAMA_HF,
        files={"model/config.json": hf_config(**changes)})
    hf("partial_rotary_huge", "rope dims far above head_dim", partial_rotary_factor=1e9)
    hf("head_dim_huge", "a head_dim of 2^40", head_dim=2**40)
    hf("head_dim_wraps_q_dim", "heads x head_dim wraps to 0", head_dim=2**62)
    hf("rope_theta_negative", "rope_theta -1", rope_parameters={"rope_theta": -1.0, "rope_type": "default"})
    hf("rope_theta_zero", "rope_theta 0", rope_parameters={"rope_theta": 0.0, "rope_type": "default"})
    hf("rms_eps_negative", "rms_norm_eps -1", rms_norm_eps=-1.0)
    hf("llama3_factor_zero", "a llama3 rope factor of 0",
       rope_parameters={"rope_theta": 10000.0, "rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    hf("kv_heads_zero", "zero KV heads", num_key_value_heads=0)
    hf("kv_heads_not_dividing", "3 KV heads for 4 heads", num_key_value_heads=3)
    hf("vocab_negative", "a negative vocab_size is not 'missing'", vocab_size=-5)
    hf("vocab_string", "a vocab_size that is a string", vocab_size="384")
    hf("layers_million", "a million layers", num_hidden_layers=1000000)
    hf("max_positions_negative", "negative max_position_embeddings", max_position_embeddings=-1)
    gg = lambda name, why, **kvs: case(  # noqa: E731
        f"config_gguf_{name}", RUN_GGUF, "error", "config", why, files={"model.gguf": tiny_gguf(**kvs)})
    gg("rope_dims_huge", "rope.dimension_count far above head_dim", **{"llama.rope.dimension_count": 2**31})
    gg("key_length_huge", "attention.key_length 2^40", **{"llama.attention.key_length": 2**40})
    gg("freq_base_nan", "a NaN freq_base", **{"llama.rope.freq_base": float("nan")})
    gg("freq_base_negative", "a negative freq_base", **{"llama.rope.freq_base": -10000.0})
    gg("eps_negative", "a negative rms epsilon", **{"llama.attention.layer_norm_rms_epsilon": -1e-5})
    gg("kv_heads_zero", "zero KV heads", **{"llama.attention.head_count_kv": 0})
    gg("block_count_wrong_type", "block_count as a string is not 'missing'", **{"llama.block_count": "1"})


# --- chat templates ----------------------------------------------------------------------

def template_cases():
    def tpl(name, template, why, expect="error"):
        tc = json.loads((ROOT / LLAMA_HF / "tokenizer_config.json").read_text())
        tc["chat_template"] = template
        case(f"template_{name}", RUN + ["-m", "{tmp}/model", "--chat"] + PROMPT, expect, "template", why,
             base=LLAMA_HF, files={"model/tokenizer_config.json": json.dumps(tc, indent=2) + "\n"})
    tpl("valid", "{% set ns = namespace(n=0) %}{{ bos_token }}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "[{{ m.role }} {{ ns.n }}] {{ m.content ~ eos_token }}{% endfor %}",
        "a well-behaved template: renders in its limited child process and runs", expect="ok")
    tpl("nested_loops", "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
        "10^10 iterations: fuel must stop it")
    tpl("doubling", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}", "a string doubled 40 times")
    tpl("concat_chain", "{% set a = 'x' * 99999999 %}{% set b = a ~ a ~ a ~ a %}{{ (b ~ b ~ b) | length }}",
        "long strings joined by ~ outside any loop: 1.2 GB before any write")
    tpl("repeat", "{{ 'x' * 10000000000 }}", "a string repeated 10^10 times")
    tpl("syntax_error", "{% for %}", "a template that does not parse")
    case("template_jinja_file_without_chat", RUN_HF, "ok", "template",
         "chat_template.jinja is a valid small template; run without --chat must work",
         base=LLAMA_HF, files={"model/chat_template.jinja": "{{ messages[0].content }}"})


# --- tokenizers ----------------------------------------------------------------------------

def tokenizer_cases():
    tok = json.loads((ROOT / LLAMA_HF / "tokenizer.json").read_text())

    def with_id(new_id):
        t = json.loads(json.dumps(tok))
        t["model"]["vocab"]["▁hostile"] = new_id
        return json.dumps(t)
    case("tokenizer_id_near_2_32", RUN_HF, "error", "tokenizer", "one token id near 2^32: was a 96 GB table",
         base=LLAMA_HF, files={"model/tokenizer.json": with_id(4294967290)}, expect_any=True)
    case("tokenizer_id_60_million", RUN_HF, "error", "tokenizer", "one id of 60 million: was 1.4 GB",
         base=LLAMA_HF, files={"model/tokenizer.json": with_id(60_000_000)}, expect_any=True)
    case("tokenizer_json_not_json", RUN_HF, "error", "tokenizer", "tokenizer.json that is not JSON",
         base=LLAMA_HF, files={"model/tokenizer.json": "{\"model\": "})
    case("gguf_tokens_missing", RUN_GGUF, "error", "tokenizer", "a GGUF without its token list names the file",
         files={"model.gguf": tiny_gguf(**{"tokenizer.ggml.tokens": None})}, message="model.gguf")
    case("vocab_above_embedding", RUN + ["-m", "{tmp}/model.gguf", "-p", "the the the"], "error", "tokenizer",
         "tokens the embedding has no row for: an error, on its own line after any echoed prompt",
         files={"model.gguf": tiny_gguf(embed_rows=200)})
    case("gguf_bos_out_of_range", RUN_GGUF, "error", "tokenizer", "a BOS id outside the vocabulary",
         files={"model.gguf": tiny_gguf(**{"tokenizer.ggml.bos_token_id": 4000000000})})


# --- special files -----------------------------------------------------------------------

def special_cases():
    for name in ["config.json", "tokenizer.json", "model.safetensors"]:
        case(f"fifo_{name.replace('.', '_')}", RUN_HF, "error", "special", f"a FIFO as {name}: was a hang",
             base=LLAMA_HF, special=[{"path": f"model/{name}", "kind": "fifo"}])
    for name in ["config.json", "tokenizer.json", "tokenizer.model", "chat_template.jinja"]:
        # tokenizer.model is read only where there is no tokenizer.json.
        remove = ["model/tokenizer.json"] if name == "tokenizer.model" else []
        case(f"dev_zero_{name.replace('.', '_')}", RUN_HF, "error", "special",
             f"/dev/zero as {name}: was reading until memory ran out",
             base=LLAMA_HF, special=[{"path": f"model/{name}", "kind": "dev-zero"}], remove=remove)
    case("fifo_model_run", RUN + ["-m", "{tmp}/model.gguf"] + PROMPT, "error", "special", "a FIFO as -m",
         special=[{"path": "model.gguf", "kind": "fifo"}])
    case("fifo_model_info", ["info", "{tmp}/model.gguf"], "error", "special", "a FIFO given to info",
         special=[{"path": "model.gguf", "kind": "fifo"}])
    case("dev_zero_model", RUN + ["-m", "{tmp}/model.gguf"] + PROMPT, "error", "special", "/dev/zero as -m",
         special=[{"path": "model.gguf", "kind": "dev-zero"}])
    ppl = ["perplexity", "--device", "cpu", "-m", "{tmp}/model.gguf", "-f", "{tmp}/text.txt"]
    case("dev_zero_perplexity_text", ppl, "error", "special", "/dev/zero as the text",
         files={"model.gguf": TINY}, special=[{"path": "text.txt", "kind": "dev-zero"}])
    case("fifo_perplexity_text", ppl, "error", "special", "a FIFO as the text",
         files={"model.gguf": TINY}, special=[{"path": "text.txt", "kind": "fifo"}])


def main():
    argument_cases()
    memory_cases()
    config_cases()
    template_cases()
    tokenizer_cases()
    special_cases()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    shared = OUT / "tiny.gguf"
    shared.write_bytes(TINY)
    for c in CASES:
        d = OUT / c["name"]
        d.mkdir(parents=True)
        files = c.pop("files")
        # The valid tiny model is shared rather than copied into every case.
        copies = [[str(shared.relative_to(ROOT)), rel] for rel, v in files.items() if v == TINY]
        if copies:
            c["copy"] = copies
        for rel, content in ((r, v) for r, v in files.items() if v != TINY):
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, str):
                content = content.encode()
            p.write_bytes(content)
        meta = {k: v for k, v in c.items() if k != "name"}
        (d / "case.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(CASES)} cases in {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
