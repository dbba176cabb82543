"""`exp run` on a matrix with a `tune:` section: every group's search, stage by stage, then the winners retrained
with the matrix's seeds, then the matrix's other cells (those that could, trained with the first rung's trials).

The groups share one schedule (the same budget), so a stage (bracket b, rung i) of every group runs as one
batch of cells through the runner: as many cells at once as there are, for every runner on the runs folder to
share (each takes the cells no other holds and waits for the rest). After each stage every group's values are
read back, its decision taken, and its Optuna study and trials.json written under the study's lock.

Trials that share a base train as together-groups (run/together.py), across groups too, and their processes live
from rung to rung (run/workers.Pool): a promoted trial goes on in memory, without a process start or a checkpoint
read (its rung checkpoint is still written, for a resume); a pruned one is released from its process before its
checkpoint is freed, and every process ends before the winners and the plain cells run. A plain cell that could
join the first rung's trials (the same base, see run/together.py) trains with them instead, in their group, to its
end: its results do not depend on the search, and a group's process (its start, imports and base load) is saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tunelab.core.config import CellConfig
from tunelab.core.files import write_json
from tunelab.core.locks import CellLock, Locked, lock
from tunelab.folders.matrix import MatrixFolder
from tunelab.machine.threads import Share
from tunelab.matrix.expansion import Cell
from tunelab.run import runner, together, workers
from tunelab.run.launch import Launch
from tunelab.run.outcome import Outcome
from tunelab.run.progress import view
from tunelab.run.together import Setting
from tunelab.tools import clean
from tunelab.tune import edges, record, sampling, trials, workloads
from tunelab.tune.plan import Group
from tunelab.tune.search import Search


@dataclass
class Result:
    outcomes: list[Outcome]  # each cell's last outcome
    waiting: list[str] = field(default_factory=list)  # searches that cannot go on yet, and why


@dataclass
class _Run:
    """One `exp run`'s runner calls, and each cell's last outcome."""

    folder: MatrixFolder
    console: Console
    how: Launch
    rerun_failed: bool
    fail_fast: bool
    together: Setting = field(default_factory=Setting)
    last: dict[str, Outcome] = field(default_factory=dict)
    stop: runner.Interrupts = field(default_factory=runner.Interrupts)  # one Ctrl-C stops every stage after it
    shares: tuple[Share, ...] = ()  # --workers: a rung's trials side by side, each on its CPUs
    pool: workers.Pool | None = None  # the search's together-groups, kept from rung to rung
    joined: set[str] = field(default_factory=set)  # plain cells that trained with the first rung's trials

    def say(self, text: str) -> None:
        """A runner's word while it waits (for the search's lock: for whom, and what that process is doing)."""
        self.console.print(escape(text), highlight=False)

    def go(self, cells: list[Cell]) -> bool:
        """Run cells (skipping what is done); False when --fail-fast or a stop signal should end everything."""
        if self.stop.stopping:
            return False
        shown = view(self.console, self.folder.name, len(cells))
        for o in runner.Runner(self.folder, shown, self.how, rerun_failed=self.rerun_failed, fail_fast=self.fail_fast,
                               stop=self.stop, shares=self.shares, together=self.together, pool=self.pool).run(cells):
            self.last[o.cell.id] = o
        failed = self.fail_fast and any(o.state == "failed" for o in self.last.values())
        return not (failed or self.stop.stopping)

    def release(self, cells: list[Cell]) -> None:
        """These trials never train again here: out of their processes, their locks let go."""
        if self.pool is not None:
            self.pool.release([self.folder.folder(c).path for c in cells])

    def end(self) -> None:
        if self.pool is not None:
            self.pool.end()


def run(groups: list[Group], chosen: list[Group], cells: list[Cell], plain: list[Cell], folder: MatrixFolder, *,
        console: Console, how: Launch, rerun_failed: bool = False, fail_fast: bool = False,
        shares: tuple[Share, ...] = (), together: Setting = Setting()) -> Result:
    """Run the chosen groups' searches and winners, then the plain cells chosen. cells.json lists every plain
    cell of the matrix and the winner of every search that has ended (those not chosen are read, not run)."""
    mdir = folder.path
    searches = [Search(g, mdir) for g in groups]
    running = [s for s in searches if s.group.study in {g.study for g in chosen}]
    write_json(folder.studies_file, [{"group": g.slug, "study": g.study, "study_index": g.study_index,
                                      "studies": g.spec.studies, "storage": g.spec.storage,
                                      "trials_file": str(folder.trials_file(g.study).relative_to(mdir))}
                                     for g in groups])
    folder.write_index(_annotated(cells, groups))  # the winners join once their searches end
    r = _Run(folder, console, how, rerun_failed, fail_fast, together, pool=workers.Pool(), shares=shares)
    try:
        searched = _stages(running, r, plain)
    finally:
        r.end()  # the searches' processes end before the winners and the plain cells run
    if not searched:
        return Result(list(r.last.values()))
    _stages([s for s in searches if s not in running], None)  # read only: whatever they have done already
    finals = {s.group.study: trials.final_cells(s.group, w.view.params, s.summary())
              for s in searches if (w := s.winner())}
    folder.write_index([*_annotated(cells, groups), *(c for f in finals.values() for c in f)])
    waiting = [f"{s.group.label}: {s.blocked}" for s in running if s.blocked]
    _say_edges(running, console)
    ours = _unique([c for s in running for c in finals.get(s.group.study, [])])
    if ours and not r.go(ours):
        return Result(list(r.last.values()), waiting)
    plain = [c for c in plain if c.id not in r.joined]
    if plain:  # none: no word of an empty batch
        r.go(plain)
    return Result(list(r.last.values()), waiting)


def _stages(searches: list[Search], r: _Run | None, plain: Sequence[Cell] = ()) -> bool:
    """Every bracket and rung of the searches (they share one schedule); with r None nothing runs and nothing is
    written: each search gets as far as its cells already are. False when --fail-fast stopped it. `plain`: the
    matrix's cells to run after the searches; those that can join the first rung's trials train with them."""
    if not searches:
        return True
    brackets = searches[0].group.schedule.brackets
    for b, bracket in enumerate(brackets):
        live = [s for s in searches if not s.blocked]
        for s in live:
            s.start_bracket(b)
        for i, step in enumerate(bracket.rungs):
            live = [s for s in live if not s.blocked]
            cells = _unique([c for s in live for c in s.cells(b, i)])  # two studies may draw one point
            if not cells:
                return True
            if r is not None:
                joining = _joining(plain, cells, r.together) if b == i == 0 else []
                r.joined.update(c.id for c in joining)
                beside = f", and {len(joining)} of the matrix's cells with them (the same base)" if joining else ""
                r.console.print(f"[bold]tune[/]: bracket {b + 1}/{len(brackets)}, rung {i + 1} (step {step}): "
                                f"{len(cells)} trial runs over {len(live)} group(s){beside}", highlight=False)
                _record_progress(live, b, i, False, r.say)
                if not r.go(cells + joining):
                    _record_progress(live, b, i, True, r.say)
                    return False
            for s in live:
                s.collect(b, i)
                s.decide(b, i)
                if r is not None:
                    _write_record(s, s.matrix_dir, r.say)
            if r is not None:
                # A cell is let go only when every trial on it is pruned: a point drawn twice (a choice or int space,
                # another study, another bracket) is one cell, and its twin may go on or have won.
                kept = {t.cell.id for s in searches for t in s.trials if t.view.state != "pruned"}
                r.release([t.cell for s in live for t in s.trials  # out of their processes before their checkpoints go
                           if t.view.state == "pruned" and t.cell.id not in kept])
                for s in live:
                    _free_pruned(s, s.matrix_dir, kept)
    return True


def _joining(plain: Sequence[Cell], trial_cells: list[Cell], setting: Setting) -> list[Cell]:
    """The plain cells that can share a together-group with these trials (run/together.py's key; none when
    together-groups are off)."""
    if setting.off:
        return []
    keys = {together.key(c.config) for c in trial_cells if together.why_alone(c.config) is None}
    return [c for c in plain if together.why_alone(c.config) is None and together.key(c.config) in keys]


def _record_progress(live: list[Search], b: int, i: int, collect: bool, say: Callable[[str], None]) -> None:
    """A stage about to run, or stopped before its end (Ctrl-C): the study says so already, each trial with its
    point and, stopped, the values and steps its cells have (`exp tune status` reads it), no decision taken."""
    for s in live:
        if collect:
            s.collect(b, i)
        _write_record(s, s.matrix_dir, say)


def _unique(cells: list[Cell]) -> list[Cell]:
    """Each cell once (by id and how far it runs)."""
    return list({(c.id, c.stop_at): c for c in cells}.values())


def _say_edges(searches: list[Search], console: Console) -> None:
    """`exp run` says which study's winner sits at an edge of its space (tune/edges.py)."""
    for s in searches:
        for e in s.summary()["edges"]:
            console.print(f"[yellow]search {s.group.label}: {edges.said(e)}", soft_wrap=True, highlight=False)


