"""Several cells' adapters over one frozen base in one process: the members of a together-group (run/together.py
plans them, cell/group.py runs them). Exact mode: each member steps alone, in turn, with the shapes it has alone, so
its losses, gradients and checkpoints are the alone cell's bit for bit whatever its group-mates.

What a member has of its own, and what makes it equal to the cell alone:
    adapter     injected under the member's name (`m<k>`), drawn from its own seed right before (peft draws an
                adapter's init from the global RNG: every method does, IA3 too), so its init is the alone init
    names       its parameters, in its checkpoints and for its optimizer, keyed as the alone cell's (`alone_key`):
                the adapter name becomes `default`, and the `.base_layer` segments that nesting adds go; either can
                resume what the other saved
    turn        before each of its steps: only its adapter active and trainable (`activate`, over peft's tuner
                layers found once, `Index`: peft's own set_adapter is per PeftModel and one tuner type, and walks
                every module), its head settings back
                on the shared output head (train/chunked.py's chunk, early flag and workspace: every
                parallel.prepare writes them, and a group-mate's left there changes the last bits of a loss), its
                own random streams (python, numpy, torch: dropout draws from them), the model in training mode
    loop        its own `train.loop.Training` (stepper + optimizer, schedule, batches, validation, checkpoints),
                driven a step at a time (`loop.advance`)
    final/      its adapter alone, written by peft's save_pretrained from a skeleton of the base on the meta
                device holding only the member's tensors (adapter_model.safetensors byte-identical to alone's)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tunelab.core.config import CellConfig
from tunelab.train import checkpoint
from tunelab.train import peft as tpeft
from tunelab.train.chunked import CHUNK_ATTR, EARLY_ATTR, WORKSPACE_ATTR
from tunelab.train.modes import set_training
from tunelab.train.parallel.anatomy import causal_lm

HEAD_ATTRS = (CHUNK_ATTR, EARLY_ATTR, WORKSPACE_ATTR)


def member_name(k: int) -> str:
    return f"m{k}"


def alone_key(key: str, name: str) -> str:
    """A member's parameter name as the alone cell has it. Tuner layers of several methods on one module nest
    (ia3.Linear(base_layer=lora.Linear(...))): an adapter's parameter never lives under a base_layer alone, so
    those segments go; the member's name becomes peft's `default` (IA3's ia3_l.<name> ends with it)."""
    return (key.replace(".base_layer", "") + ".").replace(f".{name}.", ".default.")[:-1]


INDEX = "_tunelab_members"  # where a group's model keeps its Index (inject and remove drop it)


@dataclass
class Index:
    """The model's tuner layers, which members each hosts, and each member's adapter parameters: found once, not at
    every turn (a walk over 16 LoRA members of SmolLM2 visits 12,000 modules: 30 ms, a turn per member per step).
    Only inject and remove change what it holds, and both drop it."""

    layers: list[Any]
    hosted: list[frozenset[str]]
    params: dict[str, list[torch.nn.Parameter]]

    @classmethod
    def of(cls, model: Any) -> Index:
        index = model.__dict__.get(INDEX)
        if index is None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
            params: dict[str, list[torch.nn.Parameter]] = {}
            seen: set[int] = set()
            for layer in layers:
                for attr in layer.adapter_layer_names:  # (a DoRA layer may name its magnitude twice: each param once)
                    for key, held in getattr(layer, attr).items():  # modules (LoRA's A, B) or parameters (IA3's)
                        ps = [held] if isinstance(held, torch.nn.Parameter) else list(held.parameters())
                        params.setdefault(key, []).extend(p for p in ps if id(p) not in seen)
                        seen.update(id(p) for p in ps)
            hosted = [frozenset(k for attr in layer.adapter_layer_names for k in getattr(layer, attr))
                      for layer in layers]
            index = model.__dict__[INDEX] = cls(layers, hosted, params)
        return index


def _changed(model: Any) -> None:
    """The model's adapters changed: its Index (and its base's, where one was asked of it) found again when next
    asked."""
    for m in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        if m is not None:
            m.__dict__.pop(INDEX, None)


def tuner_layers(model: Any) -> list[Any]:
    return Index.of(model).layers


def hosts(layer: Any, name: str) -> bool:
    return any(name in getattr(layer, attr) for attr in layer.adapter_layer_names)


def activate(model: Any, name: str) -> None:
    """Member `name` alone: its adapters active and trainable in every tuner layer that hosts it, none active in
    the others (a layer of another method, or a module it does not adapt). What peft's BaseTunerLayer.set_adapter
    does per layer, for nested layers of several tuner types too."""
    activate_all(model, [name])
    if name in getattr(model, "peft_config", {}):
        model.active_adapter = name  # the PeftModel's active config (train/loss.py asks is_prompt_learning)


def activate_all(model: Any, names: list[str]) -> None:
    """These members' adapters all active and trainable at once (a batched pass, train/batched.py, which routes each
    row to its own member's adapter itself)."""
    index = Index.of(model)
    for layer, hosted in zip(index.layers, index.hosted):
        layer._active_adapter = [n for n in names if n in hosted]
    for key, params in index.params.items():
        on = key in names
        for p in params:
            if p.requires_grad != on:
                p.requires_grad_(on)


def inject(model: Any, name: str, cfg: CellConfig) -> Any:
    """Member `name`'s adapter, drawn from its own seed (so its init is the alone init), onto `model` (the base, or
    the PeftModel of the members before it) -> the PeftModel."""
    from peft import get_peft_model, inject_adapter_in_model
    from transformers import set_seed

    set_seed(cfg.train.seed)
    _changed(model)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    config = tpeft.config(base, cfg.peft)
    if ends := shared_ends(base, config):  # run/together.py keeps these alone by name; a name it does not know
        from tunelab.core.errors import UserError

        raise UserError(f"its adapter would sit on {', '.join(ends)}, which every member of its together-group "
                        "shares; run it with --together off", key="peft.target_modules")
    try:
        if not hasattr(model, "peft_config"):
            return get_peft_model(model, config, adapter_name=name)
        if config.peft_type == model.peft_type:
            if not _beside(model, name, config):
                model.add_adapter(name, config)
        else:  # another tuner type on the same base: injected by hand (a PeftModel holds one type)
            inject_adapter_in_model(config, base, adapter_name=name)
    except ValueError as e:  # e.g. a target module the model does not have
        from tunelab.core.errors import UserError

        raise UserError(f"peft could not wrap the model: {e}", key="peft") from None
    finally:
        _changed(model)
    return model


def shared_ends(base: Any, config: Any) -> list[str]:
    """The base's output head and input embeddings, where `config` would adapt them (peft's own matching)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    lm = causal_lm(base)
    ends = {id(m) for m in (lm.get_output_embeddings(), lm.get_input_embeddings()) if m is not None}
    return [key for key, m in base.named_modules() if id(m) in ends and bool(check_target_module_exists(config, key))]


# What decides which modules a LoRA config adapts (and what else inject_adapter does beyond them): two configs equal
# here adapt the same modules, so a later member can be added beside an earlier one's layers (`_beside`).
_MATCHING = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "target_parameters",
             "modules_to_save", "bias", "trainable_token_indices", "ensure_weight_tying", "layer_replication")


def _matching(config: Any) -> dict:
    return {k: getattr(config, k, None) for k in _MATCHING} | {"target_modules": set(config.target_modules)}


def _beside(model: Any, name: str, config: Any) -> bool:
    """A LoRA or DoRA member added in the very layers of an earlier member with the same targets, through peft's own
    per-layer code (LoraModel._create_and_replace -> update_layer), in module order as peft's inject_adapter visits
    them, so its init draws what it draws alone. Not peft's add_adapter: that walks every module of the model several
    times and matches each against every adapter layer's name, so adding the k-th member costs k times the first
    (16 SmolLM2 members: 5.4 s). False (peft's add_adapter then) for anything else: another tuner type, other
    targets, a layer nested in another tuner type's, an init that reads data or the base (PiSSA, LoftQ, EVA...)."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import _get_submodules

    if not isinstance(config, LoraConfig) or config.init_lora_weights not in (True, False, "gaussian") \
            or not isinstance(config.target_modules, list | set) or config.bias != "none":
        return False
    mine = _matching(config)
    like = next((n for n, c in model.peft_config.items()
                 if isinstance(c, LoraConfig) and isinstance(c.target_modules, list | set) and _matching(c) == mine),
                None)
    if like is None:
        return False
    tuner = model.base_model
    keys = [k for k, m in tuner.model.named_modules() if isinstance(m, LoraLayer) and like in m.lora_A]
    if not keys or any(".base_layer" in k for k in keys):
        return False
    model.peft_config[name] = config
    try:
        for key in keys:
            parent, target, target_name = _get_submodules(tuner.model, key)
            tuner._create_and_replace(config, name, target, target_name, parent, current_key=key)
    except Exception:
        remove(model, name)
        raise
    tuner.targeted_module_names.extend(k for k in keys if k not in tuner.targeted_module_names)
    tuner._cast_adapter_dtype(adapter_name=name, autocast_adapter_dtype=True)  # as add_adapter and get_peft_model
    return True


def remove(model: Any, name: str) -> None:
    """A member's adapter gone from every tuner layer (a released or failed member: its memory back)."""
    index = Index.of(model)
    for layer, hosted in zip(index.layers, index.hosted):
        if name in hosted:
            layer._active_adapter = []  # (peft would pick another member to activate; each turn activates its own)
            layer.delete_adapter(name)
    _changed(model)
    getattr(model, "peft_config", {}).pop(name, None)


def member_state(model: Any, name: str) -> dict[str, torch.Tensor]:
    """A member's adapter tensors under their alone names."""
    return {alone_key(n, name): p.detach() for n, p in model.named_parameters() if f".{name}." in n + "."}


def write_final(model: Any, name: str, cfg: CellConfig, out: Path) -> None:
    """final/ as the alone cell writes it: peft's own save_pretrained, on a skeleton of the base on the meta device
    holding only this member's adapter (named `default`), its tensors assigned from the group's (no copy)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base_cfg = causal_lm(model).config
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        skeleton = AutoModelForCausalLM.from_config(base_cfg)
    skeleton.config._name_or_path = base_cfg._name_or_path
    view = get_peft_model(skeleton, tpeft.config(skeleton, cfg.peft))
    missing = view.load_state_dict(member_state(model, name), strict=False, assign=True)
    if missing.unexpected_keys:
        raise RuntimeError(f"member {name}'s adapter does not fit its own skeleton: {missing.unexpected_keys[:3]}")
    view.save_pretrained(str(out))


@dataclass
class HeadSettings:
    """The output head's per-stepper attributes (train/chunked.py set_chunk) of one member."""

    head: Any
    values: dict[str, Any]

    @classmethod
    def of(cls, model: Any, shared: dict[str, Any]) -> HeadSettings | None:
        head = causal_lm(model).get_output_embeddings()
        if head is None:
            return None
        values = {a: getattr(head, a, None) for a in HEAD_ATTRS}
        if values[WORKSPACE_ATTR] is not None:  # one workspace for the group: one member runs at a time
            values[WORKSPACE_ATTR] = shared.setdefault("workspace", values[WORKSPACE_ATTR])
        return cls(head, values)

    def put(self) -> None:
        for attr, value in self.values.items():
            setattr(self.head, attr, value)


@dataclass
class Member:
    """One member of a together-group: its adapter's name, its loop, its random streams and head settings, and
    where it stands (`next`: the first step it has not trained)."""

    k: int
    cfg: CellConfig
    model: Any  # the group's PeftModel
    loop: Any  # train.loop.Training
    rng: dict
    head: HeadSettings | None
    next: int = 1
    resumed_from: int | None = None
    paused_at: int | None = None
    done: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return member_name(self.k)

    @contextlib.contextmanager
    def turn(self) -> Iterator[Member]:
        """This member's adapter alone active, its head settings and random streams in place; its streams saved
        back after (whatever ends the turn)."""
        activate(self.model, self.name)
        if self.head is not None:
            self.head.put()
        if not (self.model.training and causal_lm(self.model).training):
            # Validation puts the mode back; the group's evaluation and from_pretrained (under peft's wrapper, which
            # is made in training mode) leave the model in eval mode, which its top module may not say.
            set_training(self.model, True)
        checkpoint.set_rng_state(self.rng)
        try:
            yield self
        finally:
            self.rng = checkpoint.rng_state()


def setup(k: int, model: Any, rng: dict, shared: dict[str, Any], make_loop: Callable[[Callable[[str], str]], Any],
          ) -> Member:
    """Member k's loop over the group's model, its adapter active (its stepper sees only its parameters, under
    their alone names), resumed from its folder's latest checkpoint as the cell alone would be. `rng`: the random
    state right after its adapter was injected (what its alone run has at this point); `make_loop(names)` builds
    its Training (train.loop.setup with the cell's settings)."""
    from tunelab.train import loop as tloop

    name = member_name(k)
    activate(model, name)
    checkpoint.set_rng_state(rng)
    training = make_loop(lambda n: alone_key(n, name))
    # Its parameters as the cell alone has them (total_params, MFU): the base and its own adapter, not its mates'.
    training.n_params -= sum(p.numel() for key, ps in Index.of(model).params.items() if key != name for p in ps)
    head = HeadSettings.of(model, shared)
    start, resumed_from = tloop.resume(training)
    cfg = training.cfg
    training.final_writer = lambda out: write_final(model, name, cfg, out)
    return Member(k, cfg, model, training, checkpoint.rng_state(), head, next=start, resumed_from=resumed_from)
