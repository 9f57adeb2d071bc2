"""Chat data for drafter training: load conversations, render them with the target's chat template and
mask everything but the assistant's own tokens.

Accepted row shapes (one conversation per row):

* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}``
* OpenAI:   ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}``

Sources: a local ``.json`` (a list of rows, or ``{"data": [...]}``), ``.jsonl`` or ``.parquet`` file, or
anything else ``datasets.load_dataset`` understands (a hub id; needs a network).

The assistant-only loss mask (reply + the turn-closing token the model generates) comes from
data/chat_spans.py: transformers' ``{% generation %}`` masks where the template has them, otherwise each turn
located in one render of the whole conversation, which tolerates templates that rewrite earlier turns.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from data.chat_spans import ChatMaskError, char_spans, fold_system, has_generation_markers, template_kwargs
from data.packaged import PACKAGE_SOURCES, end_note, iter_json_array, package_source

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names seen in the wild → OpenAI roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


class MalformedRowError(ValueError):
    """A source row that is not a usable conversation; the message names the row and the field."""

    def __init__(self, index: int, field: str, problem: str):
        self.index = index
        self.field = field
        self.problem = problem
        super().__init__(f"row {index}: field '{field}' {problem}" if field else f"row {index}: {problem}")


# --------------------------------------------------------------------------------------------- loading


class BadLine:
    """A source line that could not be decoded; becomes a malformed row (skipped and counted, or the error)."""

    def __init__(self, where: str):
        self.where = where


def _read_json(path: Path, keep_bad: bool = False) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start}); "
                         "re-encode the file as UTF-8") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # Many datasets ship JSON-lines under a `.json` name; accept that rather than fail.
        if e.msg == "Extra data":
            return _read_jsonl(path, keep_bad)
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        return obj["data"]
    if isinstance(obj, list):
        return obj
    raise ValueError(f"{path}: expected a JSON list of rows or an object with a 'data' list, "
                     f"got {type(obj).__name__}" + (f" with keys {sorted(obj)[:8]}" if isinstance(obj, dict) else ""))


def _read_jsonl(path: Path, keep_bad: bool = False) -> list[Any]:
    """One row per line. An undecodable or invalid-JSON line raises, naming file and line; with ``keep_bad`` it
    becomes a BadLine instead, which ``skip_malformed`` skips and counts like any other malformed row."""
    rows: list[Any] = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                rows.append(json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as e:
                bad = BadLine(f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                              "re-encode the file as UTF-8")
            except json.JSONDecodeError as e:
                bad = BadLine(f"{path}:{lineno}: not valid JSON ({e})")
            else:
                continue
            if not keep_bad:
                raise ValueError(bad.where)
            rows.append(bad)
    return rows


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq  # a dependency of `datasets`

    return pq.read_table(path).to_pylist()


def load_rows(source: str | Path, split: str = "train", keep_bad: bool = False, limit: int | None = None) -> list[dict]:
    """Raw rows from a local .json/.jsonl/.parquet file, or from a dataset `datasets.load_dataset` can load.
    ``keep_bad``: undecodable/invalid lines come back as BadLine rows instead of raising. ``limit``: at most that
    many rows (a package's streamed file stops reading there)."""
    if str(source) in PACKAGE_SOURCES:
        import itertools

        path = package_source(str(source))
        read: dict = {}
        rows = list(itertools.islice(iter_json_array(path, read), limit))
        note = end_note(len(rows), read)
        if note:  # a cut file (the shipped one is, inside its last record): say so, keep the rest
            print(f"data: {source}: {note}", flush=True)
        return rows
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix == ".jsonl":
            return _read_jsonl(path, keep_bad)
        if suffix == ".json":
            return _read_json(path, keep_bad)
        if suffix == ".parquet":
            return _read_parquet(path)
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")
    if suffix in LOCAL_SUFFIXES or str(source).startswith((".", "/", "~")):
        # Clearly meant as a local file: a hub lookup would only produce a confusing network error.
        raise FileNotFoundError(f"data source {str(source)!r} does not exist")
    from datasets import load_dataset

    try:
        ds = load_dataset(str(source), split=split)
    except Exception as e:  # datasets raises many unrelated types; one clear line beats all of them
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"data source {str(source)!r} is not a local file and could not be loaded with "
                         f"datasets.load_dataset(split={split!r}): {type(e).__name__}: {first}") from None
    return [dict(r) for r in ds]


