"""Held-out loss of a causal LM on the shipped held-out files: nats/token and bits/byte.

    python -m data.perplexity                      # tiny-code on models/tiny_code/heldout.jsonl
    python -m data.perplexity --model PATH_OR_ID   # any HF causal LM

Each file is tokenized as ``<bos> text`` and scored in non-overlapping windows of ``seq_len``
tokens (every token after <bos> is predicted exactly once; a window's first token is
conditioned on the previous window's last token). bits/byte = Σ NLL / ln 2 / UTF-8 bytes, which
does not depend on the tokenizer, so models with different vocabularies compare directly.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data import corpus
from models.core.target import EMBEDDED_DIR


@torch.inference_mode()
def heldout_loss(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    files: list[corpus.SourceFile],
    seq_len: int = 256,
    batch_size: int = 16,
) -> dict:
    model.eval()
    windows: list[list[int]] = []
    n_bytes = 0
    for f in files:
        ids = [tok.bos_token_id, *tok(f.text, add_special_tokens=False)["input_ids"]]
        n_bytes += len(f.text.encode("utf-8"))
        # window i = ids[i*L : i*L + L + 1]: inputs are its first L tokens, targets the last L.
        for s in range(0, len(ids) - 1, seq_len):
            windows.append(ids[s : s + seq_len + 1])
    nll, n_tok = 0.0, 0
    windows.sort(key=len)  # batch equal lengths together; order does not change the sum
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        width = max(len(w) for w in chunk)
        x = torch.full((len(chunk), width), -100, dtype=torch.long)
        for j, w in enumerate(chunk):
            x[j, : len(w)] = torch.tensor(w)
        inp = x[:, :-1].clamp(min=0)
        logits = model(input_ids=inp).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        nll += loss.item()
        n_tok += int((x[:, 1:] != -100).sum())
    return {
        "files": len(files),
        "tokens": n_tok,
        "bytes": n_bytes,
        "nats_per_token": nll / n_tok,
        "bits_per_byte": nll / math.log(2) / n_bytes,
        "seq_len": seq_len,
    }


def main() -> None:
    from models.core.target import load_causal_lm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(EMBEDDED_DIR))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--sample-tokens", type=int, default=0, help="also print a greedy continuation of a held-out prompt")
    a = p.parse_args()
    model, tok = load_causal_lm(a.model)
    print(json.dumps(heldout_loss(model, tok, corpus.load_heldout(), seq_len=a.seq_len), indent=1))
    if a.sample_tokens:
        prompt = corpus.heldout_prompts(tok, n=1, prompt_tokens=48)[0]["input_ids"]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=a.sample_tokens, do_sample=False)
        print(tok.decode(prompt) + "<<<PROMPT ENDS>>>" + tok.decode(out[0, len(prompt):]))


if __name__ == "__main__":
    main()
