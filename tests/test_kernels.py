"""models/core/kernels.py: the dtype probe behind target.dtype=auto."""

from __future__ import annotations

import pytest
import torch

from models.core.kernels import bandwidth_bound, cpu_features, probe, read_bandwidth, weight_bytes
from models.core.target import FrozenTarget, dtype_names


def test_probe_times_each_dtype_and_chooses_by_the_rule(tiny_llama):
    """bf16 only with a native bf16 dot product and confirming rounds that beat fp32 by the margin, else fp32."""
    from models.core.kernels import MARGIN, native_bf16

    result = probe(tiny_llama, widths=(1, 2, 3), prefix_len=8, reps=1, rounds=3)
    assert set(result["dtypes"]) == {"float32", "bfloat16"}
    for d in result["dtypes"].values():
        assert set(d["t_s"]) == {1, 2, 3} and all(t > 0 for t in d["t_s"].values()) and d["t_over_t1"][1] == 1.0
    assert result["native_bf16"] == native_bf16()
    confirm = result["confirm"]
    if not result["native_bf16"]:
        assert result["chosen"] == "float32" and confirm is None
    else:
        assert len(confirm["bf16_over_fp32"]) == 3
        from models.core import gemv  # bf16 timed on its fastest linears: the GEMV where it runs here

        assert confirm["bf16_linears"] == ("gemv" if gemv.unavailable() is None else "packed")
        assert result["chosen"] == ("bfloat16" if confirm["median_ratio"] <= 1 - MARGIN else "float32")
    assert tiny_llama.dtype == torch.float32  # probed on a copy
    assert result["machine"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(cpu_features()["flags"], list)


def test_auto_dtype_loads_the_target_in_the_probed_dtype(target_dir):
    assert "auto" in dtype_names()
    target = FrozenTarget.from_pretrained(str(target_dir), dtype="auto")
    chosen = target.model.draftsmith_kernels["chosen"]
    assert str(target.model.dtype) == f"torch.{chosen}"
    # the fingerprint does not depend on the load dtype: a drafter trained on the fp32 load still matches
    assert target.fingerprint() == FrozenTarget.from_pretrained(str(target_dir)).fingerprint()


def test_probe_cli_writes_the_probe_and_the_gemm_table(target_dir, tmp_path, capsys):
    import json

    from eval.bench.probe import main

    out = tmp_path / "probe.json"
    main(["--target", str(target_dir), "--max-width", "2", "--reps", "1", "--gemm", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["chosen"] in ("float32", "bfloat16") and set(got["dtypes"]["float32"]["t_s"]) == {"1", "2"}
    assert got["bandwidth"]["ar_tokens_per_s_bound"] > 0
    rows = {k.split(" ")[0] + " " + k.split("] ")[1] for k in got["gemm_ms"]}
    want = {f"{w} {d}" for w in ("mlp_gate", "lm_head") for d in ("float32", "bfloat16")}
    from models.core.packed import available, packs

    packed = {f"{w} {d} packed" for w in ("mlp_gate", "lm_head") for d in ("float32", "bfloat16")
              if available() and packs(getattr(torch, d))}
    from models.core import gemv

    streamed = {f"{w} bfloat16 gemv" for w in ("mlp_gate", "lm_head") if gemv.unavailable() is None}
    assert rows == want | packed | streamed
    assert all(v > 0 for t in got["gemm_ms"].values() for v in t.values())
    assert json.loads(capsys.readouterr().out) == got


def test_weight_bytes_count_what_a_step_reads(tiny_llama):
    """Tied embedding and lm_head: one matrix, read whole by the head. Untied: the input embedding is left out (a
    step reads one row of it)."""
    import copy

    m = copy.deepcopy(tiny_llama)
    every = sum(p.numel() * p.element_size() for p in m.parameters())
    emb = m.get_input_embeddings().weight
    head = m.get_output_embeddings()
    tied = head.weight.data_ptr() == emb.data_ptr()
    assert weight_bytes(m) == (every if tied else every - emb.numel() * emb.element_size())
    head.weight = emb  # tie them: one matrix, counted once and kept
    assert weight_bytes(m) == sum(p.numel() * p.element_size() for p in m.parameters())
    assert weight_bytes(m.to(torch.bfloat16)) * 2 == weight_bytes(m.to(torch.float32))


def test_bandwidth_bound_is_measured_bandwidth_over_weight_bytes(tiny_llama):
    bw = read_bandwidth(mib=16, reps=2)
    assert 1e8 < bw < 1e13  # bytes/s: any machine this runs on
    b = bandwidth_bound(tiny_llama, reps=2)
    assert b["weight_MB"] == round(weight_bytes(tiny_llama) / 1e6, 1) and b["threads"] == torch.get_num_threads()
    assert b["ar_tokens_per_s_bound"] == pytest.approx(b["read_GB_per_s"] * 1e9 / weight_bytes(tiny_llama), rel=0.02)
