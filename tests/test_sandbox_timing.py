"""The judge's time says nothing of the verdict (issue 51), from a root and an unprivileged evaluator
(tests/sandbox_fixtures.py).

A judge that decoded each answer only when its check reached it, and stopped at the first failed
assert, took longer exactly when the tests got further: a program that made the answer after a
guess slow to decode learned, from when the next sample started, whether the guess was right.
TIMING_ORACLE (tests/sandbox_hostile.py) does that with a perfect memory between samples (a file,
so the samples run in the plain fallback, outside the sandbox: only the judge stands in its way).
Against the early-stopping judge (tests/sandbox_judge_control.py, the control) it learns a bit a
sample and passes every other sample from sample BITS on; against the judge, which decodes every
answer first and runs the tests to their end, it passes none.

By chance, a guess the program repeats passes with probability 2**-(BITS-1) = 1/2048 per distinct
guess; the secret starts 1, 0 so that the two guesses of a program that learned nothing at all
(it concludes the same each time: every bit 0, or every bit 1) never pass.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from string import Template

import pytest
from sandbox_hostile import TIMING_ORACLE
from sandbox_judge_control import early_stopping_judge

pytest_plugins = ("sandbox_fixtures",)  # the fixtures `arena` and `evaluator`

BITS, N = 12, 15  # N = BITS + 3: the control passes samples BITS and BITS + 2
SLOW = 8000  # ints in the slow answer: about 0.8 s to decode on the development machine


def _samples(evaluator, workers: int, judge: str | None) -> list[str]:
    folder = tempfile.mkdtemp(prefix="tunelab-timing-")
    os.chmod(folder, 0o777)  # the unprivileged evaluator's programs keep their memory here
    try:
        carrier = os.path.join(folder, "memory")
        program = Template(TIMING_ORACLE).substitute(bits=BITS, carrier=repr(carrier), slow=SLOW)
        secret = [1, 0] + [secrets.randbits(1) for _ in range(BITS - 2)]
        tests = "".join(f"assert f({i}) == {bit}\n" for i, bit in enumerate(secret))
        runs = evaluator.samples(program, tests, ("f",), n=N, workers=workers, judge=judge, timeout_s=10.0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return [r["status"] for r in runs]


@pytest.mark.parametrize("workers", [1, 2])
def test_an_oracle_that_times_the_judge_never_passes(workers, evaluator):
    control = _samples(evaluator, workers, early_stopping_judge())
    assert control.count("passed") >= 2, control  # the program learns from the early-stopping judge's time
    assert _samples(evaluator, workers, None) == ["failed"] * N
