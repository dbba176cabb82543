"""Peak memory of training a ~100M-parameter Llama for a few steps, per optimizer, each in a fresh process.

    python benchmarks/optimizer_memory.py [--shapes 1x64,4x512] [--steps 2] [--only adamw,lomo] [--checkpointing]

Each method runs in its own subprocess: random-init Llama (fp32, CPU), one batch of each --shapes entry
(rows x tokens: 1 x 64 isolates the optimizer's own state; 4 x 512 is a realistic batch, where activations
weigh in),
--steps full training steps (default 2) as tunelab's loop does them: forward with the loop's loss
(train/loss.py), backward,
clip to norm 1.0, step; or, for LOMO/AdaLomo, `prepare_for_fused(model, opt)` as the loop calls it for them
(optimizers/tied.py) and the fused step, which clips inside its two backward passes. Two steps, not one:
an optimizer's state is made in its first step, after that step's backward has freed the activations, so
only from the second step on do the state and a batch's activations share memory, as they do in training;
at 4 x 512 one step would measure the activations alone. Measured: the
process's peak RSS (getrusage ru_maxrss) for the whole run, and that peak minus the RSS right after the
model was built (what training added). The ratios to AdamW are printed with the issue's goals.
`--checkpointing` turns on gradient checkpointing as `train.gradient_checkpointing` does (each layer's
activations recomputed in backward), so a batch's activations shrink to about a layer's, as the LOMO paper
trains.

Peak RSS also depends on glibc's allocator history: its mmap threshold grows each time a large block is
freed, after which blocks of that size come from the heap and may stay resident after free. Update-in-
backward optimizers free many parameter-sized blocks mid-backward, so their peak varies by tens of MB
with the order of frees. Every method is therefore measured twice: with the default allocator, and with
the threshold pinned (MALLOC_MMAP_THRESHOLD_=65536), which measures the tensors rather than that history.

lomo-optim's Lomo (the official implementation) trains the same model with its tied embedding: it offers no
setting for tied weights (it hooks every parameter of the model it is given), so it runs as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

METHODS = {  # name -> what it is, for the table
    "adamw": "torch AdamW",
    "lion": "tunelab Lion",
    "adan": "tunelab Adan",
    "sophiag": "tunelab SophiaG (Hessian refresh in the step)",
    "lomo": "tunelab LOMO",
    "adalomo": "tunelab AdaLomo",
    "lora": "LoRA r=8 (q,v) + AdamW",
    "lomo-optim": "lomo-optim Lomo (official)",
}
ALLOCATORS = {"default": {}, "pinned": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def one(method: str, seq: int, rows: int = 1, steps: int = 2, checkpointing: bool = False) -> dict:
    """Runs in the child process: build, `steps` steps on the same batch, report."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunelab.config import OptimCfg
    from tunelab.train import optim
    from tunelab.train.data import label_tokens
    from tunelab.train.loss import causal_lm_loss
    from tunelab.train.optimizers.tied import prepare_for_fused
    from tunelab.train.parallel import enable_gradient_checkpointing

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=1700, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    if checkpointing:
        enable_gradient_checkpointing(model)
    total = sum(p.numel() for p in model.parameters())
    after_model = rss_mb()
    ids = torch.randint(0, config.vocab_size, (rows, seq))
    batch = {"input_ids": ids, "labels": ids.clone()}
    n_items = label_tokens(batch)

    def forward_loss():  # the loop's loss: the output head only where a label is (train/loss.py)
        return causal_lm_loss(model, batch, n_items)

    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    if method == "lomo-optim":
        from lomo_optim import Lomo

        opt = Lomo(model, lr=1e-3, clip_grad_norm=1.0)

        def step(i):
            loss = forward_loss()
            opt.grad_norm(loss)
            opt.fused_backward(loss, 1e-3)
            return float(loss)
    else:
        name = "adamw" if method == "lora" else method
        kwargs = {"hessian_interval": 1} if name == "sophiag" else {}
        opt = optim.build(params, OptimCfg(name=name, lr=1e-3, kwargs=kwargs), max_grad_norm=1.0)
        if optim.spec(name).fused:  # as loop.run() does in one process: the tied weight's one gradient buffer
            prepare_for_fused(model, opt)

        def step(i):
            if hasattr(opt, "fused_step"):
                loss, _ = opt.fused_step(forward_loss)
            else:
                out = forward_loss()
                out.backward()
                loss = float(out)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if hasattr(opt, "after_step"):
                opt.after_step(step=i, model=model, batch=batch)
            return loss

    for i in range(1, steps + 1):
        loss = step(i)
    peak = peak_rss_mb()
    return {"method": method, "params": total, "trainable": sum(p.numel() for p in params), "loss": loss,
            "peak_mb": peak, "after_model_mb": after_model, "added_mb": peak - after_model}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x64,4x512", help="comma-separated ROWSxTOKENS batches")
    ap.add_argument("--only", default=",".join(METHODS), help="comma-separated methods")
    ap.add_argument("--steps", type=int, default=2, help="training steps per process (the peak is over all)")
    ap.add_argument("--checkpointing", action="store_true", help="as train.gradient_checkpointing")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.seq, args.rows, args.steps, args.checkpointing)))
        return
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for shape in args.shapes.split(","):
        n_rows, seq = map(int, shape.split("x"))
        for allocator, extra in ALLOCATORS.items():
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **extra}
            rows = []
            for method in args.only.split(","):
                out = subprocess.run([sys.executable, __file__, "--one", method, "--seq", str(seq), "--rows",
                                      str(n_rows), "--steps", str(args.steps)]
                                     + (["--checkpointing"] if args.checkpointing else []),
                                     check=False, capture_output=True, text=True, env=env)
                if out.returncode:
                    sys.exit(f"{method} failed:\n{out.stderr[-3000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"measured {method} ({shape}, {allocator} allocator)", file=sys.stderr)
            report(rows, allocator, seq, n_rows, args.steps, args.checkpointing)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


def report(rows: list[dict], allocator: str, seq: int, n_rows: int = 1, steps: int = 2,
           checkpointing: bool = False) -> None:
    base = next((r for r in rows if r["method"] == "adamw"), rows[0])
    ckpt = ", gradient checkpointing" if checkpointing else ""
    print(f"\n### batch {n_rows} x {seq}{ckpt}, {allocator} allocator\n\nLlama {rows[0]['params'] / 1e6:.1f}M "
          f"parameters, fp32, CPU, batch {n_rows} x {seq} tokens{ckpt}, {steps} training steps per fresh process\n")
    print(f"| method | what | trainable | peak RSS MB | x {base['method']} | added MB | x {base['method']} |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {METHODS[r['method']]} | {r['trainable'] / 1e6:.2f}M | {r['peak_mb']:,.0f} | "
              f"{r['peak_mb'] / base['peak_mb']:.2f} | {r['added_mb']:,.0f} | "
              f"{r['added_mb'] / base['added_mb']:.2f} |")
    by = {r["method"]: r for r in rows}
    if "adamw" in by:
        print()
        for m in ("lomo", "adalomo"):
            if m in by:
                ratio = by[m]["peak_mb"] / by["adamw"]["peak_mb"]
                line = f"- {m}: peak {ratio:.2f}x AdamW's (goal <= 0.45x: {'met' if ratio <= 0.45 else 'NOT met'})"
                if "lomo-optim" in by:
                    diff = by[m]["peak_mb"] - by["lomo-optim"]["peak_mb"]
                    verdict = "met" if diff <= 0 else "equal within 1 MB" if diff <= 1 else "NOT met"
                    line += f"; {diff:+.1f} MB against lomo-optim Lomo's peak (goal: no worse: {verdict})"
                print(line)

if __name__ == "__main__":
    main()
