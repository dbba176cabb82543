"""Every layout computes what one process computes: the first 3 losses (and gradient norms, the
validation loss and every gathered weight after them, parameter by parameter; every parameter's gradient in the
first step, where the optimizer has whole gradients) of a tiny 4-layer Llama, with full AdamW, with
LoRA, with AdaLomo (every layout), with LOMO (FSDP2, tensor parallel, a pipeline, DeepSpeed stage 0 and
ZeRO-3) and with tied embeddings (pipelines), against a single-process run computed here with the plain
head (`model(**batch).loss`), while every layout runs the output head and loss in chunks of 8 positions
(train/chunked.py). fp32, clipping at max_grad_norm 1.0 in both (DeepSpeed is told the same). One torchrun
launch per world size runs all its layouts (tests/parallel/run_layouts.py); two runs also leave a
distributed checkpoint that is resumed on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from parallel import common
from parallel.run_layouts import CKPT_AFTER, CKPT_RUNS, DS_RESUMES, LAYOUTS, methods, size

TOL = 1e-4
HEAD_TOL = 1e-6  # the first step (the same weights everywhere): the chunked head against the plain one
# Every weight after the 3 steps. LOMO's and AdaLomo's updates follow their gradients smoothly; Adam divides each
# element's gradient by its own running size, so a float-order difference in a gradient near zero can move that
# element by a share of the step (lr 1e-2): measured up to 2.5e-4 on these layouts, a twentieth of lr allowed.
WEIGHT_TOL, ADAM_WEIGHT_TOL = {"adalomo": 1e-6, "lomo": 1e-6}, common.LR / 20
WORLDS = sorted({size(p) for p in LAYOUTS.values()})


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """{world size: (results JSON or None, log tail)}, plus the checkpoint folder."""
    tmp = tmp_path_factory.mktemp("parallel")
    ckpt = tmp / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TUNELAB_LAYOUTS", None)
    out = {}
    for world in WORLDS:
        res = tmp / f"ws{world}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(REPO / "tests" / "parallel" / "run_layouts.py"), str(res), str(ckpt)]
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
        out[world] = (json.loads(res.read_text()) if res.is_file() else None, proc.stderr[-4000:])
    return out, ckpt


@pytest.fixture(scope="module")
def reference():
    """Each method's one-process numbers, with the names of its parameters (a tied weight under both) and of its
    trainable ones."""
    out = {}
    for m in common.METHODS:
        ref = common.reference(m, tensors=True)
        names = dict(common.tiny_model(m).named_parameters(remove_duplicate=False))
        out[m] = {**{k: v for k, v in ref.items() if k not in ("grads", "weights")}, "names": list(names),
                  "trainable": [n for n, p in names.items() if p.requires_grad]}
    return out


@pytest.mark.parametrize(("layout", "method"), [(n, m) for n in LAYOUTS for m in methods(n)])
def test_layout_matches_one_process(launched, reference, layout, method):
    results, log = launched[0][size(LAYOUTS[layout])]
    assert results is not None, f"torchrun wrote no results:\n{log}"
    got, want = results[f"{layout}/{method}"], reference[method]
    assert "error" not in got, got.get("error")
    # Before any update, loss and gradients differ from the plain head's only by float summation order.
    assert got["loss"][0] == pytest.approx(want["loss"][0], abs=HEAD_TOL)
    assert got["grad_norm"][0] == pytest.approx(want["grad_norm"][0], abs=HEAD_TOL)
    assert got["loss"] == pytest.approx(want["loss"], abs=TOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=TOL)
    assert got["eval"][0] == pytest.approx(want["eval"][0], abs=TOL * 100)  # a sum over 24 tokens
    assert got["eval"][1] == want["eval"][1]
    assert got["param_sum"] == pytest.approx(want["param_sum"], rel=1e-5)  # unwrap() gathered the weights
    # Every parameter, compared where the tensors are (run_layouts.py, against the same reference): the first step's
    # gradients as the engine hands them to clipping, and every weight after the last step.
    weights = got["weights"]
    assert weights["names"] == len(want["names"]) and not weights["missing"], weights
    assert weights["max"] < WEIGHT_TOL.get(method, ADAM_WEIGHT_TOL), weights
    if method in common.FUSED:  # LOMO/AdaLomo never hold a whole gradient: their updates are the weights above
        assert got["grads"] is None
        return
    grads = got["grads"]
    assert grads["names"] == len(want["trainable"]) and not grads["missing"], grads
    assert grads["max"] < HEAD_TOL, grads


def test_clipping_is_active(reference):
    """The parity above covers clipping only if the norms exceed max_grad_norm at some step."""
    assert any(n > common.MAX_NORM for m in common.METHODS for n in reference[m]["grad_norm"])


@pytest.mark.parametrize(("source", "target"), list(DS_RESUMES.items()))
def test_deepspeed_checkpoint_resumes_under_another_stage(launched, reference, source, target):
    results, log = launched[0][size(LAYOUTS[target])]
    assert results is not None, f"torchrun wrote no results:\n{log}"
    got, method = results[f"resume {source} -> {target}"], source.split("/")[1]
    assert got["loss"][0] == pytest.approx(reference[method]["loss"][CKPT_AFTER], abs=TOL)
    assert got["grad_norm"][0] == pytest.approx(reference[method]["grad_norm"][CKPT_AFTER], abs=TOL)


@pytest.mark.parametrize("run", [r for r in CKPT_RUNS if r not in DS_RESUMES])
def test_checkpoint_resumes_on_one_process(launched, reference, run):
    """Saved under a layout (dp2 x tp2; a pipeline with tied embeddings split across its stages), resumed
    on one process: the next step's loss is the uninterrupted run's."""
    from tunelab.train import parallel as par

    layout, method = run.split("/")
    ckpt = launched[1] / f"{layout}-{method}"
    assert ckpt.is_dir(), f"the {run} run wrote no checkpoint"
    cell = common.cell({}, method)
    stepper = par.prepare(common.tiny_model(method), common.optimizer(method), cell, par.setup(cell.parallel))
    stepper.load(ckpt)
    step = common.batches()[CKPT_AFTER]
    loss, norm = stepper.train_step(step, common.n_items(step))
    assert loss == pytest.approx(reference[method]["loss"][CKPT_AFTER], abs=TOL)
    assert norm == pytest.approx(reference[method]["grad_norm"][CKPT_AFTER], abs=TOL)
    # Without the checkpoint the same step gives another loss: the test sees the restore.
    fresh = par.prepare(common.tiny_model(method), common.optimizer(method), cell, par.setup(cell.parallel))
    assert abs(fresh.train_step(step, common.n_items(step))[0] - loss) > 10 * TOL
