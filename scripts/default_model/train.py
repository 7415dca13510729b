#!/usr/bin/env python3
"""Train kiln's embedded default model: a small LLaMA that has read the license texts
Debian ships in /usr/share/common-licenses.

    python3 scripts/default_model/train.py --texts DIR --out OUT [--steps N]

Run where PyTorch, transformers and sentencepiece are installed (the GPU machine; a CPU
works too, slowly). Writes:
  OUT/hf/            the trained model as a Hugging Face LLaMA directory (float32
                     safetensors, config.json, SentencePiece tokenizer)
  OUT/hf-untrained/  the same architecture at its random initialisation, for comparison
  OUT/train.json     settings, versions, losses
kiln's own converter then writes the GGUF (see scripts/default_model/README.md).

MPL-2.0 is held out of training: perplexity on it measures what the model learned.
Everything is seeded; the tokenizer is trained here on the training texts.
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

HELD_OUT = "MPL-2.0"
# Variants that repeat another file's text (GPL -> GPL-3 etc.) are skipped.
SKIP = {"GPL", "LGPL", "GFDL"}


def save_tokenizer(out, hf_dir):
    """The SentencePiece model as tokenizer.model, with a minimal tokenizer_config.json.
    (transformers 5's LlamaTokenizerFast(vocab_file=...) ignores the file, and its
    save_pretrained no longer writes tokenizer.model, so neither is used.)"""
    import shutil
    shutil.copy(out / "spm.model", hf_dir / "tokenizer.model")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()

    import sentencepiece as spm
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in Path(a.texts).iterdir() if p.is_file() and p.name not in SKIP)
    train_files = [p for p in files if p.name != HELD_OUT]
    train_text = "\n\n".join(p.read_text(errors="replace") for p in train_files)
    held_text = (Path(a.texts) / HELD_OUT).read_text(errors="replace")
    (out / "train.txt").write_text(train_text)

    spm.SentencePieceTrainer.train(
        input=str(out / "train.txt"), model_prefix=str(out / "spm"), vocab_size=1024,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        max_sentence_length=1 << 16, num_threads=4, minloglevel=2, seed_sentencepiece_size=100000)
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))

    def ids(text):
        return [1] + sp.encode(text)

    train_ids = torch.tensor(ids(train_text), dtype=torch.long)
    held_ids = torch.tensor(ids(held_text), dtype=torch.long)

    torch.manual_seed(0)
    random.seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out / "hf-untrained", safe_serialization=True)
    save_tokenizer(out, out / "hf-untrained")
    model.to(dev)

    def held_out_loss():
        model.eval()
        losses = []
        with torch.no_grad():
            for s in range(0, len(held_ids) - a.seq, a.seq):
                x = held_ids[s:s + a.seq + 1].to(dev)
                logits = model(x[None, :-1]).logits.float()
                losses.append(torch.nn.functional.cross_entropy(logits[0], x[1:]).item())
        model.train()
        return sum(losses) / len(losses)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps)))
    log = {"held_out_loss_init": held_out_loss(), "steps": []}
    start = time.time()
    n = len(train_ids) - a.seq - 1
    gen = torch.Generator().manual_seed(0)
    for step in range(a.steps):
        starts = torch.randint(0, n, (a.batch,), generator=gen)
        x = torch.stack([train_ids[s:s + a.seq + 1] for s in starts.tolist()]).to(dev)
        with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == a.steps - 1:
            entry = {"step": step, "train_loss": loss.item(), "held_out_loss": held_out_loss(),
                     "seconds": time.time() - start}
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
    model.to("cpu").float().save_pretrained(out / "hf", safe_serialization=True)
    save_tokenizer(out, out / "hf")
    log.update({"held_out_loss_final": log["steps"][-1]["held_out_loss"],
                "train_tokens": len(train_ids), "held_out_tokens": len(held_ids),
                "train_files": [p.name for p in train_files], "held_out": HELD_OUT,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                "args": vars(a)})
    (out / "train.json").write_text(json.dumps(log, indent=1))
    model.eval()
    prompt = "Permission is hereby granted"
    x = torch.tensor([ids(prompt)])
    with torch.no_grad():
        g = model.generate(x, max_new_tokens=40, do_sample=False)
    print("sample:", sp.decode(g[0, 1:].tolist()))


if __name__ == "__main__":
    main()
