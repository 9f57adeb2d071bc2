"""Every config file composes, and every `_target_` in it instantiates."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def _options():
    for g in GROUPS:
        for f in sorted((CONF / g).glob("*.yaml")):
            yield g, f.stem


def _targets(node, path=""):
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
            return
        for k in node:
            yield from _targets(node[k], f"{path}.{k}" if path else str(k))


def compose_with(group: str, option: str) -> DictConfig:
    # recipe and the overlays a recipe adds (onpolicy/) have no default in config.yaml: they are appended
    override = f"+{group}={option}" if group in ("recipe", "onpolicy") else f"{group}={option}"
    extra = ["data.source=conversations.jsonl"] if (group, option) == ("data", "sharegpt") else []
    if group == "recipe" and option.endswith("_gpu"):  # GPU recipes: chat data, cuda target (composed on a CPU here)
        extra = ["data.source=conversations.jsonl", "target.device=cpu"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[override, *extra])


def test_groups_present():
    assert {"target", "data", "draft", "optim", "deepspeed", "tracking", "recipe"} <= set(GROUPS)


@pytest.mark.parametrize("group,option", list(_options()))
def test_compose_and_instantiate(group, option):
    cfg = compose_with(group, option)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    found = list(_targets(cfg))
    assert found, "nothing to instantiate"
    for path, node in found:
        obj = instantiate(node)
        assert obj is not None, path


def test_recipes_only_list_differences():
    for f in (CONF / "recipe").glob("*.yaml"):
        assert f.read_text().lstrip().startswith("# @package _global_"), f


def compose_eval(*overrides: str) -> DictConfig:
    from eval.bench.defaults import register

    register()  # what `python -m eval` does before composing: the registry's method rows as a config node
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="eval", overrides=list(overrides))


def test_eval_config_method_rows_are_the_specs():
    """The composed eval config's methods, checkpoints, draft model, options and variants are read from the
    method specs (eval/bench/defaults.py), not kept in conf/eval.yaml: the registry is their only source."""
    from models import registry

    cfg = OmegaConf.to_container(compose_eval())
    table = registry.proposers()
    assert cfg["options"] == {name: dict(p.defaults) for name, (_, p) in table.items()}
    assert cfg["checkpoints"] == {s.name: f"runs/{s.name}/final" for s in registry.METHODS.values()
                                  if s.source == "checkpoint"}
    assert cfg["draft_model"] == registry.method("draft_model").default_path == "runs/tiny_code_draft"
    assert cfg["variants"] == registry.variants()
    assert {"eagle3_bf16": {"method": "eagle3", "weights": "bfloat16"},  # the shipped ones (a registered test
            "eagle3_int8": {"method": "eagle3", "weights": "int8"},     # method may add its own after them)
            "eagle3_lookup": {"method": "eagle3", "lookup": 2},
            "eagle3_tree_t1": {"method": "eagle3_tree", "size_for": 1},
            "eagle3_tree_lookup": {"method": "eagle3_tree", "lookup": 2}}.items() <= cfg["variants"].items()
    # every proposer then its variants, in registry order; AR (the one baseline) first
    want = [n for name, (_, p) in table.items() for n in (name, *p.variants)]
    assert cfg["methods"] == want
    assert want[:14] == ["ar", "ngram", "draft_model", "eagle3", "eagle3_bf16", "eagle3_int8", "eagle3_lookup",
                         "eagle3_tree", "eagle3_tree_t1", "eagle3_tree_lookup", "medusa", "mtp", "dflash", "peagle"]
    assert registry.baseline().name == cfg["methods"][0]
    for key in ("methods", "checkpoints", "draft_model", "options", "variants"):  # no second copy in the yaml
        assert key not in OmegaConf.load(CONF / "eval.yaml"), key


def test_eval_config_command_line_overrides_and_unknown_options():
    """The generated keys take command-line overrides as before (README / Makefile spellings); an option no spec
    declares is refused: by Hydra without ``+``, and with ``+`` as the harness's one-line error naming the known."""
    from hydra.errors import ConfigCompositionException

    from eval.bench.setup import build_methods

    cfg = compose_eval("options.eagle3.num_speculative_tokens=4", "checkpoints.eagle3=runs/x/final",
                       "methods=[ar,eagle3]", "draft_model=null",
                       "+variants.fast={method: eagle3, num_speculative_tokens: 4}",
                       "options.dflash.num_speculative_tokens=null")
    assert cfg.options.eagle3 == {"num_speculative_tokens": 4, "weights": "auto", "lookup": 0, "lookup_tokens": 6}
    assert cfg.options.dflash.num_speculative_tokens is None
    assert cfg.checkpoints.eagle3 == "runs/x/final" and list(cfg.methods) == ["ar", "eagle3"]
    assert cfg.draft_model is None and cfg.variants.fast == {"method": "eagle3", "num_speculative_tokens": 4}
    assert "eagle3_bf16" in cfg.variants  # the declared ones stay
    with pytest.raises(ConfigCompositionException, match="foo"):
        compose_eval("options.eagle3.foo=1")
    cfg = compose_eval("+options.ngram.foo=1")
    with pytest.raises(ValueError, match=r"^options.ngram: unknown option\(s\) \['foo'\]; known: ") as e:
        build_methods(None, ["ngram"], options=OmegaConf.to_container(cfg.options))  # n-gram needs no target
    assert "\n" not in str(e.value) and str(e.value).count("options.ngram") == 1


