"""A fair share of the machine (issue #52): tunelab's cells beside other processes that want the same CPUs.

    python benchmarks/shared_cpu.py [--steps 6] [--repeats 1] [--only alone,beside,before,runners,workers,together]
                                    [--model smollm2-135m-instruct] [--out FILE]

Every figure is `exp run` as a user runs it (a fresh runs folder each time, the model and data cache shared and
warmed first by an untimed one-step cell), on one LoRA cell: SmolLM2-135M-Instruct, LoRA r 16, AdamW, batch 4 of
packed 128-token rows of the arithmetic recipe (512 tokens a step), validation loss on one batch. OMP_NUM_THREADS
and the waiting policy are unset, so tunelab sizes each cell itself (docs/training.md, "Threads").

- alone:   the cell, nothing else of this script running. Its step time: the median `step_s` of steps 2..N of
           its train/metrics.jsonl (step 1 warms up).
- beside:  the same cell while a foreign torch process runs a 1024x1024 fp32 matmul loop with torch's defaults
           (a thread per core, libgomp's default spinning): speed beside / alone = alone's step time / beside's.
           Goal: at least 0.4x.
- before:  the cell as tunelab ran it before #52, alone and beside the same neighbour: `--threads <CPUs of the
           machine>` and libgomp's default waiting (GOMP_SPINCOUNT=300000, its documented default, which makes
           tunelab leave the policy alone). The 0.09x of the issue, measured in the same run; and alone, what
           sleeping idle threads cost a cell that has the machine to itself.
- runners: a matrix of 4 such cells (4 learning rates), one `exp run` against two `exp run` started together on
           one runs folder (they share its cells): wall time from start to the last exit. Goal: two <= one.
- workers: the same matrix with `exp run --workers 2` against one `exp run` (one cell at a time). Goal: <= one.
- together: the same matrix as one together-group (`exp run`'s default since #46: the 4 cells share the base in one
           process) against one cell at a time, for scale (benchmarks/together.py measures it properly).
The runners and workers figures run each cell in its own process (`--together off`), which is what #52 is about.

The machine's load average (1 minute) is printed before and after each measurement: other users' jobs show there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CELL = """name: {name}
base:
  model: {{name: {model}}}
  data: {{recipe: arithmetic, max_length: 128, pack: true}}
  peft: {{method: lora, r: 16, alpha: 32}}
  optim: {{name: adamw, lr: 2.0e-4}}
  train: {{steps: {steps}, batch_size: 4, warmup_steps: 1, log_every: 1}}
  eval: {{tasks: [val_loss], val_batches: 1, batch_size: 4}}
  tracking: {{wandb: false}}
matrix:
  optim.lr: {lrs}
"""
NEIGHBOUR = ("import torch\na = torch.randn(1024, 1024)\nprint('ready', flush=True)\nwhile True:\n    a @ a\n")
OWN = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "MKL_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OWN and not k.startswith("TUNELAB_THREADS")
           and k != "TUNELAB_CPUS"}
    return {**env, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", **extra}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def matrix(tmp: Path, name: str, model: str, steps: int, cells: int) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(CELL.format(name=name, model=model, steps=steps,
                                lrs=[round(2.0e-4 * (i + 1), 6) for i in range(cells)]))
    return path


def exp_run(path: Path, runs: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tunelab.cli", "run", str(path), "--runs-dir", str(runs), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or clean_env(), stdin=subprocess.DEVNULL)


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"exp run failed ({p.returncode}):\n{out[-3000:]}")


def step_times(runs: Path) -> list[float]:
    """step_s of steps 2.. of every cell of a runs folder's matrix."""
    out = []
    for m in runs.iterdir():
        for cell in m.iterdir():
            metrics = cell / "train" / "metrics.jsonl"
            if metrics.is_file():
                rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                out += [r["step_s"] for r in rows if r["step"] >= 2]
    return out


def threads_of(runs: Path) -> list[dict]:
    return [json.loads((c / "env.json").read_text())["threads"] for m in runs.iterdir() for c in m.iterdir()
            if (c / "env.json").is_file()]


def one_cell(tmp: Path, tag: str, model: str, steps: int, *args: str, env: dict[str, str] | None = None,
             neighbour: bool = False) -> dict:
    path = matrix(tmp, f"one-{tag}", model, steps, 1)
    runs = tmp / f"runs-{tag}"
    before = load()
    side = None
    if neighbour:
        side = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE, text=True,
                                env=clean_env())
        assert side.stdout is not None and side.stdout.readline().strip() == "ready"
    try:
        t0 = time.perf_counter()
        finish(exp_run(path, runs, *args, env=env))
        wall = time.perf_counter() - t0
    finally:
        if side is not None:
            side.kill()
            side.wait()
    times = step_times(runs)
    t = threads_of(runs)[0]
    return {"what": tag, "median_step_s": statistics.median(times), "steps_s": [round(x, 2) for x in times],
            "wall_s": round(wall, 1), "threads": t["intra"], "wait_policy": t["wait_policy"],
            "load_before": before, "load_after": load()}


