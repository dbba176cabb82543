"""What tunelab's garbage-collector policy (platform/tunelab/machine/collector.py) saves a whole `exp run`: the same
one-cell matrix run with Python's defaults (`TUNELAB_GC=plain`) and with the policy, side by side in one invocation.

    python benchmarks/collector.py [--repeats 5] [--model smollm2-135m-instruct] [--steps 3] [--out FILE]

Each repeat runs both, the order alternating, each a fresh `exp run` of a fresh runs folder (a LoRA r8 cell, batch 4,
the arithmetic recipe at max_length 64, validation on 2 batches, W&B off): the runner's process and the cell's. Timed
from the command's start to its exit, which is what a user waits for. Also from each run's files: the cell's attempt
(its process from the attempt's start to its end: imports after that point, the model, data, steps, validation,
final/) and the steps alone, so a difference that is the machine's (a slower step) shows as one. Prints every run,
each side's median, min and max, the ratio of each pair (policy / plain) with its median, min and max, and the load
before and after. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MATRIX = """name: gc
base:
  model: {{name: {model}, dtype: float32}}
  data: {{recipe: arithmetic, max_length: 64}}
  peft: {{method: lora, r: 8}}
  train: {{steps: {steps}, batch_size: 4, warmup_steps: 1}}
  eval: {{tasks: [val_loss], val_batches: 2}}
  tracking: {{wandb: false}}
"""
SIDES = ("plain", "policy")


def one(side: str, matrix: str, work: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"{side}.", dir=work))
    (folder / "gc.yaml").write_text(matrix)
    env = {**os.environ, "TUNELAB_GC": "plain" if side == "plain" else "default"}
    t0 = time.perf_counter()
    done = subprocess.run([shutil.which("exp") or "exp", "run", "gc.yaml"], check=False, cwd=folder, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{side}: exp run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cell = next((folder / "runs" / "gc").glob("*/attempts.jsonl")).parent
    attempt = json.loads((cell / "attempts.jsonl").read_text().splitlines()[-1])
    steps = sum(json.loads(line)["step_s"] for line in (cell / "train" / "metrics.jsonl").read_text().splitlines())
    shutil.rmtree(folder)
    return {"side": side, "wall_s": wall, "attempt_s": attempt["seconds"], "steps_s": steps}


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="the runs as JSON")
    args = ap.parse_args()
    matrix = MATRIX.format(model=args.model, steps=args.steps)
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    with tempfile.TemporaryDirectory(prefix="tunelab-gc.") as tmp:
        one("plain", matrix, Path(tmp))  # warm-up, not counted: the model's cache, the file system's
        runs = []
        for r in range(args.repeats):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                runs.append({"repeat": r, **one(side, matrix, Path(tmp))})
                x = runs[-1]
                print(f"repeat {r} {side:6s} exp run {x['wall_s']:.2f} s, attempt {x['attempt_s']:.2f} s, "
                      f"steps {x['steps_s']:.2f} s", flush=True)
    load.append(Path("/proc/loadavg").read_text().split()[:3])
    for key, what in (("wall_s", "exp run, start to exit"), ("attempt_s", "the cell's attempt"),
                      ("steps_s", "its steps")):
        by = {s: [x[key] for x in runs if x["side"] == s] for s in SIDES}
        ratios = [p[key] / q[key] for p, q in zip(*[[x for x in runs if x["side"] == s] for s in ("policy", "plain")])]
        print(f"{what}: plain {spread(by['plain'])} s; policy {spread(by['policy'])} s; "
              f"policy / plain {spread(ratios)}")
    print(f"load (1, 5, 15 min) before {' '.join(load[0])}, after {' '.join(load[1])}")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "load": load, "model": args.model, "steps": args.steps},
                                       indent=1))


if __name__ == "__main__":
    main()
