"""Tracking: every cell logs to local files (train/metrics.jsonl, eval/results.json) and to W&B."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from tunelab.events import Step
from tunelab.store import write_text


def wandb_mode(cfg) -> str:
    """Explicit config wins, then WANDB_MODE; without an API key a run stays offline."""
    if cfg.mode:
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


RUN_ID_FILE = "wandb_run_id"


class Tracker:
    """`resuming`: the cell continues from a checkpoint, so it continues its W&B run too (same run id,
    kept in the cell folder). A cell that starts over gets a new run: W&B drops steps already logged."""

    def __init__(self, cfg, run_dir: Path, *, group: str, name: str, config: dict, tags: list[str],
                 resuming: bool = False):
        self.run = None
        mode = wandb_mode(cfg.tracking)
        if not cfg.tracking.wandb or mode == "disabled":
            return
        import wandb

        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else secrets.token_hex(6)
        write_text(id_file, run_id + "\n")
        self.run = wandb.init(
            project=cfg.tracking.project, entity=cfg.tracking.entity, group=group, name=name,
            job_type="cell", config=config, tags=tags, dir=str(run_dir), mode=mode, reinit="create_new",
            id=run_id, resume="allow", settings=wandb.Settings(console="off", silent=True),
        )

    def on_event(self, event) -> None:
        """A cell event (tunelab.events): each optimizer step's metrics become the run's history."""
        if isinstance(event, Step):
            metrics = {("val/loss" if k == "val_loss" else f"train/{k}"): v for k, v in event.metrics.items()
                       if k != "step" and v is not None}
            self.log(metrics, step=event.step)

    def log(self, metrics: dict, step: int | None = None) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
