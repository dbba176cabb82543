"""Together-groups against one process per trial and rung (#46), side by side in one invocation.

    python benchmarks/together.py [--out DIR] [--scenarios a,b,c,d] [--repeats 1] [--threads 1] [--batched]

Scenarios (each run twice per repeat, `exp run --together off` and `exp run` with the default `auto`, in separate
runs folders, the order alternating from repeat to repeat):
  a  the paper_tuned_optimizers CPU stand-in (its header's --set line): AdamW, Lion, Adan and AdaLomo, 6 LoRA trials
     each halved at step 4 of 12, then the 4 default rows
  b  a 16-trial LoRA search on SmolLM2-135M-Instruct: optim.lr log-uniform 1e-5..1e-2 x peft.r in {4, 8, 16, 32},
     12 steps, batch 4, successive halving with eta 2 from step 3 (rungs 3/6/12: 16 -> 8 -> 4), val_batches 2
  c  memory: 8 LoRA r8 cells of SmolLM2 in one group (`--together 8`) against one such cell alone, glibc's mmap
     threshold pinned (MALLOC_MMAP_THRESHOLD_=65536, as benchmarks/optimizer_memory.py) so that RSS follows the
     tensors; the memory model's predictions beside
  d  b's search ranked at its rungs by a checkpoint score (`metric: val_loss`, `intermediate: checkpoint`): each
     trial scores its rung checkpoint before the rung is decided; alone, each trial's process loads the base again
     to score it (checkpoint_scores/evaluate.py), together the group scores every member's in shared passes over its
     base (checkpoint_scores/shared.py)

Where each run's wall time went, from its own files: training steps (every metrics.jsonl record's step_s) and
validation (val_s, and a finished cell's final validation: summary.json's final_val_s), and outside them (wall -
steps - validation), split into what the processes recorded: imports (a process's start to its attempt's start),
model load, data, adapters and loop setup, checkpoint I/O, evaluation (attempts.jsonl of every cell; a
together-group's process's own in .together/*/record.json), the runner alone before its first process starts and
after the last attempt ends (trial table, figures, leaderboard, report), the rest (processes' start and exit, the
runner between them, waits).
Printed with the goals of issue 46 on this CPU: outside <= 0.25x;
(b) wall <= 0.5x with the same winners and leaderboard (every row equal but its timing and memory columns); (c) the
group's peak <= 1.5x one cell's, the prediction within 10% of the measured tensors (peak RSS less what the process
held before the model).

--batched adds a third run to a and b: `exp run --together-mode batched` (train/batched.py: each step's rows of all
members in one pass through the base). It is close to alone, not bit for bit, so its trial table is compared by
what a search decides (which trials each rung keeps, the winner) and its values by their largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

STAND_IN = ["--set", "model.name=smollm2-135m-instruct", "--set", "model.dtype=float32", "--set",
            "data.recipe=arithmetic", "--set", "data.max_length=64", "--set", "parallel.dp=1", "--set",
            "peft.method=lora", "--set", "train.steps=12", "--set", "train.batch_size=4", "--set",
            "train.grad_accum=1", "--set", "train.warmup_steps=1", "--set", "train.gradient_checkpointing=false",
            "--set", "train.save_every=null", "--set", "eval.tasks=[val_loss]", "--set", "eval.val_batches=4",
            "--set", "tune.trials=6", "--set", "tune.min_steps=4", "--set", "seeds=[0]"]

SEARCH = """name: together-search
description: "16 LoRA trials on SmolLM2-135M: learning rate x rank, halving (eta 2) from step 3"
base:
  model: {name: smollm2-135m-instruct, dtype: float32}
  data: {recipe: arithmetic, max_length: 64}
  peft: {method: lora}
  train: {steps: 12, batch_size: 4, warmup_steps: 1}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {log_uniform: [1.0e-5, 1.0e-2]}, peft.r: {choice: [4, 8, 16, 32]}}
  trials: 16
  pruner: halving
  eta: 2
  min_steps: 3
"""

RANKED = SEARCH.replace("name: together-search", "name: together-ranked").replace(
    "  min_steps: 3\n", "  min_steps: 3\n  metric: val_loss\n  intermediate: checkpoint\n")

MEMORY = """name: together-memory
base:
  model: {name: smollm2-135m-instruct, dtype: float32}
  data: {recipe: arithmetic, max_length: 64}
  peft: {method: lora, r: 8}
  train: {steps: 3, batch_size: 4, warmup_steps: 1}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
matrix:
  optim.lr: LRS
