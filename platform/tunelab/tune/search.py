"""One method group's search, bracket by bracket and rung by rung.

Everything here is recomputed from the matrix file and the cell folders on every `exp run`: the trials of a
bracket come from the sampler replayed over the brackets before it (sampling.py), a rung's values are read off
the trials' folders, and a rung's decision is taken only once every trial of the rung has its value
(schedule.promote: best first, ties by trial number). So a search killed anywhere, or run by several runners at
once, takes the same decisions and ends with the same trials. A trial whose cell failed or was interrupted
holds its search back (no decision without it); `exp run` again (`--rerun-failed` for a failure) goes on.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tunelab.core.registries import INTERMEDIATES
from tunelab.folders.cell import CellFolder, EvalFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.matrix.expansion import Cell
from tunelab.matrix.tune_section import TuneSpec
from tunelab.tune import edges, sampling, trials, workloads
from tunelab.tune.objective import final_value, is_number
from tunelab.tune.plan import Group
from tunelab.tune.record import TrialView
from tunelab.tune.schedule import promote


@dataclass
class Trial:
    view: TrialView
    cell: Cell  # without a stop: the trial as a cell


@dataclass
class Search:
    group: Group
    matrix_dir: Path
    trials: list[Trial] = field(default_factory=list)
    active: list[Trial] = field(default_factory=list)  # the current bracket's trials still in it
    decisions: list[dict[str, Any]] = field(default_factory=list)
    blocked: str | None = None  # why it cannot go on now

    @property
    def spec(self) -> TuneSpec:
        return self.group.spec

    def start_bracket(self, b: int) -> None:
        """Sample bracket b's trials; the sampler is told the brackets before it, in trial-number order."""
        told = [[_told(t.view) for t in self.trials if t.view.bracket == k] for k in range(b)]
        points = sampling.points(self.spec, self.group.schedule, told)[b]
        first = self.group.schedule.first_trial(b)
        new = []
        for i, params in enumerate(points):
            cell = trials.trial_cell(self.group, first + i, params)
            new.append(Trial(TrialView(first + i, b, params, cell.id), cell))
        self.trials += new
        self.active = new

    def rung(self, b: int, i: int) -> int:
        return self.group.schedule.brackets[b].rungs[i]

    def cells(self, b: int, i: int) -> list[Cell]:
        """The runs of rung i: each active trial up to the rung's step (the last rung: to its end)."""
        step, bracket = self.rung(b, i), self.group.schedule.brackets[b]
        stop = None if step >= self.group.schedule.full else step
        rungs = tuple(r for r in bracket.rungs if r < self.group.schedule.full)  # a restarted run measures them too
        return [replace(t.cell, stop_at=stop, validate_at=rungs) for t in self.active]

    def collect(self, b: int, i: int) -> None:
        """Read each active trial's value at rung i; blocked when one has none."""
        step = self.rung(b, i)
        for t in self.active:
            d = MatrixFolder(self.matrix_dir).folder(t.cell)
            t.view.reached = _steps_trained(d)
            why = self._at_rung(t, d, step) if step < self.group.schedule.full else self._at_end(t, d)
            if why:
                t.view.note = why
                self.blocked = self.blocked or f"trial {t.view.number} ({d.path.name}): {why}"

    def _at_rung(self, t: Trial, d: CellFolder, step: int) -> str | None:
        entry, eval_id = INTERMEDIATES[self.spec.intermediate], t.cell.config.checkpoint_eval_id()
        value = entry.value.load()(d.path, step, self.spec.metric, eval_id)
        if value is not None:
            t.view.intermediate[step] = value
            return None
        if entry.checkpoints and eval_id and d.step_results(eval_id, step).get("complete"):  # no number: say why
            return (f"its checkpoint of step {step} has no score of {self.spec.metric} (see "
                    f"{EvalFolder(d.step_dir(eval_id, step)).results_file.relative_to(d.path)})")
        if t.view.reached > step:
            return (f"it trained past step {step} without measuring its {self.spec.ranked_by} there (its cell was "
                    "trained before this search asked, e.g. by another matrix); delete its folder to train it as a "
                    "trial")
        return _unfinished(d, f"reach step {step}" + (" and score its checkpoint" if entry.checkpoints else ""))

    def _at_end(self, t: Trial, d: CellFolder) -> str | None:
        if d.status().get("state") != "done" or not d.eval_done(t.cell.eval_id):
            return _unfinished(d, "finish")
        t.view.value = final_value(d.path, t.cell.eval_id, self.spec.metric)
        t.view.state = "complete"
        return None

    def decide(self, b: int, i: int) -> None:
        """After rung i of bracket b: the best of its trials go on, the others are pruned there."""
        bracket = self.group.schedule.brackets[b]
        if self.blocked or i == len(bracket.rungs) - 1:
            return
        step = bracket.rungs[i]
        lower = self.spec.lower_is_better
        values = [(t.view.number, t.view.intermediate.get(step)) for t in self.active]
        kept = promote(values, bracket.sizes[i + 1], lower)
        for t in self.active:
            if t.view.number not in kept:
                t.view.state, t.view.pruned_at = "pruned", step
        by = f"{self.spec.ranked_by} ({'lowest' if lower else 'highest'} first, ties by trial number)"
        self.decisions.append({"bracket": b, "rung": i, "step": step, "values": [list(v) for v in values],
                               "promoted": kept, "by": by})
        self.active = [t for t in self.active if t.view.number in kept]

    def winner(self) -> Trial | None:
        """The best trial that trained the full budget (ties by trial number); None before the search ends."""
        done = [(v, t) for t in self.trials if t.view.state == "complete" and (v := t.view.value) is not None
                and is_number(v)]
        if not done or self.blocked or len(self.trials) < self.spec.trials or self.active_unfinished():
            return None
        sign = 1 if self.spec.direction == "minimize" else -1
        return min(done, key=lambda vt: (sign * vt[0], vt[1].view.number))[1]

    def active_unfinished(self) -> bool:
        return any(t.view.state == "waiting" for t in self.trials)

    def steps_trained(self) -> int:
        """Steps the search's cells trained: a point drawn twice (a choice or int space) is one cell, trained once."""
        reached: dict[str, int] = {}
        for t in self.trials:
            reached[t.cell.id] = max(reached.get(t.cell.id, 0), t.view.reached)
        return sum(reached.values())

    def summary(self) -> dict[str, Any]:
        """What the leaderboard says of the search (one row per group)."""
        win = self.winner()
        values = sorted(v for t in self.trials if t.view.state == "complete" and (v := t.view.value) is not None
                        and is_number(v))
        ordered = values if self.spec.direction == "minimize" else values[::-1]
        return {"group": self.group.slug, "study": self.group.study, "study_index": self.group.study_index,
                "studies": self.spec.studies, "workloads": list(self.spec.workloads),
                **workloads.parts(self.group.varying, self.spec.workloads), "metric": self.spec.metric,
                "direction": self.spec.direction, "sampler": self.spec.sampler, "pruner": self.spec.pruner,
                "tuned": win.view.params if win else None, "winner": win.view.number if win else None,
                "trials": len(self.trials), "completed": len(values),
                "pruned": sum(t.view.state == "pruned" for t in self.trials),
                "search_steps": self.steps_trained(),
                "full_steps": self.group.schedule.full_steps(), "planned_steps": self.group.schedule.planned_steps(),
                "best": ordered[0] if ordered else None, "worst": ordered[-1] if ordered else None,
                "median": statistics.median(values) if values else None, "values": values,
                "edges": [asdict(e) for e in edges.of(self.spec.space, win.view.params)] if win else [],
                "test_selected": self.group.on_test, "trials_file": str(
                    MatrixFolder(self.matrix_dir).trials_file(self.group.study).relative_to(self.matrix_dir))}

    def table(self) -> dict[str, Any]:
        """trials.json: the search as a file (the report's figures read it)."""
        return {"group": self.group.slug, "study": self.group.study, "study_index": self.group.study_index,
                "studies": self.spec.studies, "varying": self.group.varying,
                "space": {k: {d.kind: d.bounds if d.choice is None else d.choice}
                          for k, d in self.spec.space.items()},
                "edge_zones": {k: d.edge_zones() for k, d in self.spec.space.items()},
                "metric": self.spec.metric, "direction": self.spec.direction, "intermediate": self.spec.ranked_by,
                "schedule": [{"rungs": list(b.rungs), "sizes": list(b.sizes)}
                             for b in self.group.schedule.brackets],
                "trials": [asdict(t.view) for t in self.trials], "decisions": self.decisions,
                "summary": self.summary(), "blocked": self.blocked}


def _told(view: TrialView) -> sampling.Told:
    state = view.state if view.state != "complete" or is_number(view.value) else "failed"
    return sampling.Told(dict(view.intermediate), state, view.value)


def _steps_trained(d: CellFolder) -> int:
    """The last step in the trial's metrics.jsonl (a run stopped at a rung logs that step)."""
    return max((r.get("step", 0) for r in d.metrics()), default=0)


def _unfinished(d: CellFolder, what: str) -> str:
    status = d.status()
    state, error = status.get("state", "not started"), status.get("error")
    if state == "failed":
        return f"its cell failed before it could {what} ({error}); fix the cause and run `exp run --rerun-failed`"
    return f"its cell did not {what} (state {state}); run `exp run` again to go on"
