"""An evaluator that runs as an unprivileged user, for tests/test_sandbox.py.

Started as root by the test (inside a mount namespace where the interpreter, the venv and
the checkout are reachable), it drops to the uid given first, before importing tunelab,
then answers one JSON line per request line on stdin:

  {"op": "run", "code": ..., "limits": {...}}  -> the SandboxResult's fields
  {"op": "describe"}                            -> sandbox.describe() and check_available()

Every answer also says how many SIGUSR1 the evaluator received and whether its
environment is still as it started: the hostile programs aim at both.
"""

import json
import os
import signal
import sys


def main() -> None:
    uid, paths = int(sys.argv[1]), sys.argv[2:]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # drops every capability
    sys.path[:0] = paths
    from tunelab.evals import sandbox

    signals = []
    signal.signal(signal.SIGUSR1, lambda *_: signals.append(1))
    environ = dict(os.environ)
    print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "uid": os.getuid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "run":
                r = sandbox.run_program(request["code"], **request.get("limits", {}))
                answer = {"status": r.status, "returncode": r.returncode, "stderr_tail": r.stderr_tail,
                          "host_uid": r.host_uid}  # fmt: skip
            else:
                answer = {"describe": sandbox.describe(), "available": sandbox.check_available()}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        answer.update(signals=len(signals), environ_same=dict(os.environ) == environ)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
