"""The causal-LM training loss with the output head applied only where a label is.

Instruction data masks the prompt and the padding (labels -100), yet a plain `model(**batch).loss` runs the
output head (vocabulary x hidden, about a fifth of a small model's matmul FLOPs) and an fp32 log-softmax over
the vocabulary at every position. Here the decoder body runs as the full model would run it, the hidden
states are gathered at the positions whose shifted label is not -100, and only those rows go through the
head and the cross-entropy: summed, then divided by `n_items` (transformers' Trainer normalization). The
loss and the gradients are the plain path's up to float rounding.

Whenever that cannot be exact (prompt-learning PEFT adds virtual tokens inside PeftModel.forward, a model
family whose forward does more than body -> head, soft-capped or scaled logits, hooks on the root module,
unknown batch fields), the plain forward is used.

Engines whose hooks sit on the root module (FSDP2 unshards there, DeepSpeed's engine is the root) cannot
have the body called directly: `root_forward_loss` calls the root forward with transformers'
`logits_to_keep` set to the labelled positions (a boolean mask; where transformers takes positions only,
the positions where any row has a label), so the head and the fp32 cross-entropy run there only: the same
sum, up to float rounding.

In every case the head and the cross-entropy run together in chunks of positions
(train/chunked.py): the logits and their gradient are never whole.
"""

from __future__ import annotations

from typing import Any

import torch

from tunelab.optimizers.sophia import sampled_loss_whole
from tunelab.train.chunked import CHUNK_ATTR, auto_chunk, computing_loss, head_loss

IGNORE = -100
# Causal-LM classes whose forward is exactly body -> lm_head -> transformers' ForCausalLMLoss
# (checked in transformers 5.x); any other family takes the plain path.
_PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2",
                               "phi3"})
_BODY_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids"})
# Config fields that change the logits after the head in some families (tanh capping, a multiplier).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _causal_lm(model: Any, root_hooks_ok: bool = False) -> Any:
    """The transformers causal LM under `model` when the head-only-at-labels path is exact, else None.
    `root_hooks_ok`: the caller runs the root forward itself (hooks on it then run too)."""
    try:
        from peft import PeftModel

        peft_types: tuple[type, ...] = (PeftModel,)
    except ImportError:  # peft is optional for full-parameter training
        peft_types = ()
    is_peft = bool(peft_types) and isinstance(model, peft_types)
    if is_peft:
        if model.active_peft_config.is_prompt_learning:
            return None
        if not root_hooks_ok and (model._forward_hooks or model._forward_pre_hooks):
            return None
        model = model.get_base_model()  # LoRA/DoRA/IA3 layers live inside its modules
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_TYPES:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        return None
    # Root hooks (FSDP, accelerate's device placement) would be skipped by calling the body directly.
    if not root_hooks_ok and (model._forward_hooks or model._forward_pre_hooks or hasattr(model, "_hf_hook")):
        return None
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(body, torch.nn.Module) or model.get_output_embeddings() is None:
        return None
    return model


def exact_at_labels(model) -> bool:
    """Whether the head and loss may run at the labelled positions only, for a caller that runs the
    model's parts itself (pipeline stages) and so with whatever hooks they carry."""
    return _causal_lm(model, root_hooks_ok=True) is not None


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: position t predicts token t+1, the last one nothing."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)


def plain_loss(model, batch: dict, n_items: torch.Tensor) -> torch.Tensor:
    return model(**batch, num_items_in_batch=n_items).loss


def causal_lm_loss(model, batch: dict, n_items: int | torch.Tensor) -> torch.Tensor:
    """Sum of the token losses of `batch` (tensors on the model's device) / `n_items`."""
    labels = batch["labels"]
    n_items = torch.as_tensor(n_items, device=labels.device)
    lm = _causal_lm(model)
    if lm is None or not set(batch) - {"labels"} <= _BODY_INPUTS:
        return plain_loss(model, batch, n_items)
    # Position t predicts token t+1; the last position of each row predicts nothing. The row indices are
    # taken before the body runs, so a GPU waits for them while its queue is short.
    shift = shifted_labels(labels).flatten()
    rows = (shift != IGNORE).nonzero().squeeze(1)
    body = getattr(lm, lm.base_model_prefix)
    hidden = body(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state
    loss = head_loss(lm.get_output_embeddings(), hidden.flatten(0, 1)[rows], shift[rows])
    return loss / n_items


def sampled_label_loss(model, batch: dict) -> tuple[torch.Tensor | None, int]:
    """(mean cross-entropy against labels sampled from the model's own predictions at the labelled positions,
    their count): SophiaG's Gauss-Newton-Bartlett estimate. Where the head-at-labels path is exact, the head
    runs in chunks for the sampling and for the loss, so no (positions, vocabulary) tensor is whole."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    lm = _causal_lm(model)
    if lm is None or not set(inputs) <= _BODY_INPUTS:
        return sampled_loss_whole(model, batch)
    shift = shifted_labels(labels).flatten()
    rows = (shift != IGNORE).nonzero().squeeze(1)
    if not rows.numel():
        return None, 0
    hidden = getattr(lm, lm.base_model_prefix)(**inputs).last_hidden_state.flatten(0, 1)[rows]
    head = lm.get_output_embeddings()
    chunk = getattr(head, CHUNK_ATTR, None) or auto_chunk(lm.config.vocab_size)
    with torch.no_grad():
        sampled = torch.cat([torch.distributions.Categorical(logits=head(hidden[a:a + chunk]).float()).sample()
                             for a in range(0, rows.numel(), chunk)])
    return head_loss(head, hidden, sampled) / rows.numel(), rows.numel()


def root_forward_loss(model, batch: dict, n_items: int | torch.Tensor, inner=None) -> torch.Tensor:
    """`causal_lm_loss` through the root forward of `model` (an FSDP2-sharded model, a DeepSpeed engine whose
    module is `inner`): the head and the loss at the positions where any row has a label."""
    labels = batch["labels"]
    n_items = torch.as_tensor(n_items, device=labels.device)
    lm = _causal_lm(inner if inner is not None else model, root_hooks_ok=True)
    if lm is None or not set(batch) - {"labels"} <= _BODY_INPUTS:
        return plain_loss(model, batch, n_items)
    shift = shifted_labels(labels)
    rows = None
    if _MASK_TO_KEEP:  # exactly the labelled positions, handed to the head as (labelled tokens, hidden)
        keep, targets = shift != IGNORE, shift[shift != IGNORE]
    else:  # the positions where any row has a label, the same for every row; the head drops the others
        keep = (shift != IGNORE).any(0).nonzero().squeeze(1)
        targets = shift[:, keep].flatten()
        rows, targets = targets != IGNORE, targets[targets != IGNORE]
    # The head module computes the summed loss in chunks where the model calls it: `.logits` is that loss.
    with computing_loss(lm.get_output_embeddings(), targets, rows):
        loss = model(**{k: v for k, v in batch.items() if k != "labels"}, logits_to_keep=keep).logits
    return loss / n_items


def _mask_to_keep() -> bool:
    """Whether this transformers takes a boolean (batch, sequence) `logits_to_keep` (5.2x's
    `slice_logits_to_keep`); older ones take positions only."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
    except ImportError:
        return False
    return True


_MASK_TO_KEEP = _mask_to_keep()
