"""The runner: runs each cell of a matrix in its own process, skips done ones, records failures.

It knows cell folders, processes, locks and status, and nothing about models.

A cell runs under its folder's lock (store.CellLock), taken by the runner before it writes anything there and
handed to the cell process, so two runners on one matrix never run a cell twice: a runner that finds a cell
locked goes on with the others and comes back to wait for it, then reports it done (or takes it over, if its
holder died without finishing: the kernel freed the lock, and a status still saying "running" is only the
dead process's last word). A cell process that dies is marked failed with its cause: the signal's name or the
exit code, and the last lines of its cell.log.

Ctrl-C (SIGINT) or SIGTERM once: the running cell checkpoints at its next step boundary and marks itself
pending, and no further cell starts; a second Ctrl-C stops the cell at once (`Interrupts`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from rich.markup import escape

from tunelab.checkpoint_scores.steps import StepScores
from tunelab.core import events
from tunelab.core.files import read_json, write_json
from tunelab.core.locks import LOCK_HELD_ENV, LOCKED_EXIT, CellLock
from tunelab.folders.cell import LAYOUT, CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.machine.threads import OWN_ENV, Share
from tunelab.matrix.expansion import Cell
from tunelab.run import groups, slurm, together, workers
from tunelab.run.launch import STOP_AT_ENV, VALIDATE_AT_ENV, Launch, cell_command, procs_per_node, run_env, threads_env
from tunelab.run.outcome import Outcome, exit_cause, killed_from_outside, said_stop
from tunelab.run.progress import RunView
from tunelab.run.together import Setting, Unit


@dataclass
class Interrupts:
    """The runner's answer to SIGINT and SIGTERM: no further cell starts, and the running one is told, whether
    the signal reached it too (a terminal's Ctrl-C goes to the whole foreground group) or only the runner
    (`kill`). The first asks it to stop at its next step boundary (SIGTERM, a stop signal of
    runtime.catch_stop_signals: it checkpoints and marks itself pending); the second stops it at once (SIGINT:
    a cell stops at once at its second SIGINT, marking itself pending without a new checkpoint)."""

    count: int = 0
    by: str | None = None  # the first signal's name: SIGINT is the user's Ctrl-C, passed on to the cell as SIGTERM
    proc: subprocess.Popen | None = None
    _saved: dict[signal.Signals, object] = field(default_factory=dict)
    running: set[subprocess.Popen] = field(default_factory=set)  # the cell processes started (--workers: several)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.by = self.by or signal.Signals(signum).name
        for proc in {p for p in (self.proc, *self.running) if p is not None}:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM if self.count == 1 else signal.SIGINT)
                except ProcessLookupError:
                    pass

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        import threading

        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._saved[s] = signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, old in self._saved.items():
                signal.signal(s, old)  # type: ignore[arg-type]

    @property
    def stopping(self) -> bool:
        return self.count > 0


def launch(folder: CellFolder, on_event: Callable[[events.Event], None], command: list[str],
           held: CellLock | None = None, log_path: Path | None = None, stop: Interrupts | None = None,
           cell: Cell | None = None, threads: dict[str, str] | None = None) -> int:
    """Run the cell process; its stdout carries events (tunelab.core.events), its stderr goes to cell.log (or
    `log_path`). `held`: the folder's lock, which the cell process inherits (it outlives this process if it must).
    `cell`: its stop_at and validate_at go to the process (launch.run_env: a search's rungs). `threads`: its
    threads, CPUs and waiting policy (launch.threads_env)."""
    env = {k: v for k, v in os.environ.items() if k not in (STOP_AT_ENV, VALIDATE_AT_ENV, *OWN_ENV)}
    env.update({"PYTHONUNBUFFERED": "1", **(run_env(cell.stop_at, cell.validate_at) if cell else {}),
                **(threads or {})})
    fds: tuple[int, ...] = ()
    if held is not None:
        env[LOCK_HELD_ENV], fds = str(folder.path.resolve()), (held.fileno(),)
    with (log_path or folder.log_file).open("a") as log:
        # Each attempt begins with a line of its own: the log of a resumed cell reads as its history.
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S %z')} runner pid {os.getpid()} on {socket.gethostname()} "
                  f"starts: {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env, pass_fds=fds)
        if stop is not None:
            stop.proc = proc
            stop.running.add(proc)
        if held is not None:
            held.note(f"cell process pid {proc.pid}")
        assert proc.stdout is not None
        for line in proc.stdout:
            event = events.decode(line)
            if event is None:
                log.write(line)
            else:
                on_event(event)
        rc = proc.wait()
        if stop is not None:
            stop.running.discard(proc)
        return rc


def settle(folder: CellFolder, rc: int | None) -> dict:
    """The cell process ended: its status as it left it, or failed with the cause when it died without
    finishing (a status still "running"), always with the exit and the log's last lines when not done.
    rc None: a together-group's member whose process goes on (run/groups.py): its status as it left it."""
    status = folder.status()
    if rc in (0, None) and status.get("state") == "done":
        return status
    if status.get("state") == "pending" and status.get("note"):  # it stopped itself in order (Ctrl-C, preemption,
        return status  # a search's rung): it will resume. Without a note it never started: see below
    if rc is None and status.get("state") == "failed":  # it said why itself, its traceback is in its cell.log
        return folder.write_status("failed", log_tail=folder.log_tail())
    rc = 1 if rc is None else rc
    tail = folder.log_tail()
    cause = exit_cause(rc, tail)
    if status.get("state") == "failed":  # it said why itself; the exit and the log go beside it
        return folder.write_status("failed", exit=cause, log_tail=tail)
    if killed_from_outside(rc, tail):  # not its own failure: the next `exp run` resumes it, as after Ctrl-C
        return folder.write_status("pending", note=f"interrupted: cell process {cause}", exit=cause, log_tail=tail,
                                   finished_at=time.time())
    error = f"cell process {cause}" if rc != 0 else "cell process exited without finishing (exit code 0)"
    return folder.write_status("failed", error=error, exit=cause, log_tail=tail, finished_at=time.time())


@dataclass
class Runner:
    """One `exp run` over a matrix's cells on this node."""

    matrix: MatrixFolder
    view: RunView
    how: Launch = field(default_factory=Launch)
    rerun_failed: bool = False
    fail_fast: bool = False
    stop: Interrupts = field(default_factory=Interrupts)
    # One per cell run at once (`--workers`: run/side_by_side.py), its threads and CPUs; () = one, this machine's.
    shares: tuple[Share, ...] = ()
    together: Setting = field(default_factory=Setting)  # cells sharing a base in one process (run/together.py)
    pool: workers.Pool | None = None  # together-groups' processes kept between calls (a search's rungs)

    @property
    def claims(self) -> bool:
        """Local cells run under the lock this runner takes (node 0: the other nodes follow its torchrun)."""
        return self.how.launcher == "local" and self.how.node_rank == 0

    def skip_reason(self, folder: CellFolder, cell: Cell, probe_lock: bool = True) -> str | None:
        status = folder.status()
        state = status.get("state")
        if state == "done" and folder.eval_done(cell.eval_id) and StepScores(folder, cell.config).settled():
            return "skipped-done"
        if cell.stop_at is not None and (status.get("paused_at") or 0) >= cell.stop_at:
            return "skipped-reached"  # it trained that far in an earlier run (a search's rung)
        if state == "failed" and not (self.rerun_failed or status.get("write_failed") or _input_changed(folder, cell)):
            return "skipped-failed"
        if self.how.launcher == "slurm" and state in ("pending", "running") and slurm.queued(status.get("slurm_job")):
            return "skipped-queued"
        return "skipped-locked" if probe_lock and folder.is_locked() else None

    def run_here(self, folder: CellFolder, cell: Cell, held: CellLock | None = None) -> Outcome:
        """Start the cell's process(es) on this node, follow its events, and settle its status."""
        evaluate_only = folder.is_trained()
        if evaluate_only and self.how.node_rank > 0:  # evaluation runs on one process, on node 0
            return Outcome(cell, "skipped-done", None)
        steps = min(cell.stop_at or cell.config.train.steps, cell.config.train.steps)
        handle = self.view.start_cell(cell.slug, steps, steps if evaluate_only else 0)
        command = (cell_command(folder.path, 1, Launch()) if evaluate_only
                   else cell_command(folder.path, cell.world_size, self.how))
        ranks = 1 if evaluate_only else procs_per_node(cell.world_size, self.how)
        threads = threads_env(self.shares[0] if self.shares else None, ranks, folder)
        rc = launch(folder, lambda ev: self.view.on_event(handle, ev), command, held,
                    self.matrix.node_log(folder, self.how.node_rank), self.stop, None if evaluate_only else cell,
                    threads)
        if self.how.node_rank > 0:  # global rank 0 lives on node 0 and owns the cell's status
            return Outcome(cell, "done" if rc == 0 else "failed", None if rc == 0 else exit_cause(rc))
        if rc == LOCKED_EXIT and held is None and folder.status().get("state") != "failed":
            self.view.end_cell(handle, "[yellow]locked by another process")
            return Outcome(cell, "skipped-locked", f"locked by another process ({folder.lock_holder()})")
        return self._ended(folder, cell, handle, rc)

    def _ended(self, folder: CellFolder, cell: Cell, handle: int, rc: int | None) -> Outcome:
        status = settle(folder, rc)
        if status.get("state") == "done":
            self.view.end_cell(handle, "[green]done")
            return Outcome(cell, "done")
        if status.get("state") == "pending" and status.get("paused_at") is not None:  # a search's rung
            self.view.end_cell(handle, f"[green]paused at step {status['paused_at']}")
            return Outcome(cell, "paused")
        if status.get("state") == "pending":
            self.view.end_cell(handle, "[yellow]interrupted: resumes on the next exp run")
            # "interrupted" (exit 130) when this runner was stopped; a cell killed from outside alone is "killed"
            if self.stop.stopping:
                return Outcome(cell, "interrupted", said_stop(folder, status, rc or 0, self.stop.by))
            return Outcome(cell, "killed", status.get("note") or exit_cause(rc or 0))
        self.view.end_cell(handle, f"[red]failed: {escape(str(status.get('error', ''))[:80])}")
        return Outcome(cell, "failed", status.get("error"))

    def claimed(self, folder: CellFolder, cell: Cell, held: CellLock, waited: bool) -> Outcome:
        """Run a cell whose lock this runner holds, unless it turned done or failed before the lock was ours."""
        skip = self.skip_reason(folder, cell, probe_lock=False)
        if skip in ("skipped-done", "skipped-reached"):  # not when this runner looked first: another process did it
            self.view.say(f"{cell.dirname}: {'done' if skip == 'skipped-done' else 'paused'} by another process")
            return Outcome(cell, "done-elsewhere")
        if skip:
            self.view.say(f"[dim]{cell.dirname}: failed in another process, skipped")
            return Outcome(cell, skip, folder.status().get("error"))
        if waited:
            self.view.say(f"{cell.dirname}: its lock is free and it is not done: running it here")
        results = folder.results_file(cell.eval_id)
        if results.is_file() and read_json(results) is None:  # damaged since (atomic writes never cut one short)
            self.view.say(f"{cell.dirname}: {results} is not readable JSON: evaluating it again")
        prepare(folder, cell, self.matrix.name)
        return self.run_here(folder, cell, held)

    def wait_for(self, folder: CellFolder, cell: Cell) -> CellLock | None:
        """Its lock once free; meanwhile who holds it and what that process is doing, said at once and on change.
        None once the cell got where this run wants it elsewhere (done, or paused at its rung: another runner's
        together-group may hold it paused in memory, lock and all, for its next rung), or this runner is stopping."""
        held = folder.lock()
        took = held.acquire_saying(self.view.say, f"{cell.dirname}: waiting for the process that holds its lock",
                                   give_up=lambda: self.stop.stopping or self.skip_reason(
                                       folder, cell, probe_lock=False) in ("skipped-done", "skipped-reached"))
        if not took:
            return None
        return held

    def first_pass(self, cell: Cell, later: list[tuple[Cell, CellFolder]],
                   to_submit: list[slurm.Job]) -> Outcome | None:
        """A cell's first turn: skipped, run, submitted later (SLURM) or put back (locked): None when not yet."""
        folder = self.matrix.folder(cell)
        # Another node's lock is no reason to skip: nodes R > 0 join the cell node 0 holds.
        skip = self.skip_reason(folder, cell, probe_lock=not self.claims and self.how.node_rank == 0)
        if skip:
            self.view.say(f"[dim]{cell.dirname}: {skip.removeprefix('skipped-')}, skipped")
            if self.how.node_rank == 0 and not folder.meta_file.is_file():  # deleted (it was damaged): again
                write_json(folder.meta_file, {**cell_meta(cell, self.matrix.name), "layout": LAYOUT})
            return Outcome(cell, skip, folder.status().get("error"))
        if self.claims:
            held = folder.lock()
            if not held.acquire(wait=0):
                self.view.say(f"{cell.dirname}: locked by another process ({folder.lock_holder()}); coming back to it")
                later.append((cell, folder))
                return None
            with held:
                return self.claimed(folder, cell, held, waited=False)
        if self.how.node_rank == 0:
            prepare(folder, cell, self.matrix.name)
        if self.how.launcher == "slurm":  # submitted together (job arrays group cells)
            to_submit.append((folder, cell))
            return None
        return self.run_here(folder, cell)

    def run(self, cells: list[Cell]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        later: list[tuple[Cell, CellFolder]] = []  # locked elsewhere: come back to them once the others are done
        to_submit: list[slurm.Job] = []

        def record(outcome: Outcome | None) -> bool:
            if outcome is not None:
                outcomes.append(outcome)
                if outcome.state != "interrupted":  # it resumes on the next run: not finished
                    self.view.advance()
            return outcome is not None and self.fail_fast and outcome.state == "failed"

        with self.view, self.stop.installed():
            if len(self.shares) > 1 and self.claims:  # --workers N: N cells at once, each on its CPUs
                from tunelab.run import side_by_side

                return side_by_side.run(self, cells)
            for unit in self.units(cells):
                if not (unit.together or self._held_here(unit)):
                    if self.stop.stopping or record(self.first_pass(unit.cells[0], later, to_submit)):
                        return outcomes
                    continue
                if self.stop.stopping:
                    return outcomes
                if [o for o in groups.run_unit(self, unit, later) if record(o)]:
                    return outcomes
            for cell, folder in later:
                if self.stop.stopping:
                    return outcomes
                held = self.wait_for(folder, cell)
                if held is None and self.stop.stopping:
                    return outcomes
                if held is None:
                    self.view.say(f"{cell.dirname}: {'done' if folder.status().get('state') == 'done' else 'paused'} "
                                  "by another process")
                    if record(Outcome(cell, "done-elsewhere")):
                        break
                    continue
                with held:
                    if record(self.claimed(folder, cell, held, waited=True)):
                        break
            for outcome in slurm.submit(to_submit, self.how, self.matrix) if to_submit else []:
                self.view.say(f"{outcome.cell.dirname}: {outcome.error}")
                record(outcome)
        return outcomes


    def _held_here(self, unit: Unit) -> bool:
        """A cell of the unit is held, paused in memory, by a together-group process of this runner's pool."""
        return self.pool is not None and any(self.pool.holding(self.matrix.folder(c).path) for c in unit.cells)

    def prepared(self, folder: CellFolder, cell: Cell) -> None:
        prepare(folder, cell, self.matrix.name)

    def units(self, cells: list[Cell]) -> list[Unit]:
        """The cells as they run: together-groups and cells alone (run/together.py); none joins unless this runner
        holds its cells' locks here (the local launcher, node 0)."""
        setting = self.together if self.claims else together.Setting("off")
        return together.plan(cells, setting, cap_of=lambda cs: groups.auto_cap(cs, setting.mode == "batched"),
                             alone=lambda c: groups.alone_now(self, c))


def prepare(folder: CellFolder, cell: Cell, matrix: str) -> None:
    """A cell about to run: its config, who it is (and what its input files were), status pending."""
    folder.prepare(cell.config, cell_meta(cell, matrix))


def cell_meta(cell: Cell, matrix: str) -> dict:
    """cell.json: who the cell is (and what its input files were)."""
    return {"matrix": matrix, "id": cell.id, "slug": cell.slug, "varying": cell.varying, "inputs": input_stamp(cell)}


def input_stamp(cell: Cell) -> dict[str, str]:
    """What a cell read besides its config: the recipe file's and its local data files' content hashes. A cell
    that failed for bad input is tried again by a plain `exp run` once one of them changed."""
    from tunelab.data.recipe import input_files  # the recipe's files, without building anything

    return {str(p): _digest(p) for p in input_files(cell.config.data.recipe)}


def _digest(path: Path) -> str:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return "unreadable"


def _input_changed(folder: CellFolder, cell: Cell) -> bool:
    """A failed cell whose failure came from its input files, and those files changed since."""
    before = folder.meta().get("inputs")
    return bool(before) and folder.status().get("bad_input", False) and before != input_stamp(cell)


def select(cells: list[Cell], only: str | None) -> list[Cell]:
    import fnmatch

    if not only:
        return cells
    return [c for c in cells if fnmatch.fnmatch(c.slug, only) or fnmatch.fnmatch(c.id, only)
            or fnmatch.fnmatch(c.dirname, only)]
