"""Training throughput, tunelab's loop vs transformers' Trainer: same model, precision, optimizer, and the same
examples in every optimizer step.

    python benchmarks/train_throughput.py [--steps N] [--warmup 2] [--batch 4] [--max-length 256] [--precision P]
                                          [--model NAME] [--device auto] [--data arithmetic|alpaca]
                                          [--order grouped|shuffled] [--repeats R] [--plain-loss-too] [--out FILE]
                                          [--only NAME,NAME] [--kept-heap] [--profile DIR]
    python benchmarks/train_throughput.py --combine A.json B.json C.json   (figures over several invocations)

Like for like: one schedule of steps, `--batch` examples each, is drawn once and every contender trains exactly
those examples in each optimizer step, in the same order of steps; the contenders differ only in how a step's
examples are laid out and computed. `--order grouped` (the default) is the order of Trainer's `group_by_length`
sampler (transformers' own `get_length_grouped_indices`: megabatches of 50 batches sorted from the longest rows down,
the least padding Trainer offers), `shuffled` a plain random order. Each contender's process records every batch it
trained on; the script checks that every contender's steps hold the same examples (by their token ids) and the same
tokens and labels, refuses to print a ratio otherwise, and writes the tokens, labelled tokens and examples of every
step of every contender into the JSON (`per_step`).

Layouts of a step's examples:
- "Trainer": Trainer on the rows padded to the longest of each step (tunelab's collate function), SDPA, also with eager
  attention ("Trainer (eager)"; under bf16 autocast on a CPU eager is the faster one on short rows) and with
  `torch_compile=True` ("Trainer (compiled)", "... (compiled eager)" under bf16);
- "Trainer padding-free (ATTN)": `DataCollatorWithFlattening`, the step's examples in one row, where an attention
  implementation keeps the flattened examples apart: checked first on a tiny model, with flash-attn's varlen kernel
  where it is installed (CUDA), then SDPA and eager (`padding_free_attention`); also compiled;
- "tunelab": tunelab's loop on the same padded rows; "tunelab packed": the step's examples packed into rows of at
  most --max-length tokens by tunelab's packer (`data.pack`'s best fit; no padding, no attention across examples: in
  one process on CPU each example is attended on its own, train/segments.py); each also with `train.compile: true`.
The headline ratio is tunelab's best against the peer's best (the fastest of every Trainer layout). The loop is
handed the schedule's batches through its own collate functions in place of its sampler (`fixed_loader`), so
tunelab's `train.group_by_length` sampler is not what is timed: its order is the schedule's.

Every contender trains COMPILE_STEPS untimed steps first (the compiled ones compile there: the first shape, then the
recompile for dynamic lengths), then --steps timed ones, after --warmup untimed forward and backward passes on a
throwaway batch (first-call costs); timed from the end of its last untimed step to the end of its last step (CUDA
synchronized). Tokens are each contender's own non-padding tokens, the same in every layout, so the ratios are ratios
of time for the same work. By default --steps covers a whole megabatch of the grouped order (50 steps at batch 4 on
about 2,000 rows; `whole_megabatches`): its steps run from its longest rows to its shortest. On CUDA all run fp32
weights with bf16 autocast (Trainer's bf16=True); on CPU all run fp32 unless --precision bf16.
AdamW is torch's fused kernel on both sides: Trainer's default optimizer (`adamw_torch_fused` since torch 2.8) and
tunelab's in one process. Each run is a fresh Python process, so no contender inherits another's allocator state.

tunelab applies the output head only at positions that carry a label (train/loss.py), so its gain depends on the share
of positions with a label, which is printed. --data arithmetic is the arithmetic recipe (short answers); --data alpaca
trains on Alpaca-shaped records generated locally by data_build.py (prompt template, instruction, optional input, a
long-tailed reply). --plain-loss-too adds tunelab's loop with the plain `model(**batch).loss` on the padded rows,
which isolates what the head-at-labels loss buys.

--only runs the named contenders alone (their names as the table prints them, comma-separated). --kept-heap starts
every contender's process with glibc told to keep the memory it frees (`KEPT_HEAP`): by default glibc hands a freed
block above its mmap threshold (128 KiB, rising to at most 32 MiB) back to the kernel, and the next step's tensor of
that size is faulted in and zeroed again, page by page. It is a setting of the C library, not of either program.
--profile DIR runs each contender under torch's profiler from its first timed step (step_profile.py) and prints
where its CPU time went, by kind of operation, per 1,000 tokens; profiled runs are slower than the figures above.
--combine reads the JSON of several invocations (--out) and prints each contender's median and range over them and
the headline ratio of each invocation: the spread a figure is quoted with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_profile.py and data_build.py, beside this script
import step_profile  # noqa: E402

# glibc's tunables (mallopt(3)): freed memory stays in the heap, large blocks come from it, the top is never trimmed
KEPT_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
             "MALLOC_TOP_PAD_": str(1 << 28)}


def default_model() -> str:
    from tunelab.models import loading

    cached = loading.cache_dir() / "models" / "smollm2-135m-instruct"
    return "smollm2-135m-instruct" if cached.is_dir() else "tiny-random-llama"


def make_cfg(args, device_type: str, pack: bool = False, batch: int | None = None, grouped: bool = False,
             steps: int | None = None):
    from tunelab.core.config import CellConfig

    return CellConfig.model_validate({
        "model": {"name": args.model, "dtype": "float32", "attn": "sdpa"},
        "data": {"recipe": str(args.recipe), "max_length": args.max_length, "pack": pack},
        "optim": {"name": "adamw", "lr": 2e-5},
        # steps: `or 1` only until prepare() has set the default from the data
        "train": {"steps": steps or args.steps or 1, "batch_size": batch or args.batch, "schedule": "constant",
                  "group_by_length": grouped, "device": device_type,
                  "precision": args.precision if args.precision != "auto" else
                  ("bf16" if device_type == "cuda" else "fp32"),
                  "save_final": False},
        "eval": {"tasks": []}, "tracking": {"wandb": False},
    })


COMPILE_STEPS = 3  # untimed first steps of every contender: a compiled one compiles, and recompiles for other lengths
FLAT_ATTENTION = ("flash_attention_2", "sdpa", "eager")  # what padding_free_attention may find, in its order


def timed(stamps: dict[int, tuple[float, float]], tokens: list[int], skip: int = COMPILE_STEPS) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process) from the end of step `skip` (stamps[0]: the
    start of the first step) to the end of the last (stamps[k]: the end of step k). CPU time is the steadier figure
    on a shared machine; wall time is what a user waits."""
    last = max(stamps)
    n = sum(tokens[skip:last])
    step_profile.STATE["tokens"] = n
    return n / (stamps[last][0] - stamps[skip][0]), n / (stamps[last][1] - stamps[skip][1])


