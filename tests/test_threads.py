"""Issue #52, a fair share of the machine: the threads each tunelab process gets (from its affinity, its cgroup's
CPU quota, --workers, --threads or the user's OMP_NUM_THREADS), its waiting policy set before torch loads, cells
side by side with `exp run --workers N` (pinned, with the losses of one at a time), and what the progress line and
`exp status` say when the machine slows a cell down.

The automatic path needs OMP_NUM_THREADS unset (CI and conftest set it for every other test): these tests start
their processes without it and inject the affinity (os.sched_setaffinity in the child, or TUNELAB_CPUS).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write
from rich.console import Console

from tunelab.core import events
from tunelab.core.errors import UserError
from tunelab.core.files import read_json, read_jsonl, write_json
from tunelab.folders.cell import CellFolder
from tunelab.machine import load
from tunelab.machine.threads import (
    CPUS_ENV,
    FROM_ENV,
    GOMP_SPIN,
    OWN_ENV,
    WAIT_KNOBS,
    Cpus,
    Share,
    beside_env,
    cgroup_quota,
    cpu_list,
    parse_cpu_list,
    process_env,
    shares,
    wait_env,
)
from tunelab.run.launch import threads_env
from tunelab.run.progress import LinesView

AFFINITY = sorted(os.sched_getaffinity(0))
TWO_CPUS = pytest.mark.skipif(len(AFFINITY) < 2, reason="needs 2 CPUs to run two cells on CPUs of their own")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any thread count or waiting policy: the automatic path."""
    drop = ("OMP_NUM_THREADS", *WAIT_KNOBS, *OWN_ENV)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "WANDB_MODE": "disabled", **extra}


# -- what a runner plans for its cells ------------------------------------------------------------------------


def test_a_cell_gets_the_usable_cpus_divided_by_the_cells_at_once():
    two = Cpus((0, 1), None)
    (one,) = shares(1, env={}, cpus=two)
    assert (one.threads, one.source, one.cpus) == (2, "auto", ())  # alone: every CPU, where the runner runs
    a, b = shares(2, env={}, cpus=two)
    assert (a.threads, a.cpus, b.threads, b.cpus) == (1, (0,), 1, (1,))  # side by side: one CPU each, pinned
    # A 16-CPU affinity under a cgroup quota of 4 CPUs: the quota binds; each of 2 cells gets 2 CPUs of its own.
    a, b = shares(2, env={}, cpus=Cpus(tuple(range(16)), 4.0))
    assert (a.threads, a.cpus, b.cpus) == (2, (0, 1), (2, 3)) and "a CPU quota of 4" in a.why
    assert Cpus(tuple(range(8)), 2.5).count == 2 and Cpus((0,), 0.3).count == 1  # rounded down, at least one
    # More cells than CPUs: one thread each, not pinned (the CPUs do not go round), and said.
    three = shares(3, env={}, cpus=two)
    assert [s.threads for s in three] == [1, 1, 1] and all(s.cpus == () for s in three)
    assert "not pinned" in three[0].why


def test_the_users_count_wins_over_the_share():
    two = Cpus((0, 1), None)
    (s,) = shares(1, env={"OMP_NUM_THREADS": "3"}, cpus=two)
    assert (s.threads, s.source) == (3, "OMP_NUM_THREADS")
    (s,) = shares(1, threads=1, env={"OMP_NUM_THREADS": "3"}, cpus=two)
    assert (s.threads, s.source) == (1, "--threads")  # --threads over OMP_NUM_THREADS
    (s,) = shares(1, env={"OMP_NUM_THREADS": "4,2"}, cpus=two)
    assert s.threads == 4  # OpenMP's nested list: its first level
    with pytest.raises(UserError, match="OMP_NUM_THREADS='zero'"):
        shares(1, env={"OMP_NUM_THREADS": "zero"}, cpus=two)


