"""Run many layouts inside one torchrun launch and write their losses as JSON.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node N tests/parallel/run_layouts.py OUT.json [CKPT_DIR]

Every layout whose process count is N runs the first steps of `common` with each method; the
pytest side compares the numbers with a single-process reference. With CKPT_DIR, the runs named in
CKPT_RUNS also save a distributed checkpoint after step 2 in CKPT_DIR/<layout>-<method> (the resume
test loads them on one process).

The model is built as a cell builds it (train.parallel.init_mode): on the meta device and filled per shard
from a saved copy (native engine), partitioned at construction (DeepSpeed ZeRO-3), or whole on every rank
(ZeRO-1/2, and the layouts named *-whole, which keep that path covered for the engines that shard).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, as pytest sees it
from parallel import common  # noqa: E402

LAYOUTS = {  # name -> parallel section; grouped by world size through dp * tp * pp
    "dp2": {"dp": 2},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "dp2-whole": {"dp": 2},
    "tp2": {"tp": 2},
    "pp2-gpipe": {"pp": 2, "pp_schedule": "gpipe", "microbatches": 2},
    "pp2-1f1b": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    "pp2-interleaved": {"pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2},
    "ds-zero1": {"dp": 2, "backend": "deepspeed", "zero": 1},
    "ds-zero2": {"dp": 2, "backend": "deepspeed", "zero": 2},
    "ds-zero3": {"dp": 2, "backend": "deepspeed", "zero": 3},
    "ds-zero3-whole": {"dp": 2, "backend": "deepspeed", "zero": 3},
    "ds-zero2-offload": {"dp": 2, "backend": "deepspeed", "zero": 2, "cpu_offload": True},
    "ds-zero3-offload": {"dp": 2, "backend": "deepspeed", "zero": 3, "cpu_offload": True},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "pp2xdp2": {"pp": 2, "dp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    "pp2xtp2": {"pp": 2, "tp": 2, "pp_schedule": "gpipe", "microbatches": 2},
    "pp2xdp2xtp2": {"pp": 2, "dp": 2, "tp": 2, "pp_schedule": "1f1b", "microbatches": 2},
}
CKPT_RUNS, CKPT_AFTER = ("dp2xtp2/full", "pp2-1f1b/tied", "ds-zero3/adalomo"), 2
# DeepSpeed with an in-backward optimizer writes full weights and the optimizer's state: checkpoint ->
# the layout that resumes it here (the native ones are resumed on one process by the pytest side).
DS_RESUMES = {"ds-zero3/adalomo": "ds-zero1"}


# Plain LOMO where each engine's own path for in-backward optimizers runs (FSDP2, tensor parallel, a pipeline,
# DeepSpeed at stage 0 and ZeRO-3); AdaLomo, which shares that machinery, runs on every layout.
LOMO_LAYOUTS = ("dp2", "tp2", "pp2-1f1b", "ds-zero2", "ds-zero3")


def methods(name: str) -> list[str]:
    p = LAYOUTS[name]
    skip = set() if name in LOMO_LAYOUTS else {"lomo"}
    if p.get("cpu_offload") and p.get("zero") != 3:  # offloads optimizer state, which AdaLomo barely has
        skip.add("adalomo")
    if p.get("pp", 1) == 1:  # tied embeddings only need care where pipeline stages split them
        skip.add("tied")
    return [m for m in common.METHODS if m not in skip]


def size(p: dict) -> int:
    return p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1)


def bases(folder: Path) -> None:
    """The base model of each method saved once (safetensors, as a cell's model folder has it)."""
    if dist.get_rank() == 0:
        for method in common.METHODS:
            if not (folder / method).is_dir():
                common.tiny_base(method).save_pretrained(folder / method)
    dist.barrier()


def build(name: str, cell, layout, method: str, folder: Path):
    """(model, deferred weights or None), built the way a cell builds it on this layout."""
    from tunelab.machine import runtime
    from tunelab.models import loading
    from tunelab.train import parallel as par

    mode = "whole" if name.endswith("-whole") else par.init_mode(cell, layout)[0]
    src = folder / method
    if mode == "meta":
        model = loading.empty(cell.model.model_copy(update={"name": str(src)}), torch.float32, "sdpa")
        return par.with_adapters(model, lambda m: common.with_peft(m, method), loading.Weights(src))
    if mode == "zero3":
        cell = cell.model_copy(update={"model": cell.model.model_copy(update={"name": str(src), "attn": "sdpa"})})
        model = par.load_partitioned(cell.model, runtime.resolve(cell, layout), cell)
        return common.with_peft(model, method), None
    return common.tiny_model(method), None


def first_grads(stepper) -> dict:
    """Every trainable parameter's gradient of the step that runs next, whole, by name, as the engine hands it to
    clipping (native: `grads.clip_`; DeepSpeed: at the accumulation boundary, before its step clips); each rank
    holds those of its own pipeline stage. Filled while that step runs; an engine whose optimizer updates inside
    backward (LOMO, AdaLomo) never holds them, and nothing is filled."""
    from torch.distributed.tensor import DTensor

    from tunelab.train.parallel import grads

    got: dict = {}
    whole = lambda g: (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()  # noqa: E731
    if hasattr(stepper, "engine"):  # DeepSpeed
        import deepspeed

        engine, step = stepper.engine, stepper.engine.step

        def ds_step(*a, **kw):
            if engine.is_gradient_accumulation_boundary():
                for n, p in engine.module.named_parameters(remove_duplicate=False):
                    if p.requires_grad:  # every rank takes part: ZeRO gathers the partitions
                        got[n] = whole(deepspeed.utils.safe_get_full_grad(p))
                engine.step = step
            return step(*a, **kw)

        if stepper.fused is None:
            engine.step = ds_step
        return got
    names = [(n, p) for n, p in stepper._view().named_parameters(remove_duplicate=False) if p.requires_grad]
    clip = grads.clip_

    def clipping(*a, **kw):
        if not got:
            got.update({n: whole(p.grad) for n, p in names})  # in the same order on every rank of a mesh
        grads.clip_ = clip
        return clip(*a, **kw)

    grads.clip_ = clipping
    return got


def on_main(part: dict) -> dict | None:
    """Every rank's {name: tensor} merged on rank 0 (pipeline stages hold disjoint parameters)."""
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    return {k: v for p in parts or [] for k, v in p.items()} if parts else None


REFERENCES: dict = {}  # method -> the one-process reference with its tensors, computed once per launch on rank 0


def run(name: str, parallel: dict, method: str, ckpt: Path | None, folder: Path) -> dict:
    from tunelab.train import parallel as par
    from tunelab.train.parallel import grads

    cell = common.cell(parallel, method)
    layout = par.setup(cell.parallel)
    model, weights = build(name, cell, layout, method, folder)
    stepper = par.prepare(model, common.optimizer(method), cell, layout, weights=weights)
    losses, norms = [], []
    clip = grads.clip_
    try:
        first = first_grads(stepper)
        for i, step in enumerate(common.batches(), start=1):
            loss, norm = stepper.train_step(step, common.n_items(step))
            losses.append(loss)
            norms.append(norm)
            if ckpt and f"{name}/{method}" in CKPT_RUNS and i == CKPT_AFTER:
                stepper.save(ckpt / f"{name}-{method}")
    finally:
        grads.clip_ = clip
    first = on_main(first)
    val = stepper.eval_loss(common.batches(1)[0][0])
    model = stepper.unwrap()
    full = sum(float(p.detach().double().sum()) for p in model.parameters()) if model is not None else None
    out = {"loss": losses, "grad_norm": norms, "eval": list(val), "param_sum": full}
    if dist.get_rank() == 0:  # every parameter against the reference's, here where the tensors are
        ref = REFERENCES.setdefault(method, common.reference(method, tensors=True))
        out["grads"] = common.max_diff(first, ref["grads"]) if first else None
        if model is not None:
            out["weights"] = common.max_diff({k: p.detach() for k, p in model.named_parameters(
                remove_duplicate=False)}, ref["weights"])
    return out


def resume(source: str, target: str, ckpt: Path) -> dict:
    """Load `source`'s step-2 checkpoint under layout `target` and take step 3."""
    from tunelab.train import parallel as par

    method = source.split("/")[1]
    cell = common.cell(LAYOUTS[target], method)
    stepper = par.prepare(common.tiny_model(method), common.optimizer(method), cell, par.setup(cell.parallel))
    stepper.load(ckpt / source.replace("/", "-"))
    step = common.batches()[CKPT_AFTER]
    loss, norm = stepper.train_step(step, common.n_items(step))
    return {"loss": [loss], "grad_norm": [norm]}


def main() -> None:
    out, ckpt = Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    folder = out.parent / "bases"
    bases(folder)
    results = {}
    for name, parallel in LAYOUTS.items():
        only = os.environ.get("TUNELAB_LAYOUTS")  # comma-separated names, for debugging one layout
        if size(parallel) != world or (only and name not in only.split(",")):
            continue
        for method in methods(name):
            t0 = time.perf_counter()
            try:
                results[f"{name}/{method}"] = run(name, parallel, method, ckpt, folder)
            except Exception as e:  # recorded, so one broken layout does not hide the others
                import traceback

                traceback.print_exc()
                results[f"{name}/{method}"] = {"error": f"{type(e).__name__}: {e}"}
            results[f"{name}/{method}"]["seconds"] = time.perf_counter() - t0
            dist.barrier()
    for source, target in DS_RESUMES.items():
        if ckpt and f"{source}" in results and "error" not in results[source]:
            results[f"resume {source} -> {target}"] = resume(source, target, ckpt)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
