"""How cells are started: plain process, torchrun (single and multi-node), SLURM scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write

from tunelab.core.errors import UserError
from tunelab.matrix.launcher import SlurmCfg
from tunelab.run.launch import Launch, cell_command, sbatch_script

RUN = Path("/runs/m/cell-abc")


def test_single_process_is_plain_python():
    assert cell_command(RUN, 1) == [sys.executable, "-m", "tunelab.cell", str(RUN)]


def test_one_node_uses_standalone_torchrun():
    cmd = cell_command(RUN, 4)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=4"]
    assert "--standalone" in cmd and cmd[-3:] == ["-m", "tunelab.cell", str(RUN)]


def test_multi_node_joins_the_rendezvous():
    cmd = cell_command(RUN, 8, Launch(nnodes=2, node_rank=1, rdzv_endpoint="node0:29500"))
    assert "--nproc-per-node=4" in cmd and "--nnodes=2" in cmd and "--node-rank=1" in cmd
    assert "--rdzv-endpoint=node0:29500" in cmd and "--standalone" not in cmd


def test_layout_must_split_over_nodes():
    with pytest.raises(UserError, match="does not split"):
        cell_command(RUN, 3, Launch(nnodes=2, rdzv_endpoint="h:1"))


@pytest.mark.parametrize("launch, needle", [
    (Launch(nnodes=2), "--rdzv-endpoint"),
    (Launch(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "--node-rank"),
    (Launch(launcher="pbs"), "--launcher"),
])
def test_bad_launch_options(launch, needle):
    with pytest.raises(UserError, match=needle):
        launch.check()


def test_sbatch_script_is_valid_bash(tmp_path):
    how = Launch(nnodes=2, launcher="slurm", slurm=SlurmCfg(gpus_per_node=4))
    text = sbatch_script([tmp_path / "cell"], 8, how, "cell")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    assert "--nproc-per-node=4" in text
    # The node rank must expand on each node, not in the batch shell: the srun command is single-quoted.
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "bash -c '" in srun and "--node-rank=$SLURM_NODEID" in srun.split("bash -c '", 1)[1]
    script = write(tmp_path / "job.sbatch", text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_one_node_job_lets_torchrun_pick_its_port(tmp_path):
    text = sbatch_script([tmp_path / "cell"], 4, Launch(launcher="slurm"), "cell")
    assert "--standalone --nproc-per-node=4" in text and "--rdzv-endpoint" not in text


def test_slurm_dry_run_writes_one_script_per_cell(cli, tmp_path):
    path = write(tmp_path / "m.yaml", """name: m
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic}
matrix:
  peft.method: [none, lora]
""")
    code, out, err = cli("run", path, "--runs-dir", tmp_path / "runs", "--launcher", "slurm", "--dry-run")
    assert code == 0, err
    scripts = sorted((tmp_path / "runs" / "m").glob("*/slurm.sbatch"))
    assert len(scripts) == 2
    assert all("-m tunelab.cell" in s.read_text() for s in scripts)
    assert not list((tmp_path / "runs" / "m").glob("*/train"))  # nothing ran


def test_multi_node_without_endpoint_is_refused_before_anything_is_written(cli, tmp_path):
    path = write(tmp_path / "m.yaml", "name: m\nbase: {model: {name: tiny-random-llama}, data: {recipe: arithmetic}}\n")
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs", "--nnodes", "2")
    assert code == 2 and "--rdzv-endpoint" in err
    assert not (tmp_path / "runs").exists()
