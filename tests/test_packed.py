"""models/core/packed.py: oneDNN pre-packed linears for the frozen target (CPU inference)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.core import packed as packed_mod
from models.core.packed import PackedLinear, available, pack_linears

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (3, 7, 24)])
def test_packed_linear_matches_f_linear(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    lin = nn.Linear(24, 40, bias=len(shape) != 2 or shape[0] == 5).to(dtype).requires_grad_(False)
    x = torch.randn(*shape, generator=g).to(dtype)
    packed = PackedLinear(lin)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(packed(x), lin(x), **tol)
    wide = torch.randn(shape[0], 48, generator=g).to(dtype)[:, ::2]  # a non-contiguous input
    torch.testing.assert_close(packed(wide), lin(wide), **tol)


def test_it_follows_its_weight_and_keeps_gradients_working():
    lin = nn.Linear(16, 8).requires_grad_(False)
    packed = PackedLinear(lin)
    x = torch.randn(3, 16)
    before = packed(x)
    with torch.no_grad():
        lin.weight.mul_(2)  # in place: the packed copy is rebuilt
    torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(packed(x), before)
    x.requires_grad_(True)  # autograd takes F.linear (the packed op has none)
    packed(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(3, 16))


def test_pack_linears_keeps_parameters_ties_state_and_outputs(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    names = sorted(model.state_dict())
    ids = torch.tensor([[5, 9, 14, 3, 22]])
    with torch.no_grad():
        ref = model(ids).logits
        n = pack_linears(model)
        got = model(ids).logits
    assert n == sum(isinstance(m, PackedLinear) for m in model.modules()) > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sorted(model.state_dict()) == names
    if tiny_llama.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    twin = copy.deepcopy(model).to(torch.bfloat16)  # deep copies re-pack for their own (cast) weights
    with torch.no_grad():
        half = twin(ids).logits.float()
    torch.testing.assert_close(half, ref, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_graph_calls_the_packed_op_and_computes_the_same(dtype):
    """Under torch.compile the packed copy stays out of the graph (oneDNN's packed tensor is opaque): the graph holds
    one draftsmith::packed_linear per linear, on the plain weight, and its kernel finds the packed copy."""
    from models.core.packed import packs

    if not packs(dtype):
        pytest.skip(f"oneDNN has no packed {dtype} linear on this CPU")
    seen = []

    def record(gm, _inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    lin = nn.Linear(24, 40).to(dtype).requires_grad_(False)
    packed = PackedLinear(lin)
    x = torch.randn(1, 3, 24).to(dtype)
    with torch.no_grad():
        torch._dynamo.reset()
        got = torch.compile(packed, backend=record, fullgraph=True)(x)
        eager = packed(x)
    assert seen == [torch.ops.draftsmith.packed_linear]  # dynamo's graph: the op, no F.linear
    seen.clear()
    with packed_mod.use_linears("plain"), torch.no_grad():  # inductor's own GEMM instead: a trace of its own
        plain = torch.compile(packed, backend=record, fullgraph=True)(x)
    assert packed_mod.LINEARS == "packed"  # as it was
    assert seen == [torch.nn.functional.linear]
    torch.testing.assert_close(plain, eager, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert torch.equal(got, eager)  # the same oneDNN kernel on the same packed weight
    moved = copy.deepcopy(packed)  # another weight: the op finds that linear's own packed copy
    with torch.no_grad():
        moved.weight.mul_(2)
        torch.testing.assert_close(torch.ops.draftsmith.packed_linear(x, moved.weight, moved.bias), lin(x) * 2 -
                                   lin.bias, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
