"""The first code to run inside the sandbox; `sandbox.py` passes this file's text to `python -c`.

It sets the resource limits, becomes the throwaway uid when the evaluator is root,
reads the pass token, and runs program.py. Only if the program's last statement
returns does it write the token to the result pipe: "passed" means the program ran
to its end, never "the process exited with 0" (sys.exit(0), os._exit(0),
posix._exit(0) or a signal in the middle all leave the token unwritten).

Argument order: uid cpu_s mem nproc fsize token_fd result_fd (-1 = leave unset).
Exit 121 means the sandbox itself could not be set up.
"""

import os
import resource
import sys


def main() -> None:
    uid, cpu_s, mem, nproc, fsize, token_fd, result_fd = map(int, sys.argv[1:8])
    sys.argv = ["program.py"]
    sys.path[:] = [p for p in sys.path if p]  # python -c puts the working directory first
    # Taken before the program runs: it may replace these names in the os module.
    write, close, read, exit_now, getpid = os.write, os.close, os.read, os._exit, os.getpid
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
        token = read(token_fd, 256)
        close(token_fd)
        with open("program.py", encoding="utf-8") as f:
            source = f.read()
        main_module = type(sys)("__main__")
        main_module.__file__ = "program.py"
        sys.modules["__main__"] = main_module
        me = getpid()
        write(result_fd, b"R")  # set up; what follows is the program's
    except BaseException as e:
        excepthook(type(e), e, e.__traceback__)
        exit_now(121)
    try:
        exec(compile(source, "program.py", "exec"), main_module.__dict__)
        stdout.flush()
        stderr.flush()
    except BaseException as e:  # SystemExit too, whatever its code
        try:
            excepthook(type(e), e, e.__traceback__)
        finally:
            exit_now(1)
    if getpid() == me:  # a forked child that ran on to here is not the program's end
        write(result_fd, token)
    exit_now(0)


if __name__ == "__main__":
    main()
