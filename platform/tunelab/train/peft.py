"""PEFT methods through the peft library: `peft.method` -> how to load the base model and wrap it.

The names and their facts (needs CUDA, prompt learning) are in tunelab.core.registries.PEFT, which points at the
functions here. Defaults for which modules to adapt come from the model family (config.model_type);
`peft.target_modules` overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core.config import CellConfig, PeftCfg
from tunelab.core.errors import UserError
from tunelab.core.registries import PEFT
from tunelab.machine.runtime import Runtime


@dataclass(frozen=True)
class Family:
    """Module names of one model family: what LoRA adapts by default, and IA3's targets."""

    linear: tuple[str, ...]  # every projection but the output head, as the QLoRA paper adapts
    ia3: tuple[str, ...]  # keys, values and the feed-forward output, as the IA3 paper scales
    ia3_feedforward: tuple[str, ...]


_LLAMA_LIKE = Family(
    linear=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ia3=("k_proj", "v_proj", "down_proj"),
    ia3_feedforward=("down_proj",),
)
FAMILIES: dict[str, Family] = {name: _LLAMA_LIKE for name in
                               ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2")}


PEFT_METHODS = PEFT  # name -> PeftSpec


def family(model) -> Family | None:
    return FAMILIES.get(getattr(model.config, "model_type", ""))


def _targets(model: Any, cfg: PeftCfg):
    if cfg.target_modules is not None:
        return list(cfg.target_modules)
    fam = family(model)
    # peft's "all-linear" finds every linear layer but the output head: a safe default for unknown families.
    return list(fam.linear) if fam else "all-linear"


def _get_peft_model(model: Any, config: Any) -> Any:
    from peft import get_peft_model

    try:
        return get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module the model does not have
        raise UserError(f"peft could not wrap the model: {e}", key="peft") from None


def _lora_config(model: Any, cfg: PeftCfg, **extra):
    from peft import LoraConfig

    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft's hint says int; floats work
                      lora_dropout=cfg.dropout, target_modules=_targets(model, cfg),
                      task_type="CAUSAL_LM", **extra)


def full(model: Any, cfg: PeftCfg):
    return model


# The peft config of each method that can share a base with other adapters (registries.PEFT's `config`): one
# adapter alone is get_peft_model(model, config); a together-group adds several under names of their own
# (train/members.py).
def lora_config(model: Any, cfg: PeftCfg):
    return _lora_config(model, cfg)


def dora_config(model: Any, cfg: PeftCfg):
    return _lora_config(model, cfg, use_dora=True)


def ia3_config(model: Any, cfg: PeftCfg):
    from peft import IA3Config

    fam = family(model)
    targets = cfg.target_modules or (list(fam.ia3) if fam else None)
    ff = cfg.feedforward_modules or (list(fam.ia3_feedforward) if fam and not cfg.target_modules else None)
    if targets is not None and ff is None:
        ff = []  # peft requires feedforward_modules to be a subset of target_modules; none is a valid subset
    return IA3Config(target_modules=targets, feedforward_modules=ff, task_type="CAUSAL_LM")


def config(model: Any, cfg: PeftCfg):
    """The peft config of `cfg.method` for `model` (methods that can join a together-group only)."""
    hook = PEFT[cfg.method].config
    if hook is None:
        raise ValueError(f"peft method {cfg.method} has no adapter config that can share a base")
    return hook.load()(model, cfg)


def lora(model: Any, cfg: PeftCfg):
    return _get_peft_model(model, lora_config(model, cfg))


def dora(model: Any, cfg: PeftCfg):
    return _get_peft_model(model, dora_config(model, cfg))


def ia3(model: Any, cfg: PeftCfg):
    return _get_peft_model(model, ia3_config(model, cfg))


def prefix(model: Any, cfg: PeftCfg):
    from peft import PrefixTuningConfig

    return _get_peft_model(model, PrefixTuningConfig(num_virtual_tokens=cfg.num_virtual_tokens,
                                                     prefix_projection=cfg.prefix_projection,
                                                     task_type="CAUSAL_LM"))


def prompt(model: Any, cfg: PeftCfg):
    from peft import PromptTuningConfig

    return _get_peft_model(model, PromptTuningConfig(num_virtual_tokens=cfg.num_virtual_tokens,
                                                     task_type="CAUSAL_LM"))


def p_tuning(model: Any, cfg: PeftCfg):
    from peft import PromptEncoderConfig

    hidden = cfg.encoder_hidden_size or model.config.hidden_size
    return _get_peft_model(model, PromptEncoderConfig(num_virtual_tokens=cfg.num_virtual_tokens,
                                                      encoder_hidden_size=hidden, task_type="CAUSAL_LM"))