def the_matrix(tmp: Path, tag: str, model: str, steps: int, runners: int, *args: str) -> dict:
    path = matrix(tmp, f"four-{tag}", model, steps, 4)
    runs = tmp / f"runs-{tag}"
    before = load()
    t0 = time.perf_counter()
    args = args if "--together" in args else ("--together", "off", *args)  # each cell its own process
    finish(*[exp_run(path, runs, *args) for _ in range(runners)])
    wall = time.perf_counter() - t0
    return {"what": tag, "wall_s": round(wall, 1), "threads": sorted({t["intra"] for t in threads_of(runs)}),
            "median_step_s": round(statistics.median(step_times(runs)), 2), "load_before": before,
            "load_after": load()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default="alone,beside,before,runners,workers,together")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    only = set(a.only.split(","))
    cpus = len(os.sched_getaffinity(0))
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"warming the model and data cache (untimed); {cpus} CPUs, load {load()}", flush=True)
        finish(exp_run(matrix(tmp, "warm", a.model, 1, 1), tmp / "runs-warm"))
        for r in range(a.repeats):
            todo = [
                ("alone", lambda r=r: one_cell(tmp, f"alone{r}", a.model, a.steps)),
                ("before", lambda r=r: one_cell(tmp, f"alone-before{r}", a.model, a.steps, "--threads", str(cpus),
                                                env=clean_env(GOMP_SPINCOUNT="300000"))),
                ("beside", lambda r=r: one_cell(tmp, f"beside{r}", a.model, a.steps, neighbour=True)),
                ("before", lambda r=r: one_cell(tmp, f"before{r}", a.model, a.steps, "--threads", str(cpus),
                                                env=clean_env(GOMP_SPINCOUNT="300000"), neighbour=True)),
                ("runners", lambda r=r: the_matrix(tmp, f"one-runner{r}", a.model, a.steps, 1)),
                ("runners", lambda r=r: the_matrix(tmp, f"two-runners{r}", a.model, a.steps, 2)),
                ("workers", lambda r=r: the_matrix(tmp, f"workers2-{r}", a.model, a.steps, 1, "--workers", "2")),
                ("together", lambda r=r: the_matrix(tmp, f"together{r}", a.model, a.steps, 1, "--together", "auto")),
            ]
            for group, measure in todo:
                if group in only:
                    got = {"repeat": r, **measure()}
                    results.append(got)
                    print(json.dumps(got), flush=True)
    by = {x["what"]: x for x in results}
    print("\nratios (per repeat):")
    for r in range(a.repeats):
        alone, beside, before = by.get(f"alone{r}"), by.get(f"beside{r}"), by.get(f"before{r}")
        if alone and beside:
            print(f"  [{r}] beside a foreign torch process: {alone['median_step_s'] / beside['median_step_s']:.2f}x of "
                  f"its speed alone (goal >= 0.4x; {beside['median_step_s']:.2f} s vs {alone['median_step_s']:.2f} s "
                  f"a step)")
        old_alone = by.get(f"alone-before{r}")
        if old_alone and before:
            print(f"  [{r}] as before #52, beside it: {old_alone['median_step_s'] / before['median_step_s']:.2f}x of "
                  f"its speed alone ({before['median_step_s']:.2f} s vs {old_alone['median_step_s']:.2f} s a step)")
        if alone and old_alone:
            print(f"  [{r}] alone, now / as before #52 (the cost of sleeping idle threads): "
                  f"{old_alone['median_step_s'] / alone['median_step_s']:.2f}x the speed")
        one, two, w2 = by.get(f"one-runner{r}"), by.get(f"two-runners{r}"), by.get(f"workers2-{r}")
        if one and two:
            print(f"  [{r}] two runners / one on 4 cells: {two['wall_s'] / one['wall_s']:.2f}x the time (goal <= 1; "
                  f"{two['wall_s']} s vs {one['wall_s']} s)")
        if one and w2:
            print(f"  [{r}] --workers 2 / one at a time: {w2['wall_s'] / one['wall_s']:.2f}x the time (goal <= 1; "
                  f"{w2['wall_s']} s vs {one['wall_s']} s)")
        tg = by.get(f"together{r}")
        if one and tg:
            print(f"  [{r}] one together-group / one at a time: {tg['wall_s'] / one['wall_s']:.2f}x the time "
                  f"({tg['wall_s']} s vs {one['wall_s']} s)")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
