"""models/core/refill.py: continuous batching against a one-sequence reference; per-request seeds make a request's
tokens independent of its batch; follow-up requests (a conversation's next turn) join while others run."""

from __future__ import annotations

import pytest
import torch

from models.core.refill import Request, generate_refill, prefill_groups
from tests.test_generate import _prompts
from tests.test_regenerate import manual_greedy  # one sequence, no padding, no cache: the reference


def _run(model, prompts, stops, batch_size, max_new=12, temperature=0.0, refill_at=0.125, seeds=None, trickle=0):
    """``trickle``: pull hands out at most that many at a time (the batch then fills up over several admissions)."""
    todo = [Request(i, p, (seeds or {}).get(i, i)) for i, p in enumerate(prompts)]
    got: dict[int, list[int]] = {}

    def pull(n):
        out = todo[: min(n, trickle or n)]
        del todo[: len(out)]
        return out

    generate_refill(model, pull, got.__setitem__, sorted(stops), pad_id=2, max_new_tokens=max_new,
                    batch_size=batch_size, temperature=temperature, refill_at=refill_at)
    return [got[i] for i in range(len(prompts))]


def test_greedy_equals_one_sequence_loop_through_refills(tiny_llama):
    """Rows end at different steps and their slots take the waiting prompts (admitted at other columns, after
    left padding of the buffer for a longer prompt): every reply is the one the prompt gets alone."""
    prompts = _prompts(13, tiny_llama.config.vocab_size, seed=3)
    prompts[9] = prompts[9] * 4  # a late prompt longer than the columns filled so far
    free = [manual_greedy(tiny_llama, p, set(), 12) for p in prompts]
    stops = {free[0][1], free[4][3], free[7][0]}
    refs = [manual_greedy(tiny_llama, p, stops, 12) for p in prompts]
    assert sum(len(r) < 12 for r in refs) >= 3
    for batch_size, refill_at, trickle in ((4, 0.25, 0), (3, 1.0, 0), (13, 0.125, 0), (1, 0.125, 0), (8, 0.125, 2)):
        got = _run(tiny_llama, prompts, stops, batch_size, refill_at=refill_at, trickle=trickle)
        assert got == refs, (batch_size, refill_at, trickle)


def test_prefill_groups_bound_padding_and_keep_every_request():
    lengths = [3, 40, 38, 5, 39, 4, 200, 12, 11, 36]
    reqs = [Request(i, [5] * n, i) for i, n in enumerate(lengths)]
    groups = prefill_groups(reqs, slack=1.25)
    assert sorted(r.tag for g in groups for r in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(len(r.prompt) for r in g) <= 1.25 * sum(len(r.prompt) for r in g)
    assert [sorted(r.tag for r in g) for g in groups][:2] == [[6], [1, 2, 4, 7, 9]]  # 200 alone; 12 joins 36-40
    assert prefill_groups(reqs, slack=100.0) == [sorted(reqs, key=lambda r: -len(r.prompt))]  # one padded forward


def test_long_runs_trim_the_buffer_and_stay_exact(tiny_llama):
    """Enough steps for the oldest columns to be dropped (trim_left) while rows keep arriving."""
    prompts = _prompts(24, tiny_llama.config.vocab_size, seed=5)
    refs = [manual_greedy(tiny_llama, p, set(), 40) for p in prompts]
    assert _run(tiny_llama, prompts, set(), 3, max_new=40, refill_at=0.3) == refs


def test_a_request_samples_the_same_tokens_in_any_batch(tiny_llama):
    prompts = _prompts(7, tiny_llama.config.vocab_size, seed=1)
    a = _run(tiny_llama, prompts, [1], 7, max_new=10, temperature=1.0)
    assert a == _run(tiny_llama, prompts, [1], 2, max_new=10, temperature=1.0)  # other batches, same draws
    reseeded = _run(tiny_llama, prompts, [1], 7, max_new=10, temperature=1.0, seeds={0: 99})
    assert reseeded[0] != a[0] and reseeded[1:] == a[1:]
    cold = _run(tiny_llama, prompts, [1], 3, max_new=10, temperature=1e-4)
    assert cold == _run(tiny_llama, prompts, [1], 3, max_new=10)


@pytest.mark.parametrize("batch_size", [2, 8])
def test_follow_up_requests_join_while_others_run(tiny_llama, batch_size):
    """finish() may queue a request (the next turn of a conversation, prompted with the reply); pull hands it out
    later, and it is answered as if alone (batch 8: the first 5 leave rows empty, which the follow-ups add)."""
    first = _prompts(5, tiny_llama.config.vocab_size, seed=2)
    queue = [Request(("a", i), p, i) for i, p in enumerate(first)]
    got = {}

    def finish(tag, new):
        got[tag] = new
        if tag[0] == "a":
            queue.append(Request(("b", tag[1]), list(first[tag[1]]) + new + [7], 100 + tag[1]))

    def pull(n):
        out = queue[:n]
        del queue[:n]
        return out

    generate_refill(tiny_llama, pull, finish, [], pad_id=2, max_new_tokens=6, batch_size=batch_size)
    for i, p in enumerate(first):
        a = manual_greedy(tiny_llama, p, set(), 6)
        assert got[("a", i)] == a and got[("b", i)] == manual_greedy(tiny_llama, list(p) + a + [7], set(), 6)


def test_bad_batch_and_empty_prompt(tiny_llama):
    with pytest.raises(ValueError, match="batch_size"):
        _run(tiny_llama, [[3]], set(), 0)
    with pytest.raises(ValueError, match="empty prompt"):
        _run(tiny_llama, [[3], []], set(), 2)


def test_bf16_model_generates(tiny_llama):
    from models.core.kernels import cast_copy

    prompts = _prompts(5, tiny_llama.config.vocab_size, seed=4)
    half = cast_copy(tiny_llama, torch.bfloat16)
    got = _run(half, prompts, set(), 2, max_new=5)
    assert [len(g) for g in got] == [5] * 5


def test_bf16_with_grouped_attention_over_whole_buffers(tiny_llama):
    """The path regeneration runs: a bf16 target whose decoding attention is models/core/attention.py's (reading
    the refill buffer whole, unfilled and dead columns masked). Greedy replies match each prompt decoded alone with
    the same bf16 model and attention."""
    from models.core.attention import use_cpu_gqa
    from models.core.kernels import cast_copy

    half = cast_copy(tiny_llama, torch.bfloat16)
    use_cpu_gqa(half)
    prompts = _prompts(10, tiny_llama.config.vocab_size, seed=6)
    alone = [_run(half, [p], set(), 1, max_new=20)[0] for p in prompts]
    assert _run(half, prompts, set(), 4, max_new=20, refill_at=0.25) == alone
