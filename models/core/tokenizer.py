"""tiny-code's tokenizer: byte-level BPE (HF `tokenizers`) wrapped as PreTrainedTokenizerFast.

Byte-level means every string round-trips exactly, so bits/byte is well defined on any file.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]

# Minimal chat template: one role token per turn, `<|end|>` closes it. The assistant-only loss
# mask is computed by rendering prefixes (data/chat.py), so the template needs no
# `{% generation %}` markers and any model's template works the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,  # windows are cut by the caller,
    )
