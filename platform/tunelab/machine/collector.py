"""Python's cyclic garbage collector in tunelab's processes: rare while a torch process imports its libraries and
builds its model, and no walk of the whole heap at exit.

A process that imports torch, transformers and peft holds ~650,000 objects the collector tracks. CPython runs a
full collection each time that population has grown by a quarter, so importing them walks the growing heap again
and again (8 full collections in a SmolLM2 LoRA cell's process, gc.callbacks), and the interpreter's teardown walks
it again at exit (a process that has imported them and does nothing else takes 1.1-1.2 s to exit; 0.5-0.6 s with
this module's exit, its own collection included). `pause` (machine/threads.start_process: a cell, a together-group,
a checkpoint evaluator, `exp eval run`) lets the youngest generation grow to QUIET objects before a collection
until `settle` (where the process starts to train or evaluate), which collects once and puts Python's thresholds
back, so that steps run on the heap they would have had and what they allocate is freed as promptly. A process
that pauses and never settles keeps the larger threshold, which bounds what it holds. Nothing is frozen while a
process lives: a together-group frees the adapters of the members it lets go, and a frozen object in a reference
cycle would never be freed. Measured on a one-cell `exp run` (benchmarks/collector.py): most of what it saves is
at exit.

`quick_exit` (also every `exp` command, whose thresholds stay Python's) registers `_at_exit`: registered at the
start of tunelab's entry points, before any other exit handler, so it runs after W&B's, logging's and the rest
(under a program that calls into tunelab later, pytest for one, it may run before some: they still run). One
collection finalizes what is garbage already, as the teardown would; open files in module globals are flushed; the
rest is frozen, so the teardown frees what reference counts free and no longer walks the heap. What it no longer
does is finalize an object that only becomes garbage during the teardown and sits in a reference cycle: a file,
or a gzip stream, held by an object that a module's globals hold and never closed, which Python's own teardown
would flush or close. Python does not promise that either ("It is not guaranteed that __del__() methods are called
for objects that still exist when the interpreter exits"); tunelab closes what it opens (its persistent writers:
tune/record.py closes on release, core/locks.py flushes at once, cell/process.py's event stream is line-buffered,
W&B runs are finished by cell/attempt.py).

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
_exiting: list[bool] = []  # [True] once the quick exit is registered


def pause() -> None:
    """Collections rare from here until `settle`, and the quick exit registered (once per process)."""
    if _defaults or os.environ.get(PLAIN_ENV) == "plain":
        return
    _defaults.append(gc.get_threshold())
    gc.set_threshold(QUIET, *_defaults[0][1:])
    quick_exit()


def quick_exit() -> None:
    """At exit: collect once, flush module globals' open files, freeze the rest (once per process)."""
    if os.environ.get(PLAIN_ENV) != "plain" and not _exiting:
        _exiting.append(True)
        atexit.register(_at_exit)


def check_env() -> None:
    """At every `exp` command's start: $TUNELAB_GC is one of its two settings (a typo would silently keep the
    policy)."""
    value = os.environ.get(PLAIN_ENV, "")
    if value not in ("", "plain"):
        from tunelab.core.errors import UserError

        raise UserError(f"{PLAIN_ENV}={value!r}: allowed is 'plain' (Python's garbage-collector defaults in every "
                        "tunelab process), or unset it (tunelab's policy: rare collections while a process builds "
                        "itself, no walk of the heap at exit)", file="environment")


def settle() -> None:
    """The process is built: one collection, then collections as often as Python's defaults make them."""
    if _defaults and gc.get_threshold() != _defaults[0]:
        gc.collect()  # once: what the build left as garbage, so that training starts on the heap Python's would
        gc.set_threshold(*_defaults[0])


def _at_exit() -> None:
    gc.collect()
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value) in FILES:
                try:
                    if not value.closed:
                        value.flush()
                except (OSError, ValueError):  # a broken pipe, a detached or closed stream: nothing left to save
                    pass
    gc.freeze()
