"""The cell's process, `python -m tunelab.cell RUN_DIR`: its event stream, stop signals, process group and
folder lock around the stages (cell/stages.py). Progress events (tunelab.core.events) go to stdout as JSON lines
for whoever launched it; everything else a library prints is sent to stderr, so it cannot corrupt that stream."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tunelab.cell.stages import requeue, run_cell
from tunelab.core import events
from tunelab.core.events import Emit
from tunelab.folders.cell import CellFolder
from tunelab.machine.runtime import Preempted

LOCK_WAIT_S = 10.0


def line_stream() -> Callable[[str], None]:
    """Keep the real stdout for event lines and point fd 1 at stderr for everything else -> write(line)."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    listening = True

    def write(line: str) -> None:
        nonlocal listening
        if listening:
            try:
                stream.write(line + "\n")
            except BrokenPipeError:  # the launcher went away: the work (and its files) still count
                listening = False

    return write


def _event_stream() -> Emit:
    write = line_stream()
    return lambda event: write(events.encode(event))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunelab.cell RUN_DIR", file=sys.stderr)
        return 2
    from contextlib import nullcontext

    from tunelab.core.locks import LOCK_HELD_ENV, LOCKED_EXIT, Locked, lock, lock_holder
    from tunelab.machine.runtime import catch_stop_signals
    from tunelab.train import parallel

    folder = CellFolder(Path(argv[0]).resolve())
    emit = _event_stream()
    catch_stop_signals()  # SIGUSR1 / SIGTERM: checkpoint at the next step boundary, mark pending, requeue
    try:
        cfg = folder.config()
        # A trained cell only evaluates, on one process; training joins torchrun's process group.
        layout = None if folder.is_trained() else parallel.setup(cfg.parallel)
        if layout is not None and not layout.is_main:
            emit = events.ignore  # events come from the main process only
        # The runner holds the folder's lock for the cell it starts; started any other way, the main process
        # takes it, waiting a moment for a process that only looks (core.locks.is_locked).
        must_lock = (layout is None or layout.is_main) and os.environ.get(LOCK_HELD_ENV) != str(folder.path)
        with lock(folder.path, wait=LOCK_WAIT_S) if must_lock else nullcontext():
            run_cell(folder.path, emit, cfg, layout)
    except Locked:
        print(f"{folder.path} is locked by {lock_holder(folder.path)}", file=sys.stderr)
        return LOCKED_EXIT
    except Preempted as e:  # not a failure: status.json says pending, the checkpoint is in place
        print(f"stopped: {e}", file=sys.stderr)
        if not getattr(e, "handled", False) and int(os.environ.get("RANK", "0")) == 0:
            requeue()  # stopped before run_cell could (while joining the process group)
        return 0
    except Exception:  # noqa: BLE001 - the traceback goes to cell.log, the exit code says failed
        traceback.print_exc()
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
