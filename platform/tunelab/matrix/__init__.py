"""A matrix file -> its cells: the file's schema (schema.py) with its `launcher:` (launcher.py) and `tune:`
(tune_section.py) sections, `--set` (sets.py), the product of the axes with slugs (expansion.py: `load`, `Cell`),
and whether the inputs the cells name can be read here (input_checks.py).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools.
"""
