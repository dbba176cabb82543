"""Tracking: every cell logs to local files (train/metrics.jsonl, eval/results.json) and to W&B."""

from __future__ import annotations

import os
from pathlib import Path


def wandb_mode(cfg) -> str:
    """Explicit config wins, then WANDB_MODE; without an API key a run stays offline."""
    if cfg.mode:
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class Tracker:
    def __init__(self, cfg, run_dir: Path, *, group: str, name: str, config: dict, tags: list[str]):
        self.run = None
        mode = wandb_mode(cfg.tracking)
        if not cfg.tracking.wandb or mode == "disabled":
            return
        import wandb

        self.run = wandb.init(
            project=cfg.tracking.project, entity=cfg.tracking.entity, group=group, name=name,
            job_type="cell", config=config, tags=tags, dir=str(run_dir), mode=mode, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )

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
