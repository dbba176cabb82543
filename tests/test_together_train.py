"""Together-groups, training (#46): several cells' adapters over one base in one process (cell/group.py,
train/members.py), each member exactly the cell alone.

The reference is each cell run alone in this process (`run_cell`, the cell process's own stages). Against it, the
group's worker process (`python -m tunelab.cell --together`) steered as the runner steers it: every step's loss, grad
norm, learning rate and validation loss, every checkpoint's model.pt, optimizer.pt and state.pt (random states
included) and final/'s adapter file are equal bit for bit, for LoRA with dropout, LoRA of another rank, targets,
seed and schedule, DoRA with Lion and LoRA with AdaLomo (updates inside backward) in one group, and IA3 in another.
Then: a rung and in-memory promotion equal the unpruned twin; a group-written checkpoint resumed alone, and an
alone-written one in a group; a member that fails fails alone; kill -9 of the worker and a stop signal resume
bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write
from processes import wait_for

from tunelab.cell.stages import run_cell
from tunelab.core import events
from tunelab.core.files import read_json, read_jsonl
from tunelab.core.locks import is_locked
from tunelab.folders.cell import CellFolder
from tunelab.matrix import expansion
from tunelab.run import runner

BASE = """name: NAME
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: STEPS, batch_size: 4, warmup_steps: 1, device: cpu, save_every: 3, keep_checkpoints: 3}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
include:
"""
LORA_DORA = [
    "{peft.method: lora, peft.dropout: 0.1, optim.lr: 1.0e-3}",
    "{peft.method: lora, peft.r: 4, peft.alpha: 8, peft.dropout: 0.2, peft.target_modules: [q_proj, v_proj], "
    "optim.lr: 3.0e-3, optim.weight_decay: 0.1, train.seed: 1, train.schedule: linear}",
    "{peft.method: dora, peft.dropout: 0.05, optim.name: lion, optim.lr: 1.0e-4}",
    "{peft.method: lora, peft.dropout: 0.1, optim.name: adalomo, optim.lr: 1.0e-2}",
]
IA3 = ["{peft.method: ia3, optim.lr: 1.0e-2}", "{peft.method: ia3, optim.lr: 3.0e-2, train.seed: 2}"]


def matrix(tmp: Path, name: str, entries: list[str], steps: int = 6, extra: str = "") -> tuple[Path, list]:
    text = BASE.replace("NAME", name).replace("STEPS", str(steps)) + "".join(f"  - {e}\n" for e in entries) + extra
    path = write(tmp / f"{name}.yaml", text)
    return path, [c for c in expansion.load(path)[1] if c.config.peft.method != "none"]  # the includes only


def prepared(root: Path, name: str, cells: list) -> list[Path]:
    """The cells' folders as the runner prepares them (config, cell.json, status pending)."""
    out = []
    for cell in cells:
        folder = CellFolder(root / name / cell.dirname)
        runner.prepare(folder, cell, name)
        out.append(folder.path)
    return out


def alone(root: Path, name: str, cells: list, **env: str) -> list[Path]:
    dirs = prepared(root, name, cells)
    for d in dirs:
        run_cell(d)
    return dirs


class Worker:
    """The group's process, steered as the runner does: ops on stdin, events (tagged by member) on stdout."""

    def __init__(self, dirs: list[Path], log: Path):
        self.dirs = dirs
        command = [sys.executable, "-m", "tunelab.cell", "--together", "--name", "g", *map(str, dirs)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("a"),
                                     text=True, start_new_session=True)
        self.events: list[tuple[int | None, object]] = []

    def send(self, op: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(op) + "\n")
        self.proc.stdin.flush()

    def until_ready(self) -> events.Ready:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event, member = events.decode_tagged(line)
            if isinstance(event, events.Ready):
                return event
            self.events.append((member, event))
        raise AssertionError(f"the worker ended (code {self.proc.wait()}) before it was ready")

    def train(self, stops: dict[int, int | None] | None = None, validate_at: tuple[int, ...] = ()) -> None:
        stops = stops if stops is not None else {k: None for k in range(len(self.dirs))}
        self.send({"op": "train", "members": {str(k): {"stop_at": s, "validate_at": list(validate_at)}
                                              for k, s in stops.items()}})
        self.until_ready()

    def end(self) -> int:
        self.send({"op": "end"})
        return self.proc.wait(timeout=120)