def test_each_process_of_a_cell_gets_its_part_and_a_resumed_cell_keeps_its_count(tmp_path):
    auto = Share(4, "auto", "4 CPU(s)")
    env = process_env(auto, ranks=2, env={})
    assert env["OMP_NUM_THREADS"] == "2" and env[FROM_ENV] == "auto" and CPUS_ENV not in env
    assert env.items() >= wait_env({}).items() and wait_env({})  # the waiting policy, for the runtime torch loads
    assert process_env(Share(3, "--threads", "--threads 3"), ranks=2, env={})["OMP_NUM_THREADS"] == "3"  # per process
    assert process_env(Share(1, "auto", "", (1,)), env={})[CPUS_ENV] == "1"
    # A cell that trained before keeps the count it trained with (every rung of a trial rounds alike) ...
    ran = CellFolder(tmp_path)
    write_json(ran.env_file, {"threads": {"intra": 2}})
    kept = threads_env(Share(1, "auto", "2 CPUs / 2 cells"), 1, ran)
    assert kept["OMP_NUM_THREADS"] == "2" and "earlier attempt" in kept["TUNELAB_THREADS_WHY"]
    # ... unless the user says otherwise now.
    assert threads_env(Share(1, "--threads", "--threads 1"), 1, ran)["OMP_NUM_THREADS"] == "1"
    # A damaged env.json is the cell's to rewrite (or to fail on, saying why): the runner sizes it afresh.
    ran.env_file.unlink()
    ran.env_file.mkdir()
    assert threads_env(Share(1, "auto", "2 CPUs / 2 cells"), 1, ran)["OMP_NUM_THREADS"] == "1"
    # A user's waiting policy is theirs: tunelab adds none of its own.
    assert not set(WAIT_KNOBS) & set(process_env(auto, env={"OMP_WAIT_POLICY": "ACTIVE"}))


def test_evaluators_beside_training_share_the_cells_threads():
    assert beside_env(1, {"OMP_NUM_THREADS": "4", FROM_ENV: "auto"})["OMP_NUM_THREADS"] == "2"
    assert beside_env(3, {"OMP_NUM_THREADS": "2", FROM_ENV: "auto"})["OMP_NUM_THREADS"] == "1"
    assert beside_env(1, {"OMP_NUM_THREADS": "4", FROM_ENV: "OMP_NUM_THREADS"})["OMP_NUM_THREADS"] == "4"  # user's


