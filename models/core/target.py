"""The frozen target: any Hugging Face causal LM, returning logits plus the hidden states a head asks for.

Layer-id convention (the only one used inside draftsmith): **an index into HF
``output_hidden_states``** for a model with L decoder layers:

    id 0        the embedding output (residual stream entering decoder layer 0)
    id k, 0<k<L the residual stream entering decoder layer k == the output of decoder layer k-1
    id L        the output of the last decoder layer *after* the final norm

Other tools (SGLang/vLLM ``eagle_aux_hidden_state_layer_ids``, SpecForge) count "output of
decoder layer i": that is our id ``i + 1`` (see ``from_layer_output_ids``/``to_layer_output_ids``).
EAGLE-3's default fusion (2, L//2, L-3) here equals (1, L//2-1, L-4) there.

Only the requested states are captured (forward hooks on the few layers involved), never all
L+1 of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from models.core.checkpoint import first_nonfinite
from models.core.hf_compat import cache_kwargs
from models.core.static_kv import StaticDecoding, StaticKV

EMBEDDED_NAME = "tiny-code"
# the embedded default target ships in the repo (models/tiny_code/; built by train/build_tiny_code.py)
EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "tiny_code"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


AUTO = "auto"  # target.dtype=auto: bf16 on a CPU with native bf16 confirmed faster, else fp32 (models/core/kernels.py)


def dtype_names() -> list[str]:
    """The load dtypes ``target.dtype`` accepts: ``parse_dtype``'s, and ``auto``."""
    return sorted([*_DTYPES, AUTO])


def resolve_name(name_or_path: str, gguf_file: str | None = None) -> str:
    """`tiny-code` (the embedded default) → its shipped directory; a GGUF (``X.gguf``, a directory + ``gguf_file``,
    or an alias such as ``smollm2``) → its converted HF directory (models/core/gguf.py; converted once, cached by
    sha256); anything else unchanged."""
    if name_or_path == EMBEDDED_NAME:
        return str(EMBEDDED_DIR)
    from models.core import gguf

    source = gguf.gguf_file_of(str(name_or_path), gguf_file)
    return str(gguf.converted_dir(source)) if source is not None else name_or_path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} not understood; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def check_target_path(name_or_path: str, gguf_file: str | None = None) -> str:
    """The directory or hub id to load ``name_or_path`` from; a missing local target is one clear error."""
    path = resolve_name(name_or_path, gguf_file)
    if name_or_path == EMBEDDED_NAME and not (Path(path) / "model.safetensors").exists():
        raise FileNotFoundError(f"embedded target weights missing under {path}; "
                                "build them with `python -m train.build_tiny_code`")
    if str(name_or_path).startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        # clearly a path: the hub's "Repo id must be in the form ..." would only confuse
        raise FileNotFoundError(f"target {name_or_path!r} does not exist (target.name_or_path / --target)")
    return path


def ships_own_code(path: str) -> bool:
    """Whether the local target at ``path`` names its own model classes (auto_map in its config.json)."""
    config = Path(path).expanduser() / "config.json"
    try:
        return "auto_map" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False  # not local, or unreadable: transformers' own load reports it


