"""A real PostgreSQL server for a test: Debian's binaries (package `postgresql`; .ci/run installs it), a fresh
cluster in a temporary folder, on a free loopback port, owned by an unprivileged user when the test runs as root
(initdb refuses root). `server()` yields a postgresql:// URL, or skips with the reason when it cannot."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def binaries() -> Path | None:
    """The folder of initdb and pg_ctl: on PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb") and shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user() -> tuple[list[str], str | None]:
    """(command prefix, owner): as root, run the server as `postgres` (Debian's) or `nobody`."""
    if os.geteuid() != 0:
        return [], None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return ["runuser", "-u", name, "--"], name
    pytest.skip("running as root and neither a postgres nor a nobody user exists: initdb refuses to run as root")


@contextlib.contextmanager
def server() -> Iterator[str]:
    bin_dir = binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb/pg_ctl on PATH or in /usr/lib/postgresql/*/bin): "
                    "apt-get install -y postgresql (.ci/run does)")
    prefix, owner = _as_user()
    root = Path(tempfile.mkdtemp(prefix="tunelab-pg-"))
    data, sock, port = root / "data", root / "sock", _free_port()
    sock.mkdir()
    if owner:
        shutil.chown(root, owner)
        shutil.chown(sock, owner)
    run = lambda *cmd: subprocess.run([*prefix, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "tunelab", "-A", "trust", "--no-sync")
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-t", "60", "-l", str(root / "server.log"), "-o",
            f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    except subprocess.CalledProcessError as e:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"PostgreSQL did not start: {e.stderr or e.stdout}")
    try:
        yield f"postgresql://tunelab@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
