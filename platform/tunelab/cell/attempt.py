"""One attempt at a cell on one process of its layout: where it works, what it runs, on which machine, and how
it reports (events to the runner, the main process's W&B run). `start` says the cell runs."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tunelab.cell import environment
from tunelab.core import events
from tunelab.core.config import CellConfig
from tunelab.core.events import Emit
from tunelab.core.files import write_json
from tunelab.folders.cell import CellFolder
from tunelab.machine.runtime import Layout, Runtime

if TYPE_CHECKING:
    from tunelab.report.tracking import Tracker


@dataclass
class Attempt:
    """One attempt at a cell on one process of its layout: what every stage needs."""

    folder: CellFolder
    cfg: CellConfig
    rt: Runtime
    emit: Emit
    timings: dict[str, float] = field(default_factory=dict)
    tracker: Tracker | None = None  # the main process's W&B run; None on the others
    stop_at: int | None = None  # this run trains up to this step only (a search's rung; run.launch.STOP_AT_ENV)
    validate_at: tuple[int, ...] = ()  # and measures validation loss at these steps (its search's rungs)

    @classmethod
    def open(cls, run_dir: Path, emit: Emit, cfg: CellConfig | None = None, layout: Layout | None = None) -> Attempt:
        """The attempt at the cell in `run_dir`: its config (read from the folder without `cfg`), the runtime on
        this machine (one plain process without `layout`), and how far this run trains (a search's rung)."""
        from tunelab.machine import runtime
        from tunelab.run.launch import stop_at_from_env, validate_at_from_env

        folder = CellFolder(run_dir)
        cfg = cfg or folder.config()
        layout = layout or Layout(device=runtime.device_of(cfg.train.device))
        return cls(folder, cfg, runtime.resolve(cfg, layout), emit, stop_at=stop_at_from_env(),
                   validate_at=validate_at_from_env())

    def track(self, resuming: bool) -> None:
        """Open the W&B run of this cell; its events reach W&B from now on."""
        from tunelab.report.tracking import Tracker

        meta = self.folder.meta()
        tracker = self.tracker = Tracker(
            self.cfg, self.folder.path, group=meta.get("matrix", "adhoc"), name=meta.get("slug", self.folder.path.name),
            config=self.cfg.model_dump(mode="json"), tags=[f"{k}={v}" for k, v in meta.get("varying", {}).items()],
            resuming=resuming)
        emit = self.emit

        def both(event: events.Event) -> None:
            tracker.on_event(event)
            emit(event)

        self.emit = both

    def summary(self, values: dict) -> None:
        if self.tracker is not None:
            self.tracker.summary(values)

    def finish(self, failed: bool = False) -> None:
        """The attempt ends (done, paused, stopped or failed): its W&B run finished. The status written next ends
        the run, and the cell folder records it in attempts.jsonl (its seconds, devices and timings: a
        together-group's member its own part; the group's process says the rest in its record.json)."""
        if self.tracker is not None:
            self.tracker.finish(failed=failed)


def start(attempt: Attempt, evaluate_only: bool, together: dict | None = None) -> None:
    """The main process says the cell runs, keeps the machine's description and opens the W&B run. `together`:
    the together-group it runs in (cell/group.py), None alone."""
    folder = attempt.folder
    if evaluate_only:  # keep the training's timings beside this evaluation's
        attempt.timings.update(folder.status().get("timings") or {})
    write_json(folder.env_file, environment.snapshot(attempt.cfg.model.name))
    folder.write_status("running", started_at=time.time(), pid=os.getpid(), process_started_at=_process_start(),
                        timings=attempt.timings, world_size=attempt.rt.world_size, device=attempt.rt.device.type,
                        evaluating_only=evaluate_only, paused_at=None, note=None, together=together)
    attempt.track(resuming=evaluate_only or _has_checkpoint(folder, attempt.cfg))


def _process_start() -> float:
    """When this process started (its imports and start-up come before `started_at`)."""
    import psutil

    return psutil.Process().create_time()


def _has_checkpoint(folder: CellFolder, cfg: CellConfig) -> bool:
    from tunelab.train import checkpoint

    return cfg.train.resume and checkpoint.latest(folder.checkpoints) is not None
