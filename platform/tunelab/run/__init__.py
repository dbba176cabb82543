"""Cells as processes: the command and environment that start one (launch.py; SLURM jobs: slurm.py), the runner
that takes each cell's folder lock, starts it and follows its events (runner.py), what the user sees meanwhile
(progress.py) and how each attempt ended (outcome.py). Cells that share a frozen base run as together-groups, one
process for several cells: which join (together.py, pure planning), their process's side in the runner (workers.py)
and a group's turn (groups.py). Nothing here imports torch or a model, but `--together auto`'s size, which reads
the model's config and the device's memory (train/parallel/capacity.py).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools,
matrix.
"""
