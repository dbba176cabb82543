"""A together-group's turn in the runner (run/together.py plans the units): each member's folder checked and locked
as a cell's is, the group's process started (or, in a search, the one that holds its members found in the pool),
its members trained, and one outcome per member, as if each had run alone.

A member that is done, failed or locked elsewhere does not join: it is skipped, or comes back later (alone), as a
cell does. A group left with one member runs it alone. A member that fails, fails alone; a process that dies takes
each member still in it to `failed` with the cause (its log's last lines beside), and the next `exp run` runs
those members alone (a member that keeps breaking its group's process cannot take a group down twice).
"""

from __future__ import annotations

import time
from typing import Protocol

from rich.markup import escape

from tunelab.core.locks import CellLock
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.matrix.expansion import Cell
from tunelab.run import together, workers
from tunelab.run.outcome import Outcome, exit_cause, killed_from_outside
from tunelab.run.progress import RunView
from tunelab.run.together import Unit


class Runner(Protocol):
    """What a group's turn needs of the runner (run/runner.py's Runner)."""

    @property
    def matrix(self) -> MatrixFolder: ...
    @property
    def view(self) -> RunView: ...
    @property
    def pool(self) -> workers.Pool | None: ...
    @property
    def stop(self) -> workers.Stoppable: ...
    @property
    def together(self) -> together.Setting: ...

    def skip_reason(self, folder: CellFolder, cell: Cell, probe_lock: bool = True) -> str | None: ...
    def claimed(self, folder: CellFolder, cell: Cell, held: CellLock, waited: bool) -> Outcome: ...
    def prepared(self, folder: CellFolder, cell: Cell) -> None: ...
    def _ended(self, folder: CellFolder, cell: Cell, handle: int, rc: int | None) -> Outcome: ...


def auto_cap(cells: list[Cell], batched: bool = False) -> int:
    """`--together auto`: how many of these cells (one base) fit one group on this machine, by the memory model
    (train/parallel/capacity.py: reads the model's config and the device's memory)."""
    from tunelab.train.parallel import capacity

    return capacity.members([c.config for c in cells], together.AUTO_MAX, batched)


def alone_now(runner: Runner, cell: Cell) -> str | None:
    """Why a cell that could join runs alone in this run, from its folder (run/together.plan's `alone`)."""
    folder = runner.matrix.folder(cell)
    status = folder.status()
    if folder.is_trained():
        return "trained already: it evaluates its final/ weights alone"
    if status.get("state") == "failed" and status.get("together") or status.get("group_died"):
        return ("its last attempt failed in a together-group, or its group's process died: it runs alone now (a "
                "member that breaks its group's process cannot take a group down twice)")
    return None


def run_unit(runner: Runner, unit: Unit, later: list[tuple[Cell, CellFolder]]) -> list[Outcome]:
    """The members' first turn: each skipped, put back (locked elsewhere), or trained in the group."""
    outcomes: list[Outcome] = []
    joined: list[tuple[Cell, CellFolder, CellLock | None]] = []  # None: held by a live worker of the pool
    for cell in unit.cells:
        folder = runner.matrix.folder(cell)
        skip = runner.skip_reason(folder, cell, probe_lock=False)
        if skip:
            runner.view.say(f"[dim]{cell.dirname}: {skip.removeprefix('skipped-')}, skipped")
            outcomes.append(Outcome(cell, skip, folder.status().get("error")))
            continue
        if runner.pool is not None and runner.pool.holding(folder.path):
            joined.append((cell, folder, None))
            continue
        held = folder.lock()
        if not held.acquire(wait=0):
            runner.view.say(f"{cell.dirname}: locked by another process ({folder.lock_holder()}); coming back to it")
            later.append((cell, folder))
            continue
        again = runner.skip_reason(folder, cell, probe_lock=False)  # not when this runner looked first
        if again in ("skipped-done", "skipped-reached"):
            held.release()
            runner.view.say(f"{cell.dirname}: {'done' if again == 'skipped-done' else 'paused'} by another process")
            outcomes.append(Outcome(cell, "done-elsewhere"))
            continue
        joined.append((cell, folder, held))
    lone = joined[0][2] if len(joined) == 1 else None
    if lone is not None:  # no company left: the cell alone
        with lone:
            outcomes.append(runner.claimed(joined[0][1], joined[0][0], lone, waited=False))
        return outcomes
    if joined:
        outcomes += _train(runner, unit.key or "alone", joined)
    return outcomes


