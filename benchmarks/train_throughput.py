"""Training throughput, tunelab's loop vs transformers' Trainer: same model, batches, precision, optimizer.

    python benchmarks/train_throughput.py [--steps N] [--warmup 2] [--batch 4] [--max-length 256] [--precision P]
                                          [--model NAME] [--device auto] [--data arithmetic|alpaca]
                                          [--repeats R] [--pack] [--plain-loss-too] [--out FILE]
                                          [--only NAME,NAME] [--kept-heap] [--profile DIR]

The peer runs at its best on the hardware: with `train_sampling_strategy="group_by_length"` (batches of
similar lengths, the least padding it offers) everywhere, with SDPA and with eager attention (on a CPU under
bf16 autocast eager is the faster one on short rows), and also padding-free (`DataCollatorWithFlattening`)
where an attention implementation keeps the flattened examples apart: checked first on a tiny model, with
flash-attn's varlen kernel where it is installed (CUDA), then SDPA and eager (`padding_free_attention`), and
grouped with `torch_compile=True` (SDPA, and eager too under bf16; its compiling steps untimed: COMPILE_STEPS); the
headline ratio is tunelab against the fastest of them.
tunelab runs the same two ways: on its padded batches ("tunelab", or packed rows with --pack) and with
`train.group_by_length: true` ("tunelab group_by_length", the same megabatch grouping as Trainer's); the
headline ratio is tunelab's best against the peer's best.
"Trainer" alone trains on tunelab's own batches (the rows in tunelab's shuffled order, padded to the longest row of
each batch by the same collate function), for a like-for-like step. All log every step. Each first runs --warmup
untimed forward and backward passes of its model on a throwaway batch (the libraries' first-call costs), then is
timed from the start of its first step to the end of its last; tokens are each contender's own non-padding tokens,
so the ratios are useful tokens per second. By default the steps are whole megabatches of Trainer's group_by_length
sampler (50 steps at batch 4 on 2,000 rows; `whole_megabatches`): Trainer runs each megabatch's batches from its
longest rows to its shortest, so a window of its first few steps holds its longest rows (about 1.6x the mean row on
the Alpaca-shaped data), where the per-step costs (the optimizer step, the weight casts) spread over the most
tokens; only whole megabatches give the throughput a run over the data gets. tunelab's grouped batches come in a
random order. On CUDA all run fp32 weights with bf16 autocast (Trainer's bf16=True); on CPU all run fp32 unless
--precision bf16 (a CPU with AMX or avx512_bf16 multiplies bf16 several times faster than fp32).
AdamW is torch's fused kernel on both sides: Trainer's default
optimizer (`adamw_torch_fused` since torch 2.8) and tunelab's in one process. Each run is a fresh Python
process, so no contender inherits another's allocator state.

tunelab applies the output head only at positions that carry a label (train/loss.py), so its gain depends
on the share of positions with a label, which is printed. --data arithmetic is the arithmetic recipe
(short answers); --data alpaca trains on Alpaca-shaped records generated locally by data_build.py (prompt
template, instruction, optional input, a long-tailed reply). --plain-loss-too adds a third contender:
tunelab's loop with the plain `model(**batch).loss`, which isolates what the head-at-labels loss buys.

With --pack, tunelab trains on the same recipe packed into rows of --max-length tokens ("tunelab packed",
data.pack: true: no padding, no attention across examples; in one process on CPU each example is attended on
its own, train/segments.py), with as many rows per step as keep the tokens per step about equal to the
padded batches'; Trainer trains on the padded batches, grouped by length, and padding-free. Tokens are each
side's own non-padding tokens, so the ratio is useful tokens per second.

--only runs the named contenders alone (their names as the table prints them, comma-separated). --kept-heap starts
every contender's process with glibc told to keep the memory it frees (`KEPT_HEAP`): by default glibc hands a freed
block above its mmap threshold (128 KiB, rising to at most 32 MiB) back to the kernel, and the next step's tensor of
that size is faulted in and zeroed again, page by page; a process whose step allocates large tensors (a
whole-vocabulary logits tensor and its gradient: 88 MB each at 450 tokens and SmolLM2's 49k words, in fp32) pays
that every step. It is a setting of the C library, not of either program, which any user can set.
--profile DIR runs each contender under torch's profiler from its first timed step (step_profile.py) and prints
where its CPU time went, by kind of operation, per 1,000 tokens; profiled runs are slower than the figures above.
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


def make_cfg(args, device_type: str, pack: bool = False, batch: int | None = None, grouped: bool = False):
    from tunelab.core.config import CellConfig

    return CellConfig.model_validate({
        "model": {"name": args.model, "dtype": "float32", "attn": "sdpa"},
        "data": {"recipe": str(args.recipe), "max_length": args.max_length, "pack": pack},
        "optim": {"name": "adamw", "lr": 2e-5},
        # steps: `or 1` only until prepare() has set the default from the data
        "train": {"steps": args.steps or 1, "batch_size": batch or args.batch, "schedule": "constant",
                  "group_by_length": grouped, "device": device_type,
                  "precision": args.precision if args.precision != "auto" else
                  ("bf16" if device_type == "cuda" else "fp32"),
                  "save_final": False},
        "eval": {"tasks": []}, "tracking": {"wandb": False},
    })


def timed(stamps: dict[int, tuple[float, float]], tokens: list[int], skip: int = 0) -> tuple[float, float]:
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


def run_tunelab(cfg, device, ds, tok, tokens, warmup, plain_loss: bool = False,
                compiled: bool = False) -> tuple[float, float]:
    """tunelab's loop on `cfg`; `compiled`: with `train.compile: true`, its first COMPILE_STEPS steps (compiling)
    untimed, as the compiled Trainer's."""
    import torch

    from tunelab import train
    from tunelab.core.events import Step
    from tunelab.models import loading
    from tunelab.train import loop, loss
    from tunelab.train.parallel import local

    skip = COMPILE_STEPS if compiled else 0
    if compiled:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": True,
                                                                          "steps": cfg.train.steps + skip})})
    model, _ = loading.load(cfg.model, device)
    warm(model, device, cfg.train.precision, cfg.train.batch_size, cfg.data.max_length, warmup)
    stamps: dict[int, tuple[float, float]] = {}
    step_fn = loop._step

    def first_stamped(lp, step, peak):
        if step == 1:
            stamps[0] = _now()
        if step == skip + 1:  # the first timed step: compiling steps stay out of a profile
            step_profile.start()
        return step_fn(lp, step, peak)

    def emit(ev):
        if isinstance(ev, Step):
            _sync(device)
            stamps[ev.step] = _now()

    def plain(m, batch, n_items):
        return loss.plain_loss(m, batch, torch.as_tensor(n_items, device=batch["labels"].device))

    with (tempfile.TemporaryDirectory() as tmp, mock.patch.object(loop, "_step", first_stamped),
          mock.patch.object(local, "causal_lm_loss", plain if plain_loss else loss.causal_lm_loss)):
        train.run(model, tok, ds, cfg, Path(tmp), emit)
    if skip:
        print(f"tunelab compiled: its first {skip} steps (compiling) took {stamps[skip][0] - stamps[0][0]:.1f} s, "
              f"untimed", file=sys.stderr, flush=True)
    return timed(stamps, tokens, skip)


