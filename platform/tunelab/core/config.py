"""The schema of one experiment cell. Each section is a pydantic model; unknown keys are errors.

Pure data: types, defaults, descriptions and the checks that need nothing else (it reads core/registries.py, the
names and facts, but no stage). Whatever needs a registry's entries, a content folder or several sections at
once is checked in `tunelab.plan`; whatever depends on the machine (CUDA, a local folder) where the cell runs
(`tunelab.machine.runtime.check_host`). The field descriptions are the
reference documentation: `exp plan` and the README point here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tunelab.core.registries import DEFAULT_ENGINE, TASKS  # names of the help texts


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelCfg(Section):
    name: str = Field(description="catalog alias (see `exp models`), local folder, or hub id org/name")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights dtype; auto = bfloat16 on a CUDA device that supports it, else float32")
    attn: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="attention kernel; auto = flash_attention_2 when flash-attn is installed, the "
        "device is CUDA and the weights are 16-bit, else sdpa")



class DataCfg(Section):
    recipe: str = Field(description="recipe name in data_recipes/ or a path to a recipe YAML")
    template: str | None = Field(None, description="override the recipe's prompt template: alpaca, chat, plain")
    max_length: int = Field(512, gt=8, description="tokens per example (and per packed row)")
    truncation: Literal["cut", "drop"] = Field(
        "cut", description="longer examples: cut = keep the first max_length tokens (dropped if no reply token "
                           "is left), drop = leave them out")
    train_on_prompt: bool = Field(False, description="also train on prompt tokens")
    pack: bool = Field(False, description="pack training examples into rows of max_length tokens; attention "
                                          "and positions stay per example, so losses are unchanged")



PeftMethod = Literal["none", "lora", "dora", "ia3", "prefix", "prompt", "p_tuning", "qlora"]


class PeftCfg(Section):
    method: PeftMethod = Field("none", description="none = full-parameter training; qlora needs CUDA")
    r: int = Field(8, gt=0, description="LoRA/DoRA/QLoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA/DoRA/QLoRA alpha")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA/DoRA/QLoRA dropout")
    target_modules: list[str] | None = Field(
        None, description="modules to adapt (LoRA, DoRA, QLoRA, IA3); None = the model family's default")
    feedforward_modules: list[str] | None = Field(
        None, description="IA3: which of target_modules are feed-forward (scaled on the input); None = default")
    num_virtual_tokens: int = Field(20, gt=0, description="prefix/prompt/p_tuning: virtual tokens")
    prefix_projection: bool = Field(False, description="prefix: reparameterize the prefix through an MLP")
    encoder_hidden_size: int | None = Field(
        None, gt=0, description="p_tuning: hidden size of the prompt encoder; None = the model's hidden size")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="qlora: 4-bit data type")
    double_quant: bool = Field(True, description="qlora: also quantize the quantization constants")



class OptimCfg(Section):
    name: str = Field("adamw", description="a registered optimizer (docs/optimizers.md), any "
                      "'torch.optim.Name' or any 'package.module:Class'")
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra constructor arguments "
                                   "(checked against the constructor's signature)")



class ParallelCfg(Section):
    """The process layout: dp x tp x pp processes (see docs/parallelism.md).

    A layout the chosen backend cannot run is refused here, so `exp plan` reports it.
    """

    dp: int = Field(1, ge=1, description="data-parallel degree: FSDP2 (native) or ZeRO (deepspeed) shards")
    tp: int = Field(1, ge=1, description="tensor-parallel degree (native only)")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree: stages of consecutive layers (native only)")
    backend: str = Field(DEFAULT_ENGINE, description="the parallel engine: a name of `exp ls engines` "
                                                     "(docs/parallelism.md)")
    zero: Literal[1, 2, 3] = Field(
        3, description="what dp shards: 1 optimizer state, 2 + gradients, 3 + parameters "
                       "(native: 3 = FSDP2 resharding after forward, 2 = keeping parameters gathered until backward)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="pipeline schedule; interleaved_1f1b puts 2 stages on each pipeline rank")
    microbatches: int = Field(
        1, ge=1, description="pipeline chunks each micro-batch is split into (pp > 1); 1f1b needs at least pp")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer in backward")
    cpu_offload: bool = Field(
        False, description="keep sharded parameters, gradients and optimizer state in CPU memory "
                           "(native: FSDP2 CPUOffloadPolicy; deepspeed: offload_optimizer, + offload_param at zero 3)")



def world_size(cfg: ParallelCfg) -> int:
    """Processes a cell with this layout needs (the runner starts that many under torchrun)."""
    return cfg.dp * cfg.tp * cfg.pp


class SelectCfg(Section):
    """Which checkpoint becomes final/: the best by a score of the checkpoint evaluation (eval.checkpoints)."""

    metric: str = Field(description="a task of the checkpoint evaluation that scores a validation split (val_loss, "
                        "or a registered task with split validation); a test set is refused")
    mode: Literal["max", "min"] | None = Field(None, description="max or min; null = the task's own direction "
                                               "(val_loss: min)")


class TrainCfg(Section):
    steps: int = Field(20, gt=0, description="optimizer steps")
    batch_size: int = Field(4, gt=0, description="examples per micro-batch")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    group_by_length: bool = Field(
        False, description="batch examples of similar length (less padding), the batches in a random order, as "
                           "transformers' group_by_length; for padded rows (data.pack: false)")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = Field(1.0, description="clip the global grad norm; null = no clipping")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(1, gt=0)
    save_final: bool = Field(True, description="write final weights (or adapter) to final/")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16 = autocast forward in bfloat16 (CPU or GPU); auto = bf16 on CUDA, else fp32")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    loss_chunk: int | None = Field(
        None, gt=0, description="labelled positions per chunk of the output head and loss, which run in chunks "
                                "(the logits and their gradient are never whole); null = "
                                "chosen from the vocabulary (a chunk's fp32 logits about 32 MiB). Changes memory "
                                "and speed, not results (float summation order only)")
    compile: bool = Field(
        False, description="the decoder body of a one-process step under torch.compile (fused elementwise work; "
                           "compiling takes seconds to minutes first); not with LOMO/AdaLomo or parallel engines")
    eval_every: int | None = Field(
        None, gt=0, description="validation loss every N steps (eval.batch_size, eval.val_batches); null = off")
    save_every: int | None = Field(
        None, gt=0, description="checkpoint to checkpoints/step-N/ every N steps (and at the end); null = off")
    keep_checkpoints: int = Field(1, gt=0, description="how many of the latest checkpoints to keep")
    resume: bool = Field(True, description="a cell that finds a checkpoint resumes from the latest one")
    select: SelectCfg | None = Field(None, description="final/ = the checkpoint of eval.checkpoints that scores best "
                                     "on this validation metric (instead of the last step)")
    keep_best: int | None = Field(None, gt=0, description="with select: keep only the best k evaluated checkpoints "
                                  "(and the latest keep_checkpoints); null = keep every evaluated one")


class CheckpointsCfg(Section):
    """Scores along training: the evaluation of saved checkpoints (docs/evaluation.md, "Scores along training").
    Its settings are the eval section's, with `suite`, `tasks`, `limit` and `settings` put over them."""

    every: int | None = Field(None, gt=0, description="evaluate the checkpoint of every N-th step, and of the last")
    at: list[int] | None = Field(None, min_length=1, description="evaluate the checkpoints of these steps")
    suite: str | None = Field(None, description="a suite for the checkpoints (e.g. a smaller one): its keys replace "
                              "the eval section's; null = the eval section's settings")
    tasks: list[str] | None = Field(None, description="tasks scored at each checkpoint; null = the suite's, else the "
                                    "eval section's")
    limit: int | None = Field(None, gt=0, description="examples per task at each checkpoint (replaces every limit)")
    settings: dict[str, Any] = Field(default_factory=dict, description="any other eval keys for the checkpoints "
                                     "(e.g. {max_new_tokens: 64}); the plan puts the suite's keys here")
    workers: int | None = Field(None, ge=0, description="evaluator processes beside training; 0 = after training, "
                                "in the cell's process; null = 1 when the cell trains on CUDA, else 0")

    @model_validator(mode="after")
    def _one_schedule(self) -> CheckpointsCfg:
        if (self.every is None) == (self.at is None):
            raise ValueError("give exactly one of every (a checkpoint every N steps) and at (a list of steps)")
        if self.at is not None and (any(s <= 0 for s in self.at) or len(set(self.at)) != len(self.at)):
            raise ValueError("at: distinct steps, each at least 1")
        return self

    def steps(self, total: int) -> tuple[int, ...]:
        """The steps whose checkpoints are evaluated, for a run of `total` steps."""
        if self.at is not None:
            return tuple(sorted(s for s in self.at if s <= total))
        assert self.every is not None
        return tuple(sorted({*range(self.every, total + 1, self.every), total}))

    def workers_on(self, cuda: bool) -> int:
        return self.workers if self.workers is not None else int(cuda)

    def mode(self, cuda: bool | None = None) -> str:
        """Where they run, in words (`exp plan`); `cuda`: whether the cell's device is CUDA, as the machine that
        plans sees it (None: not known)."""
        workers = self.workers if self.workers is not None or cuda is None else self.workers_on(cuda)
        if workers is None:
            return "beside training (1 process) on CUDA, after training on CPU"
        if workers == 0:
            why = "" if self.workers is not None else " (no CUDA device here: evaluators would slow training)"
            return f"after training, in the cell's process{why}"
        return f"beside training ({workers} process{'es' if workers > 1 else ''})"


