#!/usr/bin/env python3
"""Regenerates the tokenizer fixtures next to this script.

Needs `pip install sentencepiece tokenizers gguf`. Writes:
  hf_spm/tokenizer.model (+ tokenizer_config.json)  SentencePiece BPE, byte fallback
  hf_spm_json/tokenizer.json  that model converted as transformers' LlamaConverter does
  hf_uni/tokenizer.model (+ tokenizer_config.json)  SentencePiece unigram, byte fallback
  llama.gguf   the BPE model's vocabulary as llama.cpp's converter writes it
  hf_bpe/tokenizer.json (+ tokenizer_config.json)  byte-level BPE, GPT-2 pre-tokenizer
  bpe.gguf     that vocabulary as a GGUF "gpt2" tokenizer (tokenizer.ggml.pre "gpt-2")
  hf_llama3/, llama3.gguf  the same with llama-3's pre-tokenizer and ignore_merges
  hf_qwen2/, qwen2.gguf    the same with Qwen2's pre-tokenizer
  expected.json  ids from the Python libraries for each test string
"""
import io
import json
import os

import gguf
import numpy as np
import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

# Training text: varied enough that merges cover words, numbers, accents and a few
# non-Latin scripts, small enough that many rare characters still need byte fallback.
CORPUS = """
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
Hello world! Hello, tokenizer. Tokenizers split text into tokens, and tokens into ids.
It's a small model, but it's ours. We'll see what they're doing; I'd say you've won.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 365 1024 2048 31415926 2718281828 1234567890.
In 1999 there were 12 apples, 7 oranges and 3.14159 pies on 2024-05-17 at 10:30.
Café au lait, naïve résumé, façade, jalapeño, über, São Paulo, Zürich, Ångström.
Ελληνικά: η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.
Русский текст: быстрая лиса прыгает через ленивую собаку.
中文：敏捷的棕色狐狸跳过了懒狗。日本語：速い茶色の狐が怠け者の犬を飛び越える。
Emoji are fun 🙂 👍 🎉 and code is too: fn main() { println!("hi"); }
def f(x):\n    return x * 2  # doubled
    indented line with four spaces
\tTabbed line\twith\ttabs
Multiple   spaces   between   words   here.
Line one
Line two

Paragraph after a blank line.
"""
CORPUS = "\n".join([CORPUS] * 3 + [CORPUS.upper(), CORPUS.lower()])

TESTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading, two trailing  ",
    "runs    of     spaces",
    "line one\nline two\n\nline four\n",
    "\ttabs\tand\t\tmore tabs",
    "digits 1234567890123456789 and 3.14159",
    "café naïve résumé",
    "Ελληνικά κείμενα",
    "中文字符和日本語のテキスト",
    "emoji 🙂👍🏽 done",
    "It's we'll they're I'd",
    "mixed: 42 cafés, 🙂, \t\n  end",
    "x",
    " ",
    "\n",
    "<s> and </s> as plain text",
    "IT'S WE'LL They'Re",
    "windows\r\nline endings\r\n",
    "numbers 12 123 1234 12345 123456 1234567",
    "   ",
    "a\u00a0b non-breaking space",
]



def random_tests(n, seed=7):
    """Random mixes of words, whitespace runs, digits, punctuation and scripts: they probe
    merge order and pre-tokenizer corners the hand-picked strings miss."""
    import random
    rng = random.Random(seed)
    words = CORPUS.split()
    extras = [" ", "  ", "   ", "\n", "\t", "\r\n", "'s", "'LL", "0", "42", "31415", "é", "ï", "Ω",
              "中", "語", "🙂", "👍🏽", "!", "...", "\"", "(", ")", "-", "_", "ab", "\u00a0", "\u2581"]
    out = []
    for _ in range(n):
        parts = [rng.choice(words) if rng.random() < 0.5 else rng.choice(extras)
                 for _ in range(rng.randint(1, 12))]
        out.append("".join(p if rng.random() < 0.6 else " " + p for p in parts))
    return out


TESTS += random_tests(40)

# Regexes of llama.cpp's byte-level pre-tokenizers (llama-vocab.cpp), for the
# tokenizer.json variants that use them.
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def train_spm(kind, vocab_size):
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split("\n")),
        model_writer=out,
        model_type=kind,
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.9995,
        # Llama's settings: no normalisation, spaces kept as they are.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return out.getvalue()


def write_dir(name, files):
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    for fname, data in files.items():
        mode = "wb" if isinstance(data, bytes) else "w"
        with open(os.path.join(d, fname), mode) as f:
            f.write(data)


def spm_gguf(sp, path):
    """The vocabulary as llama.cpp's convert_hf_to_gguf.py `_create_vocab_sentencepiece`."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            t = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            t = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            t = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            t = gguf.TokenType.BYTE
        else:
            t = gguf.TokenType.NORMAL
        types.append(t)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spm_expected(sp):
    # transformers' LlamaTokenizer: BOS, then the SentencePiece ids.
    return [[sp.bos_id()] + sp.encode(s) for s in TESTS]


def spm_to_json(sp):
    """The SentencePiece BPE model as a Llama-style tokenizer.json, the way transformers'
    LlamaConverter builds one: merges recovered from the vocabulary, byte fallback, a
    "<s> $A" post-processor."""
    from tokenizers import AddedToken, normalizers, processors
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((pid, vocab[left], vocab[right], left, right))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token="<unk>",
                     fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ("<unk>", "<s>", "</s>")])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def train_bpe(pattern=None, ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n"), trainer)
    return tok


def bpe_gguf(tok, path, pre):
    """The vocabulary as llama.cpp's converter writes a GPT-2 style BPE."""
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    added = {a["id"] for a in json.loads(tok.to_str())["added_tokens"]}
    types = [gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    eot = vocab["<|endoftext|>"]
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "chat_template": "{{ messages }}"}
    expected = {"tests": TESTS}

    bpe_model = train_spm("bpe", 1000)
    write_dir("hf_spm", {"tokenizer.model": bpe_model, "tokenizer_config.json": json.dumps(config, indent=1)})
    sp = spm.SentencePieceProcessor(model_proto=bpe_model)
    spm_gguf(sp, os.path.join(HERE, "llama.gguf"))
    expected["spm_bpe"] = spm_expected(sp)

    spm_json = spm_to_json(sp)
    write_dir("hf_spm_json", {"tokenizer.json": spm_json.to_str(pretty=False),
                              "tokenizer_config.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>"})})
    expected["spm_json"] = [spm_json.encode(s, add_special_tokens=True).ids for s in TESTS]

    uni_model = train_spm("unigram", 1000)
    write_dir("hf_uni", {"tokenizer.model": uni_model, "tokenizer_config.json": json.dumps(config, indent=1)})
    expected["spm_unigram"] = spm_expected(spm.SentencePieceProcessor(model_proto=uni_model))

    for name, pre, pattern, ignore_merges in [
        ("bpe", "gpt-2", None, False),
        ("llama3", "llama-bpe", LLAMA3, True),
        ("qwen2", "qwen2", QWEN2, False),
    ]:
        tok = train_bpe(pattern, ignore_merges)
        write_dir("hf_" + name, {"tokenizer.json": tok.to_str(pretty=False),
                                 "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"})})
        bpe_gguf(tok, os.path.join(HERE, name + ".gguf"), pre)
        expected[name] = [tok.encode(s, add_special_tokens=True).ids for s in TESTS]

    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    main()
