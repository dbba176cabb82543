"""`python -m tunelab.cell RUN_DIR`: one cell's process (cell/process.py)."""

import sys

from tunelab.machine.threads import start_process

# Before anything imports torch: its OpenMP runtime reads the waiting policy once, when it loads, and threads
# started before the pinning would keep every CPU (tunelab.machine.threads).
start_process()

from tunelab.cell.process import main  # noqa: E402

sys.exit(main())
