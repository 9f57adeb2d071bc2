"""Assistant spans in a rendered conversation: one method for every chat template.

* Templates with ``{% generation %}`` markers: transformers' own assistant mask
  (``apply_chat_template(return_assistant_tokens_mask=True)``), exactly what the template author marked.
* Any other template: the conversation is rendered **once** and each turn is located in that render, in order.
  Rendering prefixes and diffing them (the obvious method) breaks on templates that rewrite earlier turns when
  the conversation grows — Qwen3 puts an empty ``<think>`` block only on turns after the last user message,
  Mistral-v0.3 folds the system prompt into the last user turn, Phi-3 appends eos after the last turn, gpt-oss
  closes the last reply with ``<|return|>`` and earlier ones with ``<|end|>``. Here an assistant turn's span is
  its reply text, found after the previous turn (anchored at the generation prompt whenever the render of the
  history plus that prompt is a prefix of the whole), plus the **one** special token that directly closes it in
  the render (``<|eot_id|>``, ``<|im_end|>``, ``</s>``, ``<|end|>``/``<|return|>``…): what the model generates to
  end its turn, and nothing after it (Phi-3's ``\\n<|endoftext|>`` is not generated, so it is not masked).
* Templates that refuse a system role (Gemma-2: "System role not supported") get the system prompt folded into
  the first user turn, as Gemma-3's template does itself.

A conversation whose turns cannot be found in its render raises ``ChatMaskError`` (callers skip and count it
with ``skip_malformed``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatMaskError(ValueError):
    """The assistant mask of one conversation cannot be derived (its turns are not in the render)."""


def resolve_template(chat_template: str | None) -> str | None:
    """A ``data.chat_template`` value: a path to a Jinja file, or the template itself; None = the tokenizer's."""
    if not chat_template:
        return None
    p = Path(str(chat_template)).expanduser()
    if "{" not in str(chat_template) and len(str(chat_template)) < 4096:
        if not p.is_file():
            raise FileNotFoundError(f"data.chat_template={chat_template!r}: no such file (pass a path to a .jinja "
                                    "file or the template text itself)")
        return p.read_text(encoding="utf-8")
    return str(chat_template)


def template_kwargs(chat_template: str | None = None, enable_thinking: bool | None = None) -> dict:
    """Keyword arguments for ``apply_chat_template`` from the data config keys."""
    kw: dict = {}
    if chat_template:
        kw["chat_template"] = resolve_template(chat_template)
    if enable_thinking is not None:
        kw["enable_thinking"] = bool(enable_thinking)  # Qwen3-style templates read it; others ignore it
    return kw


def fold_system(messages: Sequence[dict]) -> list[dict]:
    """The system prompt prepended to the first user turn (for templates without a system role)."""
    msgs = [dict(m) for m in messages]
    system = "\n\n".join(m["content"] for m in msgs if m["role"] == "system")
    rest = [m for m in msgs if m["role"] != "system"]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}" if system else m["content"]
            break
    return rest


def special_strings(tok: PreTrainedTokenizerBase) -> list[str]:
    found = set(getattr(tok, "all_special_tokens", []) or [])
    for t in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            found.add(t.content)
    return sorted((s for s in found if s), key=len, reverse=True)  # longest first: no prefix shadows a token


def closing_token(full: str, end: int, specials: Sequence[str]) -> int:
    """``end`` moved past the special token that closes a turn right after it (whitespace between allowed)."""
    j = end
    while j < len(full) and full[j].isspace():
        j += 1
    for s in specials:
        if full.startswith(s, j):
            return j + len(s)
    return end


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and bool(_GENERATION.search(template))


def char_spans(render, tok: PreTrainedTokenizerBase, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(full render, [start, end) of every assistant turn in it). ``render(messages, add_generation_prompt)``
    renders with the configured template and options."""
    full = render(messages, False)
    specials = special_strings(tok)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue  # templates move it around (Mistral: into the last user turn); never masked
        text = m["content"].strip()
        if m["role"] == "assistant":
            try:  # anchor at the generation prompt when the history renders as a prefix of the whole
                before = render(messages[:i], True)
            except Exception:  # noqa: BLE001 - a template may refuse a partial conversation; the search still works
                before = ""
            if before and full.startswith(before) and len(before) >= cursor:
                cursor = len(before)
        if not text:
            if m["role"] == "assistant" and cursor:
                end = closing_token(full, cursor, specials)
                if end > cursor:
                    spans.append((cursor, end))
                    cursor = end
            continue
        pos = full.find(text, cursor)
        if pos < 0:
            raise ChatMaskError(f"turn {i} ({m['role']}) is not in the chat template's render of the conversation "
                                "(the template drops or rewrites it); assistant masks cannot be derived — set "
                                "data.chat_template to a template that keeps every turn")
        end = pos + len(text)
        if m["role"] == "assistant":
            end = closing_token(full, end, specials)
            spans.append((pos, end))
        cursor = end
    return full, spans
