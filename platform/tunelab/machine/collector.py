"""Python's cyclic garbage collector in tunelab's processes: rare while a process imports its libraries and builds
its model, and no walk of the whole heap at exit.

A process that imports torch, transformers and peft holds ~650,000 objects the collector tracks. CPython runs a
full collection each time that population has grown by a quarter, so importing them walks the growing heap again
and again (8 full collections, ~0.9 s on this project's 2-CPU machine), and the interpreter's teardown at exit
walks it again (~1 s; measured: a process that has imported them and does nothing else takes 1.1-1.2 s to exit).
`pause` (at a process's start: machine/threads.start_process, the `exp` command) lets the youngest generation grow
to QUIET objects before a collection, which cuts those walks to about one; `settle` (where the process starts to
train or evaluate) collects once and puts Python's thresholds back, so that steps run on the heap they would have
had and what they allocate is freed as promptly. Nothing is frozen while the process lives: a together-group frees
the adapters of the members it lets go, and a frozen object in a reference cycle would never be freed. At exit
(`_at_exit`, registered first so it runs after every other exit handler: W&B's, logging's, ...) one collection
finalizes what is garbage already, as the teardown would, open files in module globals are flushed, and the rest
is frozen: the teardown then frees what reference counts free and no longer walks the heap. What it no longer
does is finalize an object that only becomes garbage during the teardown and sits in a reference cycle (a file
held by an object that a module's globals hold, never closed: Python's own teardown flushes that one). Python
does not promise it either ("It is not guaranteed that __del__() methods are called for objects that still exist
when the interpreter exits"), and tunelab closes what it opens.

`TUNELAB_GC=plain` leaves Python's defaults alone (benchmarks/collector.py measures one against the other).
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys

QUIET = 50_000  # objects the youngest generation may reach before a collection while a process builds itself
PLAIN_ENV = "TUNELAB_GC"
FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
_defaults: list[tuple[int, int, int]] = []  # the thresholds pause found, once paused


def pause() -> None:
    """Collections rare from here until `settle`, and the quick exit registered (once per process)."""
    if _defaults or os.environ.get(PLAIN_ENV) == "plain":
        return
    _defaults.append(gc.get_threshold())
    gc.set_threshold(QUIET, *_defaults[0][1:])
    atexit.register(_at_exit)


def settle() -> None:
    """The process is built: one collection, then collections as often as Python's defaults make them."""
    if _defaults and gc.get_threshold() != _defaults[0]:
        gc.collect()  # once: what the build left as garbage, so that training starts on the heap Python's would
        gc.set_threshold(*_defaults[0])


def _at_exit() -> None:
    gc.collect()
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value) in FILES and not value.closed:
                try:
                    value.flush()
                except (OSError, ValueError):  # a broken pipe, a closed descriptor: nothing left to save
                    pass
    gc.freeze()
