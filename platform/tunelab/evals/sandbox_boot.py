"""The first code to run inside the sandbox; `sandbox.py` passes `sandbox_wire.py` and then
this file's text to `python -c`.

It sets the resource limits, becomes the throwaway uid when the evaluator is root, runs
program.py as `__main__`, and then serves calls: the judge (`sandbox_judge.py`, another
process, outside the sandbox) sends a function's name and arguments, and gets back the
value it returned or the exception it raised, as plain data (`sandbox_wire.py`). Nothing
this process writes decides whether the tests passed: the judge runs them, on its side.

Argument order: uid cpu_s mem nproc fsize ready_fd call_fd answer_fd (-1 = leave unset).
Exit 121 means the sandbox itself could not be set up.
"""

import os
import resource
import sys


def main() -> None:
    uid, cpu_s, mem, nproc, fsize, ready_fd, call_fd, answer_fd = map(int, sys.argv[1:9])
    open_wire()  # noqa: F821 (sandbox_wire.py, prepended)
    sys.argv = ["program.py"]
    sys.path[:] = [p for p in sys.path if p]  # python -c puts the working directory first
    # Taken before the program runs: it may replace these names in their modules.
    write, exit_now, getpid = os.write, os._exit, os.getpid
    stdout, stderr, excepthook = sys.stdout, sys.stderr, sys.excepthook
    try:
        limits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, mem, mem),
                  (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                  (resource.RLIMIT_CORE, 0, 0)]  # fmt: skip
        for res, soft, hard in limits:
            if soft >= 0:
                resource.setrlimit(res, (soft, hard))
        if uid >= 0:
            # Root evaluator: bwrap ran without a user namespace and this process is
            # root in its own namespaces; a throwaway uid is bound by RLIMIT_NPROC and
            # file permissions, root is not. setuid() drops every capability.
            os.chown(".", uid, uid)
            os.chown("program.py", uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        with open("program.py", encoding="utf-8") as f:
            source = f.read()
        main_module = type(sys)("__main__")
        main_module.__file__ = "program.py"
        sys.modules["__main__"] = main_module
        me = getpid()
        write(ready_fd, b"R")  # set up; what follows is the program's
    except BaseException as e:
        excepthook(type(e), e, e.__traceback__)
        exit_now(121)
    try:
        exec(compile(source, "program.py", "exec"), main_module.__dict__)
    except BaseException as e:  # SystemExit too, whatever its code
        try:
            excepthook(type(e), e, e.__traceback__)
        finally:
            exit_now(1)
    if getpid() != me:  # a forked child that ran on to here is not the program
        exit_now(0)
    serve(main_module.__dict__, call_fd, answer_fd)
    stdout.flush()
    stderr.flush()
    exit_now(0)


def serve(namespace: dict, call_fd: int, answer_fd: int) -> None:
    """Answer the judge's calls until it closes its end."""
    while True:
        request = receive(call_fd)  # noqa: F821 (sandbox_wire.py, prepended)
        if request is None:
            return
        try:
            _, name, args, kwargs = request
            value = namespace[name](*decode(args), **decode(kwargs))  # noqa: F821
            answer = {"ok": encode(value)}  # noqa: F821
        except BaseException as e:  # SystemExit too: the judge decides what it means
            answer = {"raise": [type(e).__name__, _text(e)]}
        send(answer_fd, answer)  # noqa: F821


def _text(e: BaseException) -> str:
    try:
        return str(e)[:2000]
    except BaseException:  # a __str__ of the program's that raises
        return "<unprintable>"


if __name__ == "__main__":
    main()
