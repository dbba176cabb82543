"""An evaluator that runs as an unprivileged user, for tests/test_sandbox.py.

Started as root by the test (inside a mount namespace where the interpreter, the venv and
the checkout are reachable), it drops to the uid given first, before importing tunelab,
then answers one JSON line per request line on stdin:

  {"op": "run", "code": ..., "limits": {...}}  -> the SandboxResult's fields (run_program)
  {"op": "run", "code": ..., "tests": ..., "calls": [...], "limits": {...}}  -> the same, of run_tests
  {"op": "describe"}                            -> contain.describe() and check_available()
  {"op": "samples", "code", "tests", "calls", "n", "workers", "judge", "limits"}  -> run_samples's list

Every answer also says how many SIGUSR1 the evaluator received and whether its
environment is still as it started: the hostile programs aim at both; and which processes
of the program's host uid are still alive right after run_program returned.
"""

import json
import os
import signal
import sys


def sandboxed_tasks(uid: int) -> set[int]:
    """Live processes of real uid `uid` in another pid namespace than ours: a program's
    processes (each sandbox has a pid namespace of its own) or, on a developer's machine,
    other sandboxes, which the evaluators record before their first run."""
    ours = os.readlink("/proc/self/ns/pid")
    pids = set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
                if os.readlink(f"/proc/{name}/ns/pid") != ours:
                    pids.add(int(name))
        except (OSError, KeyError):
            continue
    return pids


def run_samples(sandbox, code: str, tests: str, calls: list, n: int, workers: int, judge: str | None,
                limits: dict) -> list[dict]:  # fmt: skip
    """`n` samples of one program, `workers` at a time as humaneval.score runs them, in the plain
    fallback (allow_unsandboxed, no bwrap), so that the program can keep a file between samples: a
    perfect memory. `judge`, when given, is the judge's text for these runs (a control's)."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    saved = sandbox._JUDGE, os.environ.get("TUNELAB_BWRAP")
    os.environ["TUNELAB_BWRAP"] = "/nonexistent/bwrap"
    sandbox._JUDGE = judge or saved[0]
    try:
        with warnings.catch_warnings(), ThreadPoolExecutor(workers) as pool:
            warnings.simplefilter("ignore", RuntimeWarning)  # WITHOUT a sandbox, as asked
            results = list(pool.map(lambda _: sandbox.run_tests(code, tests, calls=calls, allow_unsandboxed=True,
                                                                **limits), range(n)))  # fmt: skip
    finally:
        sandbox._JUDGE = saved[0]
        if saved[1] is None:
            os.environ.pop("TUNELAB_BWRAP", None)
        else:
            os.environ["TUNELAB_BWRAP"] = saved[1]
    return [{"status": r.status, "stderr_tail": r.stderr_tail} for r in results]


def main() -> None:
    uid, paths = int(sys.argv[1]), sys.argv[2:]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # drops every capability
    sys.path[:0] = paths
    from tunelab.evals.sandbox import contain

    signals = []
    signal.signal(signal.SIGUSR1, lambda *_: signals.append(1))
    environ = dict(os.environ)
    elsewhere = sandboxed_tasks(uid)
    print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "uid": os.getuid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "run":
                limits = request.get("limits", {})
                if request.get("tests") is None:
                    r = contain.run_program(request["code"], **limits)
                else:
                    r = contain.run_tests(request["code"], request["tests"], calls=request["calls"], **limits)
                leftovers = sorted(sandboxed_tasks(r.host_uid) - elsewhere)
                answer = {"status": r.status, "returncode": r.returncode, "stderr_tail": r.stderr_tail,
                          "host_uid": r.host_uid, "leftovers": leftovers, "memory_peak": r.memory_peak,
                          "judge_peak_kb": r.judge_peak_kb, "watched_peak": r.watched_peak}  # fmt: skip
            elif request["op"] == "samples":
                answer = {"samples": run_samples(contain, request["code"], request["tests"], request["calls"],
                                                 request["n"], request["workers"], request.get("judge"),
                                                 request.get("limits", {}))}  # fmt: skip
            else:
                answer = {"describe": contain.describe(), "available": contain.check_available()}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        answer.update(signals=len(signals), environ_same=dict(os.environ) == environ)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
