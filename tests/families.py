"""Tiny random-weight models of ten target families, built in code (no download, ~1 s each).

Each family gets transformers' own config class (so its real decoder layer, attention, MoE, sliding window,
soft-capping and rope code run), a byte-level BPE tokenizer trained on a few stdlib lines with that family's
special tokens and quirks (no bos for Qwen/gpt-oss, no pad for Llama-3/Mistral, embedding rows > len(tokenizer))
and a chat template reproducing the family's behaviours that matter for loss masks and stop tokens:

    llama        Llama-3 headers, <|eot_id|> closes a turn, `{% generation %}` markers (the HF assistant-mask path)
    qwen2        ChatML, default system prompt when none is given, no bos
    qwen3        ChatML + an empty <think> block only on assistant turns after the last user turn; enable_thinking
    qwen3_moe    as qwen3 (MoE block)
    mistral      v0.3: the system prompt is folded into the LAST user turn; sliding window
    gemma2       raises "System role not supported"; <end_of_turn>; sliding window + soft-capping
    gemma3       system folded into the first user turn; per-layer-type sliding/full layers and rope
    phi3         <|end|> closes a turn, eos appended after the last turn when add_generation_prompt=False
    deepseek_v3  <｜User｜>/<｜Assistant｜>, MLA attention + MoE
    gpt_oss      harmony: <|end|> closes earlier turns and the analysis channel, <|return|> the final reply; sinks;
                 refuses <|channel|> text in a reply's content (analysis goes in 'thinking'), as the real template
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "deepseek_v3", "qwen3_moe", "gpt_oss")
WINDOW = 16  # sliding window of the windowed families: a 40-token decode runs well past it
HIDDEN, LAYERS, HEADS = 64, 4, 4

_LLAMA = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
          "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_QWEN2 = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
          "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_QWEN3 = ("{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
          "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
          "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
          "{% if loop.index0 > ns.last_user %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
          "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
          "{% endif %}")
_MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
            "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}"
            "{% endif %}{% set ns = namespace(last_user=-1) %}{% for m in loop_messages %}"
            "{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
            "{{ bos_token }}{% for m in loop_messages %}{% if m['role'] == 'user' %}"
            "{% if system and loop.index0 == ns.last_user %}[INST] {{ system }}\n\n{{ m['content'] }}[/INST]"
            "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
            "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
_GEMMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
           "{{ raise_exception('System role not supported') }}{% endif %}"
           "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
           "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
           "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_GEMMA3 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
           "{% set prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
           "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
           "{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
           "<start_of_turn>{{ role }}\n{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
           "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")
_DEEPSEEK = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}"
             "{% endfor %}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
             "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
_GPT_OSS = ("<|start|>system<|message|>You are ChatGPT.\nReasoning: medium<|end|>"
            "{% for m in messages %}{% if m['role'] == 'system' %}<|start|>developer<|message|># Instructions\n\n"
            "{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
            "{% for m in messages %}{% if m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
            "{% elif m['role'] == 'assistant' %}"
            "{% if '<|channel|>analysis<|message|>' in m['content'] or '<|channel|>final<|message|>' in m['content'] %}"
            "{{ raise_exception(\"You have passed a message containing <|channel|> tags in the content field. "
            "Instead of doing this, you should pass analysis messages (the string between '<|message|>' and "
            "'<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and "
            "'<|end|>') in the 'content' field.\") }}{% endif %}"
            "{% if m.get('thinking') and loop.last %}"
            "<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
            "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}"
            "{% if loop.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@dataclass(frozen=True)
class Spec:
    """One family: its tokenizer's special tokens, template, generation-config eos list and config kwargs."""

    model_type: str
    template: str
    bos: str | None
    eos: str
    pad: str | None
    specials: tuple[str, ...]
    gen_eos: tuple[str, ...]          # generation_config.eos_token_id (as tokens)
    turn_end: str                     # what closes an assistant reply in the full render (the last turn's)
    config: dict = field(default_factory=dict)
    sliding: bool = False


