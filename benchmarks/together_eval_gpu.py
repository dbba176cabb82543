"""Four adapters of a ~1B model evaluated one at a time against together, on a lent GPU (no network). JSON report.

    python benchmarks/together_eval_gpu.py --tiny DIR [--out FILE] [--adapters 4] [--small]

`--small`: a 2-layer model of the same kind on the CPU, fp32, 8 new tokens: the script's own check, no timing.

The model is a randomly initialised Llama of TinyLlama-1.1B's shape (22 layers, hidden 2048, bf16), saved once to a
local folder so that each side loads it from disk as `exp eval run` does; the adapters are LoRA r8 on every
projection with small random weights; the tokenizer is the tiny test model's (`--tiny`, a copy of tunelab's
tiny-random-llama folder: token ids below 1000 serve any vocabulary). The requests have the quick suite's shapes
(evals/quick.yaml): 57 log-likelihood requests of about 650 tokens, one token scored (MMLU, one question per
subject, 5-shot); generations of 128 new tokens for 8 prompts sharing a 900-token prefix (GSM8K 8-shot), 27 of
about 700 tokens (BBH, one per task, 3-shot) and 8 of about 150 (HumanEval); every row runs to 128 tokens (no stop
strings: random weights would stop anywhere).

One at a time: per adapter, the base loaded, the adapter put on it (PeftModel.from_pretrained, `for_eval`:
unmerged), the scoring through `SharedPrefixLM` and the generation through `Decoder` with 8 slots. Together: the
base loaded once, every adapter beside it (`load_adapters`), the scoring through `FanOutLM` (every adapter's rows
in shared passes) and one `Decoder` generation of all adapters' requests with 8 slots per adapter. Reports both
times (load included), the ratio, and how the outputs compare (log-likelihoods max |diff|; greedy tokens
identical, else the logit gap at the first differing token: GPU kernels round by shape, so near-ties can flip).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def shapes(vocab: int, new: int, scale: int):
    """(scoring requests as lm-eval hands them to _loglikelihood_tokens, generation requests)."""
    from tunelab.evals.engine.generate import Request

    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    scoring = [(None, ids((640 + 7 * (i % 9)) // scale), ids(1)) for i in range(57)]
    gsm = ids(900 // scale)
    gen = [gsm + ids(40 + i) for i in range(8)] + [ids((680 + 5 * i) // scale) for i in range(27)] + [
        ids((140 + 3 * i) // scale) for i in range(8)]
    return scoring, [Request(tuple(p), new) for p in gen]


def synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "together_eval_gpu.json")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/together-gpu"))
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tunelab.core.config import PeftCfg
    from tunelab.evals.engine import route
    from tunelab.evals.engine.generate import Decoder
    from tunelab.evals.lmeval.fanout import FanOutLM
    from tunelab.evals.lmeval.lm import SharedPrefixLM
    from tunelab.train import peft

    if not torch.cuda.is_available() and not args.small:
        sys.exit("no CUDA device: this check is for a GPU machine (--small: its own check on the CPU)")
    dev, dtype, new = ("cpu", torch.float32, 8) if args.small else ("cuda", torch.bfloat16, 128)
    tok = AutoTokenizer.from_pretrained(args.tiny)
    base_dir, names = args.work / "llama-1b", [f"lora{k}" for k in range(args.adapters)]
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4) if args.small \
        else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32)
    config = LlamaConfig(vocab_size=32000, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, **size)
    torch.manual_seed(0)
    with torch.device(dev):
        made = LlamaForCausalLM(config).to(dtype)
    made.save_pretrained(base_dir)
    folders = []
    for k, name in enumerate(names):
        wrapped = peft.apply(made, PeftCfg(method="lora", r=8))
        gen = torch.Generator(device=dev).manual_seed(k)
        with torch.no_grad():
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=dev))
        wrapped.save_pretrained(args.work / name)
        folders.append(args.work / name)
        made = wrapped.unload()
    del made, wrapped
    scoring, requests = shapes(min(len(tok), 1000), new, 8 if args.small else 1)
    report: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (--small)",
                    "torch": torch.__version__, "adapters": args.adapters,
                    "model": f"random Llama, {'2 layers' if args.small else 'TinyLlama-1.1B shape'}, {dtype}",
                    "scoring_requests": len(scoring), "generation_requests": len(requests), "new_tokens": new}

    def load_base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, device_map=dev).eval()

    t0, alone_ll, alone_tokens = synced(), [], []
    for folder in folders:
        model = peft.for_eval(PeftModel.from_pretrained(load_base(), folder))
        alone_ll.append(SharedPrefixLM(model, tok, batch_size=8)._loglikelihood_tokens(scoring))
        alone_tokens.append([o.tokens for o in Decoder(model, tok, batch_size=8, stop_eos=set()).generate(requests)])
        del model
    report["alone_s"] = synced() - t0
    print(json.dumps(report), flush=True)
    t0 = synced()
    model = peft.load_adapters(load_base(), folders, names).eval()
    with route.installed(model) as router:
        lm = FanOutLM(model, tok, names, batch_size=8)
        together_ll = [lm._loglikelihood_tokens(scoring), *lm.others]
        outs = Decoder(model, tok, batch_size=8 * len(names), stop_eos=set()).generate(
            [r.__class__(r.ids, r.max_new_tokens, adapter=n) for n in names for r in requests])
        report["together_s"] = synced() - t0
        report["speedup"] = report["alone_s"] / report["together_s"]
        tokens = [[o.tokens for o in outs[k * len(requests):(k + 1) * len(requests)]] for k in range(len(names))]
        report["loglik_max_abs_diff"] = max(abs(a[0] - b[0]) for x, y in zip(alone_ll, together_ll)
                                            for a, b in zip(x, y))
        rows = [(k, r, tokens[k][i], alone_tokens[k][i]) for k in range(len(names))
                for i, r in enumerate(requests)]
        report["rows_identical"] = sum(t == a for _, _, t, a in rows)
        report["rows"] = len(rows)
        gaps = []
        for k, r, t, a in rows:  # the logit gap between the two choices at the first differing token
            step = next((i for i, (x, y) in enumerate(zip(t, a)) if x != y), None)
            if step is None:
                continue
            with router.only(names[k]), torch.inference_mode():
                logits = model(torch.tensor([[*r.ids, *t[:step]]], device=dev)).logits[0, -1].float()
            gaps.append(abs(float(logits[t[step]] - logits[a[step]])))
        report["gaps_where_differing"] = sorted(gaps, reverse=True)[:20]
    print(json.dumps(report), flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
