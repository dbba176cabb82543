"""Peak memory of training a ~100M-parameter Llama for a few steps, per optimizer, each in a fresh process.

    python benchmarks/optimizer_memory.py [--model llama-100m|smollm2-135m-instruct] [--shapes 4x512,8x1024]
        [--steps 2] [--only adamw,lomo] [--allocators default,pinned] [--checkpointing] [--before REF]
        [--results FILE]

Each method runs in its own subprocess: a random-init Llama (fp32, CPU; `llama-100m` is the LlamaConfig below,
vocabulary 32,000; any other name is a catalog alias, folder or hub id whose config is read and initialised at
random, e.g. `smollm2-135m-instruct`, vocabulary 49,152), one batch of each --shapes entry (rows x tokens: 1 x 64
isolates the optimizer's own state; 4 x 512 and 8 x 1024 are realistic batches, where activations and the
output head weigh in), --steps full training steps (default 2) as tunelab's loop does them: forward with the
loop's loss (train/loss.py), backward, clip to norm 1.0, step; or, for LOMO/AdaLomo, `prepare_for_fused(model,
opt)` as the loop calls it for them (optimizers/tied.py) and the fused step, which clips inside its two backward
passes. Every optimizer's model is prepared as the loop and its stepper prepare it (`prepare_for_fused`; for
optimizers other than LOMO/AdaLomo the chunked head builds its gradients in forward; for every method, the
official Lomo included, the lean norms and MLPs of train/lean.py). Two steps, not one: an
optimizer's state is made in its first step, after that step's backward has freed the activations, so only
from the second step on do the state and a batch's activations share memory.
Measured: the process's peak RSS (getrusage ru_maxrss) for the whole run, that peak minus the RSS right after
the model was built (what training added), and that peak minus the RSS before the model was built (the
tensors, the quantity `exp memory` predicts: train/parallel/memory.py, printed beside it).
`--checkpointing` turns on gradient checkpointing as `train.gradient_checkpointing` does.

`--before REF` measures every method a second time with the tunelab of git revision REF (its platform/ folder,
extracted once), in the same run, and prints each peak before and after and their ratio. `--results FILE`
keeps every measurement (keyed by the code's revision, model, shape, allocator, method, steps): a second run
with the same file measures only what is missing, so long runs can be split.

Peak RSS also depends on glibc's allocator history: its mmap threshold grows each time a large block is
freed, after which blocks of that size come from the heap and may stay resident after free. Update-in-
backward optimizers free many parameter-sized blocks mid-backward, so their peak varies by tens of MB
with the order of frees. `--allocators` picks default glibc, and/or the threshold pinned
(MALLOC_MMAP_THRESHOLD_=65536), which measures the tensors rather than that history.

lomo-optim's Lomo (the official implementation) trains the same model with its tied embedding and the same loss
function: it offers no setting for tied weights (it hooks every parameter of the model it is given), so it runs
as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
LLAMA_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=1700, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                  tie_word_embeddings=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def model_config(name: str):
    from transformers import AutoConfig, LlamaConfig

    if name == "llama-100m":
        return LlamaConfig(**LLAMA_100M)
    from tunelab.models.loading import resolve

    return AutoConfig.from_pretrained(resolve(name))


def one(method: str, model_name: str, seq: int, rows: int = 1, steps: int = 2, checkpointing: bool = False) -> dict:
    """Runs in the child process: build, `steps` steps on the same batch, report."""
    import torch
    from transformers import LlamaForCausalLM

    from tunelab.train.data import label_tokens
    from tunelab.train.loss import causal_lm_loss
    from tunelab.train.parallel import enable_gradient_checkpointing

    config = model_config(model_name)
    before_model = rss_mb()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    if checkpointing:
        enable_gradient_checkpointing(model)
    _lean(model)
    total = sum(p.numel() for p in model.parameters())
    after_model = rss_mb()
    ids = torch.randint(0, config.vocab_size, (rows, seq))
    batch = {"input_ids": ids, "labels": ids.clone()}
    n_items = label_tokens(batch)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    step = _stepper(method, model, params, lambda: causal_lm_loss(model, batch, n_items), batch)
    for i in range(1, steps + 1):
        loss = step(i)
    peak = peak_rss_mb()
    return {"method": method, "params": total, "trainable": sum(p.numel() for p in params), "loss": loss,
            "vocab": config.vocab_size, "peak_mb": peak, "after_model_mb": after_model,
            "added_mb": peak - after_model, "tensors_mb": peak - before_model}


def _stepper(method: str, model, params, forward_loss, batch):
    """One training step of `method` (step number -> loss), as tunelab's loop runs it."""
    import torch

    from tunelab.core.config import OptimCfg
    from tunelab.train import optim

    if method == "lomo-optim":
        from lomo_optim import Lomo

        opt = Lomo(model, lr=1e-3, clip_grad_norm=1.0)

        def lomo_step(i):
            loss = forward_loss()
            opt.grad_norm(loss)
            opt.fused_backward(loss, 1e-3)
            return float(loss)
        return lomo_step
    name = "adamw" if method == "lora" else method
    kwargs = {"hessian_interval": 1} if name == "sophiag" else {}
    opt = optim.build(params, OptimCfg(name=name, lr=1e-3, kwargs=kwargs), max_grad_norm=1.0)
    _as_the_loop_prepares(model, opt)

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
        if hasattr(opt, "after_step"):  # SophiaG's refresh, with the loop's sampled loss (the head in chunks)
            opt.after_step(step=i, model=model, batch=batch, **_sampled_loss())
        return loss
    return step


