"""Prompt templates: a conversation -> text segments, each marked trained (assistant) or masked (the rest).

Segments are tokenized apart, so a label mask falls exactly on their boundaries. `eos` on a segment asks
the tokenizer stage to append the tokenizer's EOS token after it (trained with the reply).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tunelab.core import registries

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
SECTIONS = "### Instruction:"  # where the preamble ends; the preamble never contains it


class TemplateError(ValueError):
    """The template cannot render this conversation, or renders it without the reply."""


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool
    eos: bool = False


def _user_text(turn: dict) -> str:
    return turn["content"] + (f"\n\n{turn['input']}" if turn.get("input") else "")


def _split_system(conv: list[dict]) -> tuple[str | None, list[dict]]:
    if conv and conv[0]["role"] == "system":
        return conv[0]["content"], conv[1:]
    return None, conv


def _alpaca(conv: list[dict], tokenizer=None) -> list[Segment]:
    """Stanford Alpaca's prompt for the first exchange (a system turn replaces its preamble); later
    exchanges repeat the Instruction/Input/Response sections."""
    system, turns = _split_system(conv)
    out: list[Segment] = []
    for turn in turns:
        if turn["role"] == "assistant":
            out.append(Segment(turn["content"], True, eos=True))
            continue
        if turn["role"] != "user":
            raise TemplateError(f"the alpaca template has no place for a {turn['role']!r} turn after the start")
        fmt = ALPACA_INPUT if turn.get("input") else ALPACA_NO_INPUT
        text = fmt.format(instruction=turn["content"], input=turn.get("input", ""))
        if out:  # a later exchange: sections only
            text = "\n\n" + text[text.index(SECTIONS):]
        elif system is not None:
            text = system + "\n\n" + text[text.index(SECTIONS):]
        out.append(Segment(text, False))
    return out


def _plain(conv: list[dict], tokenizer=None) -> list[Segment]:
    """No markup: the user's text and a newline, then the reply and EOS."""
    out = []
    for turn in conv:
        if turn["role"] == "assistant":
            out.append(Segment(turn["content"], True, eos=True))
        else:
            out.append(Segment(_user_text(turn) + ("\n\n" if turn["role"] == "system" else "\n"), False))
    return out


def _chat(conv: list[dict], tokenizer=None) -> list[Segment]:
    """The tokenizer's own chat template. Each assistant turn is the text the template adds when that turn
    is appended to the conversation so far, so the template must render a conversation as a prefix of
    any longer one (most do; templates that rewrite earlier turns are rejected). Turns end with the
    template's own marker; EOS goes after the last one only, and only if the template did not write it."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the 'chat' template needs a tokenizer with a chat_template")
    msgs = [{"role": t["role"], "content": _user_text(t) if t["role"] == "user" else t["content"]} for t in conv]
    eos = tokenizer.eos_token
    out, done = [], ""
    try:
        for i, turn in enumerate(msgs):
            if turn["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise TemplateError("the tokenizer's chat template does not render a conversation as a prefix of "
                                    "its continuation, so turn boundaries cannot be found")
            out += [Segment(prompt[len(done):], False), Segment(full[len(prompt):], True)]
            done = full
        if out and eos and eos not in out[-1].text:  # the template ends turns with its own marker
            out[-1] = Segment(out[-1].text, True, eos=True)
    except TemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja errors raised by the template itself (e.g. role order)
        raise TemplateError(f"the tokenizer's chat template failed: {type(e).__name__}: {e}") from None
    return out


@dataclass(frozen=True)
class Template:
    name: str
    fn: Callable[..., list[Segment]]
    add_special_tokens: bool  # prepend the tokenizer's BOS (chat templates write their own)

    def segments(self, conv: list[dict], tokenizer=None) -> list[Segment]:
        segs = self.fn(conv, tokenizer)
        trained = "".join(s.text for s in segs if s.trained)
        for turn in conv:
            reply = turn["content"].strip()
            if turn["role"] == "assistant" and reply and reply not in trained:
                raise TemplateError(f"template {self.name!r} drops the response: the reply {reply[:60]!r} is not in "
                                    f"the text it trains on")
        return segs

    def render(self, row: dict, tokenizer=None) -> tuple[str, str]:
        """An Alpaca row -> (prompt, response) text, for callers that want plain strings."""
        conv = [{"role": "user", "content": row["instruction"], "input": row.get("input", "")},
                {"role": "assistant", "content": row["output"]}]
        segs = self.segments(conv, tokenizer)
        return "".join(s.text for s in segs if not s.trained), "".join(s.text for s in segs if s.trained)


ALPACA = Template("alpaca", _alpaca, True)
PLAIN = Template("plain", _plain, True)
CHAT = Template("chat", _chat, False)
TEMPLATES = registries.TEMPLATES  # name -> Template (registered there, lazily, by the names above)
