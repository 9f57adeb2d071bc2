"""Benchmark inputs: prompts, the methods under test (built from models/registry.py), settings."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eval.decode.result import DecodeResult
from models import registry
from models.core import verify
from models.core.proposal import batch_proposer
from models.core.spec import MethodSpec, ProposerSpec
from models.core.target import FrozenTarget

# the harness's logger: eval/bench/benchmark.py runs the harness, its modules log under its name
log = logging.getLogger("eval.bench.benchmark")


# --------------------------------------------------------------------------------------------- inputs
@dataclass
class Prompt:
    """One evaluation prompt: token ids, the category it is reported under, and where it came from."""

    ids: list[int]
    category: str = "code"
    label: str = ""


@dataclass
class Method:
    """A method under test.

    ``make(num_speculative_tokens)`` returns a fresh proposer (a number overrides the chain's length; None = the
    method's own) — the batch engine needs one per row, and the dynamic policy other K. ``decode`` replaces
    ``speculative_decode`` for one sequence, called as (target, proposer, ids, max_new_tokens, eos_id=...,
    sampling=...) (another engine measured by the same harness; the tests use it to break a method on purpose).
    ``model`` is the module the proposer wraps (the HF draft model is also the assisted-generation peer's
    assistant).
    """

    name: str
    kind: str
    make: Callable[[int | None], Any] | None = None
    num_speculative_tokens: int | None = None  # chain length; None for AR and trees
    checkpoint: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    decode: Callable[..., DecodeResult] | None = None
    model: Any = None
    spec: ProposerSpec | None = None  # None for methods a test builds by hand (found by ``kind``, else a chain)
    variant_of: str | None = None  # a ``variants`` row: the method it re-runs with other options (B=1 runs only)

    def proposer_spec(self) -> ProposerSpec | None:
        return self.spec or registry.proposers().get(self.kind, (None, None))[1]

    @property
    def chain(self) -> bool:
        p = self.proposer_spec()
        return p.chain if p is not None else True

    @property
    def baseline(self) -> bool:
        """The method every other is measured against (timed with plain decoding, ``decode_ar``)."""
        p = self.proposer_spec()
        return p is not None and p.baseline

    def make_batch(self, num_speculative_tokens: int | None, b: int) -> Any:
        """One ``BatchProposer`` for b rows at that chain length: the spec's batched form (one drafter call per round
        for all rows) where it declares one, else the rows drafting one after another."""
        p = self.proposer_spec()
        rows = [self.make(num_speculative_tokens) for _ in range(b)]
        return batch_proposer(rows, p.batched if p is not None else None)

    @property
    def nodes(self) -> int:
        """Drafted nodes per round (cost tables): the tree's size, or the chain length."""
        p = self.proposer_spec()
        return p.nodes(self.options) if p is not None and p.nodes is not None else int(self.num_speculative_tokens or 1)

    def size_tree(self, target: FrozenTarget, verify_cost: Callable[[float], float], t1_s: float | None = None
                  ) -> None:
        """The method's cost-model step (e.g. Medusa ``num_nodes: auto``): given v(n) and the target's one-token
        step in seconds (for a drafter that times its own passes), fix the tree and rebuild ``make``; a no-op for
        methods without one."""
        p = self.proposer_spec()
        if p is None or p.size is None:
            return
        sized = p.size(self.model, self.checkpoint, self.options, verify_cost, t1_s=t1_s)
        if sized is not None:
            self.options = sized
            self.make = registry.factory(p, self.model, target, sized)
            if p.chain:  # a sized chain length (DFlash num_speculative_tokens: auto)
                self.num_speculative_tokens = int(sized["num_speculative_tokens"])


