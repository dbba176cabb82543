"""The events a cell emits while it works: the runner shows them, the tracker logs them.

On the wire (the cell process's stdout, one JSON object per line) each event is its fields plus its
`stage` tag:

    {"stage": "load"}                                          Stage: a stage began (load, data, train, eval)
    {"stage": "train", "step": 3, "total": 20, "loss": 1.9,    Step: an optimizer step ended; metrics is the
     "metrics": {...}}                                         step's train/metrics.jsonl record
    {"stage": "resume", "step": 10, "checkpoint": "step-10"}   Resumed: training continues from a checkpoint
    {"stage": "eval", "task": "mmlu"}                          EvalTask: an eval task began
    {"stage": "eval_progress", "task": "mmlu", "done": 40,     EvalProgress: items of the task scored so far
     "total": 57}
    {"stage": "data_progress", "done": 2000, "total": 5000}    DataProgress: examples tokenized so far

Anything else on that stream is not an event (`decode` returns None) and goes to the cell's log.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Stage:
    name: str  # load | data | train | eval
    tag: ClassVar[str] = "stage"

    def wire(self) -> dict:
        return {"stage": self.name}


@dataclass(frozen=True)
class Step:
    step: int
    total: int
    loss: float
    metrics: dict[str, Any] = field(default_factory=dict)
    tag: ClassVar[str] = "train"


@dataclass(frozen=True)
class Resumed:
    step: int
    checkpoint: str
    tag: ClassVar[str] = "resume"


@dataclass(frozen=True)
class EvalTask:
    task: str
    tag: ClassVar[str] = "eval"


@dataclass(frozen=True)
class EvalProgress:
    task: str
    done: int
    total: int
    tag: ClassVar[str] = "eval_progress"


@dataclass(frozen=True)
class DataProgress:
    done: int
    total: int
    tag: ClassVar[str] = "data_progress"


Event = Stage | Step | Resumed | EvalTask | EvalProgress | DataProgress
Emit = Callable[[Event], None]
_BY_TAG = {cls.tag: cls for cls in (Step, Resumed, EvalTask, EvalProgress, DataProgress)}


def encode(event: Event) -> str:
    body = event.wire() if isinstance(event, Stage) else {"stage": event.tag, **asdict(event)}
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