def _sampled_loss() -> dict:
    """The sampled-label loss the one-process stepper hands SophiaG's refresh (train/loss.py), where this
    revision has one."""
    try:
        from tunelab.train.loss import sampled_label_loss
    except ImportError:
        return {}
    return {"sampled_loss": sampled_label_loss}


def _lean(model) -> None:
    """The lean norms and MLPs every layout's stepper puts on the model (train/lean.py), for every method, the
    official Lomo too, so that its comparison stays optimizer against optimizer; a --before revision without
    them is left as it was."""
    try:
        from tunelab.train import lean
    except ImportError:
        return
    lean.apply(model)


def _as_the_loop_prepares(model, opt) -> None:
    """What the loop and its one-process stepper do to the model for `opt`: the tied weight's one gradient
    buffer (optimizers/tied.py) and, for an optimizer that runs one backward per forward, the chunked head's
    gradients built in forward (train/chunked.py). A --before revision without the latter is left as it was."""
    from tunelab.optimizers.tied import prepare_for_fused

    fused = hasattr(opt, "fused_step")
    prepare_for_fused(model, opt if fused else None)
    try:
        from tunelab.train.chunked import set_chunk

        set_chunk(model.get_output_embeddings(), None, early=not fused)
    except (ImportError, TypeError):
        pass


def predicted_mb(method: str, model_name: str, rows: int, seq: int, checkpointing: bool) -> float | None:
    """`exp memory`'s prediction (tensors only) for the method, or None where it has none (lomo-optim)."""
    from tunelab.train.parallel.memory import Setup, estimate, shape_of

    if method == "lomo-optim":
        return None
    peft = {"peft": "lora", "lora_targets": ("q", "v")} if method == "lora" else {}
    setup = Setup(optim="adamw" if method == "lora" else method, dtype="float32", seq=seq, batch=rows,
                  activation_checkpointing=checkpointing, **peft)
    try:
        return estimate(shape_of(model_config(model_name)), setup).peak / 2**20
    except TypeError:  # a revision of the memory model without this Setup field
        return None