class EvalCfg(Section):
    suite: str | None = Field(None, description="a suite in evals/ (paper, quick, full) or a path to one: its keys "
                              "are the defaults of this section; keys set here override them")
    tasks: list[str] = Field(default_factory=lambda: ["val_loss", "humaneval"], description="tasks to score: "
                             f"tunelab's ({', '.join(TASKS)}), any lm-eval task or group (`exp ls tasks --all`), "
                             "or a task of include_path")
    include_path: str | None = Field(None, description="a folder of lm-eval task YAMLs (as lm_eval's --include_path): "
                                     "its tasks and groups can be named in tasks; relative to where exp runs. A task's "
                                     "relative data_files are found beside its YAML; the evaluation's id covers the "
                                     "content of its files")
    limit: int | None = Field(None, gt=0, description="examples per task (per MMLU subject / BBH task); null = all")
    limits: dict[str, int] = Field(default_factory=dict, description="per-task limit, overriding `limit`")
    subtasks: dict[str, list[str]] = Field(default_factory=dict, description="run only these MMLU subjects / "
                                           "BBH tasks / members of an lm-eval group, e.g. {mmlu: [anatomy]}")
    data_dir: str | None = Field(None, description="local benchmark data instead of the hub (tunelab's tasks: "
                                 "<dir>/<task>/<subset>/<split>.jsonl; lm-eval's: <dir>/<task>/<split>.jsonl); "
                                 "$TUNELAB_EVAL_DATA sets it too")
    val_batches: int | None = Field(None, gt=0, description="validation batches for val_loss; null = all")
    batch_size: int = Field(8, gt=0)
    max_new_tokens: int | None = Field(None, gt=0, description="cap on generated tokens; null = each task's own "
                                       "(HumanEval 256, GSM8K 256, BBH 1024)")
    n_samples: int = Field(1, gt=0, description="HumanEval samples per problem (pass@k)")
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit per generated program")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template (the literature: no)")

    allow_unsandboxed: bool = Field(
        False, description="run HumanEval's generated code even where the kernel offers no sandbox (bubblewrap "
                           "with user namespaces): only on a machine you can lose; recorded in results.json")
    checkpoints: CheckpointsCfg | None = Field(
        None, description="also score saved checkpoints along training: {every: N} or {at: [steps]}, optionally "
                          "with a smaller suite, tasks, limit, and workers (evaluator processes beside training)")

    @field_validator("limits")
    @classmethod
    def _positive(cls, v: dict) -> dict:
        if any(not isinstance(n, int) or n <= 0 for n in v.values()):
            raise ValueError("limits must be positive integers")
        return v

    def limit_for(self, task: str) -> int | None:
        return self.limits.get(task, self.limit)

    def id(self) -> str:
        """Names this evaluation's results: eval/<id>/results.json in a cell's folder. Keys added later are left
        out while at their default, so evaluations made before them keep their ids (as LATER_KEYS below). The
        checkpoints' evaluation is not part of it: adding one leaves the final evaluation where it is. With
        include_path, the content of its task files is (core/taskfiles.py)."""
        dump = self.model_dump(mode="json", exclude={"checkpoints"})
        ident = {k: v for k, v in dump.items() if k not in EVAL_LATER_KEYS or v != EVAL_LATER_KEYS[k]}
        if self.include_path:  # the local tasks' YAMLs and data: a changed task is scored again
            from tunelab.core import taskfiles

            ident["include_path_content"] = taskfiles.digest(self.include_path)
        return content_id(ident)

    def at_checkpoints(self) -> EvalCfg | None:
        """The evaluation each checkpoint gets: this section with the checkpoints' suite keys (put into
        `settings` at plan time), settings, tasks and limit over it; None without eval.checkpoints. Its id names
        eval/<id>/step-N/ (the same folder as the final evaluation's when nothing differs)."""
        ck = self.checkpoints
        if ck is None:
            return None
        raw = {**self.model_dump(mode="json", exclude={"checkpoints"}), **ck.settings}
        raw["suite"] = ck.suite or self.suite
        if ck.tasks is not None:
            raw["tasks"] = ck.tasks
        if ck.limit is not None:
            raw["limit"], raw["limits"] = ck.limit, {}
        return EvalCfg.model_validate(raw)