# --------------------------------------------------------------------------------------- normalising


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def normalize_conversation(row: dict, index: int) -> list[dict]:
    """One source row → ``[{"role": system|user|assistant, "content": str}, ...]``.

    Raises MalformedRowError naming ``index`` and the offending field.
    """
    if not isinstance(row, dict):
        raise MalformedRowError(index, "", f"must be an object (got {_kind(row)})")
    if "messages" in row and row["messages"] is not None:
        field, role_key, content_key, role_map = "messages", "role", "content", {r: r for r in ROLES}
    elif "conversations" in row and row["conversations"] is not None:
        field, role_key, content_key, role_map = "conversations", "from", "value", SHAREGPT_ROLES
    else:
        raise MalformedRowError(index, "", f"has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT); "
                                           f"keys are {sorted(row)[:8]}")
    turns = row[field]
    if not isinstance(turns, list):
        raise MalformedRowError(index, field, f"must be a list (got {_kind(turns)})")
    out = []
    for j, turn in enumerate(turns):
        where = f"{field}[{j}]"
        if not isinstance(turn, dict):
            raise MalformedRowError(index, where, f"must be an object (got {_kind(turn)})")
        for key in (role_key, content_key):
            if key not in turn:
                raise MalformedRowError(index, f"{where}.{key}", "is missing")
            if not isinstance(turn[key], str):
                raise MalformedRowError(index, f"{where}.{key}", f"must be a string (got {_kind(turn[key])})")
        role = role_map.get(turn[role_key].strip().lower())
        if role is None:
            raise MalformedRowError(index, f"{where}.{role_key}",
                                    f"has unknown role {turn[role_key]!r} (known: {', '.join(sorted(role_map))})")
        out.append({"role": role, "content": turn[content_key]})
    if not any(m["role"] == "assistant" for m in out):
        raise MalformedRowError(index, field, "has no assistant turn")
    return out


def load_conversations(
    source: str | Path,
    split: str = "train",
    skip_malformed: bool = False,
    max_rows: int | None = None,
) -> tuple[list[list[dict]], dict]:
    """Normalised conversations plus stats ``{"rows", "kept", "skipped", "first_error"}``.

    Without ``skip_malformed`` the first malformed row raises; with it, bad rows are counted and skipped.
    """
    rows = load_rows(source, split, keep_bad=skip_malformed, limit=max_rows)
    if max_rows is not None:
        rows = rows[:max_rows]
    convs, stats = _normalize_all(rows, skip_malformed)
    if not convs:
        raise ValueError(f"no usable conversations in {source} ({stats['rows']} rows, {stats['skipped']} skipped"
                         + (f": first error {stats['first_error']}" if stats["first_error"] else "") + ")")
    if stats["skipped"] > stats["kept"]:  # skip_malformed is for a few bad rows, not for the wrong file
        raise ValueError(f"{source}: {stats['skipped']} of {stats['rows']} rows are malformed (first: "
                         f"{stats['first_error']}); fix the file or check data.source")
    return convs, stats


def _normalize_all(rows: Sequence[Any], skip_malformed: bool) -> tuple[list[list[dict]], dict]:
    convs: list[list[dict]] = []
    skipped, first_error = 0, None
    for i, row in enumerate(rows):
        if isinstance(row, list):  # an already-split message list
            row = {"messages": row}
        try:
            if isinstance(row, BadLine):
                raise MalformedRowError(i, "", row.where)
            convs.append(normalize_conversation(row, i))
        except MalformedRowError as e:
            if not skip_malformed:
                raise
            skipped += 1
            first_error = first_error or str(e)
    return convs, {"rows": len(rows), "kept": len(convs), "skipped": skipped, "first_error": first_error}


# -------------------------------------------------------------------------------------- tokenizing


