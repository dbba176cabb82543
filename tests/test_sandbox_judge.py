"""The judge against programs that try to learn their verdict (evals/sandbox/judge.py), from a root and
an unprivileged evaluator (tests/sandbox_fixtures.py).

A program that learned in one run whether a guess was right, and kept that in anything that
outlives the run, would pass a later sample of the same task. So the calls a program gets
must be the same whatever its answers, and nothing of a run may reach the next.
"""

from __future__ import annotations

import secrets
import warnings
from string import Template

import pytest
from sandbox_hostile import ORACLE

from tunelab.evals.sandbox.contain import run_tests

pytest_plugins = ("sandbox_fixtures",)  # the fixtures `arena` and `evaluator`

RECORDER = "import sys\ndef f(x):\n    print('call', repr(x), file=sys.stderr, flush=True)\n    return {answer}\n"
# Every way Python skips a call depending on a value: and, or, all() over a generator, x if c else y,
# an assert's message; and an answer kept for a later assert.
SEQUENCE_TESTS = (
    "assert f(1) == 2 and f(2) == 4\n"
    "assert f(3) == 6 or f(4) == 8\n"
    "assert all(f(x) == 2 * x for x in range(5, 8))\n"
    "assert (f(9) if f(8) == 16 else f(10)) == 18\n"
    "for x in (11, 12):\n    assert f(x) == 2 * x, f(-x)\n"
    "y = f(13)\nassert y == 26\n"
)
EVERY_CALL = ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "-11", "12", "-12", "13"]


def _calls(answer: dict) -> list[str]:
    return [line.split(" ", 1)[1] for line in answer["stderr_tail"].splitlines() if line.startswith("call ")]


def test_the_calls_a_program_gets_do_not_depend_on_its_answers(evaluator):
    programs = {"right": "2 * x", "first answer wrong": "2 * x + (x == 1)", "None": "None", "raises": "1 // 0",
                "wrong type": "str(x)"}  # fmt: skip
    runs = {name: evaluator.run(RECORDER.format(answer=a), SEQUENCE_TESTS, calls=("f",))
            for name, a in programs.items()}  # fmt: skip
    assert {name: r["status"] for name, r in runs.items()} == {name: "passed" if name == "right" else "failed"
                                                               for name in programs}  # fmt: skip
    assert {name: _calls(r) for name, r in runs.items()} == {name: EVERY_CALL for name in programs}


def test_a_test_whose_inputs_depend_on_answers_is_failed_not_asked(evaluator):
    """Asking f(2) after f(1) answered 2 would tell the program its answer was used: the judge
    asks only what it planned (f(1); f(y) was planned with the planner's stand-in, which is no
    data to send) and fails the run."""
    answer = evaluator.run(RECORDER.format(answer="2 * x if x is not None else 0"), "y = f(1)\nassert f(y) == 4\n",
                           calls=("f",))  # fmt: skip
    assert answer["status"] == "failed" and "depend on the program's answers" in answer["stderr_tail"]
    assert _calls(answer) == ["1"]


# The statistical test. ORACLE (tests/sandbox_hostile.py) learns from whether it is called
# again after a guess. Against a judge that stops at the first wrong answer it passes by run
# BITS + 2 at the latest (each run learns a bit; the last bit alternates):
# test_the_oracle_passes_where_the_judge_stops_at_the_first_wrong_answer shows it. So N = BITS + 2
# runs that never pass show the judge told it nothing. By chance they pass only if the secret's
# first BITS - 1 bits equal the guesses the program repeats, probability 2**-19: this test
# fails spuriously about once in half a million runs.
BITS, N = 20, 22


def _oracle(carrier: str | None) -> str:
    return Template(ORACLE).substitute(bits=BITS, carrier=repr(carrier))


def _tests(secret: list[int]) -> str:
    return "".join(f"assert f({i}) == {bit}\n" for i, bit in enumerate(secret))


def test_an_oracle_program_never_passes(evaluator):
    """In the sandbox: its memory would be the page cache of the standard library's files, which
    it can neither read undisturbed (RWF_NOWAIT is refused) nor see change (a tmpfs copy)."""
    secret = [secrets.randbits(1) for _ in range(BITS)]
    runs = [evaluator.run(_oracle(None), _tests(secret), calls=("f",)) for _ in range(N)]
    assert [r["status"] for r in runs] == ["failed"] * N, runs[-1]["stderr_tail"]
    assert "no memory" in runs[0]["stderr_tail"]


def test_an_oracle_program_with_a_perfect_memory_never_passes(monkeypatch, tmp_path):
    """Outside any sandbox, with a file it keeps between runs: only the judge stands in its way,
    and every run got every call (so it always concluded all its guesses were right)."""
    monkeypatch.setenv("TUNELAB_BWRAP", "/nonexistent/bwrap")
    carrier = tmp_path / "memory"
    secret = [secrets.randbits(1) for _ in range(BITS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # WITHOUT a sandbox, as asked
        program = _oracle(str(carrier))
        runs = [run_tests(program, _tests(secret), calls=("f",), allow_unsandboxed=True) for _ in range(N)]
    assert [r.status for r in runs] == ["failed"] * N, runs[-1].stderr_tail
    called = [line for line in carrier.read_text().split() if line.startswith("C")]
    assert called == [f"C{i}" for i in range(BITS)] * N


def test_the_oracle_passes_where_the_judge_stops_at_the_first_wrong_answer(tmp_path):
    """The control: the same program and memory against a judge that stops at the first wrong
    answer (as tunelab's did) passes by run BITS + 2."""
    carrier = tmp_path / "memory"
    secret = [secrets.randbits(1) for _ in range(BITS)]
    passed = []
    for _ in range(N):
        namespace: dict = {}
        exec(compile(_oracle(str(carrier)), "program.py", "exec"), namespace)
        passed.append(all(namespace["f"](i) == bit for i, bit in enumerate(secret)))  # all() stops at the first
    assert True in passed[: BITS + 2], passed


RANDOM_INPUTS = {
    "secrets": "import secrets\nx = secrets.randbelow(10**9)\n",
    "random, os.urandom, uuid4": "import random, os, uuid\n"
    "x = random.randrange(10**9) ^ int.from_bytes(os.urandom(4), 'big') ^ uuid.uuid4().int\n",
}


@pytest.mark.parametrize("source", RANDOM_INPUTS)
def test_random_inputs_are_the_same_when_planned_and_checked(source, evaluator):
    tests = RANDOM_INPUTS[source] + "assert triple(x) == 3 * x\n"
    answer = evaluator.run("def triple(x):\n    return 3 * x\n", tests, calls=("triple",))
    assert answer["status"] == "passed", answer["stderr_tail"]
