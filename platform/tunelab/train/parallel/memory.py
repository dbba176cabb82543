"""A per-device memory model of training a decoder under a layout, from the model's config alone.

train = parameters + optimizer state + engine buffers + max(gradients, activations): the peak of a step
comes either at the start of backward (all activations alive, no gradients yet) or at its end (all
gradients, activations freed). The load comes before it: a process that builds the model whole holds all
of its stage's weights before the engine shards them; one that builds it sharded (tunelab's own init for
every multi-process native layout and DeepSpeed ZeRO-3, train/parallel/deferred.py) holds its shards and
the one block it is reading. peak = max(load, train).

Engine buffers: FSDP2 gathers one unit (a decoder layer; an untied embedding or head) at a time; around
a unit's backward it holds the unit's gathered weights, their unsharded gradients, the copy that is
reduce-scattered, and the next unit prefetched: 4 units (zero 2 keeps every unit gathered from forward to
backward, counted as whole parameters, plus the gradients' 2). DeepSpeed keeps an fp32 copy of each
partition even of fp32 weights (counted with the optimizer state); under ZeRO-3 its gathered parameters
are capped by the sizes tunelab sets (ds_fused.py zero3_buckets: 11.9 h^2 values) and a layer's unsharded
gradients wait in its reduce bucket; under ZeRO-1/2 the reduce bucket (5e8 values by default) holds up to
every gradient.

Activations are counted as transformers' Llama-family modules keep them for backward (SDPA
attention: nothing quadratic in the sequence):
  per layer and token: 6h replicated under tp (two RMSNorms' input and output, the two blocks'
  inputs) + 3h + 2kv + 4i split under tp (query, attention output and its copy, key, value;
  gate, SiLU, up, product); plus 3h per token at the head (final norm's input and output, the labelled
  rows' copy). tunelab's lean norm and MLP (train/lean.py, the families of LEAN_TYPES) keep neither a
  norm's output nor the SiLU's: 4h + (3h + 2kv + 3i) / tp a layer, 2h at the head.
The head and loss run in chunks (train/chunked.py): one chunk's fp32 logits (chunk x v fp32 values;
measured, its temporaries do not meet the peak) instead of the whole batch's logits and their gradient,
and, as backward starts with all activations alive, the head weight's fp32 gradient (v x h: built in
forward, or being summed in backward; not under LOMO/AdaLomo with a tied embedding, whose lookup builds
it at the end of backward). Checked against measured peaks in tests/test_parallel_memory.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tunelab.core.registries import DEFAULT_ENGINE, ENGINES, OPTIMIZERS

GB = 1e9
CHUNK_BYTES = 64 * 2**20  # the chunked head's (train/chunked.py) fp32 logits of one chunk and a temporary


def auto_chunk(vocab: int) -> int:
    """Positions per chunk of the head and loss: a chunk's logits and one temporary (2 x 4 bytes a value)
    within CHUNK_BYTES."""
    return max(16, CHUNK_BYTES // (8 * vocab))

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Optimizer state per trainable parameter (fp32 values), and whether it updates inside backward (one
# parameter's gradient at a time), come from the optimizer registry: tunelab.core.registries.OPTIMIZERS.


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    lean: bool = True  # train/lean.py swaps its norms and MLPs (LEAN_TYPES)

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_matrices(self) -> list[tuple[int, int]]:
        h, q = self.hidden, self.heads * self.head_dim
        return [(q, h), (self.kv, h), (self.kv, h), (h, q), (self.inter, h), (self.inter, h), (h, self.inter)]

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.layer_matrices()) + 2 * self.hidden

    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def total(self) -> int:
        head = 0 if self.tied else self.embed_params()
        return self.embed_params() + head + self.layers * self.layer_params() + self.hidden


# Model types whose RMSNorm and MLP are transformers' Llama code, which train/lean.py swaps (it compares the
# code itself; tests/test_parallel_memory.py checks this list against it).
LEAN_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def shape_of(config) -> Shape:
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(vocab=config.vocab_size, hidden=config.hidden_size, inter=config.intermediate_size,
                 layers=config.num_hidden_layers, heads=heads,
                 kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=hd,
                 tied=bool(getattr(config, "tie_word_embeddings", False)),
                 lean=getattr(config, "model_type", None) in LEAN_TYPES)


def _llama(h: int, i: int, layers: int, heads: int) -> Shape:
    return Shape(vocab=32000, hidden=h, inter=i, layers=layers, heads=heads, kv_heads=heads, head_dim=h // heads,
                 tied=False)


# The LLaMA-1 shapes of CoLLiE's memory figure, usable offline by name.
SHAPES = {"llama-7b": _llama(4096, 11008, 32, 32), "llama-13b": _llama(5120, 13824, 40, 40),
          "llama-30b": _llama(6656, 17920, 60, 52), "llama-65b": _llama(8192, 22016, 80, 64)}


def load_shape(name: str) -> Shape:
    """A SHAPES name, a catalog alias, a local folder or a hub id; reads only the config."""
    if name in SHAPES:
        return SHAPES[name]
    from transformers import AutoConfig

    from tunelab.models.loading import resolve

    return shape_of(AutoConfig.from_pretrained(resolve(name)))


@dataclass(frozen=True)
class Setup:
    optim: str = "adamw"
    peft: str = "none"
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q", "v")
    lora_dropout: float = 0.0
    dtype: str = "bfloat16"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 3
    seq: int = 2048
    batch: int = 1
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    activation_checkpointing: bool = False
    backend: str = DEFAULT_ENGINE  # a name of registries.ENGINES, whose facts the model reads
    loss_chunk: int | None = None  # train.loss_chunk: labelled positions per chunk of the head (None: automatic)
    whole_init: bool = False  # built whole on every process even where tunelab shards at construction (DoRA)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sharded_init(self) -> bool:
        """Built sharded (parallel.init_mode "meta" or "zero3"), not whole on every process."""
        return not self.whole_init and self.world > 1 and self.zero >= ENGINES[self.backend].whole_below_zero


@dataclass(frozen=True)
class Estimate:
    params: float  # bytes per device
    grads: float
    optimizer: float
    activations: float
    trainable: int
    total_params: int
    buffers: float = 0.0  # the engine's gathered weights and communication buckets
    load: float = 0.0  # what a process holds while the model loads, before the engine shards it
    step: float = 0.0  # the optimizer step's temporaries, beside the gradients

    @property
    def train(self) -> float:
        return self.params + self.optimizer + self.buffers + max(self.grads + self.step, self.activations)

    @property
    def peak(self) -> float:
        return max(self.load, self.train)

    def as_dict(self) -> dict:
        return {**asdict(self), "train": self.train, "peak": self.peak}


def _lora_params(shape: Shape, s: Setup) -> tuple[int, list[tuple[int, int]]]:
    pick = {"q": 0, "k": 1, "v": 2, "o": 3, "gate": 4, "up": 5, "down": 6}
    mats = [shape.layer_matrices()[pick[t]] for t in s.lora_targets]
    return shape.layers * sum(s.lora_r * (a + b) for a, b in mats), [(s.lora_r, b) for a, b in mats]


def _stage_params(shape: Shape, s: Setup) -> float:
    """Parameters on the fullest pipeline stage's tensor-parallel rank (embedding and lm_head are
    replicated under tp; with pp the first stage has the embedding, the last lm_head)."""
    per_layer = (shape.layer_params() - 2 * shape.hidden) / s.tp + 2 * shape.hidden
    if s.pp == 1:
        ends = shape.embed_params() * (1 if shape.tied else 2) + shape.hidden
    else:
        ends = shape.embed_params() + shape.hidden
    return shape.layers / s.pp * per_layer + ends


def estimate(shape: Shape, s: Setup) -> Estimate:
    b = DTYPE_BYTES[s.dtype]
    stage = _stage_params(shape, s)
    if s.peft == "lora":
        trainable, matrices = _lora_params(shape, s)
        trainable_here = trainable / s.pp
        params = (stage + trainable_here) * b
    else:
        trainable, matrices = shape.total(), shape.layer_matrices()
        trainable_here = stage
        params = stage * b
    params /= s.dp if s.zero >= 3 else 1
    opt = OPTIMIZERS[s.optim]
    if opt.fused and s.pp == 1:
        # One gradient at a time, plus the fp32 copy its update works on (none for fp32 weights: optimizers/fused.py
        # updates in the gradient's own memory). The largest is the embedding's, which its lookup's backward, the
        # last, builds whole (a tied one from the head's factors too: optimizers/tied.py); it is the peak of a step
        # whose activations are small (batch 1 x 64: 98 MB of a 100M Llama's 32,000 x 768 embedding).
        whole = matrices + [(shape.vocab, shape.hidden)] * (s.peft == "none")
        grads = max(a * c for a, c in whole) / s.tp * (b + (0 if b == 4 else 4))
    else:  # (under pipelines a fused optimizer updates after the schedule: the stage's gradients exist)
        grads = trainable_here * b / (s.dp if s.zero >= 2 else 1)
    opt_values = _state_values(shape, s, opt, matrices, trainable_here)
    # Mixed precision keeps an fp32 master copy of the trainable weights (fused optimizers update in place);
    # DeepSpeed's ZeRO optimizer keeps one of its partitions whatever the weights' dtype.
    master = trainable_here if not opt.fused and (s.dtype != "float32" or ENGINES[s.backend].fp32_master) else 0
    optimizer = (opt_values + master) * 4 / s.dp  # FSDP2 and every ZeRO stage shard optimizer state
    # A per-parameter step with moments (torch's AdamW on CPU, tunelab's) builds its update of one parameter
    # beside the moments: about two fp32 temporaries of the largest matrix (measured: AdamW under gradient
    # checkpointing, where the step and not the activations sets the peak).
    per_param = not opt.fused and isinstance(opt.states, (int, float)) and opt.states > 0
    step = 2 * max(a * c for a, c in matrices + [(shape.vocab, shape.hidden)] * (s.peft == "none")) * 4 / s.dp \
        if per_param else 0.0
    return Estimate(params=params, grads=grads, optimizer=optimizer, activations=_activations(shape, s) * b, step=step,
                    trainable=int(trainable), total_params=shape.total(), buffers=_buffers(shape, s, opt, stage),
                    load=_load(shape, s, stage))


# What each member of a together-group holds beyond its tensors' values: its own PEFT modules and their
# bookkeeping, its batches' loader, its optimizer's per-parameter state objects. Measured on SmolLM2-135M, LoRA r8
# on every projection, AdamW, fp32 (benchmarks/together.py (c), pinned allocator): see benchmarks/README.md.
MEMBER_OVERHEAD = 4 * 2**20


def estimate_group(shape: Shape, setups: list[Setup], batched: bool = False) -> Estimate:
    """A together-group's peak on its one device (run/together.py): the base's weights once; each member's adapter
    weights and optimizer state for as long as it lives, and a fixed overhead (MEMBER_OVERHEAD). In exact mode the
    members step one at a time, so a step's gradients, temporaries and activations are those of the largest; in
    batched mode (train/batched.py) one pass holds the joined members' activations and gradients at once: their sum
    (a member that steps exact even so, run/together.py `why_not_batched`, steps alone after the pass). One process
    only (a group has no engine)."""
    ests = [estimate(shape, s) for s in setups]
    base = _stage_params(shape, setups[0]) * DTYPE_BYTES[setups[0].dtype]
    adapters = sum(e.params - base for e in ests)
    joined = [e for e, s in zip(ests, setups) if batched and not steps_exact(s)]
    apart = [e for e, s in zip(ests, setups) if not (batched and not steps_exact(s))]

    def most(part: str) -> float:
        return max([sum(getattr(e, part) for e in joined), *(getattr(e, part) for e in apart)])

    return Estimate(params=base + adapters + MEMBER_OVERHEAD * len(setups), grads=most("grads"),
                    optimizer=sum(e.optimizer for e in ests), activations=most("activations"),
                    trainable=sum(e.trainable for e in ests), total_params=ests[0].total_params,
                    load=max(e.load for e in ests), step=max(e.step for e in ests))


def steps_exact(s: Setup) -> bool:
    """A member that does not join a batched pass (run/together.py `why_not_batched`, in the memory model's words):
    an optimizer that updates inside its own backward, or a recomputed layer that would draw its dropout again."""
    return OPTIMIZERS[s.optim].fused or (s.activation_checkpointing and s.peft == "lora" and s.lora_dropout > 0)


def _layer_values(shape: Shape, s: Setup) -> float:
    """Values of one decoder layer on one tensor-parallel rank."""
    return (shape.layer_params() - 2 * shape.hidden) / s.tp + 2 * shape.hidden


def _buffers(shape: Shape, s: Setup, opt, stage: float) -> float:
    b = DTYPE_BYTES[s.dtype]
    if ENGINES[s.backend].buffers == "buckets":
        if s.dp == 1 or opt.fused:  # no ZeRO optimizer: nothing is bucketed (ds_fused.py)
            return 0.0
        if s.zero == 3:
            h = shape.hidden
            return (11.9 * h * h + _layer_values(shape, s)) * b
        return min(5e8, stage) * b
    if s.dp == 1:
        return 0.0
    units = [_layer_values(shape, s)] + ([] if shape.tied else [shape.embed_params()])
    if s.zero == 2:  # every unit stays gathered from forward to backward: counted as whole parameters
        return 2 * max(units) * b
    return 4 * max(units) * b


def _load(shape: Shape, s: Setup, stage: float) -> float:
    """Built whole: every weight of the stage (LoRA's adapters are small). Built sharded: this process's
    shards plus the block of the largest weight being read."""
    b = DTYPE_BYTES[s.dtype]
    if not s.sharded_init:
        return stage * b
    largest = max([shape.embed_params(), *(x * y for x, y in shape.layer_matrices())])
    share = s.dp if s.zero >= ENGINES[s.backend].shards_all_from_zero else 1
    return (stage / share + largest / share) * b


def _state_values(shape: Shape, s: Setup, opt, matrices, trainable_here: float) -> float:
    """Optimizer state values on the fullest stage: per parameter, or a row and a column per matrix
    ("factored"); Muon keeps its own count for hidden matrices and AdamW's for the rest (other_states)."""
    def values(states, params: float, mats) -> float:
        if states == "factored":
            return shape.layers / s.pp * sum(a + c for a, c in mats) / s.tp
        return states * params

    if opt.other_states is None or s.peft != "none":  # adapters' factors are all hidden matrices
        return values(opt.states, trainable_here, matrices)
    hidden = shape.layers / s.pp * (shape.layer_params() - 2 * shape.hidden) / s.tp
    return values(opt.states, hidden, matrices) + values(opt.other_states, trainable_here - hidden, [])


def _linear_inputs(shape: Shape, s: Setup) -> dict[tuple[str, ...], float]:
    """Each group of linear layers that reads one input, and that input's values per token (sharded under TP
    for the row-parallel o and down)."""
    h, i = shape.hidden, shape.inter
    return {("down",): i / s.tp, ("o",): h / s.tp, ("gate", "up"): h, ("q", "k", "v"): h}


def _unsaved_inputs(shape: Shape, s: Setup) -> float:
    """Values per token and layer that backward keeps only for a weight's gradient: with LoRA the base
    weights are frozen, and a linear layer with a frozen weight (and no adapter) does not keep its input."""
    if s.peft != "lora":
        return 0.0
    t = set(s.lora_targets)
    return sum(size for layers, size in _linear_inputs(shape, s).items() if not t & set(layers))


def _dropout_copies(shape: Shape, s: Setup) -> float:
    """Values per token and layer that LoRA's dropout adds: each adapted layer keeps its own dropped-out copy of
    its input for the adapter's backward, and the mask (a byte a value). Measured on the quickstart's LoRA cell
    (SmolLM2-135M, all seven projections, fp32): 1,949 MB of tensors with dropout 0.05 against 1,456 with 0."""
    if s.peft != "lora" or s.lora_dropout == 0:
        return 0.0
    adapted = sum(size * len(set(layers) & set(s.lora_targets)) for layers, size in _linear_inputs(shape, s).items())
    return adapted * (1 + 1 / DTYPE_BYTES[s.dtype])


def _activations(shape: Shape, s: Setup) -> float:
    h, kv, i = shape.hidden, shape.kv, shape.inter
    rows = s.batch / s.dp
    if s.pp > 1:  # the first stage holds the most micro-batches in flight
        in_flight = s.microbatches if s.pp_schedule == "gpipe" else min(s.pp, s.microbatches)
        rows = rows * in_flight / s.microbatches
    tokens = rows * s.seq
    norms, mlp, final = (4, 3, 2) if shape.lean else (6, 4, 3)  # train/lean.py: no norm or SiLU output kept
    per_layer = (norms * h + (3 * h + 2 * kv + mlp * i) / s.tp - _unsaved_inputs(shape, s)
                 + _dropout_copies(shape, s))
    layers = shape.layers / s.pp
    body = tokens * (layers * h + per_layer) if s.activation_checkpointing else tokens * layers * per_layer
    return body + tokens * final * h + _head(shape, s, tokens)


def _head(shape: Shape, s: Setup, tokens: float) -> float:
    """The chunked head and loss (train/chunked.py) as backward starts, in values of the model's dtype: one
    chunk's fp32 logits, and the head weight's fp32 gradient being summed (for a trainable
    head, unless a fused optimizer's tied lookup builds it later)."""
    fp32 = 4 / DTYPE_BYTES[s.dtype]
    chunk = min(tokens, s.loss_chunk or auto_chunk(shape.vocab))
    trainable_head = s.peft == "none" and s.pp == 1 and not (OPTIMIZERS[s.optim].fused and shape.tied)
    return (chunk * shape.vocab + (shape.vocab * shape.hidden if trainable_head else 0)) * fp32


def devices_needed(shape: Shape, s: Setup, device_gb: float, max_devices: int = 4096) -> int | None:
    """Fewest devices (growing dp, the given tp and pp) whose per-device peak fits; None if none does."""
    n = s.tp * s.pp
    dp = 1
    while dp * n <= max_devices:
        if estimate(shape, _with(s, dp=dp)).peak <= device_gb * GB:
            return dp * n
        dp *= 2
    return None


def _with(s: Setup, **kw) -> Setup:
    return Setup(**{**asdict(s), **kw})
