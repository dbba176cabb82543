"""Scores along training (`eval.checkpoints`, `train.select`): which checkpoints a cell's evaluation asks
for, which are scored, kept and best (steps.py: `StepScores`, what the loop's retention asks); one checkpoint's
evaluation, also a process of its own (evaluate.py: `python -m tunelab.checkpoint_scores.evaluate`); evaluator
processes beside training (evaluators.py); what a cell does about them around its training, selection included
(cell_side.py). Their plan-time checks are plan/checkpoint_scores.py, in the planner's layer, so that planning a
matrix imports nothing that loads a model (tests/test_layering.py).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report.
"""
