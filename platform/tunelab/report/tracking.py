"""Tracking: every cell logs to local files (train/metrics.jsonl, eval/results.json) and to W&B.

W&B is a witness, never a judge: the local files are the results, so nothing W&B does may fail or stall a
cell. A server that cannot be reached within the init timeout (WANDB_INIT_TIMEOUT, else INIT_TIMEOUT_S)
turns the run into an offline one in the cell folder (`wandb sync` uploads it later); any later W&B error
ends tracking for that cell. Each of these says what happened in the cell's log (its stderr).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any

from tunelab.core.config import CellConfig, TrackingCfg
from tunelab.core.errors import UserError, env_number
from tunelab.core.events import CheckpointScores, Step
from tunelab.core.files import write_text

WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb itself accepts


def wandb_mode(cfg: TrackingCfg) -> str:
    """Explicit config wins, then WANDB_MODE; without an API key a run stays offline."""
    if cfg.mode:
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def check_env() -> None:
    """Before a matrix runs: the W&B settings taken from the environment are ones W&B accepts."""
    mode = os.environ.get("WANDB_MODE")
    if mode and mode not in WANDB_MODES:
        raise UserError(f"environment variable WANDB_MODE={mode!r}: allowed values are {', '.join(WANDB_MODES)} "
                        "(or leave it unset: online with an API key, else offline)")
    init_timeout()


def init_timeout() -> float:
    """Seconds a cell waits for W&B's server before it logs offline; W&B's own default is 90 s."""
    return env_number("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S, what="seconds, a number")


RUN_ID_FILE = "wandb_run_id"
INIT_TIMEOUT_S = 30.0  # W&B's own default is 90 s: paid by every cell of a matrix while the server is down


def _say(message: str) -> None:
    print(f"tunelab: W&B: {message}", file=sys.stderr, flush=True)


def _why(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


_LIVE: set[int] = set()  # this process's runs not yet finished (a together-group's process holds several)


class Tracker:
    """`resuming`: the cell continues from a checkpoint, so it continues its W&B run too (same run id,
    kept in the cell folder). A cell that starts over gets a new run: W&B drops steps already logged."""

    def __init__(self, cfg: CellConfig, run_dir: Path, *, group: str, name: str, config: dict, tags: list[str],
                 resuming: bool = False):
        self.run = None
        mode = wandb_mode(cfg.tracking)
        if not cfg.tracking.wandb or mode == "disabled":
            return
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else secrets.token_hex(6)
        write_text(id_file, run_id + "\n")
        kwargs = dict(project=cfg.tracking.project, entity=cfg.tracking.entity, group=group, name=name,
                      job_type="cell", config=config, tags=tags, dir=str(run_dir), reinit="create_new",
                      id=run_id, resume="allow")
        try:
            self.run = self._init(mode, kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of W&B: the cell goes on, and says so
            if mode == "offline":
                _say(f"could not start an offline run ({_why(e)}); this cell is not tracked in W&B")
                return
            _say(f"could not start an online run ({_why(e)}); logging offline to {run_dir / 'wandb'} instead "
                 f"(upload it later with `wandb sync {run_dir / 'wandb'}`)")
            try:
                import wandb

                if not _LIVE:  # (a together-group's process holds its other members' runs: those stay)
                    wandb.teardown()  # the failed attempt keeps the run id busy otherwise
                self.run = self._init("offline", kwargs)
            except Exception as e2:  # noqa: BLE001
                _say(f"the offline run failed too ({_why(e2)}); this cell is not tracked in W&B")

    @staticmethod
    def _init(mode: Any, kwargs: dict) -> Any:
        import wandb

        timeout = init_timeout()
        run = wandb.init(mode=mode, settings=wandb.Settings(console="off", silent=True, init_timeout=timeout),
                         **kwargs)
        _LIVE.add(id(run))
        return run

    def _failed(self, what: str, e: BaseException) -> None:
        """Stop using W&B for this cell after an error: its local files keep everything."""
        _say(f"{what} failed ({_why(e)}); W&B tracking stops for this cell, its local files keep every value")
        run, self.run = self.run, None
        _LIVE.discard(id(run))
        try:
            if run is not None:
                run.finish(exit_code=1)
        except Exception:  # noqa: BLE001 - already reported
            pass

    def on_event(self, event) -> None:
        """A cell event (tunelab.core.events): each optimizer step's metrics become the run's history."""
        if isinstance(event, Step):
            metrics = {("val/loss" if k == "val_loss" else f"train/{k}"): v for k, v in event.metrics.items()
                       if k != "step" and v is not None}
            self.log(metrics, step=event.step)
        elif isinstance(event, CheckpointScores) and self.run is not None:
            # Scored after the steps W&B has seen (out of its step order): plotted against their own axis.
            try:
                self.run.define_metric("checkpoint/*", step_metric="checkpoint/step")
            except Exception as e:  # noqa: BLE001
                return self._failed("defining the checkpoint axis", e)
            numbers = {k: v for k, v in event.scores.items() if isinstance(v, (int, float))}
            self.log({"checkpoint/step": event.step, **numbers})
            self.summary({f"{k} at step {event.step}": v for k, v in event.scores.items() if k not in numbers})

    def log(self, metrics: dict, step: int | None = None) -> None:
        if self.run is not None:
            try:
                self.run.log(metrics, step=step)
            except Exception as e:  # noqa: BLE001
                self._failed("logging", e)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            try:
                self.run.summary.update(values)
            except Exception as e:  # noqa: BLE001
                self._failed("updating the summary", e)

    def finish(self, failed: bool = False) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            _LIVE.discard(id(run))
            try:
                run.finish(exit_code=1 if failed else 0)
            except Exception as e:  # noqa: BLE001
                _say(f"finishing the run failed ({_why(e)}); the cell's local files keep every value")
