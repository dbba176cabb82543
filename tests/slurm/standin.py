"""A stand-in for SLURM's sbatch, scontrol, srun and squeue on one machine, for tests (tests/slurm/bin/ puts
them on PATH). It runs a batch script the way a cluster would, without a cluster:

    sbatch --parsable SCRIPT   a job id; a detached supervisor runs SCRIPT (each task of an #SBATCH --array)
                               with SLURM_JOB_ID, SLURM_ARRAY_*, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_NODEID
                               and SLURM_RESTART_COUNT set, output to #SBATCH --output (%j %A %a)
    scontrol requeue ID        as SLURM: the job's processes get SIGTERM, and once all are gone it runs again
    scontrol show hostnames L  localhost
    scancel --signal=SIG ID    SIG to every process of the job (torchrun starts its workers in sessions of
                               their own, so the job is its process tree, as SLURM's cgroup holds it)
    srun [options] CMD ...     CMD once per node (SLURM_NODEID 0..SLURM_NNODES-1), waits for all
    squeue --jobs ID ...       the job's state while it is pending or running, nothing after

State lives in $SLURM_STANDIN_DIR: the job counter, job-ID.pgid (the running script's process group, which a
test signals as SLURM signals a job), job-ID.requeue, job-ID.rc (exit code of the last run, once finished).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("SLURM_STANDIN_DIR", "/tmp/slurm-standin"))


def _options(script: Path) -> dict[str, str]:
    opts = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(.*))?", line)
        if m:
            opts[m.group(1)] = m.group(2) or ""
    return opts


def sbatch(args: list[str]) -> int:
    script = Path(next(a for a in args if not a.startswith("-"))).resolve()
    STATE.mkdir(parents=True, exist_ok=True)
    counter = STATE / "counter"
    job = int(counter.read_text()) + 1 if counter.is_file() else 1001
    counter.write_text(str(job))
    subprocess.Popen([sys.executable, __file__, "_supervise", str(job), str(script)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(job)
    return 0


def _tree(root: int) -> list:
    import psutil

    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_job(job: str, sig: int) -> None:
    pid = STATE / f"job-{job}.pgid"
    if pid.is_file():
        for proc in _tree(int(pid.read_text())):
            try:
                proc.send_signal(sig)
            except Exception:  # noqa: BLE001 - it ended meanwhile
                pass


def _gone(root: int, members: list) -> bool:
    return not any(p.is_running() and p.status() != "zombie" for p in members)


def _run_task(job: str, script: Path, env: dict, output: str) -> None:
    """One job (or array task): run, and again for each requeue, once all its processes are gone."""
    restarts = 0
    while True:
        (STATE / f"job-{job}.requeue").unlink(missing_ok=True)
        with open(output, "a") as log:
            proc = subprocess.Popen(["bash", str(script)], env={**env, "SLURM_RESTART_COUNT": str(restarts)},
                                    stdout=log, stderr=log, start_new_session=True)
            (STATE / f"job-{job}.pgid").write_text(str(proc.pid))
            members: list = []
            while proc.poll() is None:  # the job's processes, as SLURM's cgroup would know them
                members = list({p.pid: p for p in [*members, *_tree(proc.pid)]}.values())
                time.sleep(0.1)
            rc = proc.returncode
        while not _gone(proc.pid, members):  # SLURM requeues a job once its last process has ended
            time.sleep(0.2)
        if not (STATE / f"job-{job}.requeue").is_file():
            (STATE / f"job-{job}.rc").write_text(str(rc))
            return
        restarts += 1


def supervise(job: int, script: Path) -> int:
    (STATE / f"supervisor-{job}.pid").write_text(str(os.getpid()))
    opts = _options(script)
    nodes = opts.get("nodes", "1")
    tasks = [None]
    if "array" in opts:
        lo, hi = map(int, opts["array"].split("-"))
        tasks = list(range(lo, hi + 1))
    for i, task in enumerate(tasks):
        task_job = str(job) if task is None else str(job + 1 + i)
        env = {**os.environ, "SLURM_JOB_ID": task_job, "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": nodes,
               "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_JOB_NAME": opts.get("job-name", "")}
        if task is not None:
            env.update(SLURM_ARRAY_JOB_ID=str(job), SLURM_ARRAY_TASK_ID=str(task))
            (STATE / f"job-{job}_{task}").write_text(task_job)  # the array task's own id
        output = opts.get("output", f"slurm-{task_job}.out").replace("%A", str(job)).replace(
            "%a", str(task)).replace("%j", task_job)
        _run_task(task_job, script, env, output)
    return 0


def cancel_all() -> None:
    """End every job this state folder knows (a test's cleanup): their supervisors and processes."""
    for f in [*STATE.glob("supervisor-*.pid"), *STATE.glob("job-*.pgid")]:
        for proc in _tree(int(f.read_text())):
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - it ended meanwhile
                pass


def _job_of(name: str) -> str:
    """An array task "A_i" by its own job id."""
    alias = STATE / f"job-{name}"
    return alias.read_text() if alias.is_file() else name


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        print("localhost")
        return 0
    if args[0] == "requeue":
        job = _job_of(args[1])
        (STATE / f"job-{job}.requeue").touch()
        _signal_job(job, signal.SIGTERM)
        return 0
    print(f"scontrol stand-in: unsupported {args}", file=sys.stderr)
    return 1


def srun(args: list[str]) -> int:
    cmd = [a for a in args if not a.startswith("--")]
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    procs = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)})
             for n in range(nodes)]
    return max(p.wait() for p in procs)


def scancel(args: list[str]) -> int:
    sig = next(a.split("=", 1)[1] for a in args if a.startswith("--signal="))
    _signal_job(_job_of(next(a for a in args if not a.startswith("-"))), getattr(signal, f"SIG{sig}"))
    return 0


def squeue(args: list[str]) -> int:
    job = _job_of(args[args.index("--jobs") + 1])
    if (STATE / f"job-{job}.pgid").is_file() and not (STATE / f"job-{job}.rc").is_file():
        print("RUNNING")
    return 0


def main() -> int:
    name, args = sys.argv[1], sys.argv[2:]
    if name == "_supervise":
        return supervise(int(args[0]), Path(args[1]))
    return {"sbatch": sbatch, "scontrol": scontrol, "srun": srun, "squeue": squeue, "scancel": scancel}[name](args)


if __name__ == "__main__":
    sys.exit(main())