_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
SPECS: dict[str, Spec] = {
    "llama": Spec("llama", _LLAMA, "<|begin_of_text|>", "<|eot_id|>", None,
                  ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"), ("<|end_of_text|>", "<|eot_id|>"),
                  "<|eot_id|>"),
    "qwen2": Spec("qwen2", _QWEN2, None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",),
                  ("<|im_end|>", "<|endoftext|>"), "<|im_end|>"),
    "qwen3": Spec("qwen3", _QWEN3, None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",),
                  ("<|im_end|>", "<|endoftext|>"), "<|im_end|>", dict(head_dim=32)),
    "mistral": Spec("mistral", _MISTRAL, "<s>", "</s>", None, ("[INST]", "[/INST]"), ("</s>",), "</s>",
                    dict(sliding_window=WINDOW, head_dim=32), sliding=True),
    "gemma2": Spec("gemma2", _GEMMA2, "<bos>", "<eos>", "<pad>", ("<start_of_turn>", "<end_of_turn>"),
                   ("<eos>", "<end_of_turn>"), "<end_of_turn>",
                   dict(head_dim=32, sliding_window=WINDOW, final_logit_softcapping=30.0,
                        attn_logit_softcapping=50.0, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)), sliding=True),
    "gemma3": Spec("gemma3_text", _GEMMA3, "<bos>", "<eos>", "<pad>", ("<start_of_turn>", "<end_of_turn>"),
                   ("<eos>", "<end_of_turn>"), "<end_of_turn>",
                   dict(head_dim=32, sliding_window=WINDOW, final_logit_softcapping=30.0, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                     "full_attention"][:LAYERS],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                   sliding=True),
    "phi3": Spec("phi3", _PHI3, "<s>", "<|endoftext|>", "<|endoftext|>",
                 ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), ("<|endoftext|>", "<|end|>"), "<|end|>"),
    "deepseek_v3": Spec("deepseek_v3", _DEEPSEEK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                        "<｜end▁of▁sentence｜>", ("<｜User｜>", "<｜Assistant｜>"), ("<｜end▁of▁sentence｜>",),
                        "<｜end▁of▁sentence｜>",
                        dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                             q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                             topk_group=1, **_MOE)),
    "qwen3_moe": Spec("qwen3_moe", _QWEN3, None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",),
                      ("<|im_end|>", "<|endoftext|>"), "<|im_end|>",
                      dict(head_dim=32, num_experts=4, decoder_sparse_step=1, **_MOE)),
    "gpt_oss": Spec("gpt_oss", _GPT_OSS, None, "<|return|>", "<|endoftext|>",
                    ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>"),
                    ("<|return|>", "<|endoftext|>", "<|call|>"), "<|return|>",
                    dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                          "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "truncate": False},
                         layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)), sliding=True),
}
# Qwen3's <think> tags are ordinary added tokens (not special) in the real tokenizer.
_ADDED = {"qwen3": ("<think>", "</think>"), "qwen3_moe": ("<think>", "</think>")}


@functools.lru_cache(maxsize=1)
def _corpus() -> list[str]:
    import json
    import textwrap

    text = inspect.getsource(json) + inspect.getsource(textwrap)
    chat = ["Hello, how are you today? I am fine, thank you for asking.",
            "Write a function that adds two numbers. Here is one: def add(a, b): return a + b",
            "You are a helpful assistant. Answer briefly and politely.",
            "What is the capital of France? The capital of France is Paris."]
    return text.splitlines() + chat * 10


@functools.cache
def _bpe(specials: tuple[str, ...]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def make_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The family's tokenizer: special tokens first (ids 0..), then a small byte-level BPE."""
    s = SPECS[family]
    special = [t for t in dict.fromkeys([s.bos, s.eos, s.pad, *s.specials, *s.gen_eos]) if t]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe(tuple(special)).to_str()),
                                  bos_token=s.bos, eos_token=s.eos, pad_token=s.pad,
                                  additional_special_tokens=[t for t in special if t not in (s.bos, s.eos, s.pad)],
                                  chat_template=s.template, clean_up_tokenization_spaces=False,
                                  model_max_length=1 << 30)
    if family in _ADDED:
        tok.add_tokens(list(_ADDED[family]))
    return tok


def _config(family: str, tok: PreTrainedTokenizerFast, vocab: int):
    from transformers import AutoConfig

    s = SPECS[family]
    kw = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    if family == "deepseek_v3":
        kw["num_key_value_heads"] = HEADS
    kw.update(s.config)
    return AutoConfig.for_model(s.model_type, **kw)


def make_family(family: str, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """(model, tokenizer) of ``family``; the model's vocabulary is padded past the tokenizer's."""
    from transformers import AutoModelForCausalLM

    if family not in SPECS:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    tok = make_tokenizer(family)
    vocab = (len(tok) // 64 + 2) * 64  # padded: rows no token maps to (as real checkpoints have)
    cfg = _config(family, tok, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    s = SPECS[family]
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                                               eos_token_id=[tok.convert_tokens_to_ids(t) for t in s.gen_eos])
    return model, tok


HARMONY_REPLY = ("<|channel|>analysis<|message|>The user asks a question.<|end|><|start|>assistant"
                 "<|channel|>final<|message|>Here it is.<|return|>")


@functools.lru_cache(maxsize=1)
def harmony_speaker() -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The gpt-oss family target taught to answer CONVERSATION's turns in harmony form (an analysis channel, then
    the final one), as real gpt-oss does: a few seconds of Adam on those two replies, then greedy decoding
    reproduces them. (Random weights almost never emit channel headers.)"""
    from data.chat import render_chat

    model, tok = make_family("gpt_oss")
    seqs = []
    for j, m in enumerate(CONVERSATION):
        if m["role"] == "assistant":
            prompt = render_chat(tok, CONVERSATION[:j], True)
            n = len(tok(prompt, add_special_tokens=False)["input_ids"])
            seqs.append((torch.tensor([tok(prompt + HARMONY_REPLY, add_special_tokens=False)["input_ids"]]), n))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(80):
        loss = sum(torch.nn.functional.cross_entropy(model(x).logits[0, n - 1 : -1], x[0, n:]) for x, n in seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False), tok


def save_family(family: str, path, seed: int = 0):
    """Write the family's model + tokenizer to ``path`` (a loadable local target directory)."""
    model, tok = make_family(family, seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b): return a + b"},
]
