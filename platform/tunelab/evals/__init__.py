"""The evaluation layer: a registry of tasks scored against a model in memory (`run`), or against several PEFT
adapters of one base in shared passes, one results.json each (`run_together`, together.py).

May import: core, folders, optimizers, plan, machine, data, models, train.
"""

from tunelab.evals.suite import TASKS, Context, run
from tunelab.evals.together import run_together

__all__ = ["TASKS", "Context", "run", "run_together"]
