"""Reports of a matrix's cells: the leaderboard (records -> table -> every format), exp compare, exp report."""
