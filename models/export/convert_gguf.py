"""GGUF for llama.cpp: the target, or a draft (EAGLE-3, DFlash z-lab layout) with its target's metadata.

    <python with torch, transformers, numpy> models/export/convert_gguf.py DIR --outfile OUT.gguf \\
        [--target-model-dir TARGET] [--outtype f32]

A thin wrapper over llama.cpp's own ``convert_hf_to_gguf.py`` from the sources scripts/build_llama_cpp.sh unpacks
(``LLAMA_CPP_DIR``, default .engines/llama.cpp-0.3.36): every argument is passed through. One addition: the
converter knows BPE pre-tokenizers only by a hash list of published models, so it refuses tiny-code's tokenizer
("BPE pre-tokenizer was not recognized"). When the hash is unknown and the tokenizer's pre-tokenizer is exactly
GPT-2's byte-level regex split (ByteLevel, use_regex, no prefix space), this wrapper answers ``gpt-2``, the
llama.cpp pre-tokenizer that implements that split; any other unknown tokenizer is still refused.
The vLLM venv (.venv-vllm) has all the converter needs.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LLAMA = Path(os.environ.get("LLAMA_CPP_DIR", REPO / ".engines" / "llama.cpp-0.3.36"))
GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _patch() -> None:
    import conversion.base as base  # the converter's own package (LLAMA/conversion)

    orig = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return orig(self, tokenizer)
        except NotImplementedError:
            tj = Path(getattr(tokenizer, "name_or_path", "") or self.dir_model) / "tokenizer.json"
            pre = json.loads(tj.read_text()).get("pre_tokenizer") if tj.exists() else None
            if pre == GPT2_BYTE_LEVEL:
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    # The converter imports sentencepiece before it looks for tokenizer.model, so a BPE-only target (tokenizer.json,
    # no tokenizer.model: tiny-code, SmolLM2) needs sentencepiece installed just to fall through to its BPE path.
    # Answer the converter's own FileNotFoundError first; a real tokenizer.model still goes to sentencepiece.
    orig_sp = base.TextModel._create_vocab_sentencepiece

    def _create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return orig_sp(self)

    base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece


def main() -> None:
    if not (LLAMA / "convert_hf_to_gguf.py").exists():
        sys.exit(f"error: no llama.cpp sources at {LLAMA}; run scripts/build_llama_cpp.sh (or set LLAMA_CPP_DIR)")
    sys.path[:0] = [str(LLAMA), str(LLAMA / "gguf-py")]
    _patch()
    sys.argv = [str(LLAMA / "convert_hf_to_gguf.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