@dataclass
class BenchSettings:
    """What to measure; validated on construction so bad settings fail before any model is loaded."""

    max_new_tokens: int = 64
    temperatures: Sequence[float] = (0.0, 1.0)
    top_p: float = 1.0
    top_k: int = 0
    repetitions: int = 3
    warmup: int = 1
    threads: int = 0  # 0 = keep torch's current setting (recorded either way)
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    batch_temperature: float = 0.0
    peers: bool = True
    cost_reps: int = 5
    seed: int = 0
    stop_at_eos: bool = False  # off: every method generates exactly max_new_tokens, so tokens/s compare directly
    progress: bool = True

    def __post_init__(self) -> None:
        for name, lo in (("max_new_tokens", 2), ("repetitions", 1), ("cost_reps", 1), ("warmup", 0), ("threads", 0),
                         ("seed", 0), ("top_k", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r}: must be an integer >= {lo}" + (
                    " (the first new token comes from the prompt's own forward pass, so with 1 there is nothing "
                    "to speculate on and no decoding speed to measure)" if name == "max_new_tokens" else ""))
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        try:
            temps = [float(t) for t in self.temperatures]
        except (TypeError, ValueError):
            raise ValueError(f"temperatures={list(self.temperatures)!r}: must be numbers >= 0 (0 = greedy)") from None
        if not temps:
            raise ValueError("temperatures is empty; give at least one (0 = greedy)")
        for t in temps:  # models/core/verify.py's own checks: the same one-line errors the engine would give
            if not math.isfinite(t):
                raise ValueError(f"temperatures: {t} is not finite; use values >= 0 (0 = greedy)")
            verify.sampling_probs(torch.zeros(2), t, self.top_p, self.top_k)
        if 0.0 not in temps:
            # T = 0 is the lossless check; it always runs
            log.warning("temperatures %s has no 0: adding T=0, it is the lossless check", temps)
            temps.insert(0, 0.0)
        self.temperatures = sorted(set(temps), key=temps.index)
        self.batch_temperature = float(self.batch_temperature)
        if self.batch_temperature not in self.temperatures:
            raise ValueError(f"batch_temperature={self.batch_temperature} must be one of temperatures "
                             f"{self.temperatures} (its acceptance rates drive the dynamic policy)")
        bs = [int(b) for b in self.batch_sizes]
        if any(b < 1 for b in bs) or any(b != x for b, x in zip(bs, self.batch_sizes)):
            raise ValueError(f"batch_sizes must be positive integers, got {list(self.batch_sizes)}")
        self.batch_sizes = sorted(set(bs))


PROMPTS_DIR = Path(__file__).resolve().parents[1] / "prompts"


def prompt_file(source: str | Path) -> Path:
    """A prompt file path; a bare name (``mt_bench``, ``humaneval``, ``ood_python``) is a file shipped in
    eval/prompts/ (sources and licenses: eval/prompts/LICENSES.md)."""
    p = Path(source).expanduser()
    shipped = PROMPTS_DIR / f"{source}.jsonl"
    if not p.exists() and "/" not in str(source) and not p.suffix and shipped.is_file():
        return shipped
    return p


def load_prompts(tokenizer, n: int, prompt_tokens: int, source: str | Path | None = None) -> list[Prompt]:
    """Evaluation prompts.

    ``source`` None: held-out stdlib prefixes of ``prompt_tokens`` tokens (``data.corpus.heldout_prompts``,
    category "code"). Otherwise a ``.jsonl`` whose rows each have an optional ``category`` and one of:
    - ``prompt`` or ``text`` (a string): a completion prompt (HumanEval style, your own code), tokenized as is
      (the tokenizer's own special tokens, e.g. bos) and cut to its first ``prompt_tokens`` tokens;
    - ``turns`` (list of user strings; the first turn is used) or ``messages`` (OpenAI style; everything before
      the first assistant message), MT-bench / Spec-Bench style: rendered with the tokenizer's chat template
      plus the generation prompt; chat prompts longer than ``prompt_tokens`` are skipped (with a warning).
    ``n`` prompts are taken round-robin over categories, in file order.
    """
    if n < 1 or prompt_tokens < 1:
        raise ValueError(f"n_prompts and prompt_tokens must be >= 1, got {n} and {prompt_tokens}")
    if source is None:
        from data.corpus import heldout_prompts

        rows = heldout_prompts(tokenizer, n, prompt_tokens)
        if not rows:
            raise ValueError(f"no held-out prompt has {prompt_tokens} tokens; lower prompt_tokens")
        return [Prompt(list(r["input_ids"]), "code", f"{r['path']}:{r['line']}") for r in rows]
    path = prompt_file(source)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(source)!r} does not exist")
    by_cat, too_long = _read_prompt_file(tokenizer, path, prompt_tokens)
    if too_long:
        log.warning("%s: skipped %d prompts longer than prompt_tokens=%d", path, too_long, prompt_tokens)
    out: list[Prompt] = []
    queues = [list(v) for v in by_cat.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    if not out:
        raise ValueError(f"{path}: no usable prompts (of <= prompt_tokens={prompt_tokens} tokens)")
    return out


def _read_prompt_file(tokenizer, path: Path, prompt_tokens: int) -> tuple[dict[str, list[Prompt]], int]:
    """A prompt file's usable rows by category, in file order, and how many were longer than ``prompt_tokens``
    (``load_prompts``' per-row half: parsing, tokenizing, the length rule)."""
    from data.chat import render_chat

    by_cat: dict[str, list[Prompt]] = {}
    too_long = 0
    with open(path, "rb") as fh:  # decoded line by line: a bad byte is named with its line
        for i, raw in enumerate(fh):
            line = _utf8_line(raw, path, i + 1)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i + 1}: not valid JSON ({e.msg})") from None
            text = _completion_text(row, f"{path} line {i + 1}")
            if text is not None:  # a completion prompt: its first prompt_tokens tokens, like the held-out prefixes
                ids = head_ids(tokenizer, text, prompt_tokens)
            else:
                messages = _prompt_messages(row, f"{path} line {i + 1}")
                ids = tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"{path} line {i + 1}: the prompt is empty")
            if len(ids) > prompt_tokens:
                too_long += 1
                continue
            cat = str(row.get("category") or "default")
            label = str(row.get("question_id", row.get("task_id", row.get("id", row.get("source", i)))))
            by_cat.setdefault(cat, []).append(Prompt(list(ids), cat, label))
    return by_cat, too_long