def _unseeded(config: CellConfig) -> str:
    return config.model_copy(update={"train": config.train.model_copy(update={"seed": 0})}).id()


def _annotated(plain: list[Cell], groups: list[Group]) -> list[Cell]:
    """A group's cell as written (tune.baseline) says so in cells.json: the leaderboard's `default` row."""
    baselines = {_unseeded(g.config): g for g in groups if g.spec.baseline}
    out = []
    for c in plain:
        g = baselines.get(_unseeded(c.config))
        out.append(replace(c, meta={"tune": {"role": "default", "group": g.slug, "metric": g.spec.metric,
                                             "workloads": list(g.spec.workloads),
                                             **workloads.parts(g.varying, g.spec.workloads)}}) if g else c)
    return out


def _write_record(s: Search, mdir: Path, say: Callable[[str], None]) -> None:
    """The study and trials.json, under the tune folder's lock (runners on one runs folder write in turn; one that
    waits says for whom, and what that process is doing)."""
    folder = MatrixFolder(mdir)
    held = CellLock(folder.tune_dir)
    held.acquire_saying(say, f"waiting for the process that holds the search's lock {held.path}")
    with held:
        record.repair_journal(mdir, say)
        storage = record.open_storage(s.spec.storage, mdir)
        attrs = {"tunelab": {"group": s.group.slug, "varying": s.group.varying, "metric": s.spec.metric,
                             "direction": s.spec.direction, "sampler": s.spec.sampler, "pruner": s.spec.pruner,
                             "schedule": s.group.schedule.describe(), "full_steps": s.group.schedule.full_steps(),
                             "planned_steps": s.group.schedule.planned_steps()},
                 "decisions": s.decisions}
        record.sync(storage, s.group.study, s.spec.direction, sampling.distributions(s.spec),
                    [t.view for t in s.trials], attrs)
        write_json(folder.trials_file(s.group.study), s.table())


def _free_pruned(s: Search, mdir: Path, kept: set[str]) -> None:
    """A pruned trial never trains again: its rung checkpoint goes (as `exp clean` deletes: under the cell's lock,
    renamed aside first) and its status says it was pruned; its metrics stay. A later run that asks for it again
    starts it over and validates at the same rungs (validate_at), so nothing the search reads is lost."""
    for t in s.trials:
        if t.view.state != "pruned" or t.cell.id in kept:  # the same point in a trial that goes on, or has won
            continue
        d = MatrixFolder(mdir).folder(t.cell)
        if d.checkpoints.is_dir():
            clean.delete(clean.Item(d, d.path.name, d.status().get("state", "?"), d.checkpoints, 0))
        note = f"pruned at step {t.view.pruned_at} by its search (exp tune status {mdir})"
        if d.status().get("note") != note:
            with contextlib.suppress(Locked), lock(d.path):
                d.write_status("pending", note=note)
