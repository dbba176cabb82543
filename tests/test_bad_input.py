"""The bad-input catalogue: one row per malformed input, each run through the real `exp` command.

A row is the input (files written first, the command line, the environment, a state of the runs folder) and
what a user must read: the exit code (2 for what is found before anything runs; 1 with the cell marked failed
and its cause, for what only running the cell can find), and needles that name the file and the key or line.
Every row also checks: no traceback, and nothing half-written (a plan-time error leaves the runs folder as it
was; no temporary file is left anywhere).

{m} is the matrix file (GOOD unless the row brings its own m.yaml), {runs} the runs folder ({mdir}: its
matrix's folder), {tmp} the row's folder. `state` prepares the runs folder: a finished run copied in, then
damaged; a full or a read-only mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from conftest import fill, write
from processes import run_exp

from tunelab.core.files import read_json

GOOD = """name: bad
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 2, batch_size: 2, save_every: 1}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
"""


def with_base(extra: str) -> str:
    """GOOD with more lines under base (two-space indented YAML)."""
    return GOOD.replace("  tracking: {wandb: false}\n", "  tracking: {wandb: false}\n" + extra)


def recipe_matrix(recipe: str) -> dict[str, str]:
    return {"m.yaml": GOOD.replace("{recipe: arithmetic, max_length: 48}", "{recipe: {tmp}/r.yaml, max_length: 48}"),
            "r.yaml": recipe}


def suite_matrix(suite: str) -> dict[str, str]:
    return {"m.yaml": GOOD.replace("tasks: [val_loss]", "suite: {tmp}/s.yaml"), "s.yaml": suite}


ROWS = "template: alpaca\nsources:\n  - path: rows.jsonl\n"


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    needles: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    code: int = 2
    state: str | None = None  # how the runs folder starts (see `prepare`)
    out: bool = False  # the needles are in stdout (a report), not stderr


RUN = ("run", "{m}", "--runs-dir", "{runs}")
PLAN = ("plan", "{m}")
CASES: dict[str, Case] = {
    # ---- matrix files ----
    "matrix_yaml_unclosed_bracket": Case(RUN, ("m.yaml", "YAML syntax error at line 10"), {
        "m.yaml": GOOD + "matrix:\n  optim.name: [adamw\n  peft.method: [none]\n"}),
    "matrix_yaml_tab_indent": Case(PLAN, ("m.yaml", "YAML syntax error at line 3"), {
        "m.yaml": GOOD.replace("  model:", "\tmodel:")}),
    "matrix_not_a_mapping": Case(RUN, ("m.yaml", "a matrix file is a mapping"), {"m.yaml": "- a\n- b\n"}),
    "matrix_empty_file": Case(RUN, ("m.yaml", "a matrix file is a mapping"), {"m.yaml": ""}),
    "matrix_missing_name": Case(RUN, ("m.yaml", "name: required key is missing"), {
        "m.yaml": GOOD.replace("name: bad\n", "")}),
    "matrix_bad_name": Case(RUN, ("m.yaml", "name:", "should match pattern"), {
        "m.yaml": GOOD.replace("name: bad", "name: ../elsewhere")}),
    "matrix_unknown_top_level_key": Case(RUN, ("m.yaml", "matrx: unknown key", "matrix"), {
        "m.yaml": GOOD + "matrx:\n  peft.method: [none]\n"}),
    "matrix_unknown_section_key": Case(RUN, ("m.yaml", "base.train.stepz", "unknown key", "steps"), {
        "m.yaml": GOOD.replace("steps: 2", "stepz: 2")}),
    "matrix_wrong_type": Case(RUN, ("m.yaml", "base.train.steps", "integer", "'ten'"), {
        "m.yaml": GOOD.replace("steps: 2", "steps: ten")}),
    "matrix_negative_steps": Case(RUN, ("m.yaml", "base.train.steps", "greater than 0"), {
        "m.yaml": GOOD.replace("steps: 2", "steps: -3")}),
    "matrix_zero_loss_chunk": Case(PLAN, ("m.yaml", "base.train.loss_chunk", "greater than 0"), {
        "m.yaml": GOOD.replace("steps: 2,", "steps: 2, loss_chunk: 0,")}),
    "matrix_fractional_batch": Case(RUN, ("m.yaml", "base.train.batch_size", "integer"), {
        "m.yaml": GOOD.replace("batch_size: 2", "batch_size: 2.5")}),
    "matrix_unknown_model": Case(RUN, ("m.yaml", "base.model.name", "not a catalog alias", "tiny-random-llama"), {
        "m.yaml": GOOD.replace("tiny-random-llama", "tiny-randm-llama")}),
    "matrix_unknown_optimizer_on_axis": Case(RUN, ("m.yaml", "matrix.optim.name[1]", "unknown optimizer"), {
        "m.yaml": GOOD + "matrix:\n  optim.name: [adamw, adamz]\n"}),
    "matrix_empty_axis": Case(RUN, ("m.yaml", "matrix.peft.method", "at least one value"), {
        "m.yaml": GOOD + "matrix:\n  peft.method: []\n"}),
    "matrix_axis_not_a_list": Case(RUN, ("m.yaml", "matrix.peft.method", "list"), {
        "m.yaml": GOOD + "matrix:\n  peft.method: lora\n"}),
    "matrix_axis_unknown_key": Case(RUN, ("m.yaml", "optim.lrr", "unknown key"), {
        "m.yaml": GOOD + "matrix:\n  optim.lrr: [0.1]\n"}),
    "matrix_exclude_not_an_axis": Case(RUN, ("m.yaml", "exclude[0]", "not matrix axes"), {
        "m.yaml": GOOD + "matrix:\n  peft.method: [none, lora]\nexclude:\n  - {optim.name: adamw}\n"}),
    "matrix_seeds_not_integers": Case(RUN, ("m.yaml", "seeds", "integer"), {"m.yaml": GOOD + "seeds: [one]\n"}),
    "matrix_unknown_peft": Case(RUN, ("m.yaml", "matrix.peft.method[1]", "'lora'"), {
        "m.yaml": GOOD + "matrix:\n  peft.method: [none, loar]\n"}),
    "matrix_unknown_recipe": Case(RUN, ("m.yaml", "base.data.recipe", "no recipe 'nope'", "arithmetic"), {
        "m.yaml": GOOD.replace("recipe: arithmetic", "recipe: nope")}),
    "matrix_unknown_eval_task": Case(RUN, ("m.yaml", "eval.tasks", "unknown task", "humaneval"), {
        "m.yaml": GOOD.replace("tasks: [val_loss]", "tasks: [val_loss, humaneva]")}),
    "matrix_zero_eval_limit": Case(RUN, ("m.yaml", "base.eval.limit", "greater than 0"), {
        "m.yaml": GOOD.replace("val_batches: 1", "val_batches: 1, limit: 0")}),
    "matrix_unknown_tracking_mode": Case(RUN, ("m.yaml", "base.tracking.mode", "'online'"), {
        "m.yaml": GOOD.replace("{wandb: false}", "{wandb: true, mode: sometimes}")}),
    "matrix_impossible_layout": Case(RUN, ("m.yaml", "parallel"), {
        "m.yaml": with_base("  parallel: {tp: 2, pp: 2, dp: 2}\n")}),
    "matrix_cuda_only_peft_on_cpu": Case(RUN, ("m.yaml", "qlora", "needs a CUDA device", "train.device is cpu"), {
        "m.yaml": GOOD.replace("save_every: 1}", "save_every: 1, device: cpu}") + "matrix:\n  peft.method: [qlora]\n"}),
    "matrix_cpu_offload_on_one_process": Case(RUN, ("m.yaml", "parallel.cpu_offload", "would be ignored"), {
        "m.yaml": with_base("  parallel: {cpu_offload: true}\n")}),
    "matrix_compile_under_an_engine": Case(RUN, ("m.yaml", "train.compile", "parallel engine"), {
        "m.yaml": with_base("  parallel: {dp: 2}\n").replace("save_every: 1}", "save_every: 1, compile: true}")}),
    "matrix_compile_with_lomo": Case(RUN, ("m.yaml", "train.compile", "optim.name lomo", "inside backward"), {
        "m.yaml": with_base("  optim: {name: lomo}\n").replace("save_every: 1}", "save_every: 1, compile: true}")}),
    "matrix_group_by_length_with_packing": Case(RUN, ("m.yaml", "train.group_by_length", "data.pack"), {
        "m.yaml": GOOD.replace("max_length: 48}", "max_length: 48, pack: true}").replace(
            "save_every: 1}", "save_every: 1, group_by_length: true}")}),
    "matrix_is_a_folder": Case(("run", "{tmp}", "--runs-dir", "{runs}"), ("this is a folder; expected a file",)),
    "matrix_missing_file": Case(("run", "{tmp}/nope.yaml", "--runs-dir", "{runs}"), ("nope.yaml: no such file",)),

    # ---- recipes (checked when the matrix is planned) ----
    "recipe_yaml_syntax": Case(RUN, ("m.yaml", "data.recipe", "r.yaml", "YAML syntax error at line 4"), recipe_matrix(
        "template: alpaca\nsources:\n  - {generator: arithmetic\n")),
    "recipe_not_a_mapping": Case(RUN, ("r.yaml", "a recipe is a mapping"), recipe_matrix("- generator: x\n")),
    "recipe_unknown_key": Case(RUN, ("r.yaml", "sources.0.colour", "unknown key", "generator"), recipe_matrix(
        "sources:\n  - {generator: arithmetic, colour: red}\n")),
    "recipe_two_kinds_in_a_source": Case(RUN, ("r.yaml", "sources.0", "exactly one of"), recipe_matrix(
        "sources:\n  - {generator: arithmetic, path: rows.jsonl}\n")),
    "recipe_no_sources": Case(RUN, ("r.yaml", "sources", "at least 1 item"), recipe_matrix("sources: []\n")),
    "recipe_unknown_generator": Case(RUN, ("r.yaml", "sources.0", "arithmetic"), recipe_matrix(
        "sources:\n  - {generator: arithmetik}\n")),
    "recipe_unknown_template": Case(RUN, ("r.yaml", "template", "alpaca"), recipe_matrix(
        "template: alpacca\nsources:\n  - {generator: arithmetic}\n")),
    "recipe_filters_min_above_max": Case(RUN, ("r.yaml", "filters", "min_tokens (9) is above max_tokens (3)"),
                                         recipe_matrix("sources:\n  - {generator: arithmetic}\n"
                                                       "filters: {min_tokens: 9, max_tokens: 3}\n")),

    # ---- suites ----
    "suite_missing": Case(RUN, ("m.yaml", "eval", "unknown suite 'quik'", "quick"), {
        "m.yaml": GOOD.replace("tasks: [val_loss]", "suite: quik")}),
    "suite_yaml_syntax": Case(RUN, ("s.yaml", "YAML syntax error at line 2"),
                              suite_matrix("tasks: [val_loss\nlimit: 1\n")),
    "suite_unknown_key": Case(RUN, ("s.yaml", "unknown key", "limitt", "allowed"),
                              suite_matrix("tasks: [val_loss]\nlimitt: 1\n")),
    "suite_wrong_type": Case(RUN, ("m.yaml", "eval.limit", "integer"),
                             suite_matrix("tasks: [val_loss]\nlimit: some\n")),

    # ---- command line ----
    "set_without_equals": Case((*RUN, "--set", "train.steps"), ("--set 'train.steps'", "KEY=VALUE")),
    "set_unknown_key": Case((*RUN, "--set", "train.stepz=3"), ("--set train.stepz", "unknown key", "steps")),
    "set_bad_value": Case((*RUN, "--set", "train.steps=many"), ("--set train.steps", "integer", "'many'")),
    "set_value_not_yaml": Case((*RUN, "--set", "optim.lr=[1"), ("--set 'optim.lr=[1'", "not valid YAML")),
    "only_matches_nothing": Case((*RUN, "--only", "zzz*"), ("--only 'zzz*'", "matches none of the cells", "bad")),
    "only_bad_glob": Case((*RUN, "--only", "[a-"), ("--only '[a-'", "matches none of the cells")),
    "launcher_unknown": Case((*RUN, "--launcher", "pbs"), ("--launcher 'pbs'", "local, slurm")),
    "node_rank_out_of_range": Case((*RUN, "--nnodes", "2", "--node-rank", "2"), ("--node-rank 2", "--nnodes 2")),
    "nnodes_without_rendezvous": Case((*RUN, "--nnodes", "2"), ("--rdzv-endpoint",)),
    "status_of_no_folder": Case(("status", "{tmp}/nothing"), ("nothing: no such run folder",)),
    "leaderboard_bad_format": Case(("leaderboard", "{mdir}", "--format", "xlsx"), ("--format 'xlsx'", "csv"),
                                   state="done"),
    "leaderboard_bad_where": Case(("leaderboard", "{mdir}", "--where", "optim.name"),
                                  ("--where 'optim.name'", "KEY=VALUE"), state="done"),
    "ls_unknown_kind": Case(("ls", "modelz"), ("exp ls 'modelz'", "models")),

    # ---- environment and the runs folder ----
    "cuda_asked_without_cuda": Case(RUN, ("m.yaml", "this machine cannot run the cell", "CUDA"), {
        "m.yaml": GOOD.replace("save_every: 1}", "save_every: 1, device: cuda}")}),
    "wandb_mode_env_unknown": Case(RUN, ("WANDB_MODE", "'sometimes'", "offline"), {
        "m.yaml": GOOD.replace("{wandb: false}", "{wandb: true}")}, env={"WANDB_MODE": "sometimes"}),
    "hub_timeout_env_not_a_number": Case(RUN, ("TUNELAB_HUB_TIMEOUT", "'soon'", "seconds"),
                                         env={"TUNELAB_HUB_TIMEOUT": "soon"}),
    "wandb_timeout_env_zero": Case(RUN, ("WANDB_INIT_TIMEOUT='0'", "above 0"), env={"WANDB_INIT_TIMEOUT": "0"}),
    "gc_env_unknown": Case(RUN, ("TUNELAB_GC='off'", "allowed is 'plain'"), env={"TUNELAB_GC": "off"}),
    "num_proc_env_not_whole": Case(RUN, ("TUNELAB_NUM_PROC='2.5'", "whole number at least 1"),
                                   env={"TUNELAB_NUM_PROC": "2.5"}),
    "progress_env_negative": Case(RUN, ("TUNELAB_PROGRESS_EVERY='-5'", "at least 0"),
                                  env={"TUNELAB_PROGRESS_EVERY": "-5"}),
    "cache_dir_is_a_file": Case(RUN, ("TUNELAB_CACHE", "not a folder"), {"cachefile": "x"},
                                env={"TUNELAB_CACHE": "{tmp}/cachefile"}),
    "runs_dir_is_a_file": Case(("run", "{m}", "--runs-dir", "{tmp}/runsfile"), ("runsfile", "not a folder"),
                               {"runsfile": "x"}),
    "runs_dir_read_only": Case(RUN, ("runs", "read-only file system"), state="read-only"),
    "runs_dir_full": Case(RUN, ("no space left on the device", "--runs-dir"), state="full"),

    # ---- found when the cell runs: it is marked failed with the cause, the matrix goes on ----
    # Found by the plan now (exit 2, nothing written), not when the cell builds its data.
    "data_file_missing": Case(RUN, ("r.yaml", "sources[0].path", "does not exist"), recipe_matrix(ROWS)),
    "data_file_not_json": Case(RUN, ("r.yaml", "sources[0].path", "line 2 is not JSON"), {
        **recipe_matrix(ROWS), "rows.jsonl": '{"instruction": "a", "output": "b"}\n{"instruction": \n'}, code=1),
    "data_empty_after_filters": Case(RUN, ("r.yaml", "no examples after filtering", "filters"), recipe_matrix(
        "sources:\n  - {generator: arithmetic, args: {n: 40}}\nfilters: {min_tokens: 100000}\n"), code=1),
    "eval_task_file_not_json": Case(RUN, ("evaldata/humaneval/main/test.jsonl", "line 1 is not JSON"), {
        "m.yaml": GOOD.replace("tasks: [val_loss]", "tasks: [humaneval], limit: 1, data_dir: {tmp}/evaldata"),
        "evaldata/humaneval/main/test.jsonl": "{not json\n"}, code=1, state="done"),
    "checkpoint_corrupt": Case(RUN, ("checkpoints/step-2 (state.pt has 100 bytes", "no complete checkpoint"), code=1,
                               state="corrupt-checkpoint"),
    "results_truncated": Case(RUN, ("results.json", "evaluating it again"), code=0, state="truncated-results"),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """GOOD run to its end once (checkpoints kept), for the rows that start from a finished runs folder."""
    tmp = tmp_path_factory.mktemp("finished")
    path = write(tmp / "m.yaml", GOOD)
    done = run_exp("run", path, "--runs-dir", tmp / "runs")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "runs"


def _mount_tmpfs(where, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tunelab-test", str(where)], check=False,
                          capture_output=True).returncode == 0


def prepare(state: str | None, tmp, runs, finished, monkeypatch, mounts: list) -> None:
    if state in ("done", "corrupt-checkpoint", "truncated-results"):
        shutil.copytree(finished, runs)
        (runs / "bad" / "source.json").unlink()  # the copy is this test's matrix file's (another path, other text)
        (cell,) = [p for p in (runs / "bad").iterdir() if p.is_dir()]
        if state == "corrupt-checkpoint":  # killed after its last checkpoint, whose state file is damaged
            state_pt = cell / "checkpoints" / "step-2" / "state.pt"
            state_pt.write_bytes(state_pt.read_bytes()[:100])
            shutil.rmtree(cell / "final")
            status = read_json(cell / "status.json")
            (cell / "status.json").write_text(json.dumps({**status, "state": "running", "trained": False}))
            for f in (cell / "eval").glob("*/results.json"):
                f.unlink()
        if state == "truncated-results":
            (res,) = cell.glob("eval/*/results.json")
            res.write_text(res.read_text()[:40])
    elif state == "read-only":
        if _mount_tmpfs(runs, "ro,size=1m"):
            mounts.append(runs)
        else:  # no mount here (an unprivileged container): the same failure, from the write itself
            _fail_writes(monkeypatch, 30)  # errno.EROFS
    elif state == "full":
        if _mount_tmpfs(runs, "size=64k"):
            mounts.append(runs)
            fill(runs)
        else:
            _fail_writes(monkeypatch, 28)  # errno.ENOSPC


def _fail_writes(monkeypatch, code: int) -> None:
    import tunelab.core.files as store

    def refuse(*_a, **_k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(store.Path, "mkdir", refuse)


def _files(root) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"} if root.exists() else {}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, cli, tmp_path, finished, monkeypatch):
    case = CASES[name]
    runs, mounts = tmp_path / "runs", []
    sub = {"{tmp}": str(tmp_path), "{runs}": str(runs), "{mdir}": str(runs / "bad"), "{m}": str(tmp_path / "m.yaml")}

    def fill(text: str) -> str:
        for k, v in sub.items():
            text = text.replace(k, v)
        return text

    files = {"m.yaml": GOOD, **case.files}
    for rel, text in files.items():
        write(tmp_path / rel, fill(text))
    for k, v in case.env.items():
        monkeypatch.setenv(k, fill(v))
    try:
        prepare(case.state, tmp_path, runs, finished, monkeypatch, mounts)
        before = _files(runs)
        code, out, err = cli(*(fill(a) for a in case.args))
        message = " ".join((out if case.out else err).split())  # rich wraps long lines
        assert code == case.code, (out, err)
        assert "Traceback" not in out + err
        for needle in case.needles:
            assert fill(needle) in message, message
        if case.code == 2:  # found before anything ran: the runs folder is as it was
            assert _files(runs) == before
        if case.code == 1:  # found by the cell: marked failed with that cause
            (status,) = [read_json(p) for p in runs.glob("*/*/status.json")]
            assert status["state"] == "failed" and status["exit"] == "exited with code 1" and status["log_tail"]
            for needle in case.needles:
                assert fill(needle) in status["error"], status["error"]
        leftovers = [p for p in tmp_path.rglob(".*") if p.name != ".lock" and ".tmp" not in p.parts]
        assert not leftovers, leftovers  # no temporary file of an atomic write was left behind
    finally:
        for m in mounts:
            subprocess.run(["umount", str(m)], check=False)
