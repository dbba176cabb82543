"""One score of results.json as every report shows it: value, spread, n, and what it is not.

The marks, the same in every format (leaderboard md/csv/latex/html/json, the report, the model card, W&B):
`*` after a value: a subset of the benchmark (fewer items than its official test set); a task named
`*_smoke`: a stand-in that exercises the pipeline and is not the benchmark; `unavailable`: the test set could
not be loaded, so there is no score; `failed`: the cell did not finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunelab.core.registries import TASKS

MARKS = ("`*`: a subset of the benchmark (fewer items than its official test set; see n); a task named "
         "`*_smoke`: a stand-in that exercises the pipeline and is not the benchmark; `unavailable`: the test "
         "set could not be loaded, so there is no score; `failed`: the cell did not finish.")
LOWER_IS_BETTER = {"loss"}


@dataclass(frozen=True)
class Score:
    task: str
    metric: str
    value: float | None
    stderr: float | None
    n: int
    status: str  # ok | unavailable
    subset: bool
    stand_in: bool
    reason: str = ""
    higher: bool | None = None  # as results.json says (lm-eval's higher_is_better); None: by the metric's name
    columns: tuple[tuple[str, float | None], ...] = ()  # more values with a leaderboard column each (IFEval's)

    @classmethod
    def of(cls, task: str, res: dict) -> Score:
        spec = TASKS[task] if task in TASKS else None
        n = int(res.get("n") or 0)
        subset = bool(res.get("subset")) or bool(spec and spec.partial(n))  # older results: the rule again
        board = bool(spec and spec.harness and spec.harness.board)
        return cls(task, res.get("metric") or "", res.get("value"), res.get("stderr"), n,
                   res.get("status", "ok"), subset, bool(spec and spec.stand_in), res.get("reason", ""),
                   res.get("higher_is_better"), tuple((res.get("also") or {}).items()) if board else ())

    @property
    def header(self) -> str:
        return self.task if self.metric in ("", "loss", self.task) else f"{self.task} {self.metric}"

    @property
    def higher_is_better(self) -> bool:
        return self.higher if self.higher is not None else self.metric not in LOWER_IS_BETTER

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.value is not None


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


TEST_SELECTED = "†"
TEST_SELECTED_NOTE = (f"`{TEST_SELECTED}`: the configuration was chosen by its score on a test set "
                      "(tune.allow_test_selection), so its scores are optimistic.")


def marked(value: float | None, subset: bool, unavailable: bool = False, test_selected: bool = False) -> str:
    """A value as shown in a table cell."""
    if unavailable:
        return "unavailable"
    text = f"{fmt(value)}*" if subset and value is not None else fmt(value)
    return f"{text}{TEST_SELECTED}" if test_selected and value is not None else text


def wandb_key(s: Score, prefix: str = "eval") -> str:
    """The W&B key of a score (prefix "checkpoint": a checkpoint's, logged against its step): the subset mark
    travels with the name (eval/mmlu on 57 questions is not MMLU)."""
    return f"{prefix}/{s.task}" + (f" (subset, n={s.n})" if s.subset else "")


def wandb_value(s: Score) -> float | str | None:
    """What W&B gets for a score: its value, or "unavailable" (never a silent gap or 0)."""
    return s.value if s.ok else ("unavailable" if s.status != "ok" else None)
