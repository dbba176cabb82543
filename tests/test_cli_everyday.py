"""`exp export`, `exp chat`, `exp clean` and the status disk column, on tiny cells trained once.

The cells (full, LoRA, IA3 and prompt tuning, 2 steps, checkpoints at every step) are trained in this process
by the same `run_cell` a cell process runs; every command is then run as a subprocess at least once, as a user
runs it, and its other cases in-process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import write

from tunelab.cli.common import human_bytes
from tunelab.core.files import read_json, write_json
from tunelab.core.locks import lock
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder

MATRIX = """name: ev
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  optim: {lr: 1.0e-2}
  train: {steps: 2, batch_size: 2, save_every: 1, keep_checkpoints: 2, device: cpu}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora, ia3, prompt]
"""
IDS = torch.tensor([[5, 17, 99, 300, 2, 8, 41, 7]])


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    from tunelab.cell.stages import run_cell
    from tunelab.matrix import expansion
    from tunelab.run import runner

    tmp = tmp_path_factory.mktemp("everyday")
    spec, cs = expansion.load(write(tmp / "ev.yaml", MATRIX))
    dirs = {}
    for c in cs:
        d = MatrixFolder(tmp / "runs" / spec.name).folder(c)
        runner.prepare(d, c, spec.name)
        d = d.path
        with lock(d):
            run_cell(d)
        dirs[c.config.peft.method] = d
    return tmp, dirs


def exp(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`exp ARGS` in a fresh process (PYTHONPATH and the session's cache come from os.environ)."""
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *map(str, args)], check=False, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def logits(folder_or_model) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = folder_or_model
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(IDS).logits


def base_folder() -> str:
    from tunelab.models.loading import resolve

    return resolve("tiny-random-llama")


def no_leftovers(parent) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


# ---- export ----

def test_export_full_loads_with_plain_transformers(cells):
    tmp, dirs = cells
    out = tmp / "exports" / "full"
    proc = exp("export", dirs["none"], "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "full weights" in proc.stdout
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").is_file() and not (out / "adapter_config.json").exists()
    torch.testing.assert_close(logits(out), logits(dirs["none"] / "final"), rtol=0, atol=1e-6)
    card = (out / "README.md").read_text()
    assert "# ev/none" in card and "val_loss" in card and "method: none" in card  # scores and config
    assert read_json(out / "tunelab_export.json")["template"] == "alpaca"
    assert no_leftovers(out.parent)


def test_export_merged_lora_matches_the_cell(cells, cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, dirs = cells
    out = tmp / "exports" / "lora-merged"
    code, _, err = cli("export", dirs["lora"], "--out", out, "--merge")
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    cell_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder()), dirs["lora"] / "final")
    expected = logits(cell_model)
    torch.testing.assert_close(logits(out), expected, rtol=0, atol=1e-5)
    # The adapter moved the outputs well beyond that tolerance, so the comparison can tell merged from base.
    assert (logits(base_folder()) - expected).abs().max() > 1e-3
    assert "lora adapter merged" in (out / "README.md").read_text()


def test_export_merged_ia3_matches_the_cell(cells, cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, dirs = cells
    out = tmp / "exports" / "ia3-merged"
    code, _, err = cli("export", dirs["ia3"], "--out", out, "--merge")
    assert code == 0, err
    cell_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder()), dirs["ia3"] / "final")
    expected = logits(cell_model)
    torch.testing.assert_close(logits(out), expected, rtol=0, atol=1e-5)
    assert (logits(base_folder()) - expected).abs().max() > 1e-4


def test_export_prompt_tuning_cannot_merge(cells, cli):
    tmp, dirs = cells
    out = tmp / "exports" / "prompt"
    code, _, err = cli("export", dirs["prompt"], "--out", out, "--merge")
    assert code == 0, err
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    for text in (" ".join(err.split()), (out / "README.md").read_text()):
        assert "needs the `peft` package" in text and "cannot be merged" in text and "--merge does not apply" in text


def test_export_adapter_without_merge_says_it_needs_peft(cells, cli):
    tmp, dirs = cells
    out = tmp / "exports" / "lora-adapter"
    code, stdout, err = cli("export", dirs["lora"], "--out", out)
    assert code == 0, err
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    for text in (" ".join(err.split()), (out / "README.md").read_text()):
        assert "needs the `peft` package" in text and "--merge" in text


