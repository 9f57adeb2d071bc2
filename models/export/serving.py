"""The serving-mode manifest: which target revision, chat template and thinking mode a drafter was trained for.

A drafter sees the target's hidden states on text laid out by one chat template, with thinking on or off. Served
behind another template, another thinking mode or another revision of the target's weights, it still loads and
decodes losslessly, but its acceptance collapses without an error (z-lab #60: a thinking-trained drafter served
with thinking off ran at 0.26-0.36x of AR; speculators #613 and vLLM #49559: "trains fine, serves at acceptance
~1", one of them a target revision swap). Every export records the manifest (``draftsmith.json`` ``serving``, and
the config.json stamp where the format has one, since only config + weights travel); ``--check`` compares it with
the target and the serving mode it is told about:

- another target revision (config ``_commit_hash``) or lm_head fingerprint: refused (the embedding fingerprint is
  checked by the stamp already; a fine-tune can keep the embedding and change everything after it);
- another thinking mode than the one trained with: refused (the measured 3-4x slowdown above);
- another chat template than the one trained with: a warning (templates differ in whitespace that changes little).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from typing import Any

from models.core.target import embed_fingerprint
from models.export.shared.common import fail

SERVING_KEY = "serving"


def template_hash(template: str | None) -> str | None:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16] if template else None


def training_serving(target: Any, chat_template: str | None = None, enable_thinking: bool | None = None,
                     data_kind: str | None = None) -> dict:
    """What a training run records (train/loop.py meta ``serving``): the template its data was laid out with
    (``data.chat_template`` when set, else the tokenizer's) and ``data.enable_thinking`` (None: the template's
    default). Plain-text data (the embedded code corpus) uses no template: recorded as such."""
    from data.chat_spans import resolve_template

    tok = getattr(target, "tokenizer", None)
    tmpl = resolve_template(chat_template) if chat_template else getattr(tok, "chat_template", None)
    chat = data_kind not in (None, "code", "text")
    return {"chat_template_sha256": template_hash(tmpl) if chat else None, "enable_thinking": enable_thinking,
            "data_kind": data_kind, "uses_chat_template": chat}


def _head_fingerprint(target: Any) -> str | None:
    model = getattr(target, "model", None)
    head = model.get_output_embeddings() if model is not None else None
    return embed_fingerprint(head.weight) if head is not None and head.weight.device.type != "meta" else None


def serving_manifest(target: Any, meta: Mapping | None) -> dict:
    """The manifest an export records: the training run's serving mode (from the checkpoint meta; a checkpoint
    older than the manifest gets the target tokenizer's template at export time, marked so) + the target's
    revision and fingerprints."""
    c = target.model.config
    trained = dict((meta or {}).get(SERVING_KEY) or {})
    if not trained:
        tok = getattr(target, "tokenizer", None)
        trained = {"chat_template_sha256": template_hash(getattr(tok, "chat_template", None)),
                   "enable_thinking": None, "data_kind": None, "uses_chat_template": None,
                   "recorded_at": "export (the checkpoint predates the serving manifest)"}
    return {**trained, "target_revision": getattr(c, "_commit_hash", None),
            "target_embed_fingerprint": target.fingerprint(), "target_head_fingerprint": _head_fingerprint(target)}


def manifest_of(cfg: Mapping, side: Mapping | None, where: str | None = None) -> dict:
    """The serving manifest of an export; with ``where``, both copies (draftsmith.json and config.json's stamp) are
    compared field by field first: reading one of them would let an edit of it hide what the other says."""
    from models.export.shared.identity import STAMP_KEY, stamp_of

    m, stamp = (side or {}).get(SERVING_KEY), stamp_of(cfg).get(SERVING_KEY)
    if where is not None and isinstance(m, Mapping) and isinstance(stamp, Mapping):
        for key in sorted(set(m) | set(stamp)):
            if m.get(key) != stamp.get(key):
                fail(where, f"the two serving manifests disagree: draftsmith.json {SERVING_KEY}.{key} is "
                            f"{json.dumps(m.get(key))}, config.json {STAMP_KEY}.{SERVING_KEY}.{key} is "
                            f"{json.dumps(stamp.get(key))}; export again (both are written from one record)")
    m = m or stamp
    return dict(m) if isinstance(m, Mapping) else {}


def check_serving(cfg: Mapping, side: Mapping | None, target: Any, where: str, *, enable_thinking: bool | None = None,
                  chat_template: str | None = None) -> list[str]:
    """Refuse a mismatched target revision / head or thinking mode; warn on another chat template. Returns the
    warnings (also issued). ``target``: a FrozenTarget/TargetView or None (then only the declared mode is compared);
    ``chat_template``: the template the server will use (default: the target tokenizer's)."""
    m = manifest_of(cfg, side, where)
    if not m:
        return []
    notes: list[str] = []
    if target is not None and getattr(target, "model", None) is not None:
        rev = getattr(target.model.config, "_commit_hash", None)
        if m.get("target_revision") and rev and m["target_revision"] != rev:
            fail(where, f"exported for another revision of the target: {m['target_revision']} != {rev} (a revision "
                         "swap serves at acceptance ~1 without an error; retrain or fine-tune on this revision)")
        head = _head_fingerprint(target)
        if m.get("target_head_fingerprint") and head and m["target_head_fingerprint"] != head:
            fail(where, "exported for another target: its lm_head fingerprint differs (same embedding, other "
                         "weights: another revision or fine-tune)")
    trained_think = m.get("enable_thinking")
    if enable_thinking is not None and trained_think is not None and bool(trained_think) != bool(enable_thinking):
        fail(where, f"trained with thinking {'on' if trained_think else 'off'}, to be served with it "
                     f"{'on' if enable_thinking else 'off'}: the drafter's acceptance collapses (z-lab #60: "
                     "0.26-0.36x of AR); serve in the mode it was trained in, or retrain")
    if m.get("uses_chat_template") is not False:
        tmpl = chat_template if chat_template is not None else getattr(getattr(target, "tokenizer", None),
                                                                       "chat_template", None)
        have, want = template_hash(tmpl), m.get("chat_template_sha256")
        if want and have and want != have:
            notes.append(f"{where}: the serving chat template (sha256 {have}) is not the one the drafter was trained "
                         f"with ({want}); acceptance may drop: compare served acceptance with `python -m eval`")
    for n in notes:
        warnings.warn(n, UserWarning, stacklevel=2)
    return notes
