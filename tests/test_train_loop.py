"""The training loop on the tiny random model: schedules, bf16 autocast, gradient checkpointing,
periodic validation, checkpoints, exact in-process resume, per-step metrics."""

from __future__ import annotations

import shutil

import pytest
import torch

from tunelab import train
from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.files import read_json, read_jsonl
from tunelab.models import loading
from tunelab.train import peft
from tunelab.train.loop import lr_lambda
from tunelab.train.metrics import mfu, peak_flops, peak_flops_of


def cell_cfg(method: str = "none", optim: dict | None = None, model: dict | None = None, **train_kw) -> CellConfig:
    train_cfg = {"steps": 4, "batch_size": 2, "save_final": False, **train_kw}
    return CellConfig.model_validate({
        "model": {"name": "tiny-random-llama", **(model or {})},
        "data": {"recipe": "arithmetic", "max_length": 64},
        "peft": {"method": method}, "optim": {"lr": 1e-3, **(optim or {})}, "train": train_cfg,
        "eval": {"tasks": ["val_loss"], "val_batches": 2, "batch_size": 4}, "tracking": {"wandb": False},
    })


def setup(cfg: CellConfig, n_train: int | None = None):
    """What the cell does before train.run: seed, load, build data, wrap with PEFT."""
    from transformers import set_seed

    from tunelab.data.build import build

    set_seed(cfg.train.seed)
    model, tok = loading.load(cfg.model, "cpu", **peft.load_kwargs(cfg.peft, "cpu"))
    ds = build(cfg.data, tok, loading.cache_dir())
    if n_train:
        ds["train"] = ds["train"].select(range(n_train))
    return peft.apply(model, cfg.peft), tok, ds


def train_once(cfg, run_dir, n_train=None):
    model, tok, ds = setup(cfg, n_train)
    result = train.run(model, tok, ds, cfg, run_dir)
    return model, result, read_jsonl(run_dir / "train" / "metrics.jsonl")


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_follow_transformers_after_warmup(schedule):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_scheduler(schedule if schedule != "constant" else "constant_with_warmup", opt,
                        num_warmup_steps=3, num_training_steps=20).lr_lambdas[0]
    ours = lr_lambda(schedule, 3, 20)
    # Warmup differs on purpose: transformers' first step has lr 0 (a wasted step); ours reaches lr at step 3.
    assert [ours(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert [ours(s) for s in range(3, 20)] == pytest.approx([ref(s) for s in range(3, 20)], abs=1e-12)


def test_metrics_record_every_step(tmp_path):
    _, result, rows = train_once(cell_cfg(steps=3, grad_accum=2, warmup_steps=1, schedule="linear"), tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 1e-3, 0.5e-3])
    for r in rows:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0
        assert 0 < r["mfu"] < 1  # CPU: against this host's measured matmul peak
    assert result.precision == "fp32" and result.resumed_from is None
    summary = read_json(tmp_path / "train" / "summary.json")
    assert summary["steps"] == 3


def test_the_prediction_is_for_the_longest_training_row(tmp_path):
    """Arithmetic rows are shorter than max_length 256: the stored prediction is for the longest of them (a batch
    pads to its longest row), below the one for rows of 256."""
    from tunelab.train.data import lengths_of
    from tunelab.train.parallel.predict import predicted_peak_mb

    cfg = cell_cfg(steps=1)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 256})})
    model, tok, ds = setup(cfg)
    longest = max(lengths_of(ds["train"]))
    assert longest < cfg.data.max_length
    result = train.run(model, tok, ds, cfg, tmp_path)
    assert result.predicted_peak_mb == pytest.approx(predicted_peak_mb(model.config, cfg, "float32", seq=longest))
    assert result.predicted_peak_mb < predicted_peak_mb(model.config, cfg, "float32")
    assert read_json(tmp_path / "train" / "summary.json")["predicted_peak_mb"] == pytest.approx(
        result.predicted_peak_mb)


def test_mfu_table():
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("Some Future GPU") is None
    cpu = peak_flops(torch.device("cpu"))  # measured once per host, then read from the cache
    assert cpu > 1e8 and peak_flops(torch.device("cpu")) == cpu
    assert mfu(100_000_000, 1000.0, 989e12) == pytest.approx(6e11 / 989e12)
    assert mfu(100_000_000, 1000.0, None) is None
    assert mfu(100_000_000, 1000.0, 1e11) is None  # 6e11 FLOP/s against a 1e11 peak: the peak was under-measured


def test_bf16_autocast_on_cpu(tmp_path):
    cfg = cell_cfg(steps=2, precision="bf16")
    model, tok, ds = setup(cfg)
    seen = []
    proj = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
    # training's forwards (not the fp32 no-grad check of train/cpu_attention.py)
    proj.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype) if torch.is_grad_enabled() else None)
    result = train.run(model, tok, ds, cfg, tmp_path / "bf16")
    assert result.precision == "bf16"
    assert set(seen) == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32  # weights stay fp32: autocast, not a cast
    _, _, fp32_rows = train_once(cell_cfg(steps=1), tmp_path / "fp32")
    bf16_rows = read_jsonl(tmp_path / "bf16" / "train" / "metrics.jsonl")
    assert bf16_rows[0]["loss"] == pytest.approx(fp32_rows[0]["loss"], rel=2e-2)
    assert bf16_rows[0]["loss"] != fp32_rows[0]["loss"]


@pytest.mark.parametrize("method", ["none", "lora"])
def test_gradient_checkpointing_gives_the_same_losses(tmp_path, method):
    _, _, plain = train_once(cell_cfg(method, steps=3), tmp_path / "plain")
    model, _, ckpt = train_once(cell_cfg(method, steps=3, gradient_checkpointing=True), tmp_path / "gc")
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert [r["loss"] for r in ckpt] == pytest.approx([r["loss"] for r in plain], abs=1e-5)


