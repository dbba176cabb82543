"""Checkpoint evaluators beside training: eval.checkpoints.workers processes of `python -m
tunelab.checkpoint_scores.evaluate RUN_DIR --follow`, started by a training cell's main process so that training never
waits for an evaluation.

They are told training is over by the close of their stdin (the kernel closes it too when the cell dies, so an
evaluator never outlives its cell by more than the step it is on). One that dies while training goes on (killed,
out of memory) is started again, at most RESTARTS times; what none of them finished, the cell evaluates itself
once training is over (evaluate.settle), so a dead evaluator costs time, never a score or a step of training.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import TracebackType

from tunelab.core.locks import LOCK_FDS_ENV, LOCK_HELD_ENV
from tunelab.folders.cell import CellFolder
from tunelab.machine.threads import beside_env

RESTARTS = 3  # per evaluator, while training goes on
EVALUATE = "tunelab.checkpoint_scores.evaluate"  # an evaluator's module (python -m)
# What a process of torchrun's group carries: an evaluator is a process of its own, in no process group.
NOT_INHERITED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", LOCK_HELD_ENV, LOCK_FDS_ENV)


class Beside:
    """`with Beside(folder, n):` around training; leaving the block waits for the evaluators to finish what is on
    disk (an error leaving it stops them instead)."""

    def __init__(self, folder: CellFolder, workers: int):
        self.folder, self.workers = folder, workers
        self.procs: list[subprocess.Popen] = []
        self.restarts = [0] * workers
        self._lock = threading.Lock()
        self._training = False
        self._waiters: list[threading.Thread] = []

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED and not k.startswith("TORCHELASTIC_")}
        env.update(beside_env(self.workers))  # a share of the cell's threads, on its CPUs (machine/threads.py)
        return subprocess.Popen([sys.executable, "-m", EVALUATE, str(self.folder.path), "--follow"],
                                stdin=subprocess.PIPE, stdout=sys.stderr, stderr=sys.stderr, env=env)

    def __enter__(self) -> Beside:
        self._training = True
        self.procs = [self._start() for _ in range(self.workers)]
        # One waiter per evaluator, blocked in wait(): a death is seen the moment it happens, not at the next poll
        # (a polling thread paused with training, e.g. by SIGSTOP, could lose the race to the end of training).
        self._waiters = [threading.Thread(target=self._restart_when_dead, args=(i,), daemon=True,
                                          name=f"checkpoint-evaluator-{i}") for i in range(self.workers)]
        for waiter in self._waiters:
            waiter.start()
        return self

    def _restart_when_dead(self, i: int) -> None:
        while True:
            proc = self.procs[i]
            proc.wait()
            with self._lock:
                if not self._training or self.restarts[i] >= RESTARTS:
                    return
                self.restarts[i] += 1
                print(f"tunelab: checkpoint evaluator pid {proc.pid} ended ({proc.returncode}) while training goes "
                      f"on: starting it again ({self.restarts[i]}/{RESTARTS})", file=sys.stderr, flush=True)
                self.procs[i] = self._start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with self._lock:
            self._training = False  # from here on no evaluator is started again
        try:
            for proc in self.procs:
                if proc.stdin is not None:
                    proc.stdin.close()  # training is over: finish what is on disk, then exit
            if kind is not None:
                self.stop()
            for proc in self.procs:
                proc.wait()
        except BaseException:  # interrupted while waiting: their finished steps are kept, the rest is redone
            self.stop()
            raise
        for waiter in self._waiters:
            waiter.join()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