"""
PARTS = ("imports", "load", "data", "setup", "checkpoint I/O", "evaluation", "runner start", "runner end", "rest")
TIMING_COLUMNS = {"tok/s", "peak MB", "train s"}  # measured time and memory: not the result
TIMING_KEYS = {"search cost"}  # a tuned row's measured CPU-hours


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def exp_run(file: Path, runs: Path, extra: list[str], env: dict
            ) -> tuple[float, tuple[float, float], tuple[float, float]]:
    """`exp run` to its end -> (wall seconds, load average before and after, its start and end on the epoch clock
    that the runs' files use)."""
    t0, load0, since = time.perf_counter(), os.getloadavg()[0], time.time()
    done = subprocess.run([sys.executable, "-m", "tunelab.cli", "run", str(file), "--runs-dir", str(runs), *extra],
                          check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"exp run {file} {' '.join(extra)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return time.perf_counter() - t0, (load0, os.getloadavg()[0]), (since, time.time())


def jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def where(matrix: Path, wall: float, span: tuple[float, float]) -> dict:
    """Where a run's wall time went, from its files (see the docstring); `span`: the run's start and end."""
    cells = [p.parent for p in matrix.glob("*/cell.json")]
    metrics = [r for c in cells for r in jsonl(c / "train" / "metrics.jsonl")]
    attempts = [a for c in cells for a in jsonl(c / "attempts.jsonl")]
    groups = [json.loads(p.read_text()) for p in matrix.glob(".together/*/record.json")]
    alone = [a for a in attempts if not a.get("together")]
    t = lambda rows, key: sum(r["timings"].get(key, 0.0) for r in rows)  # noqa: E731
    summaries = [json.loads(f.read_text()) for c in cells if (f := c / "train" / "summary.json").is_file()]
    out = {"wall": wall, "steps": sum(r.get("step_s", 0.0) for r in metrics),
           "validation": sum(r.get("val_s", 0.0) for r in metrics)
           + sum(s.get("final_val_s") or 0.0 for s in summaries),  # a finished cell's final validation too
           "processes": len(alone) + len(groups), "attempts": len(attempts),
           "imports": sum(a["started_at"] - a["process_started_at"] for a in alone)
           + sum(g.get("import_s", 0.0) for g in groups),
           "load": t(alone, "load_s") + sum(g.get("load_s", 0.0) for g in groups),
           "data": t(alone, "data_s") + sum(g.get("data_s", 0.0) for g in groups),
           "setup": t(alone, "setup_s") - t(alone, "load_s") - t(alone, "data_s")
           + t([a for a in attempts if a.get("together")], "setup_s") + sum(g.get("inject_s", 0.0) for g in groups),
           "checkpoint I/O": t(attempts, "checkpoint_s"),
           "evaluation": t(attempts, "eval_s") + t(attempts, "checkpoints_s"),
           # the runner alone: from its start to its first cell's or group's process, from the last attempt's end
           # to its exit (trial table, figures, leaderboard, report)
           "runner start": min(a["process_started_at"] for a in attempts) - span[0],
           "runner end": span[1] - max(a["ended_at"] for a in attempts)}
    out["outside"] = wall - out["steps"] - out["validation"]
    out["rest"] = out["outside"] - sum(out[k] for k in PARTS[:-1])
    return out


def board(matrix: Path) -> list[dict]:
    """The leaderboard's rows without their timing and memory columns."""
    rows = json.loads((matrix / "leaderboard.json").read_text())["rows"]
    return [{**{k: v for k, v in r.items() if k not in TIMING_KEYS},
             "columns": {k: v for k, v in r["columns"].items() if k not in TIMING_COLUMNS}} for r in rows]


def trials(matrix: Path) -> list:
    out = []
    for study in sorted(matrix.glob("tune/*/trials.json")):
        data = json.loads(study.read_text())
        out.append([(t["number"], t["params"], t["state"], t["value"], t["intermediate"]) for t in data["trials"]])
    return out


def show_where(label: str, w: dict, load: tuple[float, float]) -> None:
    parts = ", ".join(f"{k} {w[k]:.1f}" for k in PARTS)
    print(f"  {label:9s} wall {w['wall']:7.1f} s (load {load[0]:.1f} -> {load[1]:.1f}): steps {w['steps']:.1f}, "
          f"validation {w['validation']:.1f}, outside {w['outside']:.1f} [{parts}]; {w['processes']} processes, "
          f"{w['attempts']} attempts")


def scenario_run(name: str, a: argparse.Namespace, env: dict, repeat: int) -> dict:
    """Scenario a or b: the same matrix with --together off and auto, in separate runs folders."""
    if name == "a":
        file, extra, matrix_name = Path("experiments/paper_tuned_optimizers.yaml"), STAND_IN, "paper_tuned_optimizers"
    else:
        file = a.out / f"search-{name}.yaml"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(SEARCH if name == "b" else RANKED)
        extra, matrix_name = [], "together-search" if name == "b" else "together-ranked"
    order = ["off", "auto"] if repeat % 2 == 0 else ["auto", "off"]
    if a.batched:
        order.append("batched")
    got = {}
    for mode in order:
        runs = a.out / f"{name}-r{repeat}-{mode}"
        flags = ["--together", "auto", "--together-mode", "batched"] if mode == "batched" else ["--together", mode]
        shutil.rmtree(runs, ignore_errors=True)  # a runs folder of an earlier invocation would make this one a no-op
        wall, load, span = exp_run(file, runs, [*extra, *flags], env)
        got[mode] = {"where": where(runs / matrix_name, wall, span), "load": load, "board": board(runs / matrix_name),
                     "trials": trials(runs / matrix_name)}
    off, on = got["off"], got["auto"]
    print(f"\n({name}) repeat {repeat} ({' then '.join(order)}):")
    show_where("alone", off["where"], off["load"])
    show_where("together", on["where"], on["load"])
    r = {"outside": on["where"]["outside"] / off["where"]["outside"],
         "wall": on["where"]["wall"] / off["where"]["wall"],
         "same_board": on["board"] == off["board"], "same_trials": on["trials"] == off["trials"],
         "alone": off["where"], "together": on["where"], "loads": (off["load"], on["load"])}
    met = "met" if r["outside"] <= 0.25 else "NOT met"
    print(f"  together/alone: outside {r['outside']:.3f}x (goal <= 0.25x: {met}), "
          f"wall {r['wall']:.3f}x" + (f" (goal <= 0.5x: {'met' if r['wall'] <= 0.5 else 'NOT met'})" if name == "b"
                                      else "")
          + f"; leaderboard rows equal but timing/memory columns: {r['same_board']}; trial tables equal: "
          f"{r['same_trials']}")
    if a.batched:
        b = got["batched"]
        show_where("batched", b["where"], b["load"])
        r.update(batched=b["where"], wall_batched=b["where"]["wall"] / off["where"]["wall"],
                 same_decisions_batched=decisions(b["trials"]) == decisions(off["trials"]),
                 largest_value_difference_batched=largest_difference(b["trials"], off["trials"]))
        print(f"  batched/alone: wall {r['wall_batched']:.3f}x"
              + (f" (goal <= 0.5x: {'met' if r['wall_batched'] <= 0.5 else 'NOT met'})" if name == "b" else "")
              + f"; the same rung decisions and winners: {r['same_decisions_batched']}; largest difference of a "
              f"trial's value from alone's: {r['largest_value_difference_batched']:.2e}")
    return r


def decisions(studies: list) -> list:
    """What a search decided: each trial's parameters, how far it went and the order of the finished ones."""
    out = []
    for study in studies:
        done = sorted((t for t in study if t[3] is not None), key=lambda t: t[3])
        out.append(([(n, p, state, len(inter or {})) for n, p, state, _, inter in study], [t[0] for t in done]))
    return out


def largest_difference(a: list, b: list) -> float:
    pairs = [(x[3], y[3]) for sa, sb in zip(a, b) for x, y in zip(sa, sb) if x[3] is not None and y[3] is not None]
    return max((abs(x - y) for x, y in pairs), default=float("nan"))


def scenario_memory(a: argparse.Namespace, env: dict, repeat: int) -> dict:
    lrs = [round(1e-4 * (k + 1), 6) for k in range(8)]
    pinned = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = {}
    for label, n, flags in (("one", 1, ["--together", "off"]), ("group", 8, ["--together", "8"])):
        file = a.out / f"memory-{label}.yaml"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(MEMORY.replace("LRS", json.dumps(lrs[:n])))
        runs = a.out / f"c-r{repeat}-{label}"
        shutil.rmtree(runs, ignore_errors=True)
        wall, load, _ = exp_run(file, runs, flags, pinned)
        matrix = runs / "together-memory"
        if label == "one":
            (cell,) = [p.parent for p in matrix.glob("*/cell.json")]
            mem = json.loads((cell / "train" / "memory.json").read_text())
            measured = mem["peak_mb"][0] - mem["rss_before_load_mb"][0]
            predicted = json.loads((cell / "train" / "summary.json").read_text())["predicted_peak_mb"]
        else:
            (record,) = [json.loads(p.read_text()) for p in matrix.glob(".together/*/record.json")]
            measured = record["peak_mb"] - record["rss_before_load_mb"]
            predicted = record["predicted_peak_mb"]
        out[label] = {"measured_mb": measured, "predicted_mb": predicted, "wall": wall, "load": load}
        print(f"  (c) {label:5s}: {n} LoRA r8 member(s): tensors {measured:.0f} MB (peak RSS - RSS before the model), "
              f"predicted {predicted:.0f} MB ({predicted / measured:.3f}x), wall {wall:.0f} s, load {load[0]:.1f}")
    ratio = out["group"]["measured_mb"] / out["one"]["measured_mb"]
    pred = out["group"]["predicted_mb"] / out["group"]["measured_mb"]
    print(f"  (c) 8 joined / 1 alone: {ratio:.3f}x (goal <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); the "
          f"group's prediction {pred:.3f}x measured (goal within 10%: {'met' if abs(pred - 1) <= 0.10 else 'NOT met'})")
    return {**out, "ratio": ratio, "prediction_ratio": pred}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-together"))
    p.add_argument("--scenarios", default="a,b,c")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="threads a process (on a shared 2-core machine, 2 spin)")
    p.add_argument("--batched", action="store_true", help="a and b: also --together-mode batched")
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    print(f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{a.threads} threads a process; uptime at the start: {uptime()}")
    results: dict = {}
    for repeat in range(a.repeats):
        for name in a.scenarios.split(","):
            key = f"{name}-r{repeat}"
            results[key] = scenario_memory(a, env, repeat) if name == "c" else scenario_run(name, a, env, repeat)
            (a.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nuptime at the end: {uptime()}")


if __name__ == "__main__":
    main()
