"""vLLM and SGLang need a GPU, so their EAGLE-3 loaders are replayed here: the name/shape mapping of
``load_weights``, transcribed from the engine files cited at each function. A key we rename, drop or add then
fails here instead of in a user's deployment (SGLang skips unknown names silently and leaves the parameter at
its initial value; vLLM raises KeyError for unknown names but skips an absent embedding/d2t). Transcribed from
the files on the projects' main branches (vllm-project/vllm, sgl-project/sglang); not pinned to one release.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from models.core.target import FrozenTarget
from models.export.api import export
from models.export.shared.common import CONFIG, WEIGHTS
from tests.test_export_engines import make_drafter

STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]  # both engines' stacked mapping


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_llama, tiny_tokenizer):
    d = tmp_path_factory.mktemp("llama_loaders")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return FrozenTarget.from_pretrained(str(d))


def _read(path: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    cfg = json.loads((path / CONFIG).read_text())
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return cfg, shapes


def _engine_params(layer: dict, cfg: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """The parameters each engine builds for a one-layer Llama EAGLE-3 draft (shapes from the config)."""
    H, I_, V = layer["hidden_size"], layer["intermediate_size"], layer["vocab_size"]
    nh, nkv = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or H // nh
    Ht, Vd = cfg.get("target_hidden_size", H), cfg["draft_vocab_size"]
    p = prefix
    return {"model.embed_tokens.weight": (V, H), "model.fc.weight": (H, 3 * Ht),
            f"{p}self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * H), f"{p}self_attn.o_proj.weight": (H, nh * hd),
            f"{p}mlp.gate_up_proj.weight": (2 * I_, H), f"{p}mlp.down_proj.weight": (H, I_),
            f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,),
            f"{p}hidden_norm.weight": (H,), "model.norm.weight": (H,), "lm_head.weight": (Vd, H)}


def _shard_rows(layer: dict, shard) -> int:
    H, nh, nkv = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or H // nh
    return {"q": nh * hd, "k": nkv * hd, "v": nkv * hd, 0: layer["intermediate_size"],
            1: layer["intermediate_size"]}[shard]


def vllm_load(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, set[str]]:
    """vllm/model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights (t2d skipped, d2t →
    draft_id_to_target_id, "model." prefixed unless lm_head) then LlamaModel.load_weights ("midlayer." →
    "layers.0.", stacked q/k/v and gate/up shards, params_dict[name] KeyError on anything unknown)."""
    layer = cfg.get("transformer_layer_config") or cfg
    params = _engine_params(layer, cfg, "model.layers.0.")
    params["draft_id_to_target_id"] = (cfg["draft_vocab_size"],)
    loaded: dict[str, list] = {}
    for name, shape in shapes.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for param, shard_name, shard in STACKED:
            if shard_name in name:
                name = name.replace(shard_name, param)
                assert shape[0] == _shard_rows(layer, shard) and shape[1:] == params[name][1:], (name, shape)
                break
        else:
            shard = None
            if name not in params:
                raise KeyError(name)  # vLLM: params_dict[name]
            assert shape == params[name], (name, shape, params[name])
        loaded.setdefault(name, []).append(shard)
    return params, set(loaded)


def sglang_load(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, set[str], list[str]]:
    """sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3.load_weights (d2t → hot_token_id, t2d skipped,
    stacked shards, name or "model."+name if in params_dict, anything else skipped without a word)."""
    params = _engine_params(cfg, cfg, "model.midlayer.")
    loaded, skipped = set(), []
    for name, shape in shapes.items():
        if "d2t" in name or "t2d" in name:
            loaded.add(name)
            continue
        for param, shard_name, shard in STACKED:
            if shard_name in name:
                name = name.replace(shard_name, param)
                p = f"model.{name}" if name not in params else name
                if p in params:
                    assert shape[0] == _shard_rows(cfg, shard) and shape[1:] == params[p][1:], (name, shape)
                    loaded.add(p)
                else:
                    skipped.append(name)
                break
        else:
            p = name if name in params else f"model.{name}"
            if p in params:
                assert shape == params[p], (name, shape, params[p])
                loaded.add(p)
            else:
                skipped.append(name)
    return params, loaded, skipped


@pytest.mark.parametrize("fmt", ["eagle3_native", "eagle3_speculators"])
def test_vllm_loader_receives_every_parameter(target, tmp_path, fmt):
    cfg, shapes = _read(export(make_drafter(target, (3, 1, 2)), fmt, tmp_path / fmt, target))
    params, loaded = vllm_load(cfg, shapes)
    # the embedding may come from the target (native); the speculators file carries it (identical → deduped)
    assert set(params) - loaded <= {"model.embed_tokens.weight"}
    assert ("model.embed_tokens.weight" in loaded) == (fmt == "eagle3_speculators")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # the runner's capture list, used unchanged


def test_sglang_loader_receives_every_parameter_and_skips_nothing(target, tmp_path):
    cfg, shapes = _read(export(make_drafter(target), "eagle3_native", tmp_path / "nat", target))
    params, loaded, skipped = sglang_load(cfg, shapes)
    assert skipped == []  # SGLang would drop these silently
    assert set(params) - loaded == {"model.embed_tokens.weight"}  # SGLang sets the target's (set_embed)
    assert cfg["tie_word_embeddings"] is False  # else lm_head = embed_tokens (LlamaForCausalLMEagle3.__init__)


def test_a_renamed_key_fails_the_replay(target, tmp_path):
    cfg, shapes = _read(export(make_drafter(target), "eagle3_native", tmp_path / "nat", target))
    renamed = {k.replace("midlayer.hidden_norm", "midlayer.hnorm"): v for k, v in shapes.items()}
    _, loaded, skipped = sglang_load(cfg, renamed)
    assert skipped == ["midlayer.hnorm.weight"] and "model.midlayer.hidden_norm.weight" not in loaded
    with pytest.raises(KeyError, match="hnorm"):
        vllm_load(cfg, renamed)
