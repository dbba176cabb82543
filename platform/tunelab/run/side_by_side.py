"""`exp run --workers N`: N cells of a matrix side by side on this machine, each pinned to its share of the CPUs
with its threads sized to it (tunelab.machine.threads.shares), so a many-core machine is used without starting N
runners by hand.

A small pool: N threads of the runner, each with its own share, take the next cell and run it exactly as the
runner runs one (Runner.first_pass: the same skip, lock, status and settle), and then wait in turn for the cells
another process held. The cells' events reach one view, one call at a time. A stop signal (Ctrl-C) reaches every
running cell (Interrupts.running) and no further cell starts; --fail-fast starts none after the first failure.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Any

from tunelab.core import events
from tunelab.folders.cell import CellFolder
from tunelab.machine.threads import Share
from tunelab.matrix.expansion import Cell
from tunelab.run.outcome import Outcome
from tunelab.run.progress import RunView

JOIN_S = 0.2  # the main thread wakes this often while it waits for the pool, so a signal's handler runs at once


class OneAtATime:
    """A view shared by the pool's threads: each call whole, in turn."""

    def __init__(self, inner: RunView):
        self.inner, self.lock = inner, threading.RLock()

    def say(self, text: str) -> None:
        with self.lock:
            self.inner.say(text)

    def start_cell(self, label: str, total: int, done: int) -> int:
        with self.lock:
            return self.inner.start_cell(label, total, done)

    def on_event(self, handle: int, ev: events.Event) -> None:
        with self.lock:
            self.inner.on_event(handle, ev)

    def end_cell(self, handle: int, text: str) -> None:
        with self.lock:
            self.inner.end_cell(handle, text)

    def advance(self) -> None:
        with self.lock:
            self.inner.advance()

    def __enter__(self) -> OneAtATime:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def run(runner: Any, cells: list[Cell]) -> list[Outcome]:
    """Every cell through one of the runner's shares (a run.runner.Runner, which calls this: not imported, so the
    two make no import circle), as many at once as it has shares; the outcomes in the order the cells ended."""
    view = OneAtATime(runner.view)
    todo: deque[Cell] = deque(cells)
    later: list[tuple[Cell, CellFolder]] = []  # locked by another process at their first turn
    outcomes: list[Outcome] = []
    guard = threading.Lock()
    halt = threading.Event()
    errors: list[BaseException] = []
    shares = runner.shares
    view.say(f"{len(shares)} cells at once: " + "; ".join(
        f"{s.threads} thread(s)" + (f" on CPUs {','.join(map(str, s.cpus))}" if s.cpus else "") for s in shares)
        + f" ({shares[0].why})")

    def record(outcome: Outcome | None) -> None:
        if outcome is None:
            return
        with guard:
            outcomes.append(outcome)
        view.advance()
        if runner.fail_fast and outcome.state == "failed":
            halt.set()

    def next_of(queue: deque | list):
        with guard:
            if not queue or halt.is_set() or runner.stop.stopping:
                return None
            return queue.popleft() if isinstance(queue, deque) else queue.pop(0)

    def work(share: Share) -> None:
        me = replace(runner, view=view, shares=(share,))
        try:
            while (cell := next_of(todo)) is not None:
                record(me.first_pass(cell, later, []))
            while (item := next_of(later)) is not None:
                cell, folder = item
                with me.wait_for(folder, cell) as held:
                    record(me.claimed(folder, cell, held, waited=True))
        except BaseException as e:  # noqa: BLE001 - the main thread raises it once the others are done
            errors.append(e)
            halt.set()

    pool = [threading.Thread(target=work, args=(s,), name=f"cell-worker-{i}", daemon=True)
            for i, s in enumerate(shares)]
    for t in pool:
        t.start()
    for t in pool:
        while t.is_alive():
            t.join(JOIN_S)
    if errors:
        raise errors[0]
    return outcomes