def together(root: Path, name: str, cells: list, tmp: Path) -> list[Path]:
    dirs = prepared(root, name, cells)
    w = Worker(dirs, tmp / f"{name}-worker.log")
    w.train()
    assert w.end() == 0, (tmp / f"{name}-worker.log").read_text()[-3000:]
    return dirs


def numbers(d: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("grad_norm"), r["lr"], r.get("val_loss"))
            for r in read_jsonl(d / "train" / "metrics.jsonl")]


def same(a, b) -> bool:
    """Equal bit for bit: tensors by torch.equal, numpy arrays, containers recursively."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def checkpoints_equal(a: Path, b: Path) -> list[str]:
    """What differs between two cells' checkpoints (state.pt's wall-clock seconds aside)."""
    bad = []
    sa, sb = CellFolder(a).checkpoint_steps(), CellFolder(b).checkpoint_steps()
    if sa != sb:
        return [f"checkpoints {sa} != {sb}"]
    for step in sa:
        for f in ("model.pt", "optimizer.pt", "state.pt"):
            pa, pb = CellFolder(a).checkpoint_dir(step) / f, CellFolder(b).checkpoint_dir(step) / f
            if not pa.exists() and not pb.exists():
                continue
            x, y = torch.load(pa, weights_only=False), torch.load(pb, weights_only=False)
            if f == "state.pt":
                x["loop"].pop("seconds"), y["loop"].pop("seconds")
            if not same(x, y):
                bad.append(f"step-{step}/{f}")
    return bad


def assert_same_cell(a: Path, b: Path, final: bool = True) -> None:
    assert numbers(a) == numbers(b), (a.name, numbers(a), numbers(b))
    assert checkpoints_equal(a, b) == [], a.name
    total = [read_json(d / "train" / "summary.json").get("total_params") for d in (a, b)]  # not its mates' adapters
    assert total[0] == total[1] or not final, (a.name, total)
    if final:
        fa, fb = a / "final" / "adapter_model.safetensors", b / "final" / "adapter_model.safetensors"
        assert fa.read_bytes() == fb.read_bytes(), a.name
        ra, rb = (next((d / "eval").glob("*/results.json")) for d in (a, b))
        assert read_json(ra)["tasks"]["val_loss"]["value"] == read_json(rb)["tasks"]["val_loss"]["value"]
        assert read_json(b / "status.json")["state"] == "done"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every cell alone, once, for the tests below."""
    tmp = tmp_path_factory.mktemp("alone")
    out = {}
    for name, entries in (("ld", LORA_DORA), ("ia", IA3)):
        _, cells = matrix(tmp, name, entries)
        out[name] = (cells, alone(tmp / "runs", name, cells))
    return tmp, out


@pytest.mark.parametrize("name", ["ld", "ia"])
def test_a_group_trains_each_member_bit_for_bit_as_alone(reference, tmp_path, name):
    _, ref = reference
    cells, alone_dirs = ref[name]
    dirs = together(tmp_path / "runs", name, cells, tmp_path)
    for a, b in zip(alone_dirs, dirs):
        assert_same_cell(a, b)
        status = read_json(b / "status.json")
        assert status["together"]["members"] == len(cells) and status["together"]["group"] == "g"
        assert read_json(b / "train" / "summary.json")["together"]["member"] == dirs.index(b)
        scored = read_json(next((b / "eval").glob("*/results.json")))["together"]  # in shared passes (evals.together)
        assert scored["adapters"] == len(cells) and scored["member"] == dirs.index(b)
        assert not is_locked(b)


