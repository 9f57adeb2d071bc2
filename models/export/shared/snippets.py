"""The serving snippets of an export's README.md: what every format's ``ExportFormat.readme`` shares.

models/export/readme.py writes the format-independent frame (target, check command, num_speculative_tokens);
each format's own sections (its method's ``export.py``) come after it, built from these pieces: the engine
releases the snippets were checked against and the vLLM / SGLang command blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The engine releases whose loaders (read from their wheels) each snippet was checked against.
VLLM_CHECKED = "vLLM 0.33.0 and 0.32.0"
SGLANG_CHECKED = "SGLang 0.5.23"


@dataclass(frozen=True)
class Serve:
    """What a snippet names: the export directory (a placeholder path), the target as engines find it, and
    num_speculative_tokens."""

    path: str
    target: str
    num_speculative_tokens: int

    def speculative_config(self, method: str, **extra) -> dict:
        """vLLM's ``--speculative-config`` for this export, the engine method first."""
        return {"method": method, "model": self.path, "num_speculative_tokens": self.num_speculative_tokens,
                "draft_tensor_parallel_size": 1, **extra}


def vllm_serve(s: Serve, config: dict) -> list[str]:
    """The two lines of a ``vllm serve`` command."""
    return [f"vllm serve {s.target} \\", f"  --speculative-config '{json.dumps(config)}'"]


def vllm_section(s: Serve, config: dict, heading: str = f"vLLM (checked against {VLLM_CHECKED})") -> list[str]:
    return [f"## {heading}", "", "```bash", *vllm_serve(s, config), "```", ""]


def sglang_chain_section(s: Serve, algorithm: str) -> list[str]:
    """SGLang's launch command for a chain drafter (EAGLE3, NEXTN), with how to turn it into a tree."""
    return [f"## SGLang (checked against {SGLANG_CHECKED})", "", "```bash",
            f"python -m sglang.launch_server --model-path {s.target} \\",
            f"  --speculative-algorithm {algorithm} --speculative-draft-model-path {s.path} \\",
            f"  --speculative-num-steps {s.num_speculative_tokens} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {s.num_speculative_tokens + 1}",
            "```", "",
            "(chain drafting; for tree drafting raise --speculative-eagle-topk and "
            "--speculative-num-draft-tokens)", ""]