def code_revision(ref: str | None) -> tuple[str, Path]:
    """(revision id, platform folder) of the code to measure: this checkout (its HEAD, "+dirty" with uncommitted
    changes under platform/), or git revision `ref` extracted once into the temp folder."""
    git = ["git", "-C", str(REPO)]
    if ref is None:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "platform"], capture_output=True, text=True,
                               check=True).stdout
        return head + ("+dirty" if dirty.strip() else ""), REPO / "platform"
    rev = subprocess.run(git + ["rev-parse", "--short", ref], capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"tunelab-{rev}"
    if not (folder / "platform").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(git + ["archive", rev, "platform"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return rev, folder / "platform"


def measure(method: str, args, shape: str, allocator: str, code: Path) -> dict:
    n_rows, seq = map(int, shape.split("x"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **ALLOCATORS[allocator],
           "PYTHONPATH": str(code)}
    cmd = [sys.executable, __file__, "--one", method, "--model", args.model, "--seq", str(seq), "--rows",
           str(n_rows), "--steps", str(args.steps)] + (["--checkpointing"] if args.checkpointing else [])
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m", help="llama-100m (vocabulary 32,000) or a model name")
    ap.add_argument("--shapes", default="1x64,4x512", help="comma-separated ROWSxTOKENS batches")
    ap.add_argument("--only", default=",".join(METHODS), help="comma-separated methods")
    ap.add_argument("--steps", type=int, default=2, help="training steps per process (the peak is over all)")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS), help="default and/or pinned")
    ap.add_argument("--checkpointing", action="store_true", help="as train.gradient_checkpointing")
    ap.add_argument("--before", help="also measure with the tunelab of this git revision")
    ap.add_argument("--code", help="measure the tunelab of this git revision instead of this checkout's")
    ap.add_argument("--results", type=Path, help="a JSON-lines file of measurements, reused and extended")
    ap.add_argument("--report-only", action="store_true", help="print what --results holds, measure nothing")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.model, args.seq, args.rows, args.steps, args.checkpointing)))
        return
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    codes = {"after": code_revision(args.code)}
    if args.before:
        codes["before"] = code_revision(args.before)
    known = _load(args.results)
    for shape in args.shapes.split(","):
        for allocator in args.allocators.split(","):
            rows: dict[str, dict] = {}
            for method in args.only.split(","):
                for when, (rev, code) in codes.items():
                    key = json.dumps([rev, args.model, shape, allocator, method, args.steps, args.checkpointing])
                    if key not in known and args.report_only:
                        continue
                    if key not in known:
                        known[key] = measure(method, args, shape, allocator, code)
                        _save(args.results, key, known[key])
                        print(f"measured {method} ({args.model}, {shape}, {allocator} allocator, {rev})",
                              file=sys.stderr)
                    rows.setdefault(method, {})[when] = known[key]
            rows = {m: r for m, r in rows.items() if "after" in r}
            if rows:
                report(rows, args, shape, allocator, {w: r for w, (r, _) in codes.items()})
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


def _load(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    return {r["key"]: r["result"] for r in map(json.loads, path.read_text().splitlines()) if r}


def _save(path: Path | None, key: str, result: dict) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")


def report(rows: dict[str, dict], args, shape: str, allocator: str, revs: dict) -> None:
    n_rows, seq = map(int, shape.split("x"))
    after = {m: r["after"] for m, r in rows.items()}
    base = after.get("adamw") or next(iter(after.values()))
    ckpt = ", gradient checkpointing" if args.checkpointing else ""
    first = base
    print(f"\n### {args.model}, batch {n_rows} x {seq}{ckpt}, {allocator} allocator\n\n{first['params'] / 1e6:.1f}M "
          f"parameters, vocabulary {first['vocab']:,}, fp32, CPU, {args.steps} training steps per fresh process; "
          f"code {revs['after']}" + (f", before: {revs['before']}" if "before" in revs else "") + "\n")
    before = "before" in revs
    head = "| method | what | trainable |" + (" peak before MB |" if before else "") + " peak MB |" + \
        (" after / before |" if before else "") + " x adamw | tensors MB | exp memory MB | predicted / tensors |"
    print(head)
    print("|" + "---|" * 3 + "---:|" * (head.count("|") - 4))
    for m, r in after.items():
        pred = predicted_mb(m, args.model, n_rows, seq, args.checkpointing)
        cells = [m, METHODS[m], f"{r['trainable'] / 1e6:.2f}M"]
        was = rows[m].get("before")
        if before:
            cells.append("not measured" if was is None else f"{was['peak_mb']:,.0f}")
        cells.append(f"{r['peak_mb']:,.0f}")
        if before:
            cells.append("-" if was is None else f"{r['peak_mb'] / was['peak_mb']:.2f}")
        cells += [f"{r['peak_mb'] / base['peak_mb']:.2f}", f"{r['tensors_mb']:,.0f}",
                  "-" if pred is None else f"{pred:,.0f}", "-" if pred is None else f"{pred / r['tensors_mb']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    print()
    for m in ("lomo", "adalomo"):
        if m in after and "adamw" in after:
            ratio = after[m]["peak_mb"] / after["adamw"]["peak_mb"]
            line = f"- {m}: peak {ratio:.2f}x AdamW's"
            if "lomo-optim" in after:
                diff = after[m]["peak_mb"] - after["lomo-optim"]["peak_mb"]
                line += f"; {diff:+.1f} MB against lomo-optim Lomo's peak ({'at or below' if diff <= 0 else 'ABOVE'})"
            print(line)


if __name__ == "__main__":
    main()
