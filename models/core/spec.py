"""What a draft method is, in one object: every method package (models/methods/<name>/) exports ``SPEC``.

train/, eval/ and export read methods only through these specs (collected in models/registry.py), so a
new method is its package (network + loss, proposers, ``SPEC`` and, if engines serve it, the format rows of its
``export.py``), its ``conf/draft/<name>.yaml`` and one registry line.

    MethodSpec     the drafter: its config dataclass, how to build it for a target (training) and how to
                   rebuild an empty one of a checkpoint's shapes (eval / export load the weights after);
                   its proposers; its export formats; an optional step after training.
    ProposerSpec   one way the method drafts at decode time, named as eval names it (``eagle3``,
                   ``eagle3_tree``): a factory, its options with their defaults (the one source of defaults),
                   and an optional cost-model sizing step that fixes a tree before proposers are built.

Protocols over inheritance: a drafter is any nn.Module with the models/core/drafter.py protocol, a proposer any
object with the models/core/proposal.py ``Proposer`` protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# what eval loads before it can build a method's proposers
SOURCES = ("checkpoint", "model", "none")

# K, the tokens drafted per verification round, where nothing else sets it: eval's chain proposers (their
# ``num_speculative_tokens`` option), an EAGLE-3 export without eval results, the engine benchmarks. 3 is
# llama-server's default and what measured best on CPU. Methods whose K is fixed by their shape (Medusa's heads,
# MTP's modules, DFlash's block, P-EAGLE's depths) default to that instead.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class ProposerSpec:
    """``make(drafter, target, **options)`` → a fresh proposer (drafter: the loaded checkpoint module, the
    separate draft model, or None for model-free methods; target: the FrozenTarget it drafts for).
    ``defaults``: every option ``make`` takes, with its default; a chain's (``chain=True``) include
    ``num_speculative_tokens``, its length (the dynamic-K policy varies it).
    ``prepare(drafter, checkpoint_dir, options) → options``: once, when the method is set up (e.g. read the
    tree saved with the checkpoint). ``size(drafter, checkpoint_dir, options, v, t1_s=) → options``: the cost-model
    step, given v(n) = measured verification cost of n drafted nodes in target steps; it returns the options
    of the fastest predicted tree (None: nothing to size). ``nodes(options)``: nodes drafted per round."""

    name: str
    make: Callable[..., Any]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    chain: bool = True
    prepare: Callable[[Any, str | None, dict], dict] | None = None
    size: Callable[..., dict | None] | None = None  # (drafter, checkpoint_dir, options, v, t1_s=) → options
    nodes: Callable[[dict], int] | None = None
    # --- how eval runs it (the registry is the only list; conf/eval.yaml reads these, no copy)
    # batched(rows) → one BatchProposer drafting for all rows (models/core/proposal.py ``batch_proposer``: one drafter
    # call per round); None → the rows draft one after another (PerRowProposers)
    batched: Callable[[list], Any] | None = None
    # drafts nothing: eval times it with plain decoding (decode_ar), the baseline every method is checked against
    baseline: bool = False
    # {name: {option: value}}: this proposer with other options, benchmarked as its own batch-1 row
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # whose batch-1 K* becomes results.json's recommended_num_speculative_tokens: the lowest rank among the
    # chains benchmarked; None → never recommended
    recommend_rank: int | None = None
    # hf_peer(options, model) → (peer name, transformers generate() kwargs): the HF twin eval also runs at T=0
    # (n-gram → prompt lookup, draft model → assisted generation); None → no HF twin
    hf_peer: Callable[[Mapping[str, Any], Any], tuple[str, dict]] | None = None
    # engine_options(num_speculative_tokens) → this proposer's options for the chain an engine drafts (the harness
    # side of an in-engine comparison, eval/engines/serving.py); None → {"num_speculative_tokens": ...}
    engine_options: Callable[[int], dict] | None = None

    def __post_init__(self) -> None:
        if self.chain and "num_speculative_tokens" not in self.defaults:
            raise ValueError(f"proposer {self.name}: a chain needs the option num_speculative_tokens (its length)")

    def options(self, overrides: Mapping[str, Any] | None = None) -> dict:
        """The defaults with ``overrides`` applied; an unknown key is a one-line error listing the known ones."""
        overrides = dict(overrides or {})
        bad = sorted(set(overrides) - set(self.defaults))
        if bad:
            raise ValueError(f"options.{self.name}: unknown option(s) {bad}; known: {sorted(self.defaults)}")
        return {**self.defaults, **overrides}


@dataclass(frozen=True)
class ExportFormat:
    """One checkpoint format an engine loads, declared by the method whose drafters it holds (its
    ``export.py``; ``MethodSpec.export_formats``). ``build(drafter, target, target_name, num_speculative_tokens,
    meta) → Bundle``; ``check(cfg, tensors, sidecar, target, where) → (expected shapes, target dims)``;
    ``load(cfg, state_dict, target) → module``; ``detect(cfg, dir)`` → bool (tried in registry order, so a more
    specific format comes first within a method). ``num_speculative_tokens`` is the recommended one (eval
    results) or, without one, the method's ``MethodSpec.default_num_speculative_tokens`` (None where it declares
    none).

    The format's own facts, so that models/export/ never asks which format it holds:
    ``readme(cfg, sidecar, serve) → lines``: its sections of the exported README.md after the common frame
    (engine commands, conventions, notes; ``serve``: models/export/shared/snippets.py ``Serve``); None: the frame only,
    no engine snippet invented. ``verify_target(tensors, target, where) → bool``: for a format that carries the
    target's own tensors, compare them with the target (a FrozenTarget's fingerprint; fail on a mismatch) and
    say whether that verified it (then a differently spelled target name is not refused)."""

    name: str
    cli: str
    method: str
    served_by: str
    build: Callable
    check: Callable
    load: Callable
    detect: Callable[[dict, Any], bool]
    weights_file: str = "model.safetensors"
    readme: Callable[[dict, dict, Any], list[str]] | None = None
    verify_target: Callable[[Any, Any, str], bool] | None = None
    # vLLM's ``speculative_config.method`` for this layout (None: vLLM does not serve it), and the other
    # speculative_config keys vLLM needs for it (pairs, e.g. P-EAGLE's ``(("parallel_drafting", True),)``)
    vllm_method: str | None = None
    vllm_options: tuple[tuple[str, Any], ...] = ()
    # llama.cpp's ``--spec-type`` for this layout once converted to GGUF (models/export/llamacpp.py; None: its
    # converter does not take it)
    llamacpp: str | None = None


@dataclass(frozen=True)
class MethodSpec:
    """``build(cfg, target, train_rows)`` → a new drafter to train; ``rebuild(cfg, target)`` → a drafter of the
    shapes ``cfg`` describes, whose trainable weights and buffers the caller loads from a checkpoint.
    ``config``: the draft config dataclass (``conf/draft/<name>.yaml`` instantiates it; a checkpoint's
    ``config.json`` stores its fields). ``source``: what eval needs first (SOURCES): a drafter checkpoint, a
    separate model (``load(path, target)`` → the module; e.g. the draft-model baseline) or nothing.
    ``after_training(drafter, final_dir, heldout_metrics)``: optional, e.g. Medusa's static tree from held-out
    rank accuracies; returns what it wrote (or None).

    The method's facts train/ and models/export/ read instead of naming methods:
    ``default_num_speculative_tokens(drafter) → int``: the K an export serves without eval results (EAGLE-3:
    ``DEFAULT_NUM_SPECULATIVE_TOKENS``, Medusa: its heads, MTP: its modules, DFlash: the block's drafted slots,
    P-EAGLE: its parallel depths).
    ``check_config(config, max_len)``: the up-front checks of a draft config (its fields as
    ``conf/draft/<name>.yaml`` gives them, before anything loads; ``max_len``: data.max_len or None), each bad
    value a one-line ValueError naming the key as ``draft.config.<field>`` (models/core/config_checks.py); the
    method's depth check among them. ``final_files``: what ``after_training`` writes into final/ (training
    replaces those files with the directory)."""

    name: str
    proposers: tuple[ProposerSpec, ...]
    config: type | None = None
    build: Callable[..., Any] | None = None
    rebuild: Callable[..., Any] | None = None
    source: str = "checkpoint"
    export_formats: tuple[ExportFormat, ...] = ()
    after_training: Callable[..., Any] | None = None
    load: Callable[..., Any] | None = None
    # values for config fields a checkpoint written before they existed does not store (what it was trained with)
    checkpoint_defaults: Mapping[str, Any] = field(default_factory=dict)
    default_num_speculative_tokens: Callable[[Any], int] | None = None
    check_config: Callable[[Mapping[str, Any], int | None], None] | None = None
    final_files: tuple[str, ...] = ()
    # --- where eval finds it: the checkpoint dir (None → runs/<name>/final, what
    # ``python -m train +recipe=<name>`` writes) or the separate model eval loads by default
    default_path: str | None = None

    def eval_path(self) -> str | None:
        """What eval loads for this method unless told otherwise (conf/eval.yaml ``checkpoints.<name>``, or the
        model path); None for a method that loads nothing."""
        if self.source == "checkpoint":
            return self.default_path or f"runs/{self.name}/final"
        return self.default_path

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"method {self.name}: source {self.source!r} is not one of {SOURCES}")
        if self.source == "checkpoint" and (self.config is None or self.build is None or self.rebuild is None):
            raise ValueError(f"method {self.name}: a checkpoint method needs config, build and rebuild")
        if self.source == "model" and self.load is None:
            raise ValueError(f"method {self.name}: a separate-model method needs load")
