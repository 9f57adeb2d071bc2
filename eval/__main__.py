"""`python -m eval` — the speculative-decoding benchmark (Hydra, conf/eval.yaml); the work is in ``run(cfg)``.

Writes ``out_dir``/results.json, results.md and the PNG plots, prints a summary. Exit status: 0; 1 when a
method failed the lossless check (its T=0 tokens differ from AR's); 2 with a one-line ``error:`` for bad input
(settings out of range, a checkpoint trained for another target, a missing prompt file, a method named on the
command line whose checkpoint is missing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from eval.bench.benchmark import all_lossless, run_benchmark, write_json
from eval.bench.defaults import register
from eval.bench.report import console_summary, write_report
from eval.bench.setup import BenchSettings, build_methods, load_prompts
from models.core.checkpoint import NoSpaceError, out_of_space_as_error
from models.core.cli import quote_non_ascii

log = logging.getLogger("eval")
# absolute: a relative "../conf" is resolved as a Python package when this module is imported rather than run
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def settings_from(cfg: DictConfig) -> BenchSettings:
    """BenchSettings from the config (validated: bad values fail here, before any model is loaded)."""
    # the config's keys map 1:1 onto BenchSettings' fields (their defaults live in conf/eval.yaml; the methods'
    # rows — methods, checkpoints, draft_model, options, variants — come from their specs, eval/bench/defaults.py)
    return BenchSettings(**{f.name: OmegaConf.to_object(cfg[f.name]) if OmegaConf.is_config(cfg[f.name])
                            else cfg[f.name] for f in dataclasses.fields(BenchSettings)})


def explicit_methods(overrides: list[str], cfg_methods: list[str]) -> list[str]:
    """Methods the user asked for on the command line (``methods=[...]``, ``checkpoints.K=...``,
    ``draft_model=...``): those must run; the defaults' missing checkpoints are only skipped."""
    from models import registry

    models = [s.name for s in registry.METHODS.values() if s.source == "model"]  # their path: a top-level key
    named: list[str] = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "methods":
            named += [m for m in cfg_methods if m != registry.baseline().name]  # the baseline always runs
        elif key.startswith("checkpoints."):
            named += [m for m, (spec, _) in registry.proposers().items()
                      if spec.name == key.split(".", 1)[1] and m in cfg_methods]
        elif key in models and key in cfg_methods:
            named.append(key)
    return list(dict.fromkeys(named))


def check_option_overrides(overrides: list[str]) -> None:
    """``options.<method>.<option>=value`` naming an option the method does not declare: a one-line ValueError
    listing the ones it does (``ProposerSpec.options``), before Hydra refuses the key in several lines naming none."""
    from models import registry

    table = registry.proposers()
    for o in overrides:
        parts = o.split("=", 1)[0].lstrip("+").split(".")
        if len(parts) == 3 and parts[0] == "options" and parts[1] in table:
            table[parts[1]][1].options({parts[2]: None})