def load_causal_lm(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    device: str = "cpu",
    gguf_file: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model + tokenizer by hub id, local path or GGUF (see ``resolve_name``); eval mode, gradients off. Every
    way this can fail for a user's reason (no such target, offline, not a causal LM, remote code not trusted, a
    corrupt GGUF) is one ValueError line."""
    from models.core import gguf

    path = check_target_path(name_or_path, gguf_file)
    if not trust_remote_code and ships_own_code(path):  # refused before transformers logs about the code it won't run
        raise TargetLoadError(_load_failure(name_or_path, path, ValueError("custom code")))
    auto = dtype == AUTO
    torch_dtype = parse_dtype(torch.float32 if auto else dtype)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise TargetLoadError(_load_failure(name_or_path, path, e)) from None
    try:
        _decoder_parts(model)
    except TypeError:
        raise TargetLoadError(f"target {name_or_path!r} loads as {type(model).__name__}, not a decoder-only causal LM "
                              "with .model.layers and .model.norm (Llama/Mistral/Qwen/DeepSeek layout); "
                              "give target.name_or_path a causal LM") from None
    model.to(device).eval().requires_grad_(False)
    if device == "cpu":  # bf16 decoding attention as two matmuls (models/core/attention.py; fp32 unchanged) and
        # linear layers on weights laid out once for oneDNN (models/core/packed.py): same results, a fraction of the
        # time at decoding's few rows
        from models.core.attention import use_cpu_gqa
        from models.core.packed import pack_linears

        use_cpu_gqa(model)
        pack_linears(model)
    check_finite_weights(model.named_parameters(), name_or_path, path)  # buffers may hold -inf masks
    if auto:
        from models.core.kernels import resolve_auto_dtype

        model = resolve_auto_dtype(model)
    source = gguf.source_info(path)
    if source is not None:  # the target IS the dequantized GGUF: recorded in checkpoints and results
        model.draftsmith_gguf = {"file": Path(source["gguf"]).name, "sha256": source["sha256"],
                                 "dequantized_to": source["dequantized_to"]}
        if name_or_path != path:  # record the name the user gave (an alias / the .gguf), not the cache dir; a
            # directory + gguf_file becomes the file's path, which export and eval resolve without the extra key
            model.config._name_or_path = str(Path(name_or_path) / gguf_file) if gguf_file else str(name_or_path)
    return model, tok


class TargetLoadError(ValueError):
    """The target cannot be loaded, for a reason the user can fix; one line naming the key and the fix."""


def check_finite_weights(named: Iterable[tuple[str, torch.Tensor]], name_or_path: str, path: str) -> None:
    """Refuse a target whose weights hold NaN/inf (a damaged download, a broken conversion): every acceptance
    number measured against it would be meaningless, and nothing downstream would say why."""
    bad = first_nonfinite(named)
    if bad is None:
        return
    from models.core import gguf

    source = gguf.source_info(path) if Path(path).expanduser().is_dir() else None
    if source is not None:
        raise TargetLoadError(f"target {name_or_path!r}: tensor {bad!r} in {weights_file(path, bad)} (converted "
                              f"from {source['gguf']}) holds NaN/inf; delete {path} to convert the GGUF again, "
                              "or re-download the GGUF")
    raise TargetLoadError(f"target {name_or_path!r}: tensor {bad!r} in {weights_file(path, bad)} holds NaN/inf; "
                          "the weights are damaged: re-download or re-save them (target.name_or_path)")


def weights_file(path: str, key: str) -> str:
    """The file of a local model directory that holds tensor ``key`` (its shard, from the safetensors index), for
    messages; the directory or hub id itself where no file is known."""
    d = Path(path).expanduser()
    if not d.is_dir():
        return f"the hub model {path}"
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shard = json.loads(index.read_text()).get("weight_map", {}).get(key)
        except (OSError, ValueError, AttributeError):
            shard = None
        return str(d / shard) if shard else str(d)
    single = d / "model.safetensors"
    return str(single) if single.is_file() else str(d)


def _hub_offline() -> bool:
    import os

    try:
        from huggingface_hub import constants

        if getattr(constants, "HF_HUB_OFFLINE", False):
            return True
    except ImportError:
        pass
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _load_failure(name: str, path: str, e: BaseException) -> str:
    msg = str(e)
    first = (msg.strip().splitlines() or [type(e).__name__])[0][:200]
    key = f"target {name!r} (target.name_or_path / --target)"
    if "trust_remote_code" in msg or "custom code" in msg:
        return (f"{key} ships its own model code (auto_map in its config.json), which is not run by default; "
                "set target.trust_remote_code=true if you trust that code")
    if "Unrecognized configuration class" in msg or "Unrecognized model" in msg:
        return (f"{key} is not a causal LM that AutoModelForCausalLM can load ({first.split(' for this kind')[0]}); "
                "give a decoder-only causal LM")
    local = Path(path).expanduser().is_dir()
    if not local and ("couldn't connect" in msg or _hub_offline()):
        return (f"{key} is not a local directory and not in the Hugging Face cache, and this machine is offline "
                f"(HF_HUB_OFFLINE or no network); download it where there is network (hf download {name}) "
                "or give a local directory")
    if not local:
        return f"{key} is neither a local directory nor a model on the Hugging Face hub ({first})"
    return f"{key}: cannot load {path} ({type(e).__name__}: {first})"


def from_layer_output_ids(ids: Sequence[int]) -> list[int]:
    """'output of decoder layer i' (SGLang/vLLM/SpecForge) → our hidden-state index i+1."""
    return [i + 1 for i in ids]


def to_layer_output_ids(ids: Sequence[int]) -> list[int]:
    """Our hidden-state index k → 'output of decoder layer k-1'."""
    return [k - 1 for k in ids]


def validate_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"hidden-state layer ids {bad} out of range: valid ids are 0..{num_layers} "
                         f"(index into HF output_hidden_states for a {num_layers}-layer target)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate hidden-state layer ids {ids}: valid ids are 0..{num_layers}, each once")
    return ids


def embed_fingerprint(weight: torch.Tensor, legacy: bool = False) -> str:
    """sha256 of a strided sample of an embedding matrix, rounded to bfloat16 first: a drafter trained on a
    bf16-loaded target matches its fp32 load (both round the stored values to bf16 once), and an fp16- or
    bf16-stored target gives one value in every load dtype (fp16/bf16 → fp32 is exact). Only a lossy downcast of
    fp32 weights to fp16 (different weights) gives another value."""

    w = weight.detach()
    sample = w.reshape(-1)[:: max(1, w.numel() // 65536)][:65536].cpu()
    if legacy:
        return hashlib.sha256(sample.float().numpy().tobytes()).hexdigest()[:16]
    return hashlib.sha256(sample.float().to(torch.bfloat16).view(torch.int16).numpy().tobytes()).hexdigest()[:16]


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V] (or fewer positions with logits_to_keep)
    hidden: dict[int, torch.Tensor]  # layer id → [B, T, H]
    cache: Any = None


def _decoder_parts(model: PreTrainedModel) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(embedding, decoder layers, final norm) for the common HF decoder-only layout."""
    base = getattr(model, "model", None) or model.base_model
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise TypeError(f"{type(model).__name__}: expected .model.layers and .model.norm "
                        "(Llama/Mistral/Qwen/DeepSeek layout)")
    return base.get_input_embeddings(), layers, norm