def test_the_cgroup_quota_is_the_tightest_of_every_level(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    write(proc / "self" / "cgroup", "0::/jobs/job1/task\n")
    write(root / "jobs" / "job1" / "task" / "cpu.max", "max 100000\n")
    write(root / "jobs" / "job1" / "cpu.max", "150000 100000\n")  # the job: 1.5 CPUs, binding its task
    write(root / "jobs" / "cpu.max", "400000 100000\n")
    assert cgroup_quota(proc, root) == 1.5
    # cgroup v1: cpu.cfs_quota_us over cpu.cfs_period_us, -1 for none
    write(proc / "self" / "cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(proc, root) is None
    write(root / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct" / "docker" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(proc, root) == 3.0
    assert cgroup_quota(tmp_path / "nothing", root) is None
    assert cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8" and parse_cpu_list("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)


# -- what a process sets at its start ---------------------------------------------------------------------------

PROBE = """
import json, os, sys
from tunelab.machine.threads import start_process
assert "torch" not in sys.modules
got = start_process()
import torch
print(json.dumps({**got, "torch_intra": torch.get_num_threads(), "torch_interop": torch.get_num_interop_threads(),
                  "affinity": sorted(os.sched_getaffinity(0))}))
"""


def probe(cpus: list[int] | None = None, **env: str) -> dict:
    """A fresh process that sizes itself (start_process), run on `cpus` (its affinity, injected)."""
    def pin() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=clean_env(**env),
                         preexec_fn=pin, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_process_sizes_its_threads_to_its_affinity_and_sets_the_waiting_policy_before_torch_loads():
    one = probe([AFFINITY[0]])
    assert one["intra"] == one["torch_intra"] == 1 and one["torch_interop"] == 1 and one["source"] == "auto"
    assert one["policy_in_effect"]
    if one["openmp"] == "libgomp":  # a short spin, then sleep (machine/threads.py GOMP_SPIN)
        assert one["wait_policy"] == {"GOMP_SPINCOUNT": GOMP_SPIN}
    else:
        assert one["wait_policy"]["OMP_WAIT_POLICY"] == "PASSIVE"
    every = probe(AFFINITY)
    assert every["torch_intra"] == len(AFFINITY) and every["cpus"] == cpu_list(AFFINITY)
    # The user's OMP_NUM_THREADS and waiting policy win.
    mine = probe(AFFINITY, OMP_NUM_THREADS="3", OMP_WAIT_POLICY="ACTIVE")
    assert mine["torch_intra"] == 3 and mine["source"] == "OMP_NUM_THREADS"
    assert mine["wait_policy"] == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_exp_eval_run_sizes_itself_before_torch_loads_and_records_it(tmp_path):
    """`exp eval run` on one CPU (its affinity, injected): one thread, the waiting policy in effect, in results.json."""
    out = subprocess.run([sys.executable, "-m", "tunelab.cli", "eval", "run", "tiny-random-llama", "--tasks",
                          "gsm8k_smoke", "--limit", "1", "--out", str(tmp_path / "ev")], capture_output=True, text=True,
                         env=clean_env(), preexec_fn=lambda: os.sched_setaffinity(0, [AFFINITY[-1]]), timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    t = read_json(tmp_path / "ev" / "results.json")["threads"]
    assert (t["intra"], t["interop"], t["source"], t["cpus"]) == (1, 1, "auto", str(AFFINITY[-1]))
    assert t["policy_in_effect"] and t["wait_policy"] == wait_env({})


@TWO_CPUS
def test_a_process_pins_itself_to_the_cpus_its_launcher_chose_before_sizing():
    got = probe(None, **{CPUS_ENV: str(AFFINITY[-1])})
    assert got["affinity"] == [AFFINITY[-1]] and got["pinned"] == str(AFFINITY[-1]) and got["torch_intra"] == 1


# -- cells side by side -----------------------------------------------------------------------------------------

MATRIX = """name: m
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  optim: {lr: 1.0e-3}
  train: {steps: 4, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1, batch_size: 4}
  tracking: {wandb: false}
matrix:
  optim.lr: [1.0e-3, 2.0e-3, 3.0e-3]
"""


def exp(*args, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *map(str, args)], capture_output=True, text=True,
                          env=clean_env(COLUMNS="250", **env), stdin=subprocess.DEVNULL, timeout=600, check=False)


def losses(runs: Path) -> dict[str, list[float]]:
    return {d.name: [r["loss"] for r in read_jsonl(d / "train" / "metrics.jsonl")]
            for d in sorted((runs / "m").iterdir()) if (d / "cell.json").is_file()}


@TWO_CPUS
def test_workers_run_cells_side_by_side_pinned_with_the_losses_of_one_at_a_time(tmp_path):
    """Three cells, two at a time: each on one CPU of its own with one thread (the machine's two CPUs / 2), and
    every step's loss equal to the same cells run one at a time with one thread (--threads 1)."""
    path = write(tmp_path / "m.yaml", MATRIX)
    side = exp("run", path, "--runs-dir", tmp_path / "side", "--workers", "2")
    assert side.returncode == 0, side.stderr[-3000:]
    assert "2 cells at once: 1 thread(s) on CPUs" in side.stderr and "3/3 cell(s) finished" in side.stderr
    alone = exp("run", path, "--runs-dir", tmp_path / "alone", "--threads", "1")
    assert alone.returncode == 0, alone.stderr[-3000:]
    got, want = losses(tmp_path / "side"), losses(tmp_path / "alone")
    assert len(got) == 3 and got == want and all(len(v) == 4 for v in got.values())
    pinned = set()
    for d in (tmp_path / "side" / "m").iterdir():
        if d.is_dir():
            t = read_json(d / "env.json")["threads"]
            assert (t["intra"], t["interop"], t["source"]) == (1, 1, "auto") and t["policy_in_effect"]
            assert "/ 2 cell(s) at once" in t["why"] and t["pinned"] == t["cpus"]
            pinned.add(t["pinned"])
            rows = read_jsonl(d / "train" / "metrics.jsonl")
            assert "cpu_set" not in rows[-1] or (rows[-1]["cpu_set"], rows[-1]["cpu_asked"]) == (1, 1)
    assert pinned == {str(AFFINITY[0]), str(AFFINITY[1])}  # both slots used, each cell on one CPU
    for d in (tmp_path / "alone" / "m").iterdir():
        if d.is_dir():
            t = read_json(d / "env.json")["threads"]
            assert (t["intra"], t["source"], t["pinned"]) == (1, "--threads", None)
            assert read_json(next((d / "eval").iterdir()) / "results.json")["threads"]["intra"] == 1


SEARCH = """name: s
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 2, batch_size: 4, warmup_steps: 1}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 2
"""


@TWO_CPUS
def test_a_searchs_trials_run_side_by_side_with_workers(tmp_path):
    """The tune: driver hands --workers to the runner of each stage: a rung's two trials at once, one per CPU."""
    path = write(tmp_path / "s.yaml", SEARCH)
    got = exp("run", path, "--runs-dir", tmp_path / "runs", "--workers", "2")
    assert got.returncode == 0, got.stderr[-3000:]
    assert "2 cells at once" in got.stderr
    (study,) = json.loads(exp("tune", "status", tmp_path / "runs" / "s", "--json").stdout)
    assert [t["state"] for t in study["trials"]] == ["complete", "complete"]
    pinned = {read_json(Path(t["dir"]) / "env.json")["threads"]["pinned"] for t in study["trials"]}
    assert pinned == {str(AFFINITY[0]), str(AFFINITY[1])}


def test_workers_are_refused_where_cells_do_not_run_here_and_a_bad_thread_count_is_said(tmp_path):
    path = write(tmp_path / "m.yaml", MATRIX)
    got = exp("run", path, "--runs-dir", tmp_path / "r", "--workers", "2", "--launcher", "slurm", "--dry-run")
    assert got.returncode == 2 and "--workers 2 runs cells side by side on this machine" in got.stderr
    assert "Traceback" not in got.stderr and not (tmp_path / "r").exists()
    got = exp("run", path, "--runs-dir", tmp_path / "r", OMP_NUM_THREADS="lots")
    assert got.returncode == 2 and "OMP_NUM_THREADS='lots'" in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "r").exists()
    got = exp("run", path, "--runs-dir", tmp_path / "r", "--workers", "0")
    assert got.returncode == 2 and "--workers" in got.stderr and not (tmp_path / "r").exists()
    if len(os.sched_getaffinity(0)) >= 2:  # two cells side by side need two CPUs; a together-group is one process
        got = exp("run", path, "--runs-dir", tmp_path / "r", "--workers", "2", "--together", "2")
        assert got.returncode == 2 and "--workers 2 and --together 2" in " ".join(got.stderr.split())
        assert "Traceback" not in got.stderr and not (tmp_path / "r").exists()


def test_a_stop_signal_reaches_every_running_cell():
    from tunelab.run.runner import Interrupts

    code = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))\n"
            "print('ready', flush=True)\nwhile True: time.sleep(0.05)\n")
    kids = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for k in kids:
        assert k.stdout is not None and k.stdout.readline().strip() == "ready"
    stop = Interrupts(running=set(kids))
    stop._handle(signal.SIGINT, None)
    assert [k.wait(timeout=30) for k in kids] == [7, 7] and stop.stopping