def render_chat(tok: PreTrainedTokenizerBase, messages: Sequence[dict], add_generation_prompt: bool = False,
                chat_template: str | None = None, enable_thinking: bool | None = None) -> str:
    """The chat template rendered to text (the caller tokenizes with ``add_special_tokens=False``).

    ``chat_template`` (a template or a path to one) overrides the tokenizer's; ``enable_thinking`` is passed to
    templates that read it (Qwen3). A template that refuses the system role (Gemma-2) gets the system prompt
    folded into the first user turn.
    """
    kw = template_kwargs(chat_template, enable_thinking)
    if not (kw.get("chat_template") or getattr(tok, "chat_template", None)):
        raise ValueError(f"tokenizer {type(tok).__name__} ({getattr(tok, 'name_or_path', '')!r}) has no chat "
                         "template; chat data needs one (or set data.chat_template)")
    try:
        text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                       **kw)
    except Exception as e:
        if "system" not in str(e).lower() or not any(m["role"] == "system" for m in messages):
            raise
        text = tok.apply_chat_template(fold_system(messages), tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **kw)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def assistant_char_spans(tok: PreTrainedTokenizerBase, messages: Sequence[dict], chat_template: str | None = None,
                         enable_thinking: bool | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full render and the [start, end) character span of every assistant turn in it (data/chat_spans.py)."""
    def render(msgs: Sequence[dict], gen: bool) -> str:
        return render_chat(tok, msgs, gen, chat_template, enable_thinking)

    return char_spans(render, tok, messages)


def _generation_mask(tok: PreTrainedTokenizerBase, messages: Sequence[dict], kw: dict) -> tuple[list[int], list[int]]:
    """transformers' assistant mask for templates with ``{% generation %}`` markers."""
    try:
        out = tok.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **kw)
    except Exception as e:
        if "system" not in str(e).lower():
            raise
        out = tok.apply_chat_template(fold_system(messages), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **kw)
    return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]


