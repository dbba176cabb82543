"""Cells as processes: the command and environment that start one (launch.py; SLURM jobs: slurm.py), the runner
that takes each cell's folder lock, starts it and follows its events (runner.py), what the user sees meanwhile
(progress.py) and how each attempt ended (outcome.py). Nothing here imports torch or a model.

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools,
matrix.
"""
