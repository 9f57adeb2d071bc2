"""Shared fixtures: tiny models and tokenizers built in code (seconds, no network)."""

from __future__ import annotations

import os

# before transformers/huggingface_hub read them at import time
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.set_num_threads(1)  # tests run under xdist, one process per core


@pytest.fixture(autouse=True)
def _transformers_logs_to_this_tests_stderr():
    """transformers' log handler keeps the sys.stderr of the moment it was made; made under an earlier test's
    capsys, a later warning writes to that closed stream and prints a "Logging error" traceback into this test's
    stderr (order-dependent under xdist). Point it at the stream of the test now running."""
    import sys

    from transformers.utils import logging as hf_logging

    h = hf_logging._default_handler
    if h is not None:
        h.stream = sys.stderr  # not setStream: that flushes the old stream, which may be closed
    yield

TINY_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "Hello, how are you? I am fine, thank you. What is the weather like today?\n",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from models.core.tokenizer import train_tokenizer

    return train_tokenizer(TINY_TEXTS, vocab_size=300)


def make_tiny_llama(vocab_size: int, layers: int = 4, hidden: int = 32, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_llama(tiny_tokenizer):
    """A random 4-layer Llama over the tiny tokenizer's vocabulary."""
    return make_tiny_llama(len(tiny_tokenizer))


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    """The tiny Llama + tokenizer saved as a model directory (what `target.name_or_path` loads)."""
    d = tmp_path_factory.mktemp("target")
    tiny_llama.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d
