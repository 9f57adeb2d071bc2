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
    override = f"+recipe={option}" if group == "recipe" else f"{group}={option}"
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


def test_eval_yaml_options_are_the_registry_defaults():
    """conf/eval.yaml lists every proposer's options (Hydra can only override keys it has) with exactly the
    defaults of its ProposerSpec, the one source the harness uses when called from Python."""
    from omegaconf import OmegaConf

    from models import registry

    opts = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "eval.yaml").options)
    assert opts == {name: dict(p.defaults) for name, (_, p) in registry.proposers().items()}