def alpaca_recipe(folder: Path, records: int) -> Path:
    """A recipe over Alpaca-shaped records generated by data_build.py (seeded: the same rows every run)."""
    from data_build import alpaca_like

    (folder / "alpaca_like.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca_like(records)))
    recipe = folder / "alpaca_like.yaml"
    recipe.write_text(json.dumps({"template": "alpaca", "sources": [{"path": "alpaca_like.jsonl"}],
                                  "val_size": 0.02}))
    return recipe


def label_share(batches: list[dict]) -> tuple[float, float]:
    """(labelled positions / all positions, labelled positions / non-padding tokens) of the timed batches."""
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


COMPILE_STEPS = 3  # untimed first steps of a compiled Trainer: compiling, and recompiling for other lengths


def run_trainer(cfg, device, ds, order, pad_id, warmup, mode: str = "ordered",
                attn: str = "sdpa", compiled: bool = False) -> tuple[float, float]:
    """Trainer as a user would run it at its best. mode: `ordered` (tunelab's batches, for a like-for-like
    step), `grouped` (group_by_length: batches of similar lengths, little padding), `flattened`
    (DataCollatorWithFlattening: one padding-free row per batch, with an `attn` that keeps the examples
    apart, see `padding_free_attention`). compiled: `torch_compile=True` (the whole model under torch.compile,
    inductor); its first COMPILE_STEPS steps compile (the first shape, then the recompile with dynamic lengths)
    and run untimed, before the timed steps."""
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from tunelab.models import loading
    from tunelab.train.data import collate

    model, _ = loading.load(cfg.model.model_copy(update={"attn": attn}), device)
    warm(model, device, cfg.train.precision, cfg.train.batch_size, cfg.data.max_length, warmup)
    skip = COMPILE_STEPS if compiled else 0
    stamps: dict[int, tuple[float, float]] = {}
    seen: list[int] = []  # non-padding tokens of each batch Trainer actually trained on
    rows = ds.with_format(None)
    base = DataCollatorWithFlattening() if mode == "flattened" else collate(pad_id)

    def counting(features):
        batch = base([{k: f[k] for k in ("input_ids", "labels")} for f in features])
        seen.append(sum(len(f["input_ids"]) for f in features))
        return batch

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                stamps[0] = _now()
            if state.global_step == skip:  # the first timed step: compiling steps stay out of a profile
                step_profile.start()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            stamps[state.global_step] = _now()

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (rows[i] for i in order)

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=cfg.train.steps + skip, per_device_train_batch_size=cfg.train.batch_size,
            learning_rate=cfg.optim.lr, lr_scheduler_type="constant",  # Trainer's default optim: its best
            max_grad_norm=cfg.train.max_grad_norm, logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=device.type == "cpu", bf16=cfg.train.precision == "bf16", dataloader_num_workers=0,
            disable_tqdm=True, remove_unused_columns=False, seed=cfg.train.seed,
            train_sampling_strategy="group_by_length" if mode == "grouped" else "random", torch_compile=compiled,
        )
        data = Rows() if mode == "ordered" else rows.remove_columns([c for c in rows.column_names
                                                                      if c not in ("input_ids", "labels")])
        Trainer(model=model, args=args, train_dataset=data, data_collator=counting, callbacks=[Stamp()]).train()
    if skip:
        print(f"Trainer compiled: its first {skip} steps (compiling) took {stamps[skip][0] - stamps[0][0]:.1f} s, "
              f"untimed", file=sys.stderr, flush=True)
    return timed(stamps, seen, skip)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="timed optimizer steps; default: whole group_by_length megabatches of Trainer's, at least 20 "
                        "steps (50 at batch 4 on 2,000 rows), since each runs from its longest rows to its shortest")
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
    p.add_argument("--pack", action="store_true", help="tunelab trains on packed rows instead of padded batches")
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


