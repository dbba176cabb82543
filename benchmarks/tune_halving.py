"""What synchronous successive halving saves against the full search, on the CPU stand-in.

    python benchmarks/tune_halving.py [--out DIR] [--trials 6] [--steps 12] [--eta 3] [--min-steps 1]
                                      [--sampler-seeds 0] [--seeds 3] [--threads 2]

For each sampler seed, two `exp run` of one matrix (SmolLM2-135M-Instruct, LoRA adapters, the generated
arithmetic recipe, one learning-rate search over four decades): the full search (`pruner: none`: every trial
trains all --steps) and successive halving (`pruner: halving`, --eta, --min-steps). Both draw the same --trials
Sobol points (the sampler's seed decides them), so halving's pick is one of the full search's trials. The full
search's winner is retrained with --seeds seeds (its first seed is the winning trial itself): the spread of its
validation loss over seeds is the full search's seed noise. Printed per sampler seed, all measured from the
runs' own files (`exp tune status --json`, the leaderboard): the optimizer steps each search trained and
their ratio, each search's pick and its validation loss at the full budget, and whether halving's pick is the
full search's best or within one standard deviation of its seed noise. The goal (issue 22): the full search's
best, or one within its noise, found with at most 0.4x of its training steps. Wall times are printed as well,
with the load average: other jobs on the machine stretch them, not the step counts.

Each search runs in its own runs folder (the same trial is the same cell: in one folder halving would reuse the
full search's finished trials and train nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MATRIX = """name: halving-bench
description: "learning-rate search on the CPU stand-in, {pruner}"
base:
  model: {{name: smollm2-135m-instruct, dtype: float32}}
  data: {{recipe: arithmetic, max_length: 64}}
  peft: {{method: lora}}
  optim: {{name: adamw}}
  train: {{steps: {steps}, batch_size: 4, warmup_steps: 1}}
  eval: {{tasks: [val_loss], val_batches: 4}}
  tracking: {{wandb: false}}
seeds: {seeds}
tune:
  space: {{optim.lr: {{log_uniform: [1.0e-6, 1.0e-2]}}}}
  trials: {trials}
  seed: {sampler_seed}
  pruner: {pruner}
{rungs}"""


def exp(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], check=False, capture_output=True,
                          text=True, env=env)


def search(out: Path, pruner: str, a: argparse.Namespace, sampler_seed: int, env: dict) -> dict:
    """Run one search to its end; its study (exp tune status) and its tuned leaderboard row."""
    folder = out / f"{pruner}-s{sampler_seed}"
    rungs = f"  eta: {a.eta}\n  min_steps: {a.min_steps}\n" if pruner == "halving" else ""
    seeds = list(range(a.seeds)) if pruner == "none" else [0]
    path = folder / "matrix.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(MATRIX.format(pruner=pruner, steps=a.steps, seeds=seeds, trials=a.trials,
                                  sampler_seed=sampler_seed, rungs=rungs))
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    done = exp("run", str(path), "--runs-dir", str(folder / "runs"), env=env)
    wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    if done.returncode != 0:
        sys.exit(f"exp run {path} failed:\n{done.stderr[-4000:]}")
    status = exp("tune", "status", str(folder / "runs" / "halving-bench"), "--json", env=env)
    (study,) = json.loads(status.stdout)
    board = json.loads((folder / "runs" / "halving-bench" / "leaderboard.json").read_text())
    (row,) = [r for r in board["rows"] if r.get("tuning", "").startswith("tuned")]
    return {"study": study, "row": row, "wall_s": wall, "load": (load0, load1)}


def objective(study: dict, params: dict) -> float | None:
    """The full-budget validation loss of the trial at `params` (None: it never trained the full budget)."""
    return next((t["value"] for t in study["trials"] if t["params"] == params and t["state"] == "complete"), None)


def compare(full: dict, halving: dict) -> dict:
    fs, hs = full["study"], halving["study"]
    best, pick = fs["best"], hs["best"]
    val = full["row"]["columns"]["val_loss"]
    noise = val["spread"] if val["n"] > 1 else None  # std over the full winner's seeds
    pick_full = objective(fs, pick["params"])  # halving's pick as the full search trained it (the same cell)
    same = pick["params"] == best["params"]
    within = same or (noise is not None and pick_full is not None and pick_full - best["value"] <= noise)
    return {"full_steps": fs["steps"], "halving_steps": hs["steps"], "ratio": hs["steps"] / fs["steps"],
            "full_best": best, "halving_pick": pick, "pick_in_full": pick_full, "noise_std": noise,
            "noise_runs": val["n"], "same": same, "within_noise": within,
            "wall_s": (full["wall_s"], halving["wall_s"]), "load": (full["load"], halving["load"])}


def show(seed: int, r: dict) -> None:
    lr = lambda p: f"{p['params']['optim.lr']:.3g}"  # noqa: E731
    print(f"\nsampler seed {seed}:")
    print(f"  full search : {r['full_steps']} steps, best trial {r['full_best']['number']} (lr {lr(r['full_best'])}) "
          f"val_loss {r['full_best']['value']:.4f}; seed noise (std over {r['noise_runs']} seeds of it) "
          f"{r['noise_std'] if r['noise_std'] is None else format(r['noise_std'], '.4f')}")
    print(f"  halving     : {r['halving_steps']} steps, pick trial {r['halving_pick']['number']} "
          f"(lr {lr(r['halving_pick'])}) val_loss {r['halving_pick']['value']:.4f}")
    print(f"  ratio       : {r['ratio']:.3f}x the full search's steps (goal <= 0.4x); halving's pick is "
          + ("the full search's best" if r["same"] else
             f"{'within' if r['within_noise'] else 'NOT within'} its seed noise "
             f"({r['pick_in_full']:.4f} - {r['full_best']['value']:.4f} vs std {r['noise_std']})"))
    (lf0, lf1), (lh0, lh1) = r["load"]
    print(f"  wall        : full {r['wall_s'][0]:.0f} s (load {lf0:.1f} -> {lf1:.1f}), halving {r['wall_s'][1]:.0f} s "
          f"(load {lh0:.1f} -> {lh1:.1f}); the full search's wall time includes retraining its winner")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-tune-halving"))
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--min-steps", type=int, default=1)
    p.add_argument("--sampler-seeds", default="0", help="comma-separated tune.seed values, one comparison each")
    p.add_argument("--seeds", type=int, default=3, help="seeds the full search's winner is trained with (noise)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True, check=False).stdout.strip()}")
    results = {}
    for seed in [int(s) for s in a.sampler_seeds.split(",")]:
        full = search(a.out, "none", a, seed, env)
        halving = search(a.out, "halving", a, seed, env)
        results[seed] = compare(full, halving)
        show(seed, results[seed])
    ratios = [r["ratio"] for r in results.values()]
    print(f"\nsummary: halving trained {statistics.fmean(ratios):.3f}x the full search's steps "
          f"({', '.join(f'{x:.3f}' for x in ratios)}); its pick was the best or within noise in "
          f"{sum(r['within_noise'] for r in results.values())} of {len(results)} searches")
    (a.out / "results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
