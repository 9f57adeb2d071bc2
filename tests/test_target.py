import pytest
import torch

from models.core.target import (
    FrozenTarget,
    from_layer_output_ids,
    to_layer_output_ids,
    validate_layer_ids,
)


@pytest.fixture(scope="module")
def target(tiny_llama, tiny_tokenizer):
    return FrozenTarget(tiny_llama, tiny_tokenizer)


def test_hidden_states_match_hf_output_hidden_states(target):
    ids = torch.randint(0, target.vocab_size, (2, 11))
    ref = target.model(input_ids=ids, output_hidden_states=True)
    L = target.num_layers
    out = target(ids, layer_ids=[0, 2, L - 1, L])
    assert set(out.hidden) == {0, 2, L - 1, L}
    for k, h in out.hidden.items():
        torch.testing.assert_close(h, ref.hidden_states[k], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits)
    # id L is after the final norm: the logits are lm_head of it
    torch.testing.assert_close(target.model.lm_head(out.hidden[L]), ref.logits)


def test_only_requested_layers_are_captured(target):
    mods = [target.embed, target.norm, *target.layers]
    before = [len(m._forward_hooks) for m in mods]
    out = target(torch.randint(0, target.vocab_size, (1, 5)), layer_ids=[1])
    assert list(out.hidden) == [1]
    # our hooks are removed afterwards: no leak into later calls
    assert [len(m._forward_hooks) for m in mods] == before


def test_frozen(target):
    assert not any(p.requires_grad for p in target.parameters())
    assert not target.model.training


@pytest.mark.parametrize("ids", [[-1], [5], [1, 1]])
def test_bad_layer_ids_name_the_valid_range(ids):
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.4"):
        validate_layer_ids(ids, 4)


def test_layer_id_conventions_round_trip():
    # EAGLE-3 default for a 32-layer target: ours (2, 16, 29) == SGLang/vLLM (1, 15, 28)
    assert to_layer_output_ids([2, 16, 29]) == [1, 15, 28]
    assert from_layer_output_ids([1, 15, 28]) == [2, 16, 29]


def test_identity_records_shape(target):
    ident = target.identity()
    assert ident["num_hidden_layers"] == 4 and ident["vocab_size"] == target.vocab_size


def test_local_path_round_trip(tmp_path, tiny_llama, tiny_tokenizer):
    tiny_llama.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    t = FrozenTarget.from_pretrained(str(tmp_path))
    ids = torch.randint(0, t.vocab_size, (1, 7))
    torch.testing.assert_close(t(ids).logits, tiny_llama(input_ids=ids).logits)


def test_the_kv_cache_reaches_the_forward_under_either_keyword(target):
    """transformers 5.17 took the KV cache as ``past_key_values``, later 5.x releases as ``cache``; a wrong name falls
    silently into ``**kwargs``. A forward of the last token on the cache of the others gives the full forward's last
    logits whichever name the installed release uses, and a forward that only knows ``past_key_values`` gets it."""
    from transformers import DynamicCache

    from models.core.hf_compat import cache_kwargs

    ids = torch.randint(0, target.vocab_size, (1, 9))
    full = target(ids).logits[0, -1]
    cache = DynamicCache()
    target(ids[:, :-1], cache=cache, use_cache=True)
    step = target(ids[:, -1:], cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    assert cache_kwargs(Old(), "kv") == {"past_key_values": "kv"} and Old()(1, **cache_kwargs(Old(), "kv")) == "kv"
    import inspect

    assert set(cache_kwargs(target.model, None)) <= set(inspect.signature(target.model.forward).parameters)
