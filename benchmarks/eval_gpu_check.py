"""The decoding engine on a lent GPU machine (and its many-core CPU), in one call. Writes a JSON report.

    python benchmarks/eval_gpu_check.py --tiny DIR [--out FILE]

1. CPU, every core: greedy and sampled outputs of `Decoder` at batch sizes 1, 4 and 16 on the tiny
   random Llama (`--tiny`, a copy of tunelab's tiny-random-llama folder: that machine has no network)
   and on a random model of SmolLM2-135M's shape cut to 4 layers; identical or not.
2. CUDA, fp32: the same comparison, and the engine's greedy tokens against `model.generate` at batch
   size 1 (first divergence and logit gap).
3. CUDA, bf16: speed on a random SmolLM2-135M-shaped model, 64 prompts sharing an 800-token prefix
   with 60 tokens of their own, 128 new tokens each (no stop strings: every row runs to the end), the
   engine at batch 64 against `model.generate` on left-padded batches of 64.

Random weights: the outputs mean nothing, only their equality and the timings do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def smol_shaped(layers: int, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


class NoText:
    """A tokenizer stand-in for requests without stop strings (the engine then never decodes)."""

    eos_token_id = None


def requests(vocab: int, n: int, prefix: int, own: int, new: int, sampled: bool):
    from tunelab.evals.engine.generate import Request

    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    out = []
    for i in range(n):
        mine = torch.randint(3, vocab, (own + i % 7,), generator=g).tolist()
        out.append(Request(tuple(shared + mine), new - i % 5, temperature=1.0 if sampled and i % 2 else 0.0,
                           seed=i))
    return out


def invariance(model, tok, reqs) -> dict:
    from tunelab.evals.engine.generate import Decoder

    outs = {bs: [o.tokens for o in Decoder(model, tok, batch_size=bs, stop_eos=set()).generate(reqs)]
            for bs in (1, 4, 16)}
    return {"identical_1_4_16": outs[1] == outs[4] == outs[16],
            "rows_differing_1_vs_16": sum(a != b for a, b in zip(outs[1], outs[16])), "rows": len(reqs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "eval_gpu_check.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunelab.evals.engine.generate import Decoder, Request, first_divergence

    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    tiny = AutoModelForCausalLM.from_pretrained(args.tiny, dtype=torch.float32).eval()
    tiny_tok = AutoTokenizer.from_pretrained(args.tiny)
    report["cpu_tiny"] = invariance(tiny, tiny_tok, requests(1000, 24, 40, 8, 24, sampled=True))
    report["cpu_smol4"] = invariance(smol_shaped(4, torch.float32, "cpu"), NoText(),
                                     requests(49152, 24, 200, 20, 16, sampled=True))
    print(json.dumps(report), flush=True)
    if not torch.cuda.is_available():
        args.out.write_text(json.dumps(report, indent=1))
        return
    smol = smol_shaped(30, torch.float32, "cuda")
    reqs = requests(49152, 24, 200, 20, 24, sampled=False)
    report["cuda_fp32_smol"] = invariance(smol, NoText(), reqs)
    outs = Decoder(smol, NoText(), batch_size=16, stop_eos=set()).generate(reqs)
    divs = [first_divergence(smol, r.ids, o.tokens, r.max_new_tokens) for r, o in zip(reqs, outs)]
    report["cuda_fp32_vs_generate"] = {"rows": len(reqs), "identical": sum(d is None for d in divs),
                                       "gaps": [d.gap for d in divs if d is not None]}
    print(json.dumps(report), flush=True)
    del smol
    smol = smol_shaped(30, torch.bfloat16, "cuda")
    reqs = [Request(r.ids, 128) for r in requests(49152, 64, 800, 60, 128, sampled=False)]
    engine = Decoder(smol, NoText(), batch_size=64, stop_eos=set())
    engine.generate(reqs[:4])  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(reqs)
    torch.cuda.synchronize()
    t_engine = time.perf_counter() - t0
    width = max(len(r.ids) for r in reqs)
    ids = torch.full((len(reqs), width), 2, device="cuda")
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.ids):] = torch.tensor(r.ids, device="cuda")
        mask[i, width - len(r.ids):] = 1
    with torch.inference_mode():
        smol.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=False, pad_token_id=2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        smol.generate(ids, attention_mask=mask, max_new_tokens=128, min_new_tokens=128, do_sample=False,
                      pad_token_id=2)
        torch.cuda.synchronize()
    t_hf = time.perf_counter() - t0
    report["cuda_bf16_speed"] = {"rows": len(reqs), "new_tokens_each": 128, "engine_s": t_engine, "generate_s": t_hf,
                                 "engine_vs_generate": t_hf / t_engine}
    print(json.dumps(report), flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