def run(cfg: DictConfig, require: list[str] | tuple[str, ...] = ()) -> dict:
    """Load the target, build the methods (skipping missing checkpoints), benchmark, write the report.
    ``require``: methods that must run (named explicitly); one that cannot is an error, before any benchmark."""
    settings = settings_from(cfg)
    out = Path(cfg.out_dir)
    check_writable(out)  # before the benchmark: a read-only or full out_dir would lose every result at the end
    if settings.threads:  # target.dtype=auto times its candidates at the thread count the benchmark decodes with
        import torch

        torch.set_num_threads(settings.threads)
    target = instantiate(cfg.target)
    if cfg.get("fp32_logits", True):  # bf16/fp16 targets: argmax no longer ties on logits rounded to 8 bits
        from models.core.packed import fp32_logits

        fp32_logits(target.model)
    prompts = load_prompts(target.tokenizer, cfg.n_prompts, cfg.prompt_tokens, cfg.prompts)
    if len(prompts) < cfg.n_prompts:
        what = f"{cfg.prompts}" if cfg.prompts else "the held-out set"
        msg = (f"n_prompts={cfg.n_prompts} but {what} has only {len(prompts)} usable prompts (of <= "
               f"prompt_tokens={cfg.prompt_tokens} tokens)")
        if cfg.get("require_n_prompts", False):
            raise ValueError(f"{msg}; lower n_prompts, or require_n_prompts=false to run on {len(prompts)}")
        print(f"warning: {msg}; running {len(prompts)} (recorded in results.json: prompts.n, prompts.requested)",
              file=sys.stderr)
    methods, skipped = build_methods(target, list(cfg.methods), OmegaConf.to_container(cfg.checkpoints),
                                     cfg.draft_model, OmegaConf.to_container(cfg.options),
                                     OmegaConf.to_container(cfg.get("variants") or {}))
    missing = [m for m in require if m in skipped]
    if missing:
        raise ValueError(f"{missing[0]} was asked for but cannot run: {skipped[missing[0]]}")
    from eval.bench.decode_step import chain_widths, choose_decode_step
    from models.core.proposal import MAX_TREE_NODES

    # the static cache as long as the longest decode here needs, not prompt_tokens: attention reads its whole
    # capacity every step; the chains' widths traced unpadded
    step = choose_decode_step(target, cfg.get("decode_step", "auto"), max((len(p.ids) for p in prompts), default=1)
                              + cfg.max_new_tokens + MAX_TREE_NODES + 1, widths=chain_widths(methods))
    log.info("decode_step=%s: %s", step["mode"], {k: v for k, v in step.items() if k != "compile_s"})
    log.info("methods: %s; %d prompts", ", ".join(m.name for m in methods), len(prompts))
    results = run_benchmark(target, methods, prompts, settings, skipped, prompt_source=cfg.prompts)
    results["prompts"]["requested"] = int(cfg.n_prompts)
    files = write_results(results, out)
    print(console_summary(results))
    print("wrote " + ", ".join(str(f) for f in files))
    return results


def write_results(results: dict, out: Path) -> list[Path]:
    """results.json, results.md and the plots; a full disk is one NoSpaceError line naming ``out``."""
    with out_of_space_as_error(out, "free space, or set out_dir elsewhere"):
        return [write_json(results, out / "results.json"), *write_report(results, out).values()]


def check_writable(out: Path) -> None:
    """``out_dir`` can take the results: created if needed, and a probe file written (and removed) there."""
    probe = out / ".draftsmith-write-probe"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with out_of_space_as_error(out, "free space, or set out_dir elsewhere"):
            with open(probe, "w") as fh:
                fh.write("probe\n" * 512)  # a few KB: a full disk fails here, not after the benchmark
                fh.flush()
                os.fsync(fh.fileno())
    except NoSpaceError:
        probe.unlink(missing_ok=True)
        raise
    except OSError as e:
        raise ValueError(f"out_dir {out} is not writable ({e.strerror or e}); set out_dir to a writable "
                         "directory") from None
    probe.unlink()


USER_ERRORS = (ValueError, FileNotFoundError, NoSpaceError)


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import InstantiationException

    try:
        results = run(cfg, explicit_methods(list(HydraConfig.get().overrides.task), list(cfg.methods)))
    except (*USER_ERRORS, InstantiationException) as e:
        err = e.__cause__ if isinstance(e, InstantiationException) else e  # e.g. the target's loader refusing
        if not isinstance(err, USER_ERRORS):
            raise
        print(f"error: {(str(err).strip().splitlines() or [type(err).__name__])[0]}", file=sys.stderr)
        sys.exit(2)
    if not all_lossless(results):
        bad = [n for n, m in results["methods"].items() if not m["lossless"]]
        print(f"error: lossless check failed for {', '.join(bad)}: T=0 tokens differ from AR's", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    """The CLI: conf/eval.yaml composed over the registry's method rows as they are now (eval/bench/defaults.py)."""
    register()
    sys.argv[1:] = quote_non_ascii(sys.argv[1:])
    try:
        check_option_overrides(sys.argv[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    hydra_main()


register()  # at import too: code that composes conf/eval.yaml itself (hydra.compose) finds the node

if __name__ == "__main__":
    main()
