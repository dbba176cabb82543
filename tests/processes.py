"""Real processes for the reliability tests: `exp` started in a session of its own (so a test can kill the
runner alone, or the runner with its cells, as a machine or the OOM killer would), waits bounded in time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

WAIT_S = 300  # a bound for every wait: a test fails, it never hangs


def start_exp(*args, log: Path, env: dict | None = None) -> subprocess.Popen:
    """`exp ARGS` in a new session (its process group holds the runner and the cells it starts)."""
    return subprocess.Popen([sys.executable, "-m", "tunelab.cli", *map(str, args)], stdin=subprocess.DEVNULL,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def run_exp(*args, env: dict | None = None, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *map(str, args)], check=False,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def wait_for(condition, what: str, proc: subprocess.Popen | None = None, timeout: float = WAIT_S,
             poll: float = 0.02):
    """Poll until `condition()` is truthy; fail if `proc` ends first or the time is up."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (code {proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the runner and every cell process it started: nothing gets to say a word."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def attempts(cell_dir: Path) -> int:
    """How many times a runner started this cell (each attempt opens cell.log with a line of its own)."""
    log = cell_dir / "cell.log"
    return sum(" starts: " in line and line.startswith("--- ") for line in log.read_text().splitlines()) \
        if log.is_file() else 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def silent_server():
    """http://127.0.0.1:PORT of a socket that accepts connections (the kernel completes them) and never
    answers: a hung service. Loopback only."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def closed_port() -> str:
    """http://127.0.0.1:PORT where nothing listens: a service that is down. Loopback only."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of the processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(rest[1]) == pid:
            out.append((int(stat.parent.name), name))
    return out
