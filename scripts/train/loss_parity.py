#!/usr/bin/env python3
"""Issue 18's loss check: kiln and PyTorch training the 134M LLaMA shape from the same
initial weights over the same windows of the same tokens, their losses step by step.

    python3 scripts/train/loss_parity.py KILN WORK [--steps 200] [--batch 16]
        [--seq-len 1024] [--precision bf16] [--lr 6e-4] [--seed 7] [--text-mb 8]

1. Text, offline: the Python sources of the installed transformers package, joined into
   WORK/train.txt (--text-mb of it) and WORK/held.txt (the next 5%).
2. A byte-level BPE tokenizer of 32,000 words trained on it (the `tokenizers` library),
   no BOS added (tokenizer_config.json says so), so both sides tokenize the file as one
   document with `encode(text, add_special_tokens=False)`.
3. transformers' LlamaForCausalLM of the issue's shape (dim 768, 12 layers, 12 heads, FFN
   2048, vocabulary 32,000, tied embeddings), initialised under torch.manual_seed(seed),
   saved with the tokenizer as WORK/init (F32 safetensors).
4. `kiln train --from WORK/init` (a full fine-tune: AdamW β 0.9/0.95, weight decay 0.1,
   clipping at 1, cosine with warm-up, the precision's products) for --steps steps. Its
   WORK/out/train.json gives every step's loss and learning rate, and the data's
   fingerprint (FNV-1a over the token ids), which this script checks against its own
   tokenization before replaying anything.
5. PyTorch from the same weights over the same windows: kiln draws each step's window
   starts from SplitMix64(seed) (`crates/kiln-train/src/rng.rs`, `Trainer::step`: `below(
   len(train) - seq_len)` for each sequence), replayed here; AdamW (fused) with kiln's
   learning rate of each step, clipping, BF16 autocast over F32 weights (no autocast and
   no TF32 for --precision f32), SDPA attention.

Prints both curves side by side every 10 steps, then the differences. "Within noise": the
two curves' 10-step means differ by at most twice PyTorch's own step-to-step spread about
its 10-step means, over the second half of the run. Exits 1 when they do not. Needs a CUDA
GPU, torch, transformers and tokenizers (the GPU machine has them).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

U64 = (1 << 64) - 1


class SplitMix64:
    """kiln-train's Rng (its test `draws_are_splitmix64s` pins the values)."""

    def __init__(self, seed):
        self.state = seed & U64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & U64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
        return z ^ (z >> 31)

    def below(self, n):
        zone = U64 - U64 % n
        while True:
            v = self.next_u64()
            if v < zone:
                return v % n


def fingerprint(train, held):
    """kiln-train's TextData::fingerprint: FNV-1a over the ids' little-endian bytes, the
    training ids, u32::MAX, then the held-out ids."""
    h = 0xCBF29CE484222325
    for ids in (train, [0xFFFFFFFF], held):
        for i in ids:
            for b in i.to_bytes(4, "little"):
                h = ((h ^ b) * 0x100000001B3) & U64
    return f"{h:016x}"


def write_text(work, megabytes):
    import transformers

    root = os.path.dirname(transformers.__file__)
    paths = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")
    )
    want = int(megabytes * (1 << 20))
    parts, size = [], 0
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            t = f.read()
        parts.append(t)
        size += len(t.encode())
        if size >= want * 1.05:
            break
    text = "".join(parts)
    cut = int(len(text) / 1.05)
    train, held = text[:cut], text[cut:]
    for name, t in (("train.txt", train), ("held.txt", held)):
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write(t)
    return train, held


def make_init(work, train_text, seed, seq_len):
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    init = os.path.join(work, "init")
    os.makedirs(init, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([train_text], trainer)
    tok.save(os.path.join(init, "tokenizer.json"))
    with open(os.path.join(init, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
                   "add_eos_token": False}, f)
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=seq_len,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(init, safe_serialization=True)
    return init, tok


def run_kiln(a, init, work):
    out = os.path.join(work, "out")
    cmd = [a.kiln, "train", "--from", init, "--data", os.path.join(work, "train.txt"),
           "--held-out", os.path.join(work, "held.txt"), "--out", out,
           "--steps", str(a.steps), "--batch", str(a.batch), "--seq-len", str(a.seq_len),
           "--lr", str(a.lr), "--seed", str(a.seed), "--precision", a.precision,
           "--weight-decay", "0.1", "--betas", "0.9,0.95", "--clip", "1",
           "--eval-every", "0", "--eval-windows", "8", "--save-every", "0", "--device", "cuda"]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"kiln: {time.time() - t0:.1f} s", flush=True)
    with open(os.path.join(out, "train.json")) as f:
        return json.load(f)


def run_torch(a, init, train_ids, lrs):
    import torch
    import torch.nn.functional as F
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers.LlamaForCausalLM.from_pretrained(
        init, torch_dtype=torch.float32, attn_implementation="sdpa").cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    ids = torch.tensor(train_ids, dtype=torch.long, device="cuda")
    rng = SplitMix64(a.seed)
    span = len(train_ids) - a.seq_len
    losses = []
    t0 = time.time()
    for step in range(a.steps):
        starts = [rng.below(span) for _ in range(a.batch)]
        win = torch.stack([ids[s:s + a.seq_len + 1] for s in starts])
        x, y = win[:, :-1], win[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lrs[step]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"PyTorch: {time.time() - t0:.1f} s", flush=True)
    return losses


def tens(xs):
    return [statistics.fmean(xs[i:i + 10]) for i in range(0, len(xs) - len(xs) % 10, 10)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln")
    ap.add_argument("work")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--text-mb", type=float, default=8.0)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)

    train_text, held_text = write_text(a.work, a.text_mb)
    init, tok = make_init(a.work, train_text, a.seed, a.seq_len)
    train_ids = tok.encode(train_text, add_special_tokens=False).ids
    held_ids = tok.encode(held_text, add_special_tokens=False).ids
    log = run_kiln(a, init, a.work)
    mine = fingerprint(train_ids, held_ids)
    if log["data"]["fingerprint"] != mine or log["data"]["train_tokens"] != len(train_ids):
        sys.exit(f"the token streams differ: kiln {log['data']} against {mine}, "
                 f"{len(train_ids)} training tokens here")
    steps = log["steps"]
    kiln_losses = [s["loss"] for s in steps]
    lrs = [s["lr"] for s in steps]
    torch_losses = run_torch(a, init, train_ids, lrs)

    print("step  kiln     PyTorch  (10-step means)")
    k10, t10 = tens(kiln_losses), tens(torch_losses)
    for i, (k, t) in enumerate(zip(k10, t10)):
        print(f"{10 * i + 10:4d}  {k:7.4f}  {t:7.4f}")
    half = len(t10) // 2
    spread = statistics.pstdev(
        [x - t10[i // 10] for i, x in enumerate(torch_losses[:10 * len(t10)])][10 * half:])
    worst = max(abs(k - t) for k, t in zip(k10[half:], t10[half:]))
    first = abs(kiln_losses[0] - torch_losses[0])
    print(json.dumps({
        "test": "loss_parity", "steps": a.steps, "batch": a.batch, "seq_len": a.seq_len,
        "precision": a.precision, "first_step_diff": first,
        "second_half_worst_10_step_diff": worst, "torch_step_spread": spread,
        "kiln_last_10": k10[-1], "torch_last_10": t10[-1],
        "within_noise": worst <= 2 * spread and math.isfinite(worst)}))
    sys.exit(0 if worst <= 2 * spread else 1)


if __name__ == "__main__":
    main()
