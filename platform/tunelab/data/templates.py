"""Prompt templates: a row in the Alpaca schema -> (prompt, response) strings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Stanford Alpaca's prompts, verbatim: the response follows "### Response:" directly.
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def _alpaca(row: dict, tokenizer=None) -> tuple[str, str]:
    fmt = ALPACA_INPUT if row.get("input") else ALPACA_NO_INPUT
    return fmt.format(instruction=row["instruction"], input=row.get("input", "")), row["output"]


def _plain(row: dict, tokenizer=None) -> tuple[str, str]:
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return prompt + "\n", row["output"]


def _chat(row: dict, tokenizer=None) -> tuple[str, str]:
    """The tokenizer's own chat template; the response is the assistant turn's content."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("the 'chat' template needs a tokenizer with a chat_template")
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    return prompt, row["output"]


@dataclass(frozen=True)
class Template:
    name: str
    fn: Callable[..., tuple[str, str]]

    def render(self, row: dict, tokenizer=None) -> tuple[str, str]:
        return self.fn(row, tokenizer)


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("alpaca", _alpaca), Template("plain", _plain), Template("chat", _chat)
)}