def test_a_member_paused_at_its_rung_goes_on_in_memory_as_its_unpruned_twin(reference, tmp_path):
    """Rung at step 2 for all (validated, checkpointed, pending), one released (pruned: its lock let go), the
    others go on without a checkpoint read to the end: the twins' numbers, resumed_from None."""
    _, ref = reference
    cells, alone_dirs = ref["ld"]
    dirs = prepared(tmp_path / "runs", "ld", cells)
    w = Worker(dirs, tmp_path / "w.log")
    w.train({k: 2 for k in range(4)}, validate_at=(2,))
    for d in dirs:
        status = read_json(d / "status.json")
        assert status["state"] == "pending" and status["paused_at"] == 2
        assert CellFolder(d).checkpoint_steps() == [2] and is_locked(d)
    w.send({"op": "release", "members": [2]})
    w.until_ready()
    assert not is_locked(dirs[2]) and is_locked(dirs[0])
    w.train({0: None, 1: None, 3: None}, validate_at=(2,))
    assert w.end() == 0
    for k in (0, 1, 3):
        summary = read_json(dirs[k] / "train" / "summary.json")
        assert summary["resumed_from"] is None and summary["continued_in_memory_from"] == [2]
        ours = [r for r in numbers(dirs[k])]
        theirs = numbers(alone_dirs[k])
        # The twin did not validate at step 2; every other number is the twin's.
        assert [r[:4] for r in ours] == [r[:4] for r in theirs] and ours[-1] == theirs[-1]
        fa = (alone_dirs[k] / "final" / "adapter_model.safetensors").read_bytes()
        assert (dirs[k] / "final" / "adapter_model.safetensors").read_bytes() == fa
    assert [r["step"] for r in read_jsonl(dirs[2] / "train" / "metrics.jsonl")] == [1, 2]


FAILING = '''import torch


class FailsAtTwo(torch.optim.AdamW):
    """AdamW whose second step raises: a member that breaks mid-training."""

    def step(self, closure=None):
        self.taken = getattr(self, "taken", 0) + 1
        if self.taken == 2:
            raise RuntimeError("this optimizer fails at its second step")
        return super().step(closure)
'''


def test_a_member_that_fails_fails_alone(reference, tmp_path, monkeypatch):
    """A member whose optimizer fails in training, one whose adapter would sit on the shared output head (the plan
    keeps it alone by name; steered here as a member, injection refuses it), one whose evaluation cannot write: each
    fails alone, the others are the cells alone (their evaluation, first tried in a pass with the broken one, again
    each alone)."""
    _, ref = reference
    cells, alone_dirs = ref["ld"]
    write(tmp_path / "pkg" / "failing_optim.py", FAILING)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'pkg'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    _, bad = matrix(tmp_path, "f", ["{peft.method: lora, optim.name: 'failing_optim:FailsAtTwo', optim.lr: 1.0e-3}",
                                    "{peft.method: lora, peft.target_modules: [q_proj, lm_head], "
                                    "optim.lr: 2.0e-3}"])
    dirs = prepared(tmp_path / "runs", "ld", [cells[0], bad[0], cells[2], bad[1], cells[1]])
    blocked = CellFolder(dirs[4]).eval_dir(CellFolder(dirs[4]).config().eval.id())
    write(blocked, "a file where its evaluation's folder goes")
    w = Worker(dirs, tmp_path / "w.log")
    w.train()
    assert w.end() == 0
    status = read_json(dirs[1] / "status.json")
    assert status["state"] == "failed" and status["error"] == "RuntimeError: this optimizer fails at its second step"
    assert "failing_optim.py" in status["traceback"]
    assert "fails at its second step" in (dirs[1] / "cell.log").read_text()
    assert [r["step"] for r in read_jsonl(dirs[1] / "train" / "metrics.jsonl")] == [1]
    head = read_json(dirs[3] / "status.json")
    assert head["state"] == "failed" and "would sit on lm_head" in head["error"], head
    assert not (dirs[3] / "train" / "metrics.jsonl").exists()
    broken = read_json(dirs[4] / "status.json")
    assert broken["state"] == "failed" and "FileExistsError" in broken["error"], broken
    assert numbers(dirs[4]) == numbers(alone_dirs[1])  # its training was the cell alone's
    for a, b in ((alone_dirs[0], dirs[0]), (alone_dirs[2], dirs[2])):
        assert_same_cell(a, b)