class FrozenTarget(nn.Module):
    """A frozen HF causal LM that also returns the hidden states a drafter asks for."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.embed, self.layers, self.norm = _decoder_parts(model)
        self.num_layers = model.config.num_hidden_layers
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.static: StaticDecoding | None = None  # set by ``use_static``: one-row decoding over a compiled step

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False,
                        device: str = "cpu", gguf_file: str | None = None) -> FrozenTarget:
        model, tok = load_causal_lm(name_or_path, dtype, trust_remote_code, device, gguf_file)
        return cls(model, tok)

    def identity(self) -> dict:
        """What a drafter checkpoint records to refuse being used with another target."""
        c = self.model.config
        ident = {
            "name_or_path": getattr(c, "_name_or_path", ""),
            "architectures": list(getattr(c, "architectures", None) or []),
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "embed_fingerprint": self.fingerprint(),
        }
        if getattr(self.model, "draftsmith_gguf", None):  # models/core/gguf.py: the dequantized GGUF is the target
            ident["gguf"] = dict(self.model.draftsmith_gguf)
        return ident

    def fingerprint(self) -> str:
        """Tells two targets of one shape apart (a drafter trained for Llama-3.1-8B must not be used with
        Llama-3-8B) at a cost of ms, whatever dtype the target was loaded in (``embed_fingerprint``)."""
        return embed_fingerprint(self.embed.weight)

    def legacy_fingerprint(self) -> str:
        """The fingerprint older checkpoints recorded (float32 sample: depends on the load dtype)."""
        return embed_fingerprint(self.embed.weight, legacy=True)

    def _hook_module(self, k: int) -> nn.Module:
        if k == 0:
            return self.embed
        if k == self.num_layers:
            return self.norm
        return self.layers[k - 1]  # output of layer k-1 == input of layer k

    def use_static(self, capacity: int = 1024, backend: str | None = "inductor", linears: str = "packed",
                   widths: Sequence[int] = ()) -> StaticDecoding:
        """Decode one row at a time over a fixed-capacity cache and a compiled step (models/core/static_kv.py):
        the decoding ladder's ``new_cache`` then hands out ``StaticKV`` caches, which ``forward`` runs."""
        self.use_eager()
        self.static = StaticDecoding(self.model, self._hook_module, capacity, backend, linears, widths)
        return self.static

    def use_eager(self) -> None:
        """Decode over transformers' growing cache again (the default); a static step's hooks are removed."""
        if self.static is not None:
            self.static.close()
        self.static = None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        layer_ids: Sequence[int] = (),
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> TargetOutput:
        ids = validate_layer_ids(layer_ids, self.num_layers)
        if isinstance(cache, StaticKV):
            logits, hidden = cache.forward(input_ids, ids, attention_mask, position_ids, logits_to_keep)
            return TargetOutput(logits=logits, hidden=hidden, cache=cache)
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for k in ids:
            def hook(_m, _inp, out, k=k):
                captured[k] = out[0] if isinstance(out, tuple) else out
            handles.append(self._hook_module(k).register_forward_hook(hook))
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=use_cache, logits_to_keep=logits_to_keep, **cache_kwargs(self.model, cache))
        finally:
            for h in handles:
                h.remove()
        return TargetOutput(logits=out.logits, hidden={k: captured[k] for k in ids},
                            cache=getattr(out, "cache", None))
