"""Reports: the leaderboard table of a matrix's cells."""
