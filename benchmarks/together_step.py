"""A together-group's training step, exact mode against batched mode (#46), side by side in one process.

    python benchmarks/together_step.py [--model smollm2-135m-instruct] [--members 4] [--batch 4] [--length 64]
                                       [--steps 6] [--repeats 3] [--precision fp32|bf16] [--out FILE]

N LoRA r8 members (dropout 0.05, each its own seed and AdamW) over one base, each with its own batches of `--batch`
rows of up to `--length` tokens (lengths drawn per row, the second half labelled). Exact mode: each member's step in
turn, its adapter alone active (train/members.py, what `--together-mode exact` runs). Batched mode: one forward and
backward through the base for all members' rows (train/batched.py), then each member's optimizer step. Both
modes train the same batches from the same state; the first step's losses are compared (within 1e-6 in fp32).
Each repeat times `--steps` steps of each mode after 2 untimed ones, the order alternating from repeat to repeat;
printed: seconds a step (all members) per mode, median and range over the repeats, and batched/exact.

`--model random-1b` is a randomly initialised Llama of TinyLlama-1.1B's shape (needs no download; for a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def load(name: str, device: str, dtype: torch.dtype):
    from tunelab.core.config import ModelCfg
    from tunelab.models import loading

    if name != "random-1b":
        model, tok = loading.load(ModelCfg(name=name, dtype="float32"))
        return model.to(device=device, dtype=dtype), tok.pad_token_id or 0
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype), 0


def batches(gen: torch.Generator, n: int, rows: int, length: int, vocab: int) -> list[dict]:
    from tunelab.train.data import collate

    out = []
    for _ in range(n):
        made = []
        for _ in range(rows):
            k = int(torch.randint(length // 2, length + 1, (1,), generator=gen))
            ids = torch.randint(3, min(vocab, 30000), (k,), generator=gen).tolist()
            made.append({"input_ids": ids, "labels": [-100] * (k // 2) + ids[k // 2:]})
        out.append(collate(0)(made))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from tunelab.core.config import CellConfig
    from tunelab.train import batched, checkpoint, members
    from tunelab.train.data import label_tokens
    from tunelab.train.parallel.local import forward_loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    model, pad = load(a.model, device, torch.float32)
    cfgs = [CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                       "peft": {"method": "lora", "r": 8, "dropout": 0.05},
                                       "train": {"seed": k}}) for k in range(a.members)]
    rngs = []
    for k, cfg in enumerate(cfgs):
        model = members.inject(model, members.member_name(k), cfg)
        rngs.append(checkpoint.rng_state())
    ms = [members.Member(k, cfg, model, None, rngs[k], None) for k, cfg in enumerate(cfgs)]
    params = {m.name: [p for n, p in model.named_parameters() if f".{m.name}." in n + "."] for m in ms}
    total = (2 + a.steps) * a.repeats * 2 + 1
    gen = torch.Generator().manual_seed(0)
    data = {m.name: batches(gen, total, a.batch, a.length, model.config.vocab_size) for m in ms}
    opts = {m.name: torch.optim.AdamW(params[m.name], lr=1e-3) for m in ms}
    used = {"i": 0}

    def exact(streams: list[dict] | None = None) -> list[float]:
        i, losses = used["i"], []
        for k, m in enumerate(ms):
            members.activate(model, m.name)
            if streams is not None:  # each member's random stream as batched mode puts it in place
                checkpoint.set_rng_state(streams[k])
            b = data[m.name][i]
            loss = forward_loss(model, b, label_tokens(b), dev, a.precision)
            loss.backward()
            opts[m.name].step()
            opts[m.name].zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        used["i"] += 1
        return losses

    def joined() -> list[float]:
        i = used["i"]
        micro = [[data[m.name][i]] for m in ms]
        done = batched.backward(ms, micro, [label_tokens(mb[0]) for mb in micro], pad, dev, a.precision)
        for m in ms:
            opts[m.name].step()
            opts[m.name].zero_grad(set_to_none=True)
        used["i"] += 1
        return [float(x) for x in done.losses]

    model.train()
    state = {n: t.detach().clone() for ps in params.values() for n, t in model.named_parameters()
             if any(t is q for q in ps)}
    # the first step from one state both ways, each member's dropout from its own stream in both
    first_exact = exact([dict(r) for r in rngs])
    used["i"] -= 1
    with torch.no_grad():
        for n, t in model.named_parameters():
            if n in state:
                t.copy_(state[n])
    first_batched = joined()
    gap = max(abs(x - y) for x, y in zip(first_exact, first_batched))
    print(f"{a.model}, {a.members} LoRA members, batch {a.batch} x up to {a.length} tokens each, {a.precision}, "
          f"{device}, {torch.get_num_threads()} threads; first step's losses, batched - exact: {gap:.2e}", flush=True)
    times: dict[str, list[float]] = {"exact": [], "batched": []}
    for r in range(a.repeats):
        for mode in (["exact", "batched"] if r % 2 == 0 else ["batched", "exact"]):
            fn = exact if mode == "exact" else joined
            for _ in range(2):
                fn()
            t0 = synced()
            for _ in range(a.steps):
                fn()
            times[mode].append((synced() - t0) / a.steps)
            print(f"repeat {r + 1} {mode}: {times[mode][-1]:.3f} s a step (all members), load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
    ratios = [e / b for e, b in zip(times["exact"], times["batched"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"exact {med['exact']:.3f} s/step [{min(times['exact']):.3f}-{max(times['exact']):.3f}], batched "
          f"{med['batched']:.3f} [{min(times['batched']):.3f}-{max(times['batched']):.3f}]: batched is "
          f"{statistics.median(ratios):.2f}x exact's speed [{min(ratios):.2f}-{max(ratios):.2f} over the repeats]")
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "members": a.members, "batch": a.batch, "length": a.length,
                                     "precision": a.precision, "device": device, "times": times, "ratios": ratios,
                                     "first_step_loss_gap": gap}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
