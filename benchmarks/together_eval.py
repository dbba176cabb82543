"""Adapters of one base on an eval suite: one at a time against together, side by side in one invocation.

    python benchmarks/together_eval.py [--model smollm2-135m-instruct] [--adapters 4] [--suite quick]
        [--order alone,together] [--work DIR] [--threads T] [--val-batches 8]

One at a time is what `exp eval run` does for each cell: a process of its own that imports tunelab, loads the
base, puts the cell's adapter on it (`train.peft.load_trained`'s PeftModel.from_pretrained, `for_eval`: unmerged)
and runs `evals.run`. Together is `exp eval run BASE --adapters ...`: one process, the base loaded once, every
adapter beside it (`train.peft.load_adapters`), `evals.run_together`. Both sides are child processes timed from
start to exit; each also reports where its time went (imports, loading, each task).

The adapters are LoRA r8 on every projection of the base with random weights, small enough that the model still
answers like itself (its generation lengths are the base's) and different enough that each adapter's scores are
its own. The validation set is the arithmetic recipe's, `--val-batches` batches of it (val_loss is then measured, as
for a cell whose training did not measure it; the quick suite alone would take the whole set).
The MMLU test set comes from the offline cache (`exp eval pull`, done before any timing); GSM8K and BBH have no
offline source and are reported unavailable on both sides (their smoke stand-ins run).

Prints the machine's load before and after, both sides' wall times, the ratio, where the time went, and whether
every adapter's results are the same both ways: task values, log-likelihoods (samples.jsonl) and generated
strings (identical, or how many differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def make_adapters(model: str, n: int, work: Path) -> list[Path]:
    import torch

    from tunelab.core.config import ModelCfg, PeftCfg
    from tunelab.models import loading
    from tunelab.train import peft

    folders = [work / "adapters" / f"lora{k}" for k in range(n)]
    for k, folder in enumerate(folders):
        if (folder / "adapter_config.json").is_file():
            continue
        base, tok = loading.load(ModelCfg(name=model, dtype="float32", attn="sdpa"))
        wrapped = peft.apply(base, PeftCfg(method="lora", r=8))
        gen = torch.Generator().manual_seed(100 + k)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if p.requires_grad:  # lora_A as initialised, lora_B small: a nudge, not noise
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen) if "lora_B" in name else p)
        wrapped.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folders


def child(args) -> None:
    """One side: `--child alone K` (adapter K on its own) or `--child together`."""
    t0 = time.perf_counter()
    import torch

    from tunelab import evals, plan
    from tunelab.core.config import DataCfg, ModelCfg
    from tunelab.data.build import build
    from tunelab.models import loading
    from tunelab.train import peft

    times = {"import_s": time.perf_counter() - t0}
    torch.set_num_threads(args.threads)
    folders = [args.work / "adapters" / f"lora{k}" for k in range(args.adapters)]  # (by name: lora10 sorts first)
    cfg = plan.eval_config({"suite": args.suite, "val_batches": args.val_batches})
    t = time.perf_counter()
    base, tok = loading.load(ModelCfg(name=args.model, dtype="float32", attn="sdpa"))
    if args.child[0] == "alone":
        from peft import PeftModel

        k = int(args.child[1])
        model, names, chosen = peft.for_eval(PeftModel.from_pretrained(base, folders[k])), None, [folders[k]]
    else:
        names, chosen = [f"lora{k}" for k in range(len(folders))], folders
        model = peft.load_adapters(base, folders, names)
    data = build(DataCfg(recipe="arithmetic", max_length=256), tok, loading.cache_dir())
    times["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ctxs = [evals.Context(out_dir=args.work / "results" / args.child[0] / f.name, validation=data["validation"],
                          train=data["train"]) for f in chosen]
    if names is None:
        outs = [evals.run(model, tok, cfg, ctxs[0])]
    else:
        outs = evals.run_together(model, tok, cfg, ctxs, names)
    times["eval_s"] = time.perf_counter() - t
    times["tasks"] = {n: r["seconds"] for n, r in outs[0]["tasks"].items()}
    times["status"] = {n: r["status"] for n, r in outs[0]["tasks"].items()}
    print("CHILD " + json.dumps(times), flush=True)


def run_side(args, side: str) -> dict:
    """Wall time of one side (its child processes one after another) and the children's own split."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmds = ([["alone", str(k)] for k in range(args.adapters)] if side == "alone" else [["together"]])
    t0, parts = time.perf_counter(), []
    for c in cmds:
        proc = subprocess.run([sys.executable, __file__, "--child", *c, *forwarded(args)], env=env, check=False,
                              capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("CHILD ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"{side} {c} failed:\n{proc.stderr[-3000:]}")
        parts.append(json.loads(line[len("CHILD "):]))
    return {"wall_s": time.perf_counter() - t0, "parts": parts}


def forwarded(args) -> list[str]:
    return ["--model", args.model, "--adapters", str(args.adapters), "--suite", args.suite, "--work", str(args.work),
            "--threads", str(args.threads), "--val-batches", str(args.val_batches)]


def compare(work: Path, n: int) -> str:
    """Whether every adapter's results are the same both ways."""
    lines, same_values, ll_max, strings, differ = [], True, 0.0, 0, 0
    for k in range(n):
        a, t = work / "results" / "alone" / f"lora{k}", work / "results" / "together" / f"lora{k}"
        ra, rt = (json.loads((d / "results.json").read_text())["tasks"] for d in (a, t))
        same_values &= {x: r["value"] for x, r in ra.items()} == {x: r["value"] for x, r in rt.items()}
        sa, st = ([json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()] for d in (a, t))
        for x, y in zip(sa, st):
            if isinstance(x.get("response"), list) and x["response"] and isinstance(x["response"][0], list):
                ll_max = max([ll_max] + [abs(p[0] - q[0]) for p, q in zip(x["response"], y["response"])])
            for key in ("raw", "completion"):
                if key in x:
                    strings += 1
                    differ += x[key] != y[key]
    lines.append(f"task values equal: {same_values}; log-likelihoods max |diff| {ll_max:.1e}; generated strings "
                 f"identical {strings - differ}/{strings}")
    return "\n".join(lines)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--suite", default="quick")
    ap.add_argument("--order", default="alone,together")
    ap.add_argument("--work", type=Path, default=Path("/tmp/together-eval"))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--child", nargs="+")
    args = ap.parse_args()
    if args.child:
        return child(args)
    from tunelab.evals.testsets.pull import pull

    args.work.mkdir(parents=True, exist_ok=True)
    make_adapters(args.model, args.adapters, args.work)
    pull(log=lambda *_: None)  # MMLU into the offline cache before any timing
    print(f"{args.adapters} LoRA adapters of {args.model} on the {args.suite} suite (val_batches "
          f"{args.val_batches}), {args.threads} threads, "
          f"{os.cpu_count()} CPUs; load {load()}", flush=True)
    sides = {}
    for side in args.order.split(","):
        sides[side] = run_side(args, side)
        part = sides[side]["parts"]
        print(f"{side}: {sides[side]['wall_s']:.1f} s wall; imports {sum(p['import_s'] for p in part):.1f} s, "
              f"loading {sum(p['load_s'] for p in part):.1f} s, evaluation {sum(p['eval_s'] for p in part):.1f} s "
              f"(per task: " + ", ".join(f"{n} {sum(p['tasks'][n] for p in part):.1f}" for n in part[0]['tasks'])
              + f"); load {load()}", flush=True)
    alone, together = sides["alone"], sides["together"]
    ev = sum(p["eval_s"] for p in alone["parts"]) / together["parts"][0]["eval_s"]
    print(f"together vs one at a time: {alone['wall_s'] / together['wall_s']:.2f}x wall, {ev:.2f}x evaluation only; "
          f"unavailable tasks (both sides): {[n for n, s in together['parts'][0]['status'].items() if s != 'ok']}")
    print(compare(args.work, args.adapters))


if __name__ == "__main__":
    main()
