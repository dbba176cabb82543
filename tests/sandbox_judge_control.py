"""The judge as it checked answers before issue 51, for the controls of tests/test_sandbox_timing.py.

It decoded each answer only when the tests reached its call and stopped at the first failed
assert, so the time from a program's end to its verdict said how far the tests got: a program
that made the answer after a guess slow to decode learned from that time whether the guess was
right. `early_stopping_judge()` is today's judge with that check put back (this file's copy of
it, verbatim but for taking the namespace the judge prepares); the tests swap it in for the control
runs only (`contain._JUDGE`).
"""

from tunelab.evals.sandbox import contain

_EARLY_STOPPING_CHECK = '''
def _check(job: dict, plan: list[bytes], answers: list, cut: str | None, prepared: tuple) -> str:
    namespace = prepared[0]  # the context run and the randomness reset, as the judge prepares them

    where: dict[bytes, list[int]] = {}
    for i, message in enumerate(plan):
        where.setdefault(message, []).append(i)
    cursor = [0]
    budget = Budget(sum(len(a) for a in answers if isinstance(a, bytes)))
    for name in job["calls"]:
        namespace[name] = _replay(name, where, answers, cursor, (cut, budget))
    try:
        exec(compile(job["tests"], "tests.py", "exec"), namespace)
    except _Stop as stop:
        print(f"{stop}", file=sys.stderr)
        return stop.verdict
    except BaseException as e:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        return "failed"
    return "passed"


def _replay(name: str, where: dict, answers: list, cursor: list, state: tuple) -> Callable[..., object]:
    cut, budget = state

    def call(*args: object, **kwargs: object) -> object:
        key = encode((name, args, kwargs))
        places = where.get(key, [])
        k = bisect.bisect_left(places, cursor[0])
        if k == len(places):
            raise _Stop("failed", f"{name}() was not asked: {cut}" if cut else f"{name}() was not planned")
        cursor[0] = places[k] + 1
        return _answer(name, answers[places[k]], budget)

    call.__name__ = call.__qualname__ = name
    return call


_EARLY_GONE = {
    "timeout": ("timeout", "the program did not answer {}() in time"),
    "ended": ("ended", "the program ended before answering {}()"),
    "garbled": ("failed", "the program's answers stopped being frames of the wire before {}()"),
    "too large": ("failed", "the answer to {}() came too late"),
}


def _answer(name: str, frame: bytes | str, budget: Budget) -> object:
    if isinstance(frame, str):
        verdict, why = _EARLY_GONE[frame]
        raise _Stop(verdict, why.format(name))
    try:
        answer = decode(frame, budget)
    except WireError as e:
        raise _Stop("failed", f"the answer to {name}() is not one: {e}") from None
    if type(answer) is tuple and len(answer) == 2 and answer[0] == "ok":
        return answer[1]
    if type(answer) is tuple and len(answer) == 3 and answer[0] == "raise" and all(type(x) is str for x in answer):
        kind, text = answer[1:]
        cls = getattr(builtins, kind, None)
        error: Exception = RuntimeError(f"{name}() raised {kind}: {text}")
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                error = cls(text)
            except Exception:
                pass
        raise error
    raise _Stop("failed", f"the answer to {name}() is not one: {str(answer)[:80]}")


'''
_MAIN = 'if __name__ == "__main__":'


def early_stopping_judge() -> str:
    """The judge's text (`contain._JUDGE`) with the check that decoded lazily and stopped at the first failure."""
    head, main, tail = contain._JUDGE.rpartition(_MAIN)
    assert main, "the judge's text no longer ends with its main block"
    return head + _EARLY_STOPPING_CHECK + main + tail
