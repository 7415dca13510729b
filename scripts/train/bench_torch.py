#!/usr/bin/env python3
"""PyTorch's side of `kiln bench --train llama-134m`: training steps of the same LLaMA shape
(dim 768, 12 layers, 12 heads, FFN 2048, vocabulary 32000, tied embeddings) from scratch on
random ids, as the training issue measured it: transformers' LlamaForCausalLM with SDPA
attention, BF16 autocast over FP32 master weights, fused AdamW, global-norm clipping.

    python3 scripts/train/bench_torch.py [--batch 16] [--seq-len 1024] [--steps 10] [--compile]

Prints one JSON line: tokens/s (median step), the mode, the versions. Needs a CUDA GPU.
"""
import argparse
import json
import statistics
import time

import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=a.seq_len,
        tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len + 1), device="cuda")
    x, y = ids[:, :-1], ids[:, 1:]

    def loss_of(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    fwd = torch.compile(loss_of) if a.compile else loss_of

    def step():
        loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):  # warm-up (and compilation)
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        loss = step()
        loss.item()
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    print(json.dumps({
        "test": "train", "peer": "pytorch", "mode": "compile" if a.compile else "eager",
        "params": params, "batch": a.batch, "seq_len": a.seq_len, "median_s": s,
        "tokens_per_s": a.batch * a.seq_len / s, "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
