"""The events a cell emits while it works: the runner shows them, the tracker logs them.

On the wire (the cell process's stdout, one JSON object per line) each event is its fields plus its
`stage` tag:

    {"stage": "load"}                                          Stage: a stage began (load, data, train, eval)
    {"stage": "train", "step": 3, "total": 20, "loss": 1.9,    Step: an optimizer step ended; metrics is the
     "metrics": {...}}                                         step's train/metrics.jsonl record
    {"stage": "resume", "step": 10, "checkpoint": "step-10",   Resumed: training continues from a checkpoint
     "skipped": "step-15: optimizer.pt is missing"}            (the newer incomplete ones it skipped, and why)
    {"stage": "eval", "task": "mmlu"}                          EvalTask: an eval task began
    {"stage": "eval_progress", "task": "mmlu", "done": 40,     EvalProgress: items of the task scored so far
     "total": 57}
    {"stage": "data_progress", "done": 2000, "total": 5000}    DataProgress: examples tokenized so far
    {"stage": "checkpoint_scores", "step": 4, "scores":         CheckpointScores: the scores of a checkpoint
     {"checkpoint/val_loss": 1.7}}                             (eval.checkpoints), keyed as W&B shows them

Anything else on that stream is not an event (`decode` returns None) and goes to the cell's log.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stage:
    name: str  # load | data | train | eval: its own name is its tag on the wire


@dataclass(frozen=True)
class Step:
    step: int
    total: int
    loss: float
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Resumed:
    step: int
    checkpoint: str
    skipped: str = ""  # newer checkpoints that were incomplete, and why (train/checkpoint.py: usable)


@dataclass(frozen=True)
class EvalTask:
    task: str


@dataclass(frozen=True)
class EvalProgress:
    task: str
    done: int
    total: int


@dataclass(frozen=True)
class DataProgress:
    done: int
    total: int


@dataclass(frozen=True)
class CheckpointScores:
    step: int
    scores: dict[str, float | str | None] = field(default_factory=dict)  # "unavailable": said, not a gap


Event = Stage | Step | Resumed | EvalTask | EvalProgress | DataProgress | CheckpointScores
Emit = Callable[[Event], None]
_BY_TAG: dict[str, type] = {"train": Step, "resume": Resumed, "eval": EvalTask, "eval_progress": EvalProgress,
                            "data_progress": DataProgress, "checkpoint_scores": CheckpointScores}  # wire tag -> class
_TAG = {cls: tag for tag, cls in _BY_TAG.items()}


def encode(event: Event) -> str:
    body = {"stage": event.name} if isinstance(event, Stage) else {"stage": _TAG[type(event)], **asdict(event)}
    return json.dumps(body, default=str)


def decode(line: str) -> Event | None:
    try:
        body = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(body, dict) or "stage" not in body:
        return None
    tag = body.pop("stage")
    if tag in _BY_TAG:
        try:
            return _BY_TAG[tag](**body)
        except TypeError:
            return None
    return Stage(tag) if not body else None


def ignore(event: Event) -> None:
    """An Emit that drops everything (library use, and every process but the main one)."""
