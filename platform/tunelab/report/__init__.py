"""Reports of a matrix's cells: the leaderboard (records -> table -> every format), exp compare, exp report.

May import: core, folders, optimizers, plan, machine, data, models, train, evals.
"""