def warm(model, device, precision: str, rows: int, length: int, passes: int) -> None:
    """Untimed forward and backward passes on a throwaway batch, so that first-call costs (kernel selection,
    the allocator's first growth) fall outside every contender's timed steps alike."""
    import torch

    ids = torch.randint(model.config.vocab_size, (rows, length), device=device)
    for _ in range(passes):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def examples_of(batch: dict) -> list[int]:
    """The examples a batch holds, whatever its layout, as sorted hashes of their token ids: padded rows (a 2D
    attention mask) or rows of examples one after the other (`position_ids` restarting at 0; a padding token there
    is a one-token example of its own, which no real example is)."""
    ids, mask = batch["input_ids"].cpu(), batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        seqs = [ids[r, :int(mask[r].sum())] for r in range(ids.shape[0]) if mask[r].any()]
    else:
        pos, seqs = batch["position_ids"].cpu(), []
        for r in range(ids.shape[0]):
            starts = [*(pos[r] == 0).nonzero().flatten().tolist(), ids.shape[1]]
            seqs += [ids[r, a:b] for a, b in zip(starts, starts[1:]) if b - a > 1]
    return sorted(hash(tuple(s.tolist())) for s in seqs)


def trained(batches: list[dict], steps: int) -> dict:
    """What a contender's steps held (the first `steps` batches it collated): tokens, labelled tokens, examples."""
    from tunelab.train.data import batch_tokens, label_tokens

    batches = batches[:steps]  # a loader may collate one batch ahead of the last step
    return {"tokens": [batch_tokens(b) for b in batches], "labels": [label_tokens(b) for b in batches],
            "examples": [examples_of(b) for b in batches]}