def test_periodic_validation_and_checkpoints(tmp_path):
    cfg = cell_cfg(steps=5, eval_every=2, save_every=2, keep_checkpoints=2, log_every=5)
    _, result, rows = train_once(cfg, tmp_path)
    # log_every=5 logs step 5; steps with a validation loss are always logged.
    assert [(r["step"], "val_loss" in r) for r in rows] == [(2, True), (4, True), (5, False)]
    assert all(r["val_loss"] > 0 for r in rows[:2])
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step-4", "step-5"]  # every 2 steps and at the end; older ones pruned
    assert {p.name for p in (tmp_path / "checkpoints" / "step-5").iterdir()} == {"model.pt", "optimizer.pt",
                                                                              "state.pt", "manifest.json"}


@pytest.mark.parametrize("grouped", [False, True])
def test_resume_in_process_is_exact(tmp_path, grouped):
    # 10 rows, batch 2, 2 micro-batches a step: the epoch ends mid-step, so the data position crosses epochs.
    cfg = cell_cfg(steps=8, grad_accum=2, save_every=3, keep_checkpoints=3, warmup_steps=2, eval_every=4,
                   save_final=True, group_by_length=grouped)
    model_a, _, full = train_once(cfg, tmp_path, n_train=10)
    assert [r["step"] for r in full] == list(range(1, 9))
    for name in ("step-6", "step-8"):
        shutil.rmtree(tmp_path / "checkpoints" / name)
    model_b, result, resumed = train_once(cfg, tmp_path, n_train=10)
    assert result.resumed_from == 3
    assert [r["step"] for r in resumed] == list(range(1, 9))  # steps 4..8 replaced, not appended
    for a, b in zip(full, resumed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), a["step"]
        assert b["lr"] == pytest.approx(a["lr"], abs=1e-12)
    assert resumed[3]["val_loss"] == pytest.approx(full[3]["val_loss"], abs=1e-6)
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), n


def test_group_by_length_batches_alike_rows_in_a_random_order():
    """Every row once an epoch, less padding than plain shuffling, batches not sorted over the epoch, and
    the same batches from the same seed (the loop's data position depends on it)."""
    from tunelab.train.data import LengthGrouped, lengths_of, loader

    model_tok = loading.load(cell_cfg().model, "cpu")[1]
    from tunelab.data.build import build

    ds = build(cell_cfg().data, model_tok, loading.cache_dir())["train"]
    lengths = lengths_of(ds)
    assert lengths == [len(x) for x in ds["input_ids"]]
    sampler = LengthGrouped(lengths, 4, torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(ds))) and len(batches) == len(sampler)

    def padding(dl):
        return sum(int((b["attention_mask"] == 0).sum()) for b in dl)

    plain, grouped = (loader(ds, 4, model_tok.pad_token_id, shuffle=True, group_by_length=g) for g in (False, True))
    assert padding(grouped) < padding(plain) / 2
    widths = [max(lengths[i] for i in b) for b in batches]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)
    assert list(LengthGrouped(lengths, 4, torch.Generator().manual_seed(0))) == batches


def test_resume_can_be_turned_off(tmp_path):
    train_once(cell_cfg(steps=2, save_every=1), tmp_path)
    _, result, rows = train_once(cell_cfg(steps=2, save_every=1, resume=False), tmp_path)
    assert result.resumed_from is None and [r["step"] for r in rows] == [1, 2]


def test_flash_attention_on_cpu_is_a_user_error():
    cfg = cell_cfg(model={"attn": "flash_attention_2"})
    with pytest.raises(UserError, match=r"model\.attn.*flash_attention_2 needs a CUDA device"):
        loading.load(cfg.model, "cpu")


def test_auto_dtype_and_attention_on_cpu():
    model, _ = loading.load(cell_cfg().model, "cpu")
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("train_kw, key", [
    ({"precision": "fp16"}, "train.precision"),
    ({"eval_every": 0}, "train.eval_every"),
    ({"save_every": -1}, "train.save_every"),
    ({"keep_checkpoints": 0}, "train.keep_checkpoints"),
])
def test_bad_train_keys_are_refused(tmp_path, cli, train_kw, key):
    import yaml

    base = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}, "train": train_kw}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "base": base, "matrix": {"train.seed": [0]}}))
    code, _, err = cli("plan", path)
    assert code == 2 and key in err, err


@pytest.mark.parametrize("steps, passes", [(4, 2), (5, 3)])
def test_the_final_validation_is_the_last_steps_when_it_validated(tmp_path, monkeypatch, steps, passes):
    """Validated after the last step (every 2 steps of 4): the final validation loss is that one, not measured a
    second time; after 5 steps the last validation was at step 4, so it is measured."""
    from tunelab.train import loop

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return validation_loss(*args, **kwargs)

    validation_loss = loop.validation_loss
    monkeypatch.setattr(loop, "validation_loss", counted)
    from tunelab.train.validation import Validation

    cfg = cell_cfg(steps=steps, eval_every=2)
    model, tok, ds = setup(cfg)
    result = train.run(model, tok, ds, cfg, tmp_path, validation=Validation.of(cfg.eval))  # final: as a cell's
    rows = read_jsonl(tmp_path / "train" / "metrics.jsonl")
    assert len(calls) == passes
    validated = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(validated) == 2 and result.val_loss is not None
    assert (result.val_loss == validated[-1]) == (steps == 4)
    assert (result.final_val_s is None) == (steps == 4)  # its seconds where it was measured