EVAL_LATER_KEYS = {"include_path": None}


class TrackingCfg(Section):
    wandb: bool = Field(True, description="log to Weights & Biases")
    project: str = "tunelab"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="null: WANDB_MODE if set, else online with an API key, else offline"
    )


# Training keys added after cells were first run, left out of a cell's identity while at their default (which
# trains as before the key existed), so that run folders made earlier keep their ids and are not trained again.
LATER_KEYS = {("train", "group_by_length"): False, ("train", "loss_chunk"): None, ("train", "select"): None,
              ("train", "keep_best"): None, ("train", "compile"): False}


class CellConfig(Section):
    model: ModelCfg
    data: DataCfg
    peft: PeftCfg = PeftCfg()
    optim: OptimCfg = OptimCfg()
    parallel: ParallelCfg = ParallelCfg()
    train: TrainCfg = TrainCfg()
    eval: EvalCfg = EvalCfg()
    tracking: TrackingCfg = TrackingCfg()

    def identity(self) -> dict[str, Any]:
        """What decides a cell's trained model: every training section, and the validation settings when
        training measures validation loss on the way (train.eval_every). Evaluation and tracking are not
        part of it: a new eval task evaluates the same trained model again instead of retraining it."""
        ident = self.model_dump(mode="json", exclude={"tracking", "eval"})
        for (section, key), default in LATER_KEYS.items():
            if ident[section][key] == default:
                del ident[section][key]
        if self.train.eval_every:
            ident["validation"] = {"batch_size": self.eval.batch_size, "val_batches": self.eval.val_batches}
        if self.train.select is not None:  # final/ is the checkpoint this evaluation scores best
            ident["selection"] = {"steps": list(self.checkpoint_steps()), "eval": self.checkpoint_eval_id()}
        return ident

    def checkpoint_steps(self) -> tuple[int, ...]:
        """The steps whose checkpoints eval.checkpoints evaluates (none without it)."""
        ck = self.eval.checkpoints
        return ck.steps(self.train.steps) if ck is not None else ()

    def checkpoint_eval_id(self) -> str | None:
        """The id of the checkpoints' evaluation: eval/<id>/step-N/ (None without eval.checkpoints)."""
        ecfg = self.eval.at_checkpoints()
        return ecfg.id() if ecfg is not None else None

    def id(self) -> str:
        """The cell's folder key (a hash of `identity`)."""
        return content_id(self.identity())


def content_id(obj: Any) -> str:
    """First 10 hex digits of the sha256 of canonical JSON: the same content, the same id."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]