STEPS = 12
TWO = LORA_DORA[:1] + LORA_DORA[2:3]  # LoRA with dropout, DoRA with Lion


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The two cells of TWO, 12 steps, alone."""
    tmp = tmp_path_factory.mktemp("twins")
    _, cells = matrix(tmp, "k", TWO, steps=STEPS)
    return cells, alone(tmp / "runs", "k", cells)


def _last(d: Path) -> int:
    return max((r["step"] for r in read_jsonl(d / "train" / "metrics.jsonl")), default=0)


def training(twins, tmp_path: Path, past: int) -> tuple[list[Path], list[Path], Worker]:
    """The twins' cells in a group's process that trains them to the end, once both are past step `past`."""
    cells, alone_dirs = twins
    dirs = prepared(tmp_path / "runs", "k", cells)
    w = Worker(dirs, tmp_path / "w.log")
    w.send({"op": "train", "members": {"0": {"stop_at": None}, "1": {"stop_at": None}}})
    wait_for(lambda: _last(dirs[1]) >= past, f"both members past step {past}", w.proc)
    return alone_dirs, dirs, w


def test_a_worker_killed_mid_training_resumes_each_member_bit_for_bit_in_a_group_or_alone(twins, tmp_path):
    alone_dirs, dirs, w = training(twins, tmp_path, 5)  # past their step-3 checkpoint
    os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.wait(timeout=60)
    for d in dirs:  # killed while training: its last word says running, under a free lock
        assert read_json(d / "status.json")["state"] == "running" and CellFolder(d).state() == "interrupted"
        assert _last(d) < STEPS and CellFolder(d).checkpoint_steps()
    copy = tmp_path / "runs" / "k-alone" / dirs[1].name
    shutil.copytree(dirs[1], copy)  # the same folder resumed alone by the cell's own stages
    run_cell(copy)
    w = Worker(dirs, tmp_path / "w2.log")
    w.train()
    assert w.end() == 0
    for a, b in ((alone_dirs[0], dirs[0]), (alone_dirs[1], dirs[1]), (alone_dirs[1], copy)):
        assert_same_cell(a, b)
        resumed = read_json(b / "train" / "summary.json")["resumed_from"]
        assert resumed is not None and resumed % 3 == 0


def test_a_stop_signal_checkpoints_every_member_and_the_next_run_goes_on_bit_for_bit(twins, tmp_path):
    alone_dirs, dirs, w = training(twins, tmp_path, 4)
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=120) == 0, (tmp_path / "w.log").read_text()[-3000:]
    stopped = []
    for d in dirs:
        status = read_json(d / "status.json")
        assert status["state"] == "pending" and "stopped by SIGTERM" in status["note"], status
        stopped.append(CellFolder(d).checkpoint_steps()[-1])
        assert stopped[-1] == _last(d) < STEPS  # its checkpoint is where it stopped
    w = Worker(dirs, tmp_path / "w2.log")
    w.train()
    assert w.end() == 0
    for a, b, at in zip(alone_dirs, dirs, stopped):
        assert_same_cell(a, b)
        assert read_json(b / "train" / "summary.json")["resumed_from"] == at


def test_lora_dora_and_ia3_members_nest_over_one_base_each_as_alone(reference, tmp_path):
    """peft holds one tuner type per model: IA3 joins a LoRA group by injection beside it (its layers wrap the LoRA
    layers: `.base_layer` segments in its names, which its checkpoints drop), each member still the cell alone."""
    _, ref = reference
    (ld, ld_alone), (ia, ia_alone) = ref["ld"], ref["ia"]
    cells, alone_dirs = [ld[0], ia[0], ld[2], ia[1]], [ld_alone[0], ia_alone[0], ld_alone[2], ia_alone[1]]
    dirs = together(tmp_path / "runs", "mixed", cells, tmp_path)
    for a, b in zip(alone_dirs, dirs):
        assert_same_cell(a, b)


def test_a_member_that_leaves_keeps_its_tensors_parked_until_a_new_member_is_set_up(tmp_path, monkeypatch):
    """A released (or trained, or failed) member's adapter leaves the model at once, but its tensors are parked, not
    handed back to malloc mid-run (cell/group.py `_park`: glibc scatters later steps' tensors into such holes); a
    member set up afterwards wants the memory, and the parked tensors go then."""
    import gc
    import weakref

    from tunelab.cell.group import Group, Seat
    from tunelab.train import members

    monkeypatch.setenv("WANDB_MODE", "disabled")
    _, cells = matrix(tmp_path, "pk", LORA_DORA[:2] + ["{peft.method: lora, optim.lr: 2.0e-3}"], steps=3)
    dirs = prepared(tmp_path / "runs", "pk", cells)
    group = Group("g", [Seat(k, CellFolder(d), CellFolder(d).config(), -1) for k, d in enumerate(dirs)],
                  write=lambda line: None)
    group.train({0: (2, (2,)), 1: (2, (2,))})
    assert [s.state for s in group.seats] == ["paused", "paused", "waiting"]
    adapter = weakref.ref(members.Index.of(group.model).params["m1"][0])
    optimizer = weakref.ref(group.seats[1].member.loop.stepper.optimizer)
    group.release([1])
    gc.collect()
    assert "m1" not in members.Index.of(group.model).params and group.seats[1].member is None
    assert adapter() is not None and optimizer() is not None  # parked
    group.train({2: (None, ())})  # a member set up now: the parked tensors go
    gc.collect()
    assert adapter() is None and optimizer() is None
    assert group.seats[2].state == "done" and read_json(dirs[2] / "status.json")["state"] == "done"
    group.end()


ALONG = ("eval: {tasks: [val_loss], val_batches: 2, limit: 1, max_new_tokens: 4, "
         "checkpoints: {at: [1, 3, 4], tasks: [val_loss, humaneval], workers: 0}}")


def test_members_checkpoints_are_scored_over_the_shared_base_in_shared_passes_as_alone(tmp_path, monkeypatch):
    """eval.checkpoints in a group (checkpoint_scores/shared.py): at the rung (step 2) the step 1 of every member,
    after training steps 3 and 4, are scored over the group's base in shared passes (each checkpoint's weights
    swapped into its member's adapter for the pass), not on a base loaded again per checkpoint; every score and
    generated program is what the cell alone writes, and the members' training after the swaps is still alone's."""
    from tunelab.cell.group import Group, Seat

    monkeypatch.setenv("WANDB_MODE", "disabled")
    text = BASE.replace("NAME", "ck").replace("STEPS", "4").replace("eval: {tasks: [val_loss], val_batches: 2}", ALONG)
    path = write(tmp_path / "ck.yaml", text + "".join(f"  - {e}\n" for e in LORA_DORA[:3]))
    cells = [c for c in expansion.load(path)[1] if c.config.peft.method != "none"]
    alone_dirs = alone(tmp_path / "alone", "ck", cells)
    dirs = prepared(tmp_path / "runs", "ck", cells)
    group = Group("g", [Seat(k, CellFolder(d), CellFolder(d).config(), -1) for k, d in enumerate(dirs)],
                  write=lambda line: None)
    group.train({k: (2, (2,)) for k in range(3)})
    eval_id = CellFolder(dirs[0]).config().checkpoint_eval_id()
    assert [sorted(CellFolder(d).step_evaluations(eval_id)) for d in dirs] == [[1]] * 3  # before the decision
    group.train({k: (None, ()) for k in range(3)})
    group.end()
    for a, b in zip(alone_dirs, dirs):
        assert read_json(b / "status.json")["state"] == "done"
        assert [r[:4] for r in numbers(a)] == [r[:4] for r in numbers(b)]
        assert (a / "final" / "adapter_model.safetensors").read_bytes() == \
            (b / "final" / "adapter_model.safetensors").read_bytes()
        for step in (1, 3, 4):
            ra, rb = CellFolder(a).step_results(eval_id, step), CellFolder(b).step_results(eval_id, step)
            assert ra["evaluated_by"] == "the cell, after training"
            assert rb["evaluated_by"] == ("the together-group, in shared passes with 3 adapters, "
                                          + ("paused at step 2" if step == 1 else "after training"))
            assert rb["together"]["adapters"] == 3 and rb["complete"]
            for task in ("val_loss", "humaneval"):
                assert ra["tasks"][task]["value"] == rb["tasks"][task]["value"], (b.name, step, task)
            sa, sb = (read_jsonl(CellFolder(d).step_dir(eval_id, step) / "samples.jsonl") for d in (a, b))
            assert [s.get("completion") for s in sa] == [s.get("completion") for s in sb] and sa, (b.name, step)