def qlora_load_kwargs(cfg: PeftCfg, device: Any) -> dict:
    import importlib.util

    import torch
    from transformers import BitsAndBytesConfig

    if torch.device(device).type != "cuda":
        raise UserError(f"qlora loads the base model in 4 bits with bitsandbytes, which needs a CUDA device; "
                        f"this cell trains on {device}. Set train.device to cuda (or auto on a GPU machine), "
                        "or use peft.method lora.", key="peft.method")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("qlora needs the bitsandbytes package: pip install bitsandbytes", key="peft.method")
    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=cfg.quant_type, bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16)}


def qlora(model: Any, cfg: PeftCfg):
    from peft import prepare_model_for_kbit_training

    # The loop turns on gradient checkpointing itself when train.gradient_checkpointing says so.
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return _get_peft_model(model, _lora_config(model, cfg))


def load_kwargs(cfg: PeftCfg, device: Any) -> dict:
    """Extra `from_pretrained` arguments the method needs (4-bit quantization for qlora)."""
    hook = PEFT[cfg.method].load_kwargs
    return hook.load()(cfg, device) if hook else {}


def apply(model: Any, cfg: PeftCfg):
    return PEFT[cfg.method].wrap.load()(model, cfg)


def for_eval(model):
    """A model ready for evaluation and generation, its adapters NOT merged: the transformers model with the tuner
    layers inside (LoRA, DoRA, IA3, QLoRA), each computing base + adapter as in training. Unmerged, a cell scores
    what the same adapter scores beside others on one shared base (evals.run_together) bit for bit on CPU; merged
    weights round differently (docs/evaluation.md). Prompt-learning methods (prefix, prompt, p_tuning) generate
    through the PeftModel (their virtual tokens live there)."""
    cfg = getattr(model, "active_peft_config", None)
    if cfg is None or cfg.is_prompt_learning:
        return model
    return model.get_base_model()


def load_adapters(model: Any, folders: list[Path], names: list[str]) -> Any:
    """Trained adapters (final/ folders of PEFT cells over the same base) onto `model`, unmerged, as `names`: peft's
    `inject_adapter_in_model` + `set_peft_model_state_dict`, so LoRA, DoRA and IA3 share one base (several tuner
    types on one module nest) -> the model, for evals.run_together."""
    import warnings

    import torch
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.tuners_utils import cast_adapter_dtype
    from peft.utils import load_peft_weights

    for folder, name in zip(folders, names, strict=True):
        config = PeftConfig.from_pretrained(str(folder))
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # first values overwritten: on a fork
            warnings.filterwarnings("ignore", "Already found a `peft_config`")  # several adapters: what we want
            inject_adapter_in_model(config, model, adapter_name=name)
        cast_adapter_dtype(model, adapter_name=name)  # fp32 adapters on a bf16/fp16 base, as PeftModel loads them
        loaded: Any = set_peft_model_state_dict(model, load_peft_weights(str(folder), device="cpu"), adapter_name=name)
        missing = [k for k in loaded.missing_keys if k.endswith(f".{name}") or f".{name}." in k]
        if loaded.unexpected_keys or missing:
            raise UserError(f"{folder}: the adapter's weights do not fit the base model "
                            f"({(loaded.unexpected_keys or missing)[0]} and more)", key="model")
    model.requires_grad_(False)
    return model


def load_trained(cfg: CellConfig, final_dir: Path, runtime: Runtime) -> tuple[Any, Any]:
    """A cell's saved final/ folder as a model to evaluate again: the full weights, or the base model
    (cfg.model, quantized as the method loads it) with the adapter on top. -> (model, tokenizer)."""
    from transformers import AutoTokenizer

    from tunelab.models import loading

    if cfg.peft.method == "none":
        return loading.load(cfg.model.model_copy(update={"name": str(final_dir), "revision": None}), runtime)
    from peft import PeftModel

    base, _ = loading.load(cfg.model, runtime, **load_kwargs(cfg.peft, runtime.device))
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return PeftModel.from_pretrained(base, final_dir), tokenizer


def load_checkpoint(cfg: CellConfig, step_dir: Path, runtime: Runtime) -> tuple[Any, Any]:
    """The weights of a checkpoint (checkpoints/step-N/, any layout's) as a one-process model: the base model
    loaded as the cell loads it, the method applied, then the checkpoint's weights over it. -> (model, tokenizer)."""
    import torch

    from tunelab.models import loading
    from tunelab.train.checkpoint import load_weights

    model, tokenizer = loading.load(cfg.model, runtime, **load_kwargs(cfg.peft, runtime.device))
    with torch.random.fork_rng(devices=[]):  # adapters' first values are overwritten: they draw on a fork
        model = apply(model, cfg.peft)
    load_weights(model, step_dir)
    model.eval()
    return model, tokenizer
