"""What a user sees while `exp run` works: rich progress bars on a terminal, plain lines anywhere else.

A log file or a pipe (`nohup exp run ... > log`) gets one line per cell event (started, resumed, a stage,
done, failed) and, while a cell trains or evaluates, a line every `every_s` seconds with its step, loss,
tokens/s and the time left, so it can be followed with `tail -f`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tunelab.core import events
from tunelab.core.errors import env_number
from tunelab.machine.load import StepWindow, strain

EVERY_ENV = "TUNELAB_PROGRESS_EVERY"
PLAIN_EVERY_S = 30.0  # seconds between the periodic lines of a plain log ($TUNELAB_PROGRESS_EVERY overrides)


class RunView(Protocol):
    def say(self, text: str) -> None: ...
    def start_cell(self, label: str, total: int, done: int) -> int: ...
    def on_event(self, handle: int, ev: events.Event) -> None: ...
    def end_cell(self, handle: int, text: str) -> None: ...
    def advance(self) -> None: ...
    def __enter__(self) -> RunView: ...
    def __exit__(self, *exc: object) -> None: ...


def shown(ev: events.Event, machine: str | None = None) -> dict[str, Any]:
    """How an event shows on the cell's progress line; `machine`: what the machine is doing to it (strained)."""
    if isinstance(ev, events.Step):
        return {"completed": ev.step, "info": f"train loss {ev.loss:.4f}" + (f"; {machine}" if machine else "")}
    if isinstance(ev, events.EvalProgress):  # the cell's bar follows the task's items (and shows their ETA)
        return {"total": ev.total, "completed": ev.done, "info": f"eval {ev.task} {ev.done}/{ev.total}"}
    if isinstance(ev, events.DataProgress):
        return {"info": f"tokenizing {ev.done}/{ev.total}"}
    if isinstance(ev, events.EvalTask):
        return {"info": f"eval {ev.task}" + (f" of the checkpoint of step {ev.step}" if ev.step is not None else "")}
    if isinstance(ev, events.Resumed):
        skipped = f" (not from {ev.skipped})" if ev.skipped else ""
        return {"completed": ev.step, "info": f"resumed from {ev.checkpoint}{skipped}"}
    if isinstance(ev, events.CheckpointScores):
        return {"info": f"checkpoint of step {ev.step} scored"}
    return {"info": ev.name if isinstance(ev, events.Stage) else ""}


class BarsView:
    """A terminal: a bar for the matrix and one per cell (rich)."""

    def __init__(self, console: Console, matrix: str, cells: int):
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                 console=console, transient=False)
        self.overall = self.progress.add_task(f"[bold]{matrix}", total=cells, info="")
        self.steps: dict[int, StepWindow] = {}

    def say(self, text: str) -> None:
        self.progress.console.print(text, soft_wrap=True, highlight=False)  # paths stay whole, to be copied

    def start_cell(self, label: str, total: int, done: int) -> int:
        return int(self.progress.add_task(f"  {label}", total=total, info="starting", completed=done))

    def on_event(self, handle: int, ev: events.Event) -> None:
        self.progress.update(TaskID(handle), **shown(ev, strained(self.steps.setdefault(handle, StepWindow()), ev)))

    def end_cell(self, handle: int, text: str) -> None:
        self.progress.update(TaskID(handle), info=text)

    def advance(self) -> None:
        self.progress.advance(self.overall)

    def __enter__(self) -> BarsView:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)


@dataclass
class _Cell:
    label: str
    total: int
    done: int
    started: float = field(default_factory=time.monotonic)
    first_step: tuple[int, float] | None = None  # (step, time) of the first step this attempt saw
    last: events.Event | None = None
    said_at: float = field(default_factory=time.monotonic)
    steps: StepWindow = field(default_factory=StepWindow)  # for what the machine is doing (machine/load.py)
    machine: str | None = None


class LinesView:
    """No terminal: plain lines, with no colour codes or cursor movement."""

    def __init__(self, console: Console, matrix: str, cells: int, every_s: float = PLAIN_EVERY_S):
        self.console, self.every_s = console, every_s
        self.cells: dict[int, _Cell] = {}
        self.total, self.finished = cells, 0
        self.say(f"{matrix}: {cells} cell(s)")

    def say(self, text: str) -> None:
        self.console.print(text, soft_wrap=True, highlight=False, markup=True)

    def start_cell(self, label: str, total: int, done: int) -> int:
        handle = len(self.cells)
        self.cells[handle] = _Cell(label, total, done)
        self.say(f"{escape(label)}: started" + (" (training done, evaluating)" if done >= total else ""))
        return handle

    def on_event(self, handle: int, ev: events.Event) -> None:
        cell, now = self.cells[handle], time.monotonic()
        if isinstance(ev, events.Step):
            cell.done = ev.step
            cell.first_step = cell.first_step or (ev.step, now)
            cell.machine = strained(cell.steps, ev)
        cell.last = ev
        if isinstance(ev, (events.Stage, events.Resumed, events.EvalTask)):
            self.say(f"{escape(cell.label)}: {shown(ev)['info']}")
            cell.said_at = now
        elif now - cell.said_at >= self.every_s:
            self.say(f"{escape(cell.label)}: {self._line(cell, now)}")
            cell.said_at = now

    def _line(self, cell: _Cell, now: float) -> str:
        ev = cell.last
        if isinstance(ev, events.EvalProgress):
            return f"eval {ev.task} {ev.done}/{ev.total}"
        if isinstance(ev, events.DataProgress):
            return f"tokenizing {ev.done}/{ev.total}"
        if not isinstance(ev, events.Step):
            return shown(ev)["info"] if ev else "working"
        parts = [f"step {ev.step}/{ev.total}", f"loss {ev.loss:.4f}"]
        if (tps := ev.metrics.get("tokens_per_s")) is not None:
            parts.append(f"{tps:.0f} tokens/s")
        if cell.first_step and ev.step > cell.first_step[0]:
            per_step = (now - cell.first_step[1]) / (ev.step - cell.first_step[0])
            parts.append(f"{_duration(per_step * (ev.total - ev.step))} left in training")
        return ", ".join(parts) + (f"; {cell.machine}" if cell.machine else "")

    def end_cell(self, handle: int, text: str) -> None:
        cell = self.cells[handle]
        self.say(f"{escape(cell.label)}: {text} after {_duration(time.monotonic() - cell.started)}")

    def advance(self) -> None:
        self.finished += 1
        self.say(f"{self.finished}/{self.total} cell(s) finished")

    def __enter__(self) -> LinesView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def strained(steps: StepWindow, ev: events.Event) -> str | None:
    """A Step's record kept; what the machine is doing to the cell, if anything (machine/load.py: slow steps, busy
    CPUs, with the figures)."""
    if not isinstance(ev, events.Step):
        return None
    steps.add({"step": ev.step, **ev.metrics})
    said = strain(steps.rows())
    return f"slow: {said}" if said else None


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def view(console: Console, matrix: str, cells: int) -> RunView:
    """Bars on a terminal, lines elsewhere; $TUNELAB_PROGRESS_EVERY sets the seconds between plain lines."""
    if console.is_terminal:
        return BarsView(console, matrix, cells)
    return LinesView(console, matrix, cells, every_s=every_s())


def every_s() -> float:
    """Seconds between a plain log's periodic lines: $TUNELAB_PROGRESS_EVERY (0: at every event), else 30."""
    return env_number(EVERY_ENV, PLAIN_EVERY_S, strict=False, what="seconds, a number")