# -- what the machine is doing ----------------------------------------------------------------------------------


def steps(rates: list[float], **cpu) -> list[dict]:
    return [{"step": i + 1, "loss": 1.0, "tokens_per_s": r, "step_s": 512 / r, **cpu} for i, r in enumerate(rates)]


def test_slow_recent_steps_and_busy_cpus_are_said_with_their_figures():
    assert load.strain(steps([100, 400, 410, 405, 400, 395, 402, 398, 401, 399, 400])) is None  # steady
    said = load.strain(steps([100, 400, 410, 405, 400, 395, 300, 150, 140, 150, 145]))
    assert said == "steps 7-11 ran at 150 tokens/s, 0.38x the 400 tokens/s of steps 2-6"
    # Other processes on the CPUs it asked for: 2 CPUs, 2 threads asked, 1.9 busy of which the cell used 0.9.
    busy = load.strain(steps([400] * 6, cpu_set=2, cpu_asked=2, cpu_busy=1.9, cpu_own=0.9, cpu_pressure=55.0))
    assert busy == ("its 2 CPU(s) were busier than it asked for (2 thread(s)): 1.9 busy, 1.0 of them by other "
                    "processes, CPU pressure 55% (tasks waited for a CPU that share of the last 10 s)")
    # One thread asked on two CPUs: another process on the second CPU takes nothing the cell asked for.
    assert load.strain(steps([400] * 6, cpu_set=2, cpu_asked=1, cpu_busy=1.9, cpu_own=0.95, cpu_pressure=5.0)) is None
    window = load.StepWindow()
    for row in steps([100, 400, 410, 405, 400, 395] + [400] * 50 + [150] * 5):
        window.add(row)
    assert len(window.rows()) == 11 and load.strain(window.rows()) == load.strain(
        steps([100, 400, 410, 405, 400, 395, 150, 150, 150, 150, 150])).replace("7-11", "57-61")


