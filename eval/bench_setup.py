"""Benchmark inputs: the method kinds and their default options, prompts, methods under test, settings.

Split out of eval/benchmark.py for readability (no behaviour change); eval/benchmark.py re-exports every name.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eval import verify
from eval.decode import DecodeResult
from models.target import FrozenTarget

# the harness's logger, kept from before the split (logging config and filters on "eval.benchmark" still apply)
log = logging.getLogger("eval.benchmark")


KINDS = ("ar", "ngram", "draft_model", "eagle3", "eagle3_tree", "medusa", "mtp")
CHAIN_KINDS = ("ngram", "draft_model", "eagle3", "mtp")  # what speculative_decode_batch can verify
CHECKPOINT_KINDS = {"eagle3": "eagle3", "eagle3_tree": "eagle3", "medusa": "medusa", "mtp": "mtp"}
# Which method's batch-1 K* becomes the top-level recommendation (the exporter reads one number).
RECOMMEND_ORDER = ("eagle3", "mtp", "draft_model", "ngram")
# Per-kind proposer settings. Trees are sized for CPU (verify cost grows with nodes there); the EAGLE-2 paper's
# GPU setting is depth 6, top_k 10, total_tokens 60 and Medusa's default tree has 63 nodes.
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "ngram": {"k": 5, "max_ngram": 3, "min_ngram": 1},
    "draft_model": {"k": 4},
    "eagle3": {"k": 5},
    "eagle3_tree": {"depth": 5, "top_k": 4, "total_tokens": 24},
    "medusa": {"top_k": 4, "num_nodes": "auto", "max_nodes": 24, "choices": None},
    "mtp": {"k": None},  # None = the drafter's number of modules
}


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

    ``make(k)`` returns a fresh proposer (``k`` overrides the chain length; None = the method's own) — the
    batch engine needs one per row, and the dynamic policy other K. ``decode`` replaces
    ``speculative_decode`` for one sequence (another engine measured by the same harness; the tests use it to
    break a method on purpose). ``model`` is the module the proposer wraps (the HF draft model is also the
    assisted-generation peer's assistant).
    """

    name: str
    kind: str
    make: Callable[[int | None], Any] | None = None
    k: int | None = None  # chain length; None for AR and trees
    checkpoint: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    decode: Callable[..., DecodeResult] | None = None
    model: Any = None

    @property
    def chain(self) -> bool:
        return self.kind in CHAIN_KINDS


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
        temps = [float(t) for t in self.temperatures]
        if not temps:
            raise ValueError("temperatures is empty; give at least one (0 = greedy)")
        for t in temps:  # eval/verify.py's own checks: the same one-line errors the engine would give
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
        for name in ("max_new_tokens", "repetitions", "cost_reps"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v}")
        for name in ("warmup", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v}")
        bs = [int(b) for b in self.batch_sizes]
        if any(b < 1 for b in bs) or any(b != x for b, x in zip(bs, self.batch_sizes)):
            raise ValueError(f"batch_sizes must be positive integers, got {list(self.batch_sizes)}")
        self.batch_sizes = sorted(set(bs))


def load_prompts(tokenizer, n: int, prompt_tokens: int, source: str | Path | None = None) -> list[Prompt]:
    """Evaluation prompts.

    ``source`` None: held-out stdlib prefixes of ``prompt_tokens`` tokens (``data.corpus.heldout_prompts``,
    category "code"). Otherwise a conversation ``.jsonl`` (MT-bench / Spec-Bench style): each row has an
    optional ``category`` and either ``turns`` (list of user strings; the first turn is used) or
    ``messages`` (OpenAI style; everything before the first assistant message is used). Rows are rendered
    with the tokenizer's chat template plus the generation prompt; prompts longer than ``prompt_tokens``
    are skipped (with a warning); ``n`` prompts are taken round-robin over categories, in file order.
    """
    if n < 1 or prompt_tokens < 1:
        raise ValueError(f"n_prompts and prompt_tokens must be >= 1, got {n} and {prompt_tokens}")
    if source is None:
        from data.corpus import heldout_prompts

        rows = heldout_prompts(tokenizer, n, prompt_tokens)
        if not rows:
            raise ValueError(f"no held-out prompt has {prompt_tokens} tokens; lower prompt_tokens")
        return [Prompt(list(r["input_ids"]), "code", f"{r['path']}:{r['line']}") for r in rows]
    from data.chat import render_chat

    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(source)!r} does not exist")
    by_cat: dict[str, list[Prompt]] = {}
    too_long = 0
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i + 1}: not valid JSON ({e.msg})") from None
            messages = _prompt_messages(row, f"{path} line {i + 1}")
            ids = tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
            if len(ids) > prompt_tokens:
                too_long += 1
                continue
            cat = str(row.get("category") or "default")
            label = str(row.get("question_id", row.get("id", i)))
            by_cat.setdefault(cat, []).append(Prompt(list(ids), cat, label))
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
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: needs 'turns' (list of strings) or 'messages' (list of role/content)")
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


