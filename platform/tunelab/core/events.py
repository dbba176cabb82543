"""The events a cell emits while it works: the runner shows them, the tracker logs them.

On the wire (the cell process's stdout, one JSON object per line) each event is its fields plus its
`stage` tag:

    {"stage": "load"}                                          Stage: a stage began (load, data, train, eval)
    {"stage": "train", "step": 3, "total": 20, "loss": 1.9,    Step: an optimizer step ended; metrics is the
     "metrics": {...}}                                         step's train/metrics.jsonl record
    {"stage": "resume", "step": 10, "checkpoint": "step-10",   Resumed: training continues from a checkpoint
     "skipped": "step-15: optimizer.pt is missing"}            (the newer incomplete ones it skipped, and why)
    {"stage": "eval", "task": "mmlu", "step": null}            EvalTask: an eval task began (of a checkpoint: its step)
    {"stage": "eval_progress", "task": "mmlu", "done": 40,     EvalProgress: items of the task scored so far
     "total": 57}
    {"stage": "data_progress", "done": 2000, "total": 5000}    DataProgress: examples tokenized so far
    {"stage": "checkpoint_scores", "step": 4, "scores":         CheckpointScores: the scores of a checkpoint
     {"checkpoint/val_loss": 1.7}}                             (eval.checkpoints), keyed as W&B shows them

    {"stage": "ready", "op": "train"}                          Ready: a together-group's worker did what it was
                                                               asked (cell/group.py); the runner's next turn

A together-group's worker (cell/group.py) tags each member's events with the member's number: `"m": 2`
(`encode(event, member=2)`, `decode_tagged`). Anything else on that stream is not an event (`decode` returns
None) and goes to the cell's log.
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
    step: int | None = None  # a checkpoint's evaluation (eval.checkpoints): its step; None: the final evaluation


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


@dataclass(frozen=True)
class Ready:
    op: str  # the operation done: train (every member asked paused, ended or failed), release


Event = Stage | Step | Resumed | EvalTask | EvalProgress | DataProgress | CheckpointScores | Ready
Emit = Callable[[Event], None]
_BY_TAG: dict[str, type] = {"train": Step, "resume": Resumed, "eval": EvalTask, "eval_progress": EvalProgress,
                            "data_progress": DataProgress, "checkpoint_scores": CheckpointScores,
                            "ready": Ready}  # wire tag -> class
_TAG = {cls: tag for tag, cls in _BY_TAG.items()}
MEMBER = "m"  # a together-group member's tag on the wire


def encode(event: Event, member: int | None = None) -> str:
    body = {"stage": event.name} if isinstance(event, Stage) else {"stage": _TAG[type(event)], **asdict(event)}
    return json.dumps(body if member is None else {**body, MEMBER: member}, default=str)


def decode(line: str) -> Event | None:
    return decode_tagged(line)[0]


def decode_tagged(line: str) -> tuple[Event | None, int | None]:
    """An event line -> (the event or None, the member it belongs to or None)."""
    try:
        body = json.loads(line)
    except json.JSONDecodeError:
        return None, None
    if not isinstance(body, dict) or "stage" not in body:
        return None, None
    tag, member = body.pop("stage"), body.pop(MEMBER, None)
    member = member if isinstance(member, int) and not isinstance(member, bool) else None
    if tag in _BY_TAG:
        try:
            return _BY_TAG[tag](**body), member
        except TypeError:
            return None, None
    return (Stage(tag) if not body else None), member


def ignore(event: Event) -> None:
    """An Emit that drops everything (library use, and every process but the main one)."""