def prepare(args, data_cache: Path, device) -> SimpleNamespace:
    """The data every contender trains on, and what each one's steps hold: the padded batches in tunelab's
    order (`order`: row indices), tunelab's length-grouped batches and, with --pack, its packed rows."""
    import torch

    from tunelab.data.build import build
    from tunelab.models import loading
    from tunelab.train.data import batch_tokens, loader
    from tunelab.train.loop import BatchStream

    cfg = make_cfg(args, device.type)
    _, tok = loading.load(cfg.model, "cpu")
    ds = build(cfg.data, tok, data_cache)
    if args.steps is None:
        args.steps = whole_megabatches(len(ds["train"]), args.batch)
        cfg = make_cfg(args, device.type)

    def stream(data, rows: int, grouped: bool = False) -> list[dict]:
        s = BatchStream(loader(data, rows, tok.pad_token_id, shuffle=True, seed=cfg.train.seed,
                               group_by_length=grouped))
        return [next(s) for _ in range(cfg.train.steps + COMPILE_STEPS)]  # the compiled contenders' too

    # tunelab's row order: the same sampler and generator draws as its loader, over row indices.
    indices = BatchStream(torch.utils.data.DataLoader(range(len(ds["train"])), batch_size=args.batch, shuffle=True,
                                                      generator=torch.Generator().manual_seed(cfg.train.seed)))
    d = SimpleNamespace(cfg=cfg, tok=tok, ds=ds, order=[int(i) for _ in range(cfg.train.steps) for i in next(indices)])
    every = stream(ds["train"], args.batch)
    batches = every[:cfg.train.steps]
    d.tokens = [int(b["attention_mask"].sum()) for b in every]
    d.padding_share = 1 - sum(d.tokens[:cfg.train.steps]) / sum(b["attention_mask"].numel() for b in batches)
    d.labelled = label_share(batches)
    # tunelab's own length grouping (train.group_by_length), the like of the peer's best padded setting
    d.gr_cfg = make_cfg(args, device.type, grouped=True)
    d.gr_tokens = [batch_tokens(b) for b in stream(ds["train"], args.batch, grouped=True)]
    d.tl_cfg, d.tl_ds, d.tl_tokens, d.tl_labelled = cfg, ds, d.tokens, d.labelled
    if args.pack:  # rows of max_length tokens, as many per step as carry about the padded batch's tokens
        rows = max(1, round(sum(d.tokens[:cfg.train.steps]) / cfg.train.steps / args.max_length))
        d.tl_cfg = make_cfg(args, device.type, pack=True, batch=rows)
        d.tl_ds = build(d.tl_cfg.data, tok, data_cache)
        packed = stream(d.tl_ds["train"], rows)
        d.tl_tokens, d.tl_labelled = [batch_tokens(b) for b in packed], label_share(packed[:cfg.train.steps])
    return d


