"""The tiny model, batches and single-process reference shared by the parity script and its test."""

from __future__ import annotations

import torch

STEPS, GRAD_ACCUM, BATCH, MAX_NORM, LR = 3, 2, 4, 1.0, 1e-2
# adalomo, lomo: full-parameter, updated inside backward; tied: full AdamW on the model with tied embeddings
METHODS = ("full", "lora", "adalomo", "lomo", "tied")
FUSED = ("adalomo", "lomo")
# Labelled positions per chunk of the output head and loss (train.loss_chunk): a micro-batch's 20-50 labelled
# positions (10-25 per pipeline chunk) run in several chunks on every layout; the reference is the plain head.
LOSS_CHUNK = 8


def tiny_base(method: str, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=method == "tied", pad_token_id=0, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def tiny_model(method: str, layers: int = 4):
    return with_peft(tiny_base(method, layers), method)


def with_peft(model, method: str):
    """The method's adapters on `model`, drawn from their own seed (as a cell seeds before PEFT), so that a
    model built on the meta device gets the same ones (train/parallel/deferred.py)."""
    torch.manual_seed(1)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        # Adapters on split-output (q, v) and split-input (o, down) layers, so TP covers both cases;
        # B starts non-zero so the adapters change the loss from the first step on.
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    return model


def batches(steps: int = STEPS) -> list[list[dict]]:
    """steps x GRAD_ACCUM micro-batches of BATCH rows, right-padded, prompt and padding masked."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(GRAD_ACCUM):
            lens = torch.randint(6, 17, (BATCH,), generator=g)
            width = int(lens.max())
            ids = torch.zeros(BATCH, width, dtype=torch.long)
            labels = torch.full((BATCH, width), -100)
            mask = torch.zeros(BATCH, width, dtype=torch.long)
            for i, n in enumerate(lens.tolist()):
                ids[i, :n] = torch.randint(2, 128, (n,), generator=g)
                mask[i, :n] = 1
                prompt = int(torch.randint(1, 4, (1,), generator=g))
                labels[i, prompt:n] = ids[i, prompt:n]
            step.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
        out.append(step)
    return out


def n_items(step: list[dict]) -> int:
    return sum(int((b["labels"][:, 1:] != -100).sum()) for b in step)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def adalomo(params):
    from tunelab.optimizers import AdaLomo

    return AdaLomo(params, lr=LR, clip_grad_norm=MAX_NORM)


def lomo(params):
    from tunelab.optimizers import Lomo

    return Lomo(params, lr=LR, clip_grad_norm=MAX_NORM)


def optimizer(method: str):
    return {"adalomo": adalomo, "lomo": lomo}.get(method, adamw)


def reference(method: str, steps: int = STEPS, tensors: bool = False) -> dict:
    """One process, the computation every layout must reproduce. `tensors`: also every parameter's gradient in the
    first step, before clipping (`grads`; none for LOMO/AdaLomo, which never hold a whole one), and every
    parameter after the last step (`weights`), by name (a tied weight under both its names)."""
    model = tiny_model(method)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(method)(params)
    losses, norms, first = [], [], {}
    for step in batches(steps):
        n, total = n_items(step), 0.0
        if method in FUSED:  # the optimizer runs backward (twice: norm, then clipped update)
            loss, norm = opt.fused_step(lambda s=step, n=n: torch.stack(
                [model(**b, num_items_in_batch=torch.tensor(n)).loss for b in s]).sum())
            losses.append(loss)
            norms.append(norm)
            continue
        for b in step:
            loss = model(**b, num_items_in_batch=torch.tensor(n)).loss
            loss.backward()
            total += float(loss.detach())
        if tensors and not first:
            first = {k: p.grad.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)
                     if p.requires_grad}
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    with torch.no_grad():
        b = batches(1)[0][0]
        val = float(model(**b, num_items_in_batch=torch.tensor(1)).loss)
    param_sum = sum(float(p.detach().double().sum()) for p in model.parameters())
    out = {"loss": losses, "grad_norm": norms, "eval": [val, n_items([b])], "param_sum": param_sum}
    if tensors:
        out.update(grads=first, weights={k: p.detach().clone() for k, p in
                                         model.named_parameters(remove_duplicate=False)})
    return out


def max_diff(got: dict, want: dict) -> dict:
    """{"names": how many compared, "missing": names on one side only, "max": the largest absolute difference over
    every element of every tensor, "at": the parameter where it is} of two {name: tensor} maps."""
    missing = sorted(set(got) ^ set(want))
    diffs = {k: float((got[k].float() - want[k].float()).abs().max()) for k in set(got) & set(want)}
    at = max(diffs, key=diffs.get) if diffs else None
    return {"names": len(diffs), "missing": missing, "max": diffs.get(at, 0.0), "at": at}


def cell(parallel: dict, method: str):
    from tunelab.core.config import CellConfig

    return CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
        "peft": {"method": "lora" if method == "lora" else "none"},
        "optim": {"name": method if method in FUSED else "adamw"},
        "parallel": parallel,
        # A cell refuses grad_accum > 1 with an in-backward optimizer (nothing to accumulate into); the
        # engine still takes the step's micro-batches, running them as one graph, as the reference does.
        "train": {"batch_size": BATCH, "grad_accum": 1 if method in FUSED else GRAD_ACCUM,
                  "max_grad_norm": MAX_NORM, "loss_chunk": LOSS_CHUNK},
    })