def test_export_card_marks_scores_like_the_leaderboard(cells, cli):
    tmp, dirs = cells
    cell = tmp / "marked" / dirs["none"].name
    shutil.copytree(dirs["none"], cell)
    time.sleep(0.01)  # the newer eval set must have a later mtime
    write_json(cell / "eval" / "later" / "results.json", {"tasks": {
        "humaneval": {"metric": "pass@1", "value": 0.5, "n": 2, "subset": True, "status": "ok"},
        "gsm8k_smoke": {"metric": "exact_match", "value": 0.25, "n": 4, "status": "ok"},
        "mmlu": {"metric": "acc", "value": None, "status": "unavailable", "reason": "no test set offline"}}})
    ids = [eval_id for eval_id, _ in CellFolder(cell).evaluations()]
    assert ids[0] == "later" and len(ids) == 2  # the cell's own evaluation, and the newer one: newest first
    code, _, err = cli("export", cell, "--out", tmp / "exports" / "marked")
    assert code == 0, err
    rows = [line for line in (tmp / "exports" / "marked" / "README.md").read_text().splitlines()
            if line.startswith((f"| {ids[0]} |", f"| {ids[1]} |"))]
    assert [r.split(" | ")[0] for r in rows] == ["| later"] * 3 + [f"| {ids[1]}"]  # newest set first
    by_task = {r.split(" | ")[1]: r for r in rows}
    assert "| 0.5* |" in by_task["humaneval"] and "| 0.25 |" in by_task["gsm8k_smoke"]
    assert "unavailable (no test set offline)" in by_task["mmlu"] and by_task["val_loss"].startswith(f"| {ids[1]} |")


@pytest.mark.parametrize("case", ["not_done", "no_final", "not_a_cell", "exists", "bad_dtype"])
def test_export_refusals(cells, cli, tmp_path, case):
    _, dirs = cells
    cell, out = tmp_path / "cell", tmp_path / "out"
    shutil.copytree(dirs["none"], cell)
    args = []
    if case == "not_done":
        CellFolder(cell).write_status("failed", error="boom")
        needle = "the cell is failed, not done"
    elif case == "no_final":
        shutil.rmtree(cell / "final")
        needle = "has no final/ weights"
    elif case == "not_a_cell":  # (a cell's final/ stands for its cell: folders.targets)
        cell = cell / "train"
        needle = "`exp export` takes a cell"
    elif case == "exists":
        out.mkdir()
        needle = "already exists"
    else:
        args = ["--dtype", "float8"]
        needle = "--dtype 'float8': allowed are auto"
    code, stdout, err = cli("export", cell, "--out", out, *args)
    message = " ".join(err.split())
    assert code == 2 and needle in message and "Traceback" not in stdout + err, message
    assert not out.exists() or case == "exists" and not any(out.iterdir())
    assert no_leftovers(tmp_path)


def test_export_failing_midway_leaves_nothing(cells, tmp_path):
    from safetensors import SafetensorError

    from tunelab.tools.export import export_cell

    _, dirs = cells
    cell = tmp_path / "cell"
    shutil.copytree(dirs["lora"], cell)
    (cell / "final" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("the old export")
    with pytest.raises((SafetensorError, OSError, ValueError, RuntimeError)):
        export_cell(cell, tmp_path / "out", merge=True, force=True)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]  # --force replaces only when complete
    assert no_leftovers(tmp_path)


# ---- chat ----