def fixed_loader(steps: list[list[int]], kept: list[dict]):
    """A stand-in for `tunelab.train.data.loader` that gives the loop the schedule's steps (dataset rows), collated
    by the function the real loader would choose for the same dataset and attention (padded, packed, or flattened
    for attention by example); every batch is kept in `kept`."""
    import torch
    from torch.utils.data import DataLoader

    from tunelab.train import data

    def make(ds, batch_size, pad_id, *, shuffle, seed=0, attn="sdpa", group_by_length=False):
        real = data.loader(ds, batch_size, pad_id, shuffle=False, seed=seed, attn=attn)

        def collate(rows):
            kept.append(real.collate_fn(rows))
            return kept[-1]

        return DataLoader(real.dataset, batch_sampler=steps, collate_fn=collate,
                          generator=torch.Generator().manual_seed(seed))

    return make


def run_tunelab(cfg, device, ds, tok, steps, warmup, plain_loss: bool = False, compiled: bool = False) -> dict:
    """tunelab's loop on `cfg`, its steps the rows `steps` of `ds["train"]`; `compiled`: with `train.compile: true`."""
    import torch

    from tunelab import train
    from tunelab.core.events import Step
    from tunelab.models import loading
    from tunelab.train import loop, loss
    from tunelab.train.parallel import local

    if compiled:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": True})})
    model, _ = loading.load(cfg.model, device)
    warm(model, device, cfg.train.precision, cfg.train.batch_size, cfg.data.max_length, warmup)
    stamps: dict[int, tuple[float, float]] = {}
    kept: list[dict] = []
    step_fn = loop._step

    def first_stamped(lp, step, peak, *rest):
        if step == 1:
            stamps[0] = _now()
        if step == COMPILE_STEPS + 1:  # the first timed step: untimed steps stay out of a profile
            step_profile.start()
        return step_fn(lp, step, peak, *rest)

    def emit(ev):
        if isinstance(ev, Step):
            _sync(device)
            stamps[ev.step] = _now()

    def plain(m, batch, n_items):
        return loss.plain_loss(m, batch, torch.as_tensor(n_items, device=batch["labels"].device))

    with (tempfile.TemporaryDirectory() as tmp, mock.patch.object(loop, "_step", first_stamped),
          mock.patch.object(loop, "loader", fixed_loader(steps, kept)),
          mock.patch.object(local, "causal_lm_loss", plain if plain_loss else loss.causal_lm_loss)):
        train.run(model, tok, ds, cfg, Path(tmp), emit)
    print(f"tunelab: its first {COMPILE_STEPS} steps{' (compiling)' if compiled else ''} took "
          f"{stamps[COMPILE_STEPS][0] - stamps[0][0]:.1f} s, untimed", file=sys.stderr, flush=True)
    held = trained(kept, len(steps))
    return {"timed": timed(stamps, held["tokens"]), **held}


def alpaca_recipe(folder: Path, records: int) -> Path:
    """A recipe over Alpaca-shaped records generated by data_build.py (seeded: the same rows every run)."""
    from data_build import alpaca_like

    (folder / "alpaca_like.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca_like(records)))
    recipe = folder / "alpaca_like.yaml"
    recipe.write_text(json.dumps({"template": "alpaca", "sources": [{"path": "alpaca_like.jsonl"}],
                                  "val_size": 0.02}))
    return recipe


def label_share(batches: list[dict]) -> tuple[float, float]:
    """(labelled positions / all positions, labelled positions / non-padding tokens) of the padded batches."""
    from tunelab.train.data import batch_tokens, label_tokens

    labelled = sum(label_tokens(b) for b in batches)
    return labelled / sum(b["labels"].numel() for b in batches), labelled / sum(batch_tokens(b) for b in batches)


def padding_free_attention(device, use_cache: bool | None = None) -> tuple[str | None, dict[str, float]]:
    """The attention implementation under which a `DataCollatorWithFlattening` row (examples one after the
    other, positions restarting) gives each example's own logits, on a tiny random Llama called as Trainer
    calls it; None when none does. Also the largest logit difference measured for each implementation tried.

    Trainer sets `model.config.use_cache` to `TrainingArguments.use_cache` (False unless asked), and that
    matters: with a cache, transformers builds a plain causal mask and the flattened examples attend to each
    other; without one it finds the examples where `position_ids` restart. `use_cache` None: Trainer's default."""
    import importlib.util

    import torch
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    use_cache = trainer_use_cache() if use_cache is None else use_cache

    tried = (["flash_attention_2"] if device.type == "cuda" and importlib.util.find_spec("flash_attn") else [])
    gaps: dict[str, float] = {}
    rows = [list(range(5, 17)), list(range(30, 37))]
    flat = DataCollatorWithFlattening()([{"input_ids": r, "labels": r} for r in rows])
    for attn in [*tried, *FLAT_ATTENTION[1:]]:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, attn_implementation=attn)
        model = LlamaForCausalLM(config).to(device).train()  # no dropout in Llama's config: training mode is exact
        model.config.use_cache = use_cache  # what Trainer does to the model it is given
        if attn == "flash_attention_2":  # flash-attn runs in half precision only
            model = model.to(torch.bfloat16)
        with torch.no_grad():
            together = model(**{k: v.to(device) for k, v in flat.items()})  # the collated batch, as Trainer passes it
            apart = torch.cat([model(torch.tensor([r], device=device)).logits[0] for r in rows])
        gaps[attn] = float((together.logits[0] - apart).abs().max())
        if gaps[attn] < (1e-2 if attn == "flash_attention_2" else 1e-4):  # bf16 for flash-attn
            return attn, gaps
    return None, gaps