PEERS = ("Trainer", "Trainer group_by_length", "Trainer group_by_length (eager)", "Trainer group_by_length (compiled)",
         "Trainer group_by_length (compiled eager)")
FLAT_ATTENTION = ("flash_attention_2", "sdpa", "eager")  # what padding_free_attention may find, in its order


def contender_names(args) -> list[str]:
    """Every name `contenders` can give on any machine: the padding-free peer's depends on its check."""
    ours = ["tunelab packed" if args.pack else "tunelab", "tunelab group_by_length"]
    ours += [f"{n} (compiled)" for n in ours]
    return [*PEERS, *(f"Trainer padding-free{c} ({a})" for a in FLAT_ATTENTION for c in ("", " compiled")), *ours,
            *(["tunelab-plain-loss"] if args.plain_loss_too else [])]


def contenders(args, d: SimpleNamespace, device, flat_attn: str | None) -> tuple[dict, list[str], list[str]]:
    """{name: (function, arguments)} of every contender, the peer's names and tunelab's. The peer at its best on
    this hardware: group_by_length everywhere, SDPA and eager; padding-free rows where an attention
    implementation keeps the examples apart (checked, not assumed). "Trainer" (tunelab's batches) is the
    like-for-like step."""
    pad, train_rows = d.tok.pad_token_id, d.ds["train"]
    ours_name = "tunelab packed" if args.pack else "tunelab"
    table = {  # PEERS, in order
        "Trainer": (run_trainer, (d.cfg, device, train_rows, d.order, pad, args.warmup)),
        "Trainer group_by_length": (run_trainer, (d.cfg, device, train_rows, d.order, pad, args.warmup, "grouped")),
        # Eager attention is the faster implementation of the two under bf16 autocast on a CPU at short rows
        # (torch's bf16 SDPA kernel is slow there: benchmarks/sdpa_cpu.py), so the sweep includes it.
        "Trainer group_by_length (eager)": (run_trainer, (d.cfg, device, train_rows, d.order, pad, args.warmup,
                                                          "grouped", "eager")),
        # torch_compile=True: inductor fuses the elementwise work (norms, activations, the loss over the vocabulary).
        "Trainer group_by_length (compiled)": (run_trainer, (d.cfg, device, train_rows, d.order, pad, args.warmup,
                                                             "grouped", "sdpa", True)),
    }
    if d.cfg.train.precision == "bf16":  # where eager attention can be the faster one, compiled too
        table["Trainer group_by_length (compiled eager)"] = (run_trainer, (d.cfg, device, train_rows, d.order, pad,
                                                                            args.warmup, "grouped", "eager", True))
    if flat_attn:
        table[f"Trainer padding-free ({flat_attn})"] = (run_trainer, (d.cfg, device, train_rows, d.order, pad,
                                                                      args.warmup, "flattened", flat_attn))
        table[f"Trainer padding-free compiled ({flat_attn})"] = (run_trainer, (
            d.cfg, device, train_rows, d.order, pad, args.warmup, "flattened", flat_attn, True))
    peers = list(table)
    table[ours_name] = (run_tunelab, (d.tl_cfg, device, d.tl_ds, d.tok, d.tl_tokens, args.warmup))
    table["tunelab group_by_length"] = (run_tunelab, (d.gr_cfg, device, d.ds, d.tok, d.gr_tokens, args.warmup))
    # train.compile: the decoder body under torch.compile, as the compiled Trainer's whole model
    table[f"{ours_name} (compiled)"] = (run_tunelab, (d.tl_cfg, device, d.tl_ds, d.tok, d.tl_tokens, args.warmup,
                                                      False, True))
    table["tunelab group_by_length (compiled)"] = (run_tunelab, (d.gr_cfg, device, d.ds, d.tok, d.gr_tokens,
                                                                 args.warmup, False, True))
    ours = list(table)[len(peers):]
    if args.plain_loss_too:
        table["tunelab-plain-loss"] = (run_tunelab, (d.tl_cfg, device, d.tl_ds, d.tok, d.tl_tokens, args.warmup,
                                                     True))
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
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
    for i in range(args.repeats):  # alternated, so a change in machine load hits all alike
        for name, (fn, fn_args) in table.items():
            runs[name].append(in_fresh_process(step_profile.run, args.profile, name, fn, *fn_args) if args.profile
                              else in_fresh_process(fn, *fn_args))
            # Each run as it ends: a long benchmark stopped early still leaves its figures.
            print(f"run {i + 1} {name}: {runs[name][-1][0]:.1f} tokens/s, {runs[name][-1][1]:.1f} tokens/CPU-s, "
                  f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    result = summarize(args, d, device, runs, peers, ours)
    if args.profile:
        print(f"where the CPU time went (the last run of each, profiled: {args.profile}):\n"
              f"{step_profile.compare(args.profile, list(table))}", flush=True)
    result["peer_padding_free"] = {"attention": flat_attn, "largest_logit_difference": flat_gaps}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def summarize(args, d: SimpleNamespace, device, runs: dict, peers: list[str], ours: list[str]) -> dict:
    """Medians, the ratios, and a printed table."""
    import torch
    from transformers import TrainingArguments

    wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    result = {
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "precision": d.cfg.train.precision, "data": args.data, "batch": args.batch, "max_length": args.max_length,
        "steps_timed": args.steps, "repeats": args.repeats, "padding_share": round(d.padding_share, 3),
        "label_share_of_positions": round(d.labelled[0], 3), "label_share_of_tokens": round(d.labelled[1], 3),
        "tunelab_packed": args.pack, "tunelab_rows_per_step": d.tl_cfg.train.batch_size,
        "tunelab_label_share_of_positions": round(d.tl_labelled[0], 3),
        "trainer_optim": getattr(TrainingArguments(output_dir="unused").optim, "value", None),
        "tokens_per_s": {k: round(v, 1) for k, v in wall.items()},
        "tokens_per_cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "runs_tokens_per_s": {k: [round(w, 1) for w, _ in v] for k, v in runs.items()},
        "kept_heap": args.kept_heap,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    if peers and ours:  # the headline: each side at its best (--only may leave a side out)
        result.update(peer_best=max(peers, key=lambda k: wall[k]), tunelab_best=max(ours, key=lambda k: wall[k]),
                      ratio=round(max(wall[k] for k in ours) / max(wall[k] for k in peers), 3),
                      ratio_cpu_time=round(max(cpu[k] for k in ours) / max(cpu[k] for k in peers), 3))
    for key, a, b in (("ratio_grouped", "tunelab group_by_length", "Trainer group_by_length"),
                      ("ratio_same_batches", "tunelab", "Trainer"),
                      ("ratio_plain_loss", "tunelab-plain-loss", "Trainer")):
        if a in wall and b in wall:
            result[key] = round(wall[a] / wall[b], 3)
    print(f"{'':34} {'tokens/s':>10} {'tokens/CPU-s':>13}")
    for k in runs:
        print(f"{k:34} {wall[k]:10.1f} {cpu[k]:13.1f}")
    same = f"; on the same batches {result['ratio_same_batches']:.3f}" if "ratio_same_batches" in result else ""
    grouped = f"; both grouped by length {result['ratio_grouped']:.3f}" if "ratio_grouped" in result else ""
    head = (f"ratio tunelab's best ({result['tunelab_best']}) / the peer's best ({result['peer_best']}): "
            f"{result['ratio']:.3f} wall, {result['ratio_cpu_time']:.3f} CPU time" if "ratio" in result else
            "no ratio: --only left one side out")
    heap = ", glibc keeping freed memory" if args.kept_heap else ""
    print(f"{head}{grouped}{same}  ({result['model']}, {result['device']}, {result['precision']}, "
          f"{args.data}, batch {args.batch}, padding {d.padding_share:.0%} of positions, labels on "
          f"{d.labelled[0]:.0%} of positions, median of {args.repeats}{heap}, "
          f"load average at the end {result['load_average'][0]})")
    return result


if __name__ == "__main__":
    sys.exit(main())
