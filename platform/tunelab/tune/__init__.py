"""Hyperparameter search per method group with the same budget: the `tune:` section of a matrix (docs/tuning.md).

plan.py (method groups, checked at plan time, each once per study: tune.studies), workloads.py (the workload axes a
method is tuned on), schedule.py (brackets and rungs), sampling.py (Optuna samplers replayed in trial order;
schedule.promote takes the synchronous rung decision), objective.py (the objective: any task of the eval section;
intermediate values), edges.py (a winner at the edge of its space), trials.py (trials and winners as ordinary
cells), record.py
(the Optuna study: journal file or PostgreSQL), search.py + driver.py (the search, rung by rung, through the
runner), status.py and show.py (what `exp plan` and `exp tune status` print); the verbs are in cli/tune.py. The
section's schema is tunelab.matrix.tune_section, a part of the matrix file.

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools,
matrix, run, cell.
"""
