"""The judge: runs a task's tests in a process of its own, outside the sandbox.

`sandbox.py` passes `sandbox_wire.py` and then this file's text to `python -I -S -c`,
with the job (the context, the tests and the names to call) on stdin. The context (for
HumanEval, the prompt: its helpers and imports) and the tests run here; each name in
`calls` is bound to a stand-in that calls the program's function of that name in the
sandbox and returns its value as plain data. Only if the tests run to their end does this
process write "passed" to the verdict pipe, which the program has no handle on: the
program can only answer calls, so it passes only by returning the right values.

Argument order: call_fd answer_fd verdict_fd.
"""

import builtins
import json
import os
import sys


def main() -> None:
    call_fd, answer_fd, verdict_fd = map(int, sys.argv[1:4])
    open_wire()  # noqa: F821 (sandbox_wire.py, prepended)
    job = json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(job["context"], "context.py", "exec"), namespace)
    for name in job["calls"]:
        namespace[name] = _remote(name, call_fd, answer_fd)
    exec(compile(job["tests"], "tests.py", "exec"), namespace)
    os.write(verdict_fd, b"passed")


def _remote(name: str, call_fd: int, answer_fd: int):
    def call(*args, **kwargs):
        send(call_fd, ["call", name, encode(list(args)), encode(kwargs)])  # noqa: F821
        answer = receive(answer_fd)  # noqa: F821
        if answer is None:
            raise EOFError(f"the program ended during a call of {name}()")
        if isinstance(answer, dict) and answer.keys() == {"ok"}:
            return decode(answer["ok"])  # noqa: F821
        if isinstance(answer, dict) and answer.keys() == {"raise"} and len(answer["raise"]) == 2:
            kind, text = map(str, answer["raise"])
            cls = getattr(builtins, kind, None)
            error = RuntimeError(f"{name}() raised {kind}: {text}")
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:  # a builtin exception the tests may expect, e.g. ValueError
                    error = cls(text)
                except Exception:  # one that takes other arguments
                    pass
            raise error
        raise WireError(f"not an answer: {str(answer)[:80]}")  # noqa: F821

    call.__name__ = call.__qualname__ = name
    return call


if __name__ == "__main__":
    main()