def _train(runner: Runner, key: str, joined: list[tuple[Cell, CellFolder, CellLock | None]]) -> list[Outcome]:
    fresh = [(cell, folder, held) for cell, folder, held in joined if held is not None]
    for cell, folder, _ in fresh:
        runner.prepared(folder, cell)
    groups: dict[int, tuple[workers.Worker, list[tuple[Cell, CellFolder]]]] = {}
    for cell, folder, held in joined:
        if held is None:
            w = runner.pool.holding(folder.path) if runner.pool else None
            assert w is not None
            groups.setdefault(id(w), (w, []))[1].append((cell, folder))
    if fresh:
        def told(proc) -> None:
            runner.stop.proc = proc

        w = workers.start(key, [(folder, held) for _, folder, held in fresh if held is not None], runner.matrix,
                          told, runner.together.mode)
        if runner.pool is not None:
            runner.pool.add(w)
        groups[id(w)] = (w, [(cell, folder) for cell, folder, _ in fresh])
    outcomes: list[Outcome] = []
    for w, members in groups.values():
        runner.stop.proc = w.proc
        outcomes += _turn(runner, w, members)
        if runner.pool is None:
            w.end()
    return outcomes


def _turn(runner: Runner, w: workers.Worker, members: list[tuple[Cell, CellFolder]]) -> list[Outcome]:
    """One train operation of the worker over these members; an outcome each."""
    handles = {}
    for cell, folder in members:
        steps = min(cell.stop_at or cell.config.train.steps, cell.config.train.steps)
        reached = folder.status().get("paused_at") or 0 if runner.pool and runner.pool.holding(folder.path) else 0
        handles[folder.path.resolve()] = runner.view.start_cell(cell.slug, steps, reached)
    asks = {folder.path.resolve(): (cell.stop_at, cell.validate_at) for cell, folder in members}
    ready = w.train(asks, lambda p, ev: runner.view.on_event(handles[p], ev))
    outcomes = []
    for cell, folder in members:
        handle = handles[folder.path.resolve()]
        if ready:  # (its process goes on: None, no exit to report)
            outcomes.append(runner._ended(folder, cell, handle, None))
        else:
            outcomes.append(_died(runner, w, folder, cell, handle))
    if not ready:
        w.end()  # its locks: the runner's copies go too
    else:  # what the worker let go (done, failed), the runner lets go; paused members stay in it
        w.forget([f.path.resolve() for (_, f), o in zip(members, outcomes) if o.state != "paused"])
    return outcomes


def _died(runner: Runner, w: workers.Worker, folder: CellFolder, cell: Cell, handle: int) -> Outcome:
    """The group's process ended before it said it was done: each member as it left it, or, when it was still
    running, interrupted (killed from outside: the next `exp run` resumes it, as a killed cell) or failed with the
    cause (a crash). Either way `group_died` says so, and the member runs alone from then on."""
    rc = w.rc if w.rc is not None else w.proc.wait()
    status = folder.status()
    if status.get("state") != "running":
        return runner._ended(folder, cell, handle, None if status.get("state") in ("done", "pending") else rc)
    tail = w.log_tail()
    cause = exit_cause(rc, tail)
    said = f"its together-group's process {cause}"
    if killed_from_outside(rc, tail):
        folder.write_status("pending", note=f"interrupted: {said}", exit=cause, log_tail=tail, group_died=cause,
                            finished_at=time.time())
        return runner._ended(folder, cell, handle, rc)
    folder.write_status("failed", error=said, exit=cause, log_tail=tail, group_died=cause, finished_at=time.time())
    runner.view.end_cell(handle, f"[red]failed: {escape(said[:80])}")
    return Outcome(cell, "failed", said)
