"""One `exp run`: the plan of a matrix file (every refusal before the first file is written), its cells and
searches run, and the results written (session.py).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools,
matrix, run, cell, tune.
"""
