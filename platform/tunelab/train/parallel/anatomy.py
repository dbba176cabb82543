"""Where the parts of a Hugging Face decoder live, by module path, for plain and peft-wrapped models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tunelab.core.errors import UserError


@dataclass(frozen=True)
class Anatomy:
    config: object
    embed: str
    layers: list[str]  # one path per decoder layer, in order
    norm: str
    rotary: str
    lm_head: str

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))


def causal_lm(root: Any) -> Any:  # a transformers PreTrainedModel: its methods are not nn.Module's
    """The transformers *ForCausalLM under a peft wrapper (or the root itself)."""
    return root.get_base_model() if hasattr(root, "get_base_model") else root


def anatomy(root: nn.Module) -> Anatomy:
    lm = causal_lm(root)
    dec: Any = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    parts: dict[str, Any] = {name: getattr(dec, name, None) for name in names}
    if dec is None or any(v is None for v in parts.values()):
        raise UserError(f"{type(lm).__name__} is not a decoder with embed_tokens, layers, norm and rotary_emb "
                        "(Llama, Qwen2, Mistral and their kin): tensor and pipeline parallelism cannot split it",
                        key="parallel")
    path = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    return Anatomy(config=lm.config, embed=path[id(parts["embed_tokens"])],
                   layers=[path[id(layer)] for layer in parts["layers"]], norm=path[id(parts["norm"])],
                   rotary=path[id(parts["rotary_emb"])], lm_head=path[id(lm.get_output_embeddings())])