def trainer_use_cache() -> bool:
    """The `use_cache` Trainer puts on the model's config by default (`TrainingArguments.use_cache`)."""
    import dataclasses

    from transformers import TrainingArguments

    return next(f.default for f in dataclasses.fields(TrainingArguments) if f.name == "use_cache")


def run_trainer(cfg, device, ds, order, pad_id, warmup, flattened: bool = False, attn: str = "sdpa",
                compiled: bool = False) -> dict:
    """Trainer as a user would run it at its best, on the rows of `ds` in the schedule's `order` (`--batch` at a
    time: one step each). flattened: `DataCollatorWithFlattening` (one padding-free row per step, with an `attn`
    that keeps the examples apart, see `padding_free_attention`), else padded rows. compiled: `torch_compile=True`
    (the whole model under torch.compile, inductor)."""
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from tunelab.models import loading
    from tunelab.train.data import collate

    model, _ = loading.load(cfg.model.model_copy(update={"attn": attn}), device)
    warm(model, device, cfg.train.precision, cfg.train.batch_size, cfg.data.max_length, warmup)
    stamps: dict[int, tuple[float, float]] = {}
    kept: list[dict] = []  # every batch Trainer's loader collated, in order
    rows = ds.with_format(None)
    base = DataCollatorWithFlattening() if flattened else collate(pad_id)

    def keeping(features):
        kept.append(base([{k: f[k] for k in ("input_ids", "labels")} for f in features]))
        return kept[-1]

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                stamps[0] = _now()
            if state.global_step == COMPILE_STEPS:  # the first timed step: untimed steps stay out of a profile
                step_profile.start()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            stamps[state.global_step] = _now()

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (rows[i] for i in order)

    steps = len(order) // cfg.train.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=cfg.train.batch_size,
            learning_rate=cfg.optim.lr, lr_scheduler_type="constant",  # Trainer's default optim: its best
            max_grad_norm=cfg.train.max_grad_norm, logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=device.type == "cpu", bf16=cfg.train.precision == "bf16", dataloader_num_workers=0,
            disable_tqdm=True, remove_unused_columns=False, seed=cfg.train.seed, torch_compile=compiled,
        )
        Trainer(model=model, args=args, train_dataset=Rows(), data_collator=keeping, callbacks=[Stamp()]).train()
    print(f"Trainer: its first {COMPILE_STEPS} steps{' (compiling)' if compiled else ''} took "
          f"{stamps[COMPILE_STEPS][0] - stamps[0][0]:.1f} s, untimed", file=sys.stderr, flush=True)
    held = trained(kept, steps)
    return {"timed": timed(stamps, held["tokens"]), **held}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="timed optimizer steps (after COMPILE_STEPS untimed ones); default: whole megabatches of the "
                        "grouped order, at least 20 steps (50 at batch 4 on 2,000 rows)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed forward and backward passes on a throwaway batch before the timed steps")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--model", default=None, help="default: smollm2-135m-instruct when cached, else tiny")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--data", default="arithmetic", choices=["arithmetic", "alpaca"],
                   help="the arithmetic recipe, or Alpaca-shaped records generated locally")
    p.add_argument("--records", type=int, default=2000, help="--data alpaca: records to generate")
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternated; medians reported")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    p.add_argument("--order", default="grouped", choices=["grouped", "shuffled"],
                   help="the examples' order, shared by every contender: Trainer's group_by_length order, or random")
    p.add_argument("--combine", type=Path, nargs="+", default=None,
                   help="print the figures of these --out files of several invocations, with their spread")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="both sides: bf16 = fp32 weights with bf16 autocast (Trainer's bf16=True); "
                        "auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--plain-loss-too", action="store_true",
                   help="also time tunelab's loop with the plain model(**batch).loss")
    p.add_argument("--only", default=None, help="run only these contenders (comma-separated, as the table names them)")
    p.add_argument("--kept-heap", action="store_true",
                   help="every contender's process starts with glibc keeping the memory it frees (KEPT_HEAP)")
    p.add_argument("--profile", type=Path, default=None,
                   help="profile each contender's timed steps into this folder (step_profile.py); slows them")
    args = p.parse_args()
    if args.combine:
        return combine(args.combine)
    if args.only:  # checked before the data and models are set up, which takes tens of seconds
        args.only = [n.strip() for n in args.only.split(",") if n.strip()]
        names = contender_names(args)
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"--only: no contender named {', '.join(map(repr, unknown))}; the contenders here are "
                  f"{', '.join(map(repr, names))}", file=sys.stderr)
            return 2
    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory() as work:
        # Generated data is built into a throwaway cache, so it never lands in tunelab's own.
        args.recipe = alpaca_recipe(Path(work), args.records) if args.data == "alpaca" else "arithmetic"
        return measure(args, Path(work) if args.data == "alpaca" else None)


