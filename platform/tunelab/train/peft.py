"""PEFT methods through the peft library: method name -> a function wrapping the model."""

from __future__ import annotations

from collections.abc import Callable

PEFT_METHODS: dict[str, Callable] = {}


def register(name: str):
    def deco(fn: Callable) -> Callable:
        PEFT_METHODS[name] = fn
        return fn

    return deco


@register("none")
def _full(model, cfg):
    return model


@register("lora")
def _lora(model, cfg):
    from peft import LoraConfig, get_peft_model

    # target_modules=None lets peft pick its per-family default (q_proj, v_proj for Llama).
    lora = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def apply(model, cfg):
    return PEFT_METHODS[cfg.method](model, cfg)


def for_eval(model):
    """A model ready for generation: adapters merged into the weights where peft can merge them."""
    if hasattr(model, "merge_and_unload"):
        try:
            return model.merge_and_unload()
        except (AttributeError, NotImplementedError, ValueError):
            return model
    return model
