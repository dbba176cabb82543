"""The evaluation layer: a registry of tasks scored against a model in memory."""

from tunelab.evals.engine import TASKS, Context, run

__all__ = ["TASKS", "Context", "run"]