def tokenize_conversation(tok: PreTrainedTokenizerBase, messages: Sequence[dict], max_len: int,
                          chat_template: str | None = None, enable_thinking: bool | None = None) -> dict | None:
    """``{"input_ids", "loss_mask"}`` with 1 exactly on assistant tokens (reply + turn-closing token).

    Truncated to ``max_len`` tokens. Returns **None** when nothing trainable is left after truncation
    (the assistant turns all start beyond ``max_len``); callers count and drop those. Raises ``ChatMaskError``
    when the turns cannot be located in the template's render.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not getattr(tok, "is_fast", False):
        raise TypeError(f"{type(tok).__name__} is not a fast tokenizer; the assistant mask needs offset mappings")
    # A giant row (MBs of text) must not be rendered and tokenized in full when max_len keeps its first tokens:
    # clip the contents to a character budget, and widen it only if the clipped render is too short to be exact.
    budget = 64 * max_len + 4096
    while True:
        clipped, was_clipped = _clip_contents(messages, budget)
        ids, mask = _tokenize_masked(tok, clipped, chat_template, enable_thinking)
        # a cut changes at most the tokens around it: exact as long as the clipped render reaches past max_len
        if not was_clipped or len(ids) >= max_len + 16:
            break
        budget *= 4
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return {"input_ids": ids, "loss_mask": mask}


def _clip_contents(messages: Sequence[dict], budget: int) -> tuple[list[dict], bool]:
    """Messages whose contents total at most ``budget`` characters (later turns dropped, the last one cut)."""
    out, used = [], 0
    for m in messages:
        if used >= budget:
            return out, True
        c = m["content"]
        if used + len(c) > budget:
            out.append({**m, "content": c[: budget - used]})
            return out, True
        out.append(dict(m))
        used += len(c)
    return out, False


def _tokenize_masked(tok: PreTrainedTokenizerBase, messages: Sequence[dict], chat_template: str | None = None,
                     enable_thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """Render + tokenize + assistant mask, untruncated."""
    kw = template_kwargs(chat_template, enable_thinking)
    if has_generation_markers(kw.get("chat_template") or getattr(tok, "chat_template", None)):
        ids, mask = _generation_mask(tok, messages, kw)
    else:
        full, spans = assistant_char_spans(tok, messages, chat_template, enable_thinking)
        # The template writes bos itself; letting the tokenizer add another would double it.
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        mask = [0] * len(ids)
        # Spans and offsets are both sorted: one linear sweep. A token belongs to a span if their
        # character ranges overlap (a BPE merge across the boundary still carries assistant text).
        k = 0
        for t, (a, b) in enumerate(offsets):
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            if k < len(spans) and a < spans[k][1] and b > spans[k][0]:
                mask[t] = 1
    return ids, mask


def check_token_ids(rows: Iterable[dict], vocab_size: int) -> None:
    """Refuse rows holding ids outside ``[0, vocab_size)``: data tokenized with another tokenizer."""
    for i, row in enumerate(rows):
        ids = row["input_ids"]
        if not len(ids):
            continue
        hi, lo = max(ids), min(ids)
        if hi >= vocab_size or lo < 0:
            bad = hi if hi >= vocab_size else lo
            raise ValueError(f"row {i}: token id {bad} is outside the target vocabulary [0, {vocab_size}); the data "
                             "was probably tokenized with a different tokenizer — re-tokenize it with the target's")


def tokenize_conversations(tok: PreTrainedTokenizerBase, convs: Sequence[Sequence[dict]], max_len: int,
                           skip_malformed: bool = False, chat_template: str | None = None,
                           enable_thinking: bool | None = None) -> tuple[list[dict], dict]:
    """Rows of every conversation plus ``{"unmaskable", "truncated", "first_error"}`` counts.

    A conversation whose assistant turns cannot be located in the template's render raises (naming its index)
    unless ``skip_malformed``, which skips and counts it; conversations with nothing trainable within
    ``max_len`` are dropped and counted.
    """
    rows, unmaskable, truncated, first_error = [], 0, 0, None
    for i, messages in enumerate(convs):
        try:
            row = tokenize_conversation(tok, messages, max_len, chat_template, enable_thinking)
        except ChatMaskError as e:
            if not skip_malformed:
                raise ChatMaskError(f"conversation {i}: {e} (or set data.skip_malformed=true to skip such rows)") \
                    from None
            unmaskable += 1
            first_error = first_error or f"conversation {i}: {e}"
            continue
        if row is None:
            truncated += 1
        else:
            rows.append(row)
    if unmaskable:
        log.warning("%d of %d conversations skipped: assistant mask not derivable (first: %s)", unmaskable,
                    len(convs), first_error)
    return rows, {"unmaskable": unmaskable, "truncated": truncated, "first_error": first_error}


def build_chat_dataset(
    tok: PreTrainedTokenizerBase,
    source_or_conversations: str | Path | Sequence[Any],
    max_len: int,
    skip_malformed: bool = False,
) -> Dataset:
    """A ``datasets.Dataset`` with columns ``input_ids`` and ``loss_mask`` (assistant-only).

    ``source_or_conversations``: a path/hub id, or a list of rows / message lists (validated the same way).
    Conversations with no assistant token left after truncation are dropped (logged).
    """
    if isinstance(source_or_conversations, (str, Path)):
        convs, stats = load_conversations(source_or_conversations, skip_malformed=skip_malformed)
        name = str(source_or_conversations)
    else:
        convs, stats = _normalize_all(list(source_or_conversations), skip_malformed)
        name = "the given conversations"
    rows, tstats = tokenize_conversations(tok, convs, max_len, skip_malformed)
    ids, masks = [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows]
    dropped = tstats["truncated"]
    if dropped:
        log.warning("%d of %d conversations from %s have no assistant token within max_len=%d; dropped",
                    dropped, len(convs), name, max_len)
    if not ids:
        raise ValueError(f"no usable conversations in {name} ({stats['rows']} rows, "
                         f"{stats['skipped'] + tstats['unmaskable']} skipped, "
                         f"{dropped} with no assistant token within max_len={max_len}"
                         + (f"; first error {stats['first_error']}" if stats["first_error"] else "") + ")")
    return Dataset.from_dict({"input_ids": ids, "loss_mask": masks})