def test_eval_refuses_an_option_a_method_does_not_declare_in_one_line_naming_its_options():
    """``python -m eval options.eagle3.k=5`` (K is ``num_speculative_tokens``): one line listing eagle3's options,
    before Hydra's several-line refusal that names none."""
    from eval.__main__ import check_option_overrides

    with pytest.raises(ValueError,
                       match=r"^options.eagle3: unknown option\(s\) \['k'\]; known: .*num_speculative_tokens"):
        check_option_overrides(["methods=[ar,eagle3]", "options.eagle3.k=5"])
    check_option_overrides(["options.eagle3.num_speculative_tokens=5", "+options.dflash.min_confidence=0.5"])


@pytest.mark.parametrize("suffix", ["_smollm2", "_smollm2_onpolicy"])
def test_smollm2_recipes_share_one_feature_cache_that_stores_their_layers(suffix):
    """Every *_smollm2 recipe reads one feature cache (the 30-layer target runs once), and so does every
    *_smollm2_onpolicy recipe (another cache: other rows): the same data rows, and the cache stores each recipe's
    layers (train.feature_layers), so none of them is refused the cache another built."""
    from models.methods.dflash.config import default_layer_ids as dflash_ids
    from models.methods.eagle3.config import default_layer_ids as eagle3_ids
    from models.methods.peagle.config import default_layer_ids as peagle_ids

    L = 30  # SmolLM2-135M-Instruct
    recipes = sorted(f.stem for f in (CONF / "recipe").glob(f"*{suffix}.yaml"))
    methods = ("eagle3", "dflash", "dspark", "mtp") + (("peagle", "medusa") if suffix == "_smollm2" else ())
    assert {f"{m}{suffix}" for m in methods} <= set(recipes)
    caches, datas = set(), set()
    for r in recipes:
        cfg = compose_with("recipe", r)
        caches.add(cfg.train.feature_cache)
        datas.add(OmegaConf.to_yaml(cfg.data))
        assert cfg.train.mode == "offline", r
        c = cfg.draft.config
        ids = {"eagle3": lambda: c.layer_ids or eagle3_ids(L), "peagle": lambda: c.layer_ids or peagle_ids(L),
               "dflash": lambda: c.layer_ids or dflash_ids(L, c.num_layers), "medusa": list,
               "mtp": list}[cfg.draft.method]()
        assert set(ids) <= set(cfg.train.feature_layers), (r, ids)
    assert len(caches) == 1 and len(datas) == 1
    assert "onpolicy" in next(iter(caches)) if suffix.endswith("onpolicy") else "onpolicy" not in next(iter(caches))