def build_methods(
    target: FrozenTarget,
    names: Sequence[str],
    checkpoints: Mapping[str, str | None] | None = None,
    draft_model: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[Method], dict[str, str]]:
    """The methods named in ``names`` (``KINDS``), AR first. A method whose checkpoint (or draft model) is not
    given or not on disk is skipped; returns (methods, {skipped name: reason}). A checkpoint trained for
    another target, or of another method, raises a one-line ValueError (train/build.py ``load_drafter``)."""
    from eval import proposers as P
    from train.build import load_drafter

    checkpoints = dict(checkpoints or {})
    unknown = [n for n in names if n not in KINDS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; use any of {list(KINDS)}")
    opts = {k: {**v, **dict((options or {}).get(k) or {})} for k, v in DEFAULT_OPTIONS.items()}
    bad = [k for k in (options or {}) if k not in DEFAULT_OPTIONS]
    if bad:
        raise ValueError(f"options for unknown method(s) {bad}; known: {sorted(DEFAULT_OPTIONS)}")
    methods = [Method("ar", "ar")]
    skipped: dict[str, str] = {}
    drafters: dict[str, tuple[Any, dict]] = {}
    for name in dict.fromkeys(names):  # ordered, no duplicates
        if name == "ar":
            continue
        o = opts[name]
        if name == "ngram":
            def make(k, o=o):
                return P.NGramProposer(k=k or o["k"], max_ngram=o["max_ngram"], min_ngram=o["min_ngram"])

            methods.append(Method(name, name, make, k=int(o["k"]), options=o))
            continue
        if name == "draft_model":
            if not draft_model:
                skipped[name] = "no draft_model given (a small causal LM sharing the target's tokenizer)"
                continue
            if str(draft_model).startswith(("runs/", "./", "/")) and not Path(draft_model).exists():
                skipped[name] = (f"draft model {draft_model} not found (tiny-code's: "
                                 "python -m models.build_tiny_code --draft)")
                continue
            from models.target import load_causal_lm

            model, tok = load_causal_lm(draft_model, dtype=target.model.dtype, device=str(target.model.device))
            P.DraftModelProposer(model, k=o["k"], target=target, tokenizer=tok)  # refuses another tokenizer now

            def make(k, o=o, model=model):
                return P.DraftModelProposer(model, k=k or o["k"], target=target)

            methods.append(Method(name, name, make, k=int(o["k"]), checkpoint=str(draft_model), options=o,
                                  model=model))
            continue
        path = checkpoints.get(CHECKPOINT_KINDS[name])
        if not path or not (Path(path) / "model.safetensors").exists():
            skipped[name] = f"no checkpoint at {path!r} (train it: python -m train +recipe={CHECKPOINT_KINDS[name]})"
            continue
        if path not in drafters:
            drafters[path] = load_drafter(path, target)  # raises for a drafter trained on another target
        drafter, meta = drafters[path]
        if meta["method"] != CHECKPOINT_KINDS[name]:
            raise ValueError(f"{path} is a {meta['method']} checkpoint, not {CHECKPOINT_KINDS[name]}; "
                             f"fix checkpoints.{CHECKPOINT_KINDS[name]}")
        if name == "eagle3":
            def make(k, o=o, d=drafter):
                return P.Eagle3ChainProposer(d, k=k or o["k"])

            methods.append(Method(name, name, make, k=int(o["k"]), checkpoint=str(path), options=o, model=drafter))
        elif name == "eagle3_tree":
            def make(k, o=o, d=drafter):
                return P.Eagle3TreeProposer(d, depth=o["depth"], top_k=o["top_k"], total_tokens=o["total_tokens"])

            make(None)  # one-line errors for bad tree settings now, not mid-run
            methods.append(Method(name, name, make, checkpoint=str(path), options=o, model=drafter))
        elif name == "medusa":
            choices = o.get("choices")
            auto = o.get("num_nodes") == "auto"  # sized by the cost model in run_benchmark, up to max_nodes
            if choices is None:  # the tree saved with the checkpoint (held-out rank accuracies), resized
                from models.medusa import load_static_tree, tree_capacity

                choices = load_static_tree(path, int(o["max_nodes"]) if auto else o.get("num_nodes"))
            if choices is None and auto:
                raise ValueError(f"options.medusa.num_nodes=auto needs the rank accuracies saved with the checkpoint "
                                 f"({path}/medusa_choices.json, written when trained with metric_top_k > 0); "
                                 "pass a number of nodes instead")
            if choices is None:
                heads = drafter.cfg.num_heads
                n_nodes = min(int(o["num_nodes"]), tree_capacity(heads, int(o["top_k"])))
                log.warning("%s has no medusa_choices.json: using a made-up-accuracy tree of %d nodes", path, n_nodes)
                choices = P.default_medusa_choices(heads, top_k=int(o["top_k"]), num_nodes=n_nodes)

            def make(k, d=drafter, choices=choices):
                return P.MedusaProposer(d, choices=choices)

            make(None)
            methods.append(Method(name, name, make, checkpoint=str(path),
                                  options={**o, "num_nodes": len(choices), "auto_size": auto}, model=drafter))
        elif name == "mtp":
            k0 = int(o["k"] or drafter.cfg.num_modules)

            def make(k, d=drafter, k0=k0):
                return P.MTPProposer(d, k=k or k0)

            methods.append(Method(name, name, make, k=k0, checkpoint=str(path), options={**o, "k": k0},
                                  model=drafter))
    for name, why in skipped.items():
        log.warning("skipping %s: %s", name, why)
    return methods, skipped
