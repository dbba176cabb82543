"""`python -m tunelab.cell RUN_DIR`: one cell's process (cell/process.py)."""

import sys

from tunelab.cell.process import main

sys.exit(main())