def test_the_cpu_meter_adds_its_figures_once_a_window_closes(monkeypatch):
    meter = load.CpuMeter(threads=1)
    assert meter.sample() == {}  # no window of MIN_S yet: no figure made of tick rounding
    monkeypatch.setattr(load, "MIN_S", 0.0)
    time.sleep(0.05)
    got = meter.sample()
    assert got["cpu_set"] == len(AFFINITY) and got["cpu_asked"] == 1 and got["cpu_own"] >= 0
    assert got["cpu_busy"] is None or 0 <= got["cpu_busy"] <= len(AFFINITY)


def test_the_progress_line_says_when_steps_slow_down():
    import io

    text = io.StringIO()
    view = LinesView(Console(file=text, width=300), "m", 1, every_s=0.0)
    h = view.start_cell("lr0.001", 11, 0)
    for row in steps([100, 400, 410, 405, 400, 395, 300, 150, 140, 150, 145]):
        view.on_event(h, events.Step(row["step"], 11, 1.0, row))
    lines = text.getvalue().splitlines()
    assert "slow: " not in lines[2]  # steady at first
    assert lines[-1].endswith("; slow: steps 7-11 ran at 150 tokens/s, 0.38x the 400 tokens/s of steps 2-6")


def test_exp_status_says_why_a_running_cell_is_slow(tmp_path):
    """A cell folder whose metrics.jsonl (written here) shows its recent steps at a third of its first ones."""
    from tunelab.folders.cell import CellFolder

    cell = CellFolder(tmp_path / "runs" / "m" / "lr0.001-abc")
    cell.path.mkdir(parents=True)
    write(cell.path / "cell.json", json.dumps({"slug": "lr0.001", "id": "abc", "matrix": "m"}))
    cell.write_status("running", started_at=time.time())
    cell.train_dir.mkdir()
    rows = steps([100, 400, 410, 405, 400, 395, 300, 150, 140, 150, 145],
                 cpu_set=2, cpu_asked=2, cpu_busy=2.0, cpu_own=1.0, cpu_pressure=62.0)
    cell.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = cell.lock()  # its process holds the lock: it runs
    assert held.acquire()
    with held:
        got = exp("status", tmp_path / "runs" / "m")
    assert got.returncode == 0, got.stderr
    assert "running" in got.stdout
    assert ("lr0.001 slow: steps 7-11 ran at 150 tokens/s, 0.38x the 400 tokens/s of steps 2-6; its 2 CPU(s) were "
            "busier than it asked for (2 thread(s)): 2.0 busy, 1.0 of them by other processes, CPU pressure 62%") \
        in " ".join(got.stdout.split())
    (row,) = json.loads(exp("status", tmp_path / "runs" / "m", "--json").stdout)
    assert row["machine"].startswith("steps 7-11 ran at 150 tokens/s")