def whole_megabatches(rows: int, batch: int, at_least: int = 20) -> int:
    """Steps that cover whole megabatches of Trainer's group_by_length sampler (transformers'
    get_length_grouped_indices: min(rows // (4 x batch), 50) batches each, sorted from the longest rows down)."""
    mega = max(1, min(rows // (batch * 4), 50))
    return mega * -(-at_least // mega)


def schedule(lengths: list[int], batch: int, steps: int, order: str, seed: int) -> list[list[int]]:
    """The examples (row indices) of every step, `batch` each: the rows in Trainer's group_by_length order
    (transformers' get_length_grouped_indices, seeded) or a random one, cut into steps."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    g = torch.Generator().manual_seed(seed)
    rows = (get_length_grouped_indices(lengths, batch, generator=g) if order == "grouped"
            else torch.randperm(len(lengths), generator=g).tolist())
    cut = [rows[i:i + batch] for i in range(0, len(rows) - batch + 1, batch)]
    if len(cut) < steps:
        raise SystemExit(f"{steps} steps of {batch} need {steps * batch} examples; the data has {len(rows)}")
    return cut[:steps]


def packed_steps(train, steps: list[list[int]], length: int):
    """Each step's examples packed into rows of at most `length` tokens by tunelab's packer (data/pack.py: best fit,
    positions restarting per example, each example's first label ignored), as a dataset of packed rows, and the rows
    of each step."""
    import datasets
    import numpy as np

    from tunelab.data.pack import pack
    from tunelab.data.tokenize import Tokenized

    plain = train.with_format(None)
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    out = []
    for step in steps:
        ex = [plain[i] for i in step]
        lens = np.array([len(e["input_ids"]) for e in ex])
        tk = Tokenized(np.concatenate([e["input_ids"] for e in ex]), np.concatenate([e["labels"] for e in ex]),
                       np.concatenate([[0], np.cumsum(lens)]), np.zeros(len(ex), dtype=np.int64), lens,
                       np.zeros(len(ex), dtype=bool))
        packed = pack(tk, length)
        out.append(list(range(len(rows["input_ids"]), len(rows["input_ids"]) + len(packed))))
        for a, b in zip(packed.offsets[:-1], packed.offsets[1:]):
            rows["input_ids"].append(packed.ids[a:b].tolist())
            rows["labels"].append(packed.labels[a:b].tolist())
            rows["position_ids"].append(packed.position_ids[a:b].tolist())
    return datasets.Dataset.from_dict(rows), out


def prepare(args, data_cache: Path, device) -> SimpleNamespace:
    """The data, the shared schedule of steps, and each layout's rows for it."""
    from tunelab.data.build import build
    from tunelab.models import loading
    from tunelab.train.data import collate, lengths_of

    cfg = make_cfg(args, device.type)
    _, tok = loading.load(cfg.model, "cpu")
    ds = build(cfg.data, tok, data_cache)
    if args.steps is None:
        args.steps = whole_megabatches(len(ds["train"]), args.batch)
    total = COMPILE_STEPS + args.steps  # every contender trains the untimed steps too
    cfg = make_cfg(args, device.type, steps=total)
    steps = schedule(lengths_of(ds["train"]), args.batch, total, args.order, cfg.train.seed)
    rows = ds["train"].with_format(None)
    padded = [collate(tok.pad_token_id)([rows[i] for i in step]) for step in steps]
    d = SimpleNamespace(cfg=cfg, tok=tok, ds=ds, steps=steps, order=[i for step in steps for i in step])
    d.want = trained(padded, total)  # what every contender's steps must hold
    timed_batches = padded[COMPILE_STEPS:]
    d.padding_share = 1 - sum(d.want["tokens"][COMPILE_STEPS:]) / sum(b["attention_mask"].numel()
                                                                      for b in timed_batches)
    d.labelled = label_share(timed_batches)
    packed_train, d.packed_rows = packed_steps(ds["train"], steps, args.max_length)
    d.packed_ds = {**ds, "train": packed_train}
    d.packed_cfg = make_cfg(args, device.type, pack=True, steps=total)
    return d


PEERS = ("Trainer", "Trainer (eager)", "Trainer (compiled)", "Trainer (compiled eager)")


def contender_names(args) -> list[str]:
    """Every name `contenders` can give on any machine: the padding-free peer's depends on its check."""
    ours = ["tunelab", "tunelab packed"]
    ours += [f"{n} (compiled)" for n in ours]
    return [*PEERS, *(f"Trainer padding-free{c} ({a})" for a in FLAT_ATTENTION for c in ("", " compiled")), *ours,
            *(["tunelab-plain-loss"] if args.plain_loss_too else [])]


def contenders(args, d: SimpleNamespace, device, flat_attn: str | None) -> tuple[dict, list[str], list[str]]:
    """{name: (function, arguments)} of every contender, the peer's names and tunelab's; all train `d.steps`."""
    pad, rows, w = d.tok.pad_token_id, d.ds["train"], args.warmup
    table: dict[str, tuple] = {  # PEERS, in order
        "Trainer": (run_trainer, (d.cfg, device, rows, d.order, pad, w)),
        # Eager attention is the faster implementation of the two under bf16 autocast on a CPU at short rows
        # (torch's bf16 SDPA kernel is slow there: benchmarks/sdpa_cpu.py), so the sweep includes it.
        "Trainer (eager)": (run_trainer, (d.cfg, device, rows, d.order, pad, w, False, "eager")),
        # torch_compile=True: inductor fuses the elementwise work (norms, activations, the loss over the vocabulary).
        "Trainer (compiled)": (run_trainer, (d.cfg, device, rows, d.order, pad, w, False, "sdpa", True)),
    }
    if d.cfg.train.precision == "bf16":  # where eager attention can be the faster one, compiled too
        table["Trainer (compiled eager)"] = (run_trainer, (d.cfg, device, rows, d.order, pad, w, False, "eager", True))
    if flat_attn:
        table[f"Trainer padding-free ({flat_attn})"] = (run_trainer, (d.cfg, device, rows, d.order, pad, w, True,
                                                                      flat_attn))
        table[f"Trainer padding-free compiled ({flat_attn})"] = (run_trainer, (d.cfg, device, rows, d.order, pad, w,
                                                                               True, flat_attn, True))
    peers = list(table)
    for compiled in (False, True):  # train.compile: the decoder body under torch.compile
        c = " (compiled)" if compiled else ""
        table[f"tunelab{c}"] = (run_tunelab, (d.cfg, device, d.ds, d.tok, d.steps, w, False, compiled))
        table[f"tunelab packed{c}"] = (run_tunelab, (d.packed_cfg, device, d.packed_ds, d.tok, d.packed_rows, w,
                                                     False, compiled))
    ours = list(table)[len(peers):]
    if args.plain_loss_too:
        table["tunelab-plain-loss"] = (run_tunelab, (d.cfg, device, d.ds, d.tok, d.steps, w, True))
    return table, peers, ours


def in_fresh_process(fn, *fn_args):
    """fn(*fn_args) in a new Python process: each contender starts from the same state (the allocator's free
    lists and thresholds, the model's memory, tunelab's or transformers' global settings), whatever ran
    before it, as a user's run does."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *fn_args).result()


def measure(args, data_cache: Path | None) -> int:
    import torch

    from tunelab.models import loading

    args.model = args.model or default_model()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          args.device if args.device != "auto" else "cpu")
    d = prepare(args, data_cache or loading.cache_dir(), device)
    flat_attn, flat_gaps = padding_free_attention(device)
    print(f"Trainer padding-free (DataCollatorWithFlattening): largest logit difference from the examples run "
          f"apart, {', '.join(f'{k} {v:.1e}' for k, v in flat_gaps.items())}: "
          f"{f'a contender with {flat_attn}' if flat_attn else 'examples attend to each other, not a contender'}",
          file=sys.stderr, flush=True)
    table, peers, ours = contenders(args, d, device, flat_attn)
    if args.only:  # a padding-free name the check did not make a contender is simply not run
        table = {n: table[n] for n in args.only if n in table}
        peers, ours = [n for n in peers if n in table], [n for n in ours if n in table]
    if args.kept_heap:  # read by glibc when each contender's fresh process starts
        os.environ.update(KEPT_HEAP)
    runs: dict[str, list[dict]] = {name: [] for name in table}
    loads = [round(os.getloadavg()[0], 2)]
    for i in range(args.repeats):  # alternated, so a change in machine load hits all alike
        for name, (fn, fn_args) in table.items():
            got = (in_fresh_process(step_profile.run, args.profile, name, fn, *fn_args) if args.profile
                   else in_fresh_process(fn, *fn_args))
            runs[name].append(got)
            loads.append(round(os.getloadavg()[0], 2))
            # Each run as it ends: a long benchmark stopped early still leaves its figures.
            print(f"run {i + 1} {name}: {got['timed'][0]:.1f} tokens/s, {got['timed'][1]:.1f} tokens/CPU-s, "
                  f"load average {loads[-1]:.2f}", file=sys.stderr, flush=True)
    unlike = [f"{name} (run {i + 1})" for name, rs in runs.items() for i, r in enumerate(rs)
              if {k: r[k] for k in d.want} != d.want]
    if unlike:  # a ratio of different work is no figure
        print(f"not like for like: {', '.join(unlike)} trained other examples, tokens or labels in some step than "
              f"the schedule's", file=sys.stderr)
        return 1
    result = summarize(args, d, device, runs, peers, ours, loads)
    if args.profile:
        print(f"where the CPU time went (the last run of each, profiled: {args.profile}):\n"
              f"{step_profile.compare(args.profile, list(table))}", flush=True)
    result["peer_padding_free"] = {"attention": flat_attn, "largest_logit_difference": flat_gaps}
    print(json.dumps({k: v for k, v in result.items() if k != "per_step"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


PAIRS = (("ratio_padded", "tunelab", "Trainer"),  # the same layout on both sides
         ("ratio_padded_compiled", "tunelab (compiled)", "Trainer (compiled)"),
         ("ratio_one_row", "tunelab packed", "Trainer padding-free (sdpa)"),
         ("ratio_one_row_compiled", "tunelab packed (compiled)", "Trainer padding-free compiled (sdpa)"),
         ("ratio_plain_loss", "tunelab-plain-loss", "Trainer"))


def summarize(args, d: SimpleNamespace, device, runs: dict, peers: list[str], ours: list[str],
              loads: list[float]) -> dict:
    """Medians, the ratios, what every step held, and a printed table."""
    import torch
    from transformers import TrainingArguments

    wall = {k: statistics.median(r["timed"][0] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["timed"][1] for r in v) for k, v in runs.items()}
    timed_tokens = d.want["tokens"][COMPILE_STEPS:]
    result = {
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "precision": d.cfg.train.precision, "data": args.data, "order": args.order, "batch": args.batch,
        "max_length": args.max_length, "steps_untimed": COMPILE_STEPS, "steps_timed": args.steps,
        "repeats": args.repeats, "tokens_per_timed_step": round(statistics.mean(timed_tokens), 1),
        "examples_per_step": args.batch, "padding_share": round(d.padding_share, 3),
        "label_share_of_positions": round(d.labelled[0], 3), "label_share_of_tokens": round(d.labelled[1], 3),
        "same_examples_every_step": True,  # checked by measure(): every contender's steps equal the schedule's
        "trainer_optim": getattr(TrainingArguments(output_dir="unused").optim, "value", None),
        "tokens_per_s": {k: round(v, 1) for k, v in wall.items()},
        "tokens_per_cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "runs_tokens_per_s": {k: [round(r["timed"][0], 1) for r in v] for k, v in runs.items()},
        "kept_heap": args.kept_heap,
        "load_average": {"at each run's end": loads, "now": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        # every step of every contender (untimed first): its tokens, labelled tokens and examples, as it trained them
        "per_step": {k: {"tokens": v[-1]["tokens"], "labels": v[-1]["labels"],
                         "examples": [len(e) for e in v[-1]["examples"]]} for k, v in runs.items()},
    }
    if peers and ours:  # the headline: each side at its best (--only may leave a side out)
        best_peer, best_ours = max(peers, key=lambda k: wall[k]), max(ours, key=lambda k: wall[k])
        result.update(peer_best=best_peer, tunelab_best=best_ours, ratio=round(wall[best_ours] / wall[best_peer], 3),
                      ratio_cpu_time=round(cpu[best_ours] / cpu[best_peer], 3),
                      ratio_each_repeat=[round(a["timed"][0] / b["timed"][0], 3)
                                         for a, b in zip(runs[best_ours], runs[best_peer])])
    for key, a, b in PAIRS:
        if a in wall and b in wall:
            result[key] = round(wall[a] / wall[b], 3)
    print(f"{'':40} {'tokens/s':>10} {'tokens/CPU-s':>13}")
    for k in runs:
        print(f"{k:40} {wall[k]:10.1f} {cpu[k]:13.1f}")
    pairs = "".join(f"; {a} / {b} {result[key]:.3f}" for key, a, b in PAIRS if key in result)
    head = (f"ratio tunelab's best ({result['tunelab_best']}) / the peer's best ({result['peer_best']}): "
            f"{result['ratio']:.3f} wall, {result['ratio_cpu_time']:.3f} CPU time" if "ratio" in result else
            "no ratio: --only left one side out")
    heap = ", glibc keeping freed memory" if args.kept_heap else ""
    print(f"{head}{pairs}  ({result['model']}, {result['device']}, {result['precision']}, {args.data}, the same "
          f"{args.batch} examples a step for all ({result['tokens_per_timed_step']} tokens a timed step, {args.order} "
          f"order), padding {d.padding_share:.0%} of padded positions, labels on {d.labelled[0]:.0%} of them, "
          f"median of {args.repeats}{heap}, load average {loads[0]} at the start, {loads[-1]} at the end)")
    return result


def combine(files: list[Path]) -> int:
    """Each contender's tokens/s over several invocations (their --out files): median, range, and each invocation's
    headline ratio; they must have measured the same thing."""
    got = [json.loads(f.read_text()) for f in files]
    same = ("model", "precision", "data", "order", "batch", "max_length", "steps_timed", "tokens_per_timed_step")
    if any({k: g.get(k) for k in same} != {k: got[0].get(k) for k in same} for g in got):
        print(f"--combine: the files did not measure the same thing ({', '.join(same)})", file=sys.stderr)
        return 2
    names = [n for n in got[0]["tokens_per_s"] if all(n in g["tokens_per_s"] for g in got)]
    print(f"{len(got)} invocations; tokens/s: median (range over the invocations' medians)")
    for n in names:
        v = [g["tokens_per_s"][n] for g in got]
        print(f"{n:40} {statistics.median(v):8.1f} ({min(v):.1f}-{max(v):.1f})")
    for key in ("ratio", *(k for k, _, _ in PAIRS)):
        v = [g[key] for g in got if key in g]
        if v:
            print(f"{key}: median {statistics.median(v):.3f}, range {min(v):.3f}-{max(v):.3f} over {len(v)}: "
                  f"{', '.join(f'{x:.3f}' for x in v)}")
    print("the headline's contenders: " + "; ".join(f"{g['tunelab_best']} / {g['peer_best']}" for g in got if
                                                     "ratio" in g))
    ends = [g["load_average"]["at each run's end"] for g in got]
    print("load average at each invocation's start and end: " + "; ".join(f"{e[0]}-{e[-1]}" for e in ends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