def test_chat_prompt_streams_the_cells_greedy_answer(cells):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunelab.data.templates import ALPACA_NO_INPUT

    _, dirs = cells
    proc = exp("chat", dirs["none"], "--prompt", "What is 2+3?", "--temperature", "0", "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alpaca, the template this model was trained with" in proc.stderr
    # The same answer computed here: the Alpaca prompt the cell trained with, greedy decoding.
    final = dirs["none"] / "final"
    tok, model = AutoTokenizer.from_pretrained(final), AutoModelForCausalLM.from_pretrained(final)
    enc = tok(ALPACA_NO_INPUT.format(instruction="What is 2+3?"), return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    expected = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert expected.strip() and proc.stdout == expected + "\n"


def test_chat_peft_cell_and_fallback_note(cells, cli):
    _, dirs = cells
    for method in ("lora", "prompt"):  # merged for generation; prompt tuning generates through the PeftModel
        code, out, err = cli("chat", dirs[method], "--prompt", "hi", "--max-new-tokens", "3", "--temperature", "0")
        assert code == 0 and out.endswith("\n"), err
    code, out, err = cli("chat", "tiny-random-llama", "--prompt", "hi", "--max-new-tokens", "3", "--system", "Be brief")
    assert code == 0, err
    assert err.count("no chat template") == 1 and "Alpaca prompt" in err


def test_chat_session_reads_turns_until_exit(cells, cli, monkeypatch):
    import io

    _, dirs = cells
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nagain\n/exit\nnever read\n"))
    code, out, err = cli("chat", dirs["none"], "--max-new-tokens", "3", "--temperature", "0")
    assert code == 0, err
    assert out.count(">>> ") == 4 and "chatting with cell ev/none" in err


def test_chat_template_rendering():
    from transformers import AutoTokenizer

    from tunelab.tools.chat import choose_template, render

    tok = AutoTokenizer.from_pretrained(base_folder())
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    text, bos = render(conv, "alpaca", tok)
    assert text == "S\n\n### Instruction:\nQ1\n\n### Response:A1<|endoftext|>\n\n### Instruction:\nQ2\n\n### Response:"
    assert bos
    assert choose_template("auto", tok, None)[0] == "alpaca"
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert choose_template("auto", tok, None) == ("chat", None)
    assert choose_template("auto", tok, "alpaca")[0] == "alpaca"  # a cell is prompted as it trained
    assert render(conv, "chat", tok) == ("<system>S\n<user>Q1\n<assistant>A1\n<user>Q2\n<assistant>", False)


@pytest.mark.parametrize("args,needle", [
    (["--device", "tpu"], "--device 'tpu': allowed are auto, cpu, cuda"),
    (["--template", "vicuna"], "--template 'vicuna': allowed are auto, chat"),
    (["--temperature", "-1"], "--temperature"),
])
def test_chat_bad_options(cells, cli, args, needle):
    _, dirs = cells
    code, out, err = cli("chat", dirs["none"], "--prompt", "x", *args)
    assert code == 2 and needle in " ".join(err.split()) and "Traceback" not in out + err


def test_chat_unknown_model(cli, tmp_path):
    code, out, err = cli("chat", str(tmp_path / "nope"), "--prompt", "x")
    said = " ".join(err.split())
    assert code == 2 and "no such folder" in said and "a catalog alias" in said and "Traceback" not in err


# ---- clean and status ----

def test_clean_checkpoints_of_done_cells(cells, tmp_path):
    _, dirs = cells
    mdir = tmp_path / "ev"
    shutil.copytree(dirs["none"].parent, mdir)
    before = {d.name: CellFolder(d).disk_usage(d / "checkpoints") for d in mdir.iterdir()
              if (d / "checkpoints").is_dir()}
    assert len(before) == len(dirs) and all(before.values())
    proc = exp("clean", mdir, "--checkpoints", "--yes")
    assert proc.returncode == 0, proc.stderr[-2000:]
    total = sum(before.values())
    assert f"{total} bytes" in proc.stdout and f"freed {total} bytes" in proc.stdout
    for name, size in before.items():
        assert str(size) in proc.stdout
        assert not (mdir / name / "checkpoints").exists() and (mdir / name / "final").is_dir()
    assert no_leftovers(mdir) and not list(mdir.glob("*/.checkpoints.deleting"))


def test_clean_failed_asks_and_refreshes_the_leaderboard(cells, cli, monkeypatch, tmp_path):
    import io

    from tunelab.report import leaderboard

    _, dirs = cells
    mdir = tmp_path / "ev"
    shutil.copytree(dirs["none"].parent, mdir)
    failed = mdir / dirs["lora"].name
    CellFolder(failed).write_status("failed", error="boom")
    leaderboard.write(mdir)
    monkeypatch.setattr(sys, "stdin", io.StringIO("n\n"))
    code, out, err = cli("clean", mdir, "--failed")
    assert code == 1 and "nothing deleted" in err and failed.is_dir()
    assert str(CellFolder(failed).disk_usage()) in out
    code, out, err = cli("clean", mdir, "--failed", "--yes")
    assert code == 0, err
    assert not failed.exists() and (mdir / dirs["none"].name / "checkpoints").is_dir()  # done cells untouched
    board = (mdir / "leaderboard.md").read_text()
    assert not re.search(r"^\| lora +\|", board, re.M) and re.search(r"^\| none +\|", board, re.M)


def test_clean_leaves_a_locked_cell_alone(cells, cli, tmp_path):
    _, dirs = cells
    cell = tmp_path / "ev" / dirs["none"].name
    shutil.copytree(dirs["none"], cell)
    with lock(cell):  # a process working in it
        code, out, err = cli("clean", cell.parent, "--yes")
    assert code == 0, err
    assert "locked" in out and (cell / "checkpoints").is_dir()


@pytest.mark.parametrize("where", ["missing", "no_cells"])
def test_clean_bad_folder(cli, tmp_path, where):
    target = tmp_path / "nope" if where == "missing" else tmp_path
    code, out, err = cli("clean", target, "--yes")
    assert code == 2 and "expected runs/, runs/<matrix>/ or a cell folder" in " ".join(err.split())


def test_status_shows_disk_per_cell_and_honours_no_color(cells):
    _, dirs = cells
    mdir = dirs["none"].parent
    # FORCE_COLOR makes rich style its output even into a pipe; NO_COLOR must still take the colours out.
    proc = exp("status", mdir, env={"FORCE_COLOR": "1", "NO_COLOR": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "disk" in proc.stdout
    for d in dirs.values():
        assert human_bytes(CellFolder(d).disk_usage()) in proc.stdout
    codes = {int(c) for seq in re.findall(r"\x1b\[([\d;]*)m", proc.stdout) for c in seq.split(";") if c}
    assert 1 in codes  # bold headers: styling is on
    assert not codes & {*range(30, 39), *range(40, 49), *range(90, 98)}  # but no colour ("done" is green)