CHARS_PER_TOKEN, SPARE_TOKENS = 16, 16
_LAST_WORD_END = re.compile(r".*\S(?=\s)", re.DOTALL)  # greedy: the last word end before the search's endpos


def head_ids(tokenizer, text: str, n: int) -> list[int]:
    """``tokenizer(text)["input_ids"][:n]`` without tokenizing all of a huge text (a 12.5 MB prompt took 2.9 GB).

    The text is cut at a word's end (a non-space before a whitespace) within ``CHARS_PER_TOKEN * n`` characters:
    the pre-tokenizer splits at whitespace, so only the last word's tokens can differ from the whole text's, and a
    cut holding ``SPARE_TOKENS`` more than ``n`` keeps those out of the first ``n``. Fewer: a 4x longer cut, up to
    the whole text."""
    bound = CHARS_PER_TOKEN * n
    while bound < len(text):
        end = _LAST_WORD_END.match(text, 0, bound)
        if end:
            ids = tokenizer(text[:end.end()])["input_ids"]
            if len(ids) >= n + SPARE_TOKENS:
                return ids[:n]
        bound *= 4
    return tokenizer(text)["input_ids"][:n]


def _utf8_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} line {lineno}: not UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} of the "
                         "line); save the file as UTF-8") from None


def _completion_text(row: Any, where: str) -> str | None:
    """A completion row's text (``prompt`` or ``text``), or None for a chat row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object")
    key = "prompt" if "prompt" in row else "text" if "text" in row else None
    if key is None:
        return None
    if not isinstance(row[key], str) or not row[key]:
        raise ValueError(f"{where}: '{key}' must be a non-empty string")
    return row[key]


def _prompt_messages(row: Any, where: str) -> list[dict]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object")
    turns = row.get("turns")
    if turns is not None:
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        # only the first turn: later turns would need the model's own answer to turn 1 in the context
        return [{"role": "user", "content": turns[0]}]
    msgs = row.get("messages")
    if msgs is None and row.get("conversations") is not None:  # ShareGPT, as training reads it (data/chat.py)
        msgs = _sharegpt_messages(row["conversations"], where)
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: needs 'prompt' or 'text' (a completion string), 'turns' (list of strings), "
                         "'messages' (list of role/content) or 'conversations' (ShareGPT: list of from/value)")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{j}] needs string 'role' and 'content'")
        if m["role"] == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise ValueError(f"{where}: no user message before the first assistant message")
    return out


def _sharegpt_messages(turns: Any, where: str) -> list[dict]:
    """ShareGPT ``conversations`` ([{"from": "human"|"gpt"|..., "value": str}]) → role/content messages."""
    from data.chat import SHAREGPT_ROLES

    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of from/value objects")
    out = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise ValueError(f"{where}: conversations[{j}] needs string 'from' and 'value'")
        role = SHAREGPT_ROLES.get(t["from"].strip().lower())
        if role is None:
            raise ValueError(f"{where}: conversations[{j}].from has unknown role {t['from']!r} (known: "
                             f"{', '.join(sorted(SHAREGPT_ROLES))})")
        out.append({"role": role, "content": t["value"]})
    return out


def build_methods(
    target: FrozenTarget,
    names: Sequence[str],
    checkpoints: Mapping[str, str | None] | None = None,
    draft_model: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[Method], dict[str, str]]:
    """The methods named in ``names`` (models/registry.py ``proposers()`` + ``variants``), the baseline (AR) first,
    named or not. A method whose checkpoint (or draft model) is not given or not on disk is skipped; returns
    (methods, {skipped: reason}). A checkpoint trained for another target, or of another method, raises a
    one-line ValueError.

    ``variants`` {name: {"method": a proposer name, option: value, ...}}: the same method with other options,
    benchmarked as its own row (what a config switch buys, e.g. EAGLE-3 drafting in bf16); None → the variants
    the proposers declare (``registry.variants()``). A variant with its own ``checkpoints.<variant>`` loads that
    drafter instead (a DSpark checkpoint is a dflash one: ``+variants.dspark={method: dflash}`` and
    ``+checkpoints.dspark=runs/dspark/final`` put it beside DFlash in one run)."""
    checkpoints = dict(checkpoints or {})
    table = registry.proposers()
    variants = {k: dict(v) for k, v in (registry.variants() if variants is None else variants).items()}
    check_names(table, names, options or {}, variants)
    methods: list[Method] = []
    skipped: dict[str, str] = {}
    sources: dict[str, tuple[Any, dict | None]] = {}  # loaded once per checkpoint / model path
    for name in dict.fromkeys([registry.baseline().name, *names]):  # the baseline first, ordered, no duplicates
        base = variants[name]["method"] if name in variants else name
        spec, p = table[base]
        path, why = _source_path(spec, name, checkpoints, draft_model)
        if why:
            skipped[name] = why
            continue
        if path is not None and path not in sources:
            sources[path] = _load_source(spec, path, target)
        drafter, meta = sources[path] if path is not None else (None, None)
        if meta is not None and meta["method"] != spec.name:
            raise ValueError(f"{path} is a {meta['method']} checkpoint, not {spec.name}; fix checkpoints.{spec.name}")
        opts = dict((options or {}).get(base) or {})
        if name in variants:
            opts.update({k: v for k, v in variants[name].items() if k != "method"})
        try:
            make, o = registry.make_proposer_factory(base, drafter, target, path, opts)
        except (ValueError, TypeError) as e:  # a bad option value: name where it was set (once)
            where = f"variants.{name}" if name in variants else f"options.{base}"
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(msg if msg.startswith(f"{where}:") else f"{where}: {msg}") from None
        methods.append(Method(name, base, make, checkpoint=path, options=o, model=drafter, spec=p,
                              num_speculative_tokens=int(o["num_speculative_tokens"]) if p.chain else None,
                              variant_of=base if name in variants else None))
    for name, why in skipped.items():
        log.warning("skipping %s: %s", name, why)
    return methods, skipped


def check_names(table: Mapping[str, Any], names: Sequence[str], options: Mapping[str, Any],
                variants: Mapping[str, Mapping[str, Any]]) -> None:
    """Every method, variant and options key names a proposer the registry knows (one-line errors)."""
    for vname, v in variants.items():
        if vname in table:
            raise ValueError(f"variant {vname!r} has a method's own name; name it e.g. {vname}_fast")
        if v.get("method") not in table:
            raise ValueError(f"variants.{vname}.method={v.get('method')!r}; use one of {sorted(table)}")
    unknown = [n for n in names if n not in table and n not in variants]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; use any of {[*table, *variants]}")
    bad = [k for k in options if k not in table]
    if bad:
        raise ValueError(f"options for unknown method(s) {bad}; known: {sorted(table)}")


def _source_path(spec: MethodSpec, name: str, checkpoints: Mapping[str, str | None],
                 draft_model: str | None) -> tuple[str | None, str | None]:
    """(what to load, or None; why the method is skipped, or None)."""
    if spec.source == "none":
        return None, None
    if spec.source == "model":
        if not draft_model:
            return None, f"no {name} given (a small causal LM sharing the target's tokenizer)"
        if str(draft_model).startswith(("runs/", "./", "/")) and not Path(draft_model).exists():
            return None, f"{name} {draft_model} not found (tiny-code's: python -m train.build_tiny_code --draft)"
        return str(draft_model), None
    path = checkpoints.get(name) or checkpoints.get(spec.name)  # a variant may name its own: checkpoints.<variant>
    if not path or not (Path(path) / "model.safetensors").exists():
        return None, f"no checkpoint at {path!r} (train it: python -m train +recipe={spec.name})"
    return str(path), None


def _load_source(spec: MethodSpec, path: str, target: FrozenTarget) -> tuple[Any, dict | None]:
    if spec.source == "model":
        return spec.load(path, target), None
    return registry.load_drafter(path, target)  # raises for a drafter trained on another target
