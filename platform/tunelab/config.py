"""The schema of one experiment cell. Each section is a pydantic model; unknown keys are errors.

The field descriptions are the reference documentation: `exp plan` and the README point here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelCfg(Section):
    name: str = Field(description="catalog alias (see `exp models`), local folder, or hub id org/name")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights dtype")
    attn: Literal["sdpa", "eager", "flash_attention_2"] = Field("sdpa", description="attention kernel")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from tunelab.models import check_name

        check_name(v)
        return v


class DataCfg(Section):
    recipe: str = Field(description="recipe name in data_recipes/ or a path to a recipe YAML")
    template: str | None = Field(None, description="override the recipe's prompt template")
    max_length: int = Field(512, gt=8, description="tokens per example; longer ones are truncated")
    train_on_prompt: bool = Field(False, description="also train on prompt tokens")

    @field_validator("recipe")
    @classmethod
    def _exists(cls, v: str) -> str:
        from tunelab.data.recipe import find_recipe

        find_recipe(v)
        return v


PeftMethod = Literal["none", "lora"]


class PeftCfg(Section):
    method: PeftMethod = Field("none", description="none = full-parameter training")
    r: int = Field(8, gt=0, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout")
    target_modules: list[str] | None = Field(None, description="modules to adapt; None = the family default")


class OptimCfg(Section):
    name: str = Field("adamw", description="optimizer name (see `exp optimizers`)")
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra constructor arguments")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from tunelab.train.optim import check_name

        check_name(v)
        return v


class ParallelCfg(Section):
    dp: Literal[1] = Field(1, description="data-parallel degree (multi-process layouts are not built yet)")
    tp: Literal[1] = Field(1, description="tensor-parallel degree")
    pp: Literal[1] = Field(1, description="pipeline-parallel degree")


class TrainCfg(Section):
    steps: int = Field(20, gt=0, description="optimizer steps")
    batch_size: int = Field(4, gt=0, description="examples per micro-batch")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = Field(1.0, description="clip the global grad norm; null = no clipping")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(1, gt=0)
    save_final: bool = Field(True, description="write final weights (or adapter) to final/")


class EvalCfg(Section):
    tasks: list[str] = Field(default_factory=lambda: ["val_loss", "humaneval"], description="tasks to score")
    limit: int | None = Field(None, gt=0, description="examples per task; null = all")
    val_batches: int | None = Field(None, gt=0, description="validation batches for val_loss; null = all")
    batch_size: int = Field(8, gt=0)
    max_new_tokens: int = Field(256, gt=0)
    n_samples: int = Field(1, gt=0, description="HumanEval samples per problem (pass@k)")
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit per generated program")

    @field_validator("tasks")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        from tunelab.evals.engine import TASKS

        unknown = [t for t in v if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(TASKS)}")
        return v


class TrackingCfg(Section):
    wandb: bool = Field(True, description="log to Weights & Biases")
    project: str = "tunelab"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="null: WANDB_MODE if set, else online with an API key, else offline"
    )


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
        """What decides a cell's results: everything but where it is logged."""
        return self.model_dump(mode="json", exclude={"tracking"})
