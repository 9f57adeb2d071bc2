"""A llama.cpp tool killed by a signal (a native-ISA build on a quantized type) is one line naming the signal, the
model's GGUF type and the fix. No engine needed: the message helper, and eval/engines/llamacpp.py's ``_run`` on a
real child process that a signal kills."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def test_a_crash_is_one_line_naming_the_signal_the_target_type_and_the_fix():
    """A llama.cpp tool killed by a signal (a native-ISA build on a quantized type): the engine benchmark said
    "llama-server exited (rc -11): … no API key is set …", naming nothing useful."""
    from eval.engines.llamacpp import crash_line
    from models.core.gguf import alias_path

    line = crash_line("llama-server", -11, alias_path("smollm2"))
    assert line.startswith("llama-server crashed with SIGSEGV on SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1): ")
    assert "LLAMA_CPP_NATIVE=OFF make engines" in line and "\n" not in line


def test_run_turns_a_child_killed_by_sigsegv_into_that_one_line(tmp_path):
    """A real process that a SIGSEGV kills (its return code is -11, not an exit status): ``_run`` reads the model
    from the argument after "-m", as it does for the llama.cpp tools. Core dumps are off in the child: only the
    signal matters here."""
    from eval.engines.llamacpp import _run

    model = tmp_path / "draft.gguf"  # not a GGUF: its type reads as "unknown"
    model.write_bytes(b"not a gguf")
    kill = ("import os, resource, signal; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
            "os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(RuntimeError) as e:
        _run([sys.executable, "-c", kill, "-m", str(model)], timeout=60)
    msg = str(e.value)
    assert msg.startswith(f"{Path(sys.executable).name} crashed with SIGSEGV on draft.gguf (unknown): "), msg
    assert "LLAMA_CPP_NATIVE=OFF make engines" in msg and "\n" not in msg
