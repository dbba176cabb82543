"""Two "nodes" on this machine, really launched: two `exp run --nnodes 2 --node-rank R --rdzv-endpoint
127.0.0.1:PORT` processes, each starting 2 of the 4 processes of a dp 4 cell and of a dp 2 x pp 2 cell
through torchrun's static rendezvous (loopback only, a free port). Both cells end `done` with the losses of one
process (which every one-node layout reproduces: tests/test_parallel_parity.py), and node 1 writes nothing
into the cell folders: they hold what a one-node run writes, and node 1's logs are under nodes/node-1/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from tunelab.core.files import read_jsonl

BASE = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic", "max_length": 96},
        "optim": {"lr": 1.0e-3}, "train": {"steps": 3, "batch_size": 4}, "eval": {"tasks": ["val_loss"],
        "val_batches": 1}, "tracking": {"wandb": False}}
LAYOUTS = {"dp4": {"parallel.dp": 4}, "dp2": {"parallel.dp": 2, "parallel.pp": 2, "parallel.microbatches": 2}}
# What a one-node run writes into a cell folder.
CELL_FILES = {".lock", "cell.json", "config.yaml", "status.json", "attempts.jsonl", "env.json", "cell.log", "train",
              "final", "eval"}
TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(matrix folder, exit codes, outputs) of the two `exp run` processes."""
    from tunelab.models.loading import resolve

    resolve("tiny-random-llama")  # the model cache, built once before eight processes look for it
    tmp = tmp_path_factory.mktemp("multinode")
    spec = {"name": "mn", "base": BASE, "matrix": {"parallel.dp": [4]}, "include": [LAYOUTS["dp2"]]}
    (tmp / "mn.yaml").write_text(yaml.safe_dump(spec))
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "from tunelab.cli import main; main()", "run", str(tmp / "mn.yaml"), "--runs-dir",
           str(tmp / "runs"), "--nnodes", "2", "--rdzv-endpoint", endpoint]
    procs = [subprocess.Popen([*cmd, "--node-rank", str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:  # a hung rendezvous must not outlive the test
            if p.poll() is None:
                p.kill()
    return tmp / "runs" / "mn", [p.returncode for p in procs], outs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same training on one process (in this process): per-step losses."""
    from tunelab.cell.stages import run_cell

    run_dir = tmp_path_factory.mktemp("one") / "cell"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(BASE))
    run_cell(run_dir)
    return [r["loss"] for r in read_jsonl(run_dir / "train" / "metrics.jsonl")]


def cell(mdir, slug: str):
    return next(mdir.glob(f"{slug}-*"))


def test_both_nodes_exit_cleanly(two_nodes):
    _, codes, outs = two_nodes
    assert codes == [0, 0], "\n".join(err[-3000:] for _, err in outs)


@pytest.mark.parametrize("slug", list(LAYOUTS))
def test_cells_are_done_with_the_one_process_losses(two_nodes, one_process, slug):
    folder = cell(two_nodes[0], slug)
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "done" and status["world_size"] == 4, status
    metrics = read_jsonl(folder / "train" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]  # each step once: one writer
    assert [r["loss"] for r in metrics] == pytest.approx(one_process, abs=1e-4)


@pytest.mark.parametrize("slug", list(LAYOUTS))
def test_only_node_0_writes_the_cell_folder(two_nodes, slug):
    mdir = two_nodes[0]
    folder = cell(mdir, slug)
    assert {p.name for p in folder.iterdir()} == CELL_FILES
    # Each node's two workers say how they built the model: node 0's into cell.log, node 1's into its own log.
    node1 = mdir / "nodes" / "node-1" / f"{folder.name}.log"
    assert (folder / "cell.log").read_text().count("model init: meta") == 2
    assert node1.read_text().count("model init: meta") == 2


def test_the_matrix_folder_is_node_0s(two_nodes):
    mdir = two_nodes[0]
    assert sorted(p.name for p in mdir.iterdir() if p.is_file()) == [
        ".lock", "cells.json", "leaderboard.csv", "leaderboard.json", "leaderboard.md", "leaderboard.tex",
        "matrix.yaml", "report.html", "source.json"]
