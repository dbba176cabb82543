"""Parity with transformers' Trainer: same model, batches, seed and hyperparameters, full-parameter AdamW,
fp32 -> the same per-step losses over 20 steps (within 1e-4).

Both see the same batches: tunelab's own batch stream is recorded and fed to Trainer, in order, as an
iterable dataset of ready batches. Both normalize the loss by the label tokens of the whole accumulated
step, clip at the same norm and follow the same schedule (no warmup: transformers' warmup starts at lr 0,
tunelab's at lr/warmup, see docs/training.md).
"""

from __future__ import annotations

import pytest
import torch
from test_train_loop import cell_cfg, setup

from tunelab import train
from tunelab.core.files import read_jsonl
from tunelab.train.data import loader
from tunelab.train.loop import BatchStream

STEPS, ACCUM, BATCH, LR, CLIP = 20, 2, 4, 3e-3, 0.5


class Batches(torch.utils.data.IterableDataset):
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_same_losses_as_transformers_trainer(tmp_path, schedule):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg = cell_cfg(steps=STEPS, batch_size=BATCH, grad_accum=ACCUM, schedule=schedule, warmup_steps=0,
                   max_grad_norm=CLIP, optim={"lr": LR, "weight_decay": 0.0})
    model, tok, ds = setup(cfg)
    train.run(model, tok, ds, cfg, tmp_path / "tunelab")
    ours = read_jsonl(tmp_path / "tunelab" / "train" / "metrics.jsonl")

    ref_model, tok, ds = setup(cfg)  # the same starting weights, loaded again
    stream = BatchStream(loader(ds["train"], BATCH, tok.pad_token_id, shuffle=True, seed=cfg.train.seed))
    batches = [next(stream) for _ in range(STEPS * ACCUM)]

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                seen.append(dict(logs))

    seen: list[dict] = []
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=STEPS, per_device_train_batch_size=1,
        gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type=schedule, warmup_steps=0,
        weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    Trainer(model=ref_model, args=args, train_dataset=Batches(batches), data_collator=lambda rows: rows[0],
            callbacks=[Record()]).train()

    theirs = [r["loss"] for r in seen]
    assert len(theirs) == len(ours) == STEPS
    assert [r["loss"] for r in ours] == pytest.approx(theirs, abs=1e-4)
    # The comparison means something only if clipping and the schedule were at work.
    assert any(r["grad_norm"] > CLIP for r in ours)
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in seen], rel=1e-3)
    assert [r["lr"] for r in ours] == pytest.approx([r["learning_rate"] for r in seen], rel=1e-6)
    assert ours[0]["loss"] - ours[-1]["loss"] > 0.1  # it learned, so later steps depend on the updates


def _throughput_benchmark():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("train_throughput", REPO / "benchmarks" / "train_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_checks_padding_free_as_trainer_runs_it():
    """benchmarks/train_throughput.py's check calls the model as Trainer does (`use_cache` off): then SDPA keeps
    flattened examples apart; with the cache on (the check's former mistake) they attend to each other."""
    bench = _throughput_benchmark()
    assert bench.trainer_use_cache() is False
    attn, gaps = bench.padding_free_attention(torch.device("cpu"))
    assert attn == "sdpa" and gaps["sdpa"] < 1e-4
    attn, gaps = bench.padding_free_attention(torch.device("cpu"), use_cache=True)
    assert attn is None and min(gaps.values()) > 1e-2


def test_trainer_padding_free_trains_on_the_examples_apart(tmp_path):
    """Trainer on one DataCollatorWithFlattening row logs the loss of the same rows padded (SDPA, CPU)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from tunelab.train.data import collate

    cfg = cell_cfg(steps=1, batch_size=4)
    losses = {}
    for name in ("padded", "flattened"):
        model, tok, ds = setup(cfg)
        rows = [{k: r[k] for k in ("input_ids", "labels")} for r in ds["train"].with_format(None).select(range(4))]
        batch = DataCollatorWithFlattening()(rows) if name == "flattened" else collate(tok.pad_token_id)(rows)
        class Record(TrainerCallback):
            seen: list[float] = []

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    self.seen.append(logs["loss"])

        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=1,
                                 logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                                 disable_tqdm=True)
        record = Record()
        Trainer(model=model, args=args, train_dataset=Batches([batch]), data_collator=lambda b: b[0],
                callbacks=[record]).train()
        losses[name] = record.seen[0]
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert losses["flattened"] == pytest.approx(losses["padded"], abs=1e-5)
