"""`python -m tunelab.cell RUN_DIR`: one cell's process (cell/process.py); `python -m tunelab.cell --together --name
NAME RUN_DIR...`: a together-group's process (cell/group.py)."""

import sys

from tunelab.machine.threads import start_process

# Before anything imports torch: its OpenMP runtime reads the waiting policy once, when it loads, and threads
# started before the pinning would keep every CPU (tunelab.machine.threads).
start_process()

if sys.argv[1:2] == ["--together"]:
    from tunelab.cell.group import main as group_main

    sys.exit(group_main(sys.argv[2:]))

from tunelab.cell.process import main  # noqa: E402

sys.exit(main())
