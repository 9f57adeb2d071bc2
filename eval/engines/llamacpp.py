"""llama.cpp running draftsmith's GGUF exports: its own tools, driven as subprocesses, one prompt each.

- ``llama-completion`` (greedy, ``--temp 0``): the engine's AR, its tokens and its decode tokens/s;
- ``llama-speculative-simple -md draft.gguf --spec-type T --spec-draft-n-max K``: speculative decoding, its text,
  its decode tokens/s and, from its debug log, every round's ``accepted a/d draft tokens``;
- ``llama-tokenize``: the engine's own token ids of a prompt text.

Aligning the rounds with the harness. llama-speculative-simple evaluates the prompt minus its last token and makes
that token its first round's anchor, so its first round also yields the first generated token, which the harness
gets from prefill for free: every later round boundary would sit one token off. So the engine gets the prompt
*plus* the target's first greedy token t0, and generates ``max_new_tokens - 1``: its first round drafts after t0
from the features of the prompt, exactly the harness's first round. Prompts are kept only where the engine's
tokenization of that text is exactly prompt + [t0] (a BPE merge across the boundary would shift it; checked with
llama-tokenize, not assumed).

End of a request: the engine caps each draft at the remaining budget (n_predict - produced - 1, as the harness
does) and then runs one round past the budget (its n_max 0 reads as the default); rounds that start after the
budget is spent are reported apart (``past_budget``), never compared.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from models.export.llamacpp import llamacpp_dir

TOOLS = ("llama-speculative-simple", "llama-completion", "llama-tokenize")
TRAILER = "\n\n"  # both tools LOG("\n\n") after the generated text
ROUND = re.compile(r"accepted (\d+)/(\d+) draft tokens")
SPEED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")


def binary(tool: str) -> Path:
    return llamacpp_dir() / "build" / "bin" / tool


def available() -> bool:
    """All the tools the tier runs are built (scripts/build_llama_cpp.sh)."""
    return all(binary(t).exists() for t in TOOLS)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    if proc.returncode < 0:
        raise RuntimeError(crash_line(Path(cmd[0]).name, proc.returncode, cmd[cmd.index("-m") + 1]
                                      if "-m" in cmd else None))
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {proc.returncode}): {' | '.join(tail)}")
    return proc


def crash_line(tool: str, returncode: int, model: str | Path | None) -> str:
    """One line for a llama.cpp tool killed by a signal: which signal, on which model (and its GGUF type), and the
    fix. A build for the CPU's native ISA can crash on quantized types where the CPU has AMX or the newer AVX-512
    extensions; scripts/build_llama_cpp.sh then rebuilds with an explicit ISA list."""
    import signal

    try:
        sig = signal.Signals(-returncode).name
    except ValueError:
        sig = f"signal {-returncode}"
    what = f" on {Path(model).name} ({gguf_type(model)})" if model else ""
    return (f"{tool} crashed with {sig}{what}: a llama.cpp built for this CPU's native ISA can crash on quantized "
            f"types; rebuild it with an explicit ISA list: rm -rf {llamacpp_dir()} && LLAMA_CPP_NATIVE=OFF make "
            "engines")


def gguf_type(model: str | Path) -> str:
    """The GGUF's weight type as its header names it (general.file_type), or "unknown"."""
    try:
        from gguf import GGUFReader, LlamaFileType

        field = GGUFReader(str(model)).fields.get("general.file_type")
        return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_") if field else "unknown"
    except Exception:  # noqa: BLE001 - a message helper: any unreadable header is "unknown"
        return "unknown"


def tokenize(model: str | Path, text: str, timeout: float = 120) -> list[int]:
    """The engine's token ids for ``text`` (with whatever BOS the model's GGUF asks for, as the other tools do)."""
    proc = _run([str(binary("llama-tokenize")), "-m", str(model), "-p", text, "--no-escape", "--ids", "--log-disable"],
                timeout)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _common(model: str | Path, text: str, n: int, threads: int) -> list[str]:
    # --no-escape: -p text is taken verbatim (by default the tools turn a literal backslash-n in code into a newline)
    return ["-m", str(model), "-p", text, "--no-escape", "-n", str(n), "--temp", "0", "-t", str(threads),
            "-c", "2048", "--seed", "0"]


def run_ar(model: str | Path, text: str, n: int, threads: int = 1, timeout: float = 600) -> dict:
    """Greedy AR by the engine: the generated text and its decode tokens/s (prompt processing excluded)."""
    cmd = [str(binary("llama-completion")), *_common(model, text, n, threads), "-no-cnv", "--no-display-prompt"]
    proc = _run(cmd, timeout)
    m = EVAL.findall(proc.stderr)  # "eval time = X ms / R runs": the R decode steps after the prompt's own
    if not m:
        raise RuntimeError(f"llama-completion printed no eval time: {proc.stderr[-300:]!r}")
    return {"text": _strip_trailer(proc.stdout).removesuffix(" [end of text]\n"),
            "decoded": int(m[-1][1]), "decode_s": float(m[-1][0]) / 1000}


def run_spec(model: str | Path, text: str, n: int, spec_type: str, num_speculative_tokens: int,
             draft: str | Path | None = None, threads: int = 1, extra: Sequence[str] = (),
             timeout: float = 600) -> dict:
    """Speculative decoding by the engine. ``rounds``: (accepted, drafted) per verification round, in order."""
    cmd = [str(binary("llama-speculative-simple")), *_common(model, text, n, threads), "--spec-type", spec_type,
           "--spec-draft-n-max", str(num_speculative_tokens), "-v", *extra]
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads)]
    proc = _run(cmd, timeout)
    out = _strip_trailer(proc.stdout)
    prefix = "\n\n" + text  # the tool echoes the prompt's pieces after two newlines
    if not out.startswith(prefix):
        raise RuntimeError(f"llama-speculative-simple echoed another prompt: {out[:80]!r}")
    sp = SPEED.findall(proc.stderr)
    if not sp:
        raise RuntimeError(f"llama-speculative-simple printed no decode speed: {proc.stderr[-300:]!r}")
    return {"text": out[len(prefix):], "rounds": [(int(a), int(d)) for a, d in ROUND.findall(proc.stderr)],
            "decoded": int(sp[-1][0]), "decode_s": float(sp[-1][1])}


def _strip_trailer(s: str) -> str:
    return s[:-len(TRAILER)] if s.endswith(TRAILER) else s


def counts(rounds: Sequence[tuple[int, int]], budget: int, num_speculative_tokens: int) -> dict:
    """vLLM's counter definitions over the rounds that start within ``budget`` generated tokens (after t0):
    drafts = rounds that drafted, accepted per position unconditional (rounds accepting > j drafted tokens)."""
    done, live, past = 0, [], 0
    for a, d in rounds:
        if done >= budget:
            past += 1
            continue
        done += a + 1
        if d > 0:
            live.append(a)
    return {"num_drafts": len(live), "num_accepted_tokens": sum(live),
            "accepted_per_pos": [sum(1 for a in live if a > j) for j in range(num_speculative_tokens)],
            "past_budget": past,
            "accepted_by_round": live}


def aligned_prompts(tokenizer, model_gguf: str | Path, candidates: Sequence[Sequence[int]],
                    first_tokens: Sequence[int], n: int) -> list[dict]:
    """Up to ``n`` of ``candidates`` whose text + t0 the engine tokenizes to exactly prompt + [t0] (module doc)."""
    out = []
    for ids, t0 in zip(candidates, first_tokens):
        want = [*ids, int(t0)]
        text = tokenizer.decode(want)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != want:
            continue  # cheap pre-filter with the HF tokenizer; the engine's own tokenization decides below
        if tokenize(model_gguf, text) == want:
            out.append({"input_ids": list(ids), "t0": int(t0), "text": text})
        if len(out) == n:
            break
    return out


def ngram_run(num_speculative_tokens: int, n: int = 3) -> dict:
    """llama.cpp's prompt lookup (``ngram-simple``) as vLLM's ngram runs it: match the last ``n`` tokens, draft
    ``num_speculative_tokens`` (its defaults, a 12-token match and 48 drafts, almost never fire on a short
    request)."""
    return {"name": "ngram", "spec_type": "ngram-simple", "num_speculative_tokens": num_speculative_tokens,
            "extra": _ngram_args(n, num_speculative_tokens)}


def lookup_run(draft_spec_type: str, num_speculative_tokens: int, n: int = 2) -> dict:
    """A drafter behind llama.cpp's prompt lookup: ``--spec-type ngram-simple,<draft>`` tries its types in a fixed
    priority, the n-gram ones first (common/speculative.cpp ``common_speculative_init``), and a round the lookup
    drafts for skips the drafter (``common_speculative_draft``), as the harness's ``lookup`` option
    (models/core/lookup.py) does; the last ``n`` tokens are matched (the harness: 2..3), and every draft is capped
    at ``--spec-draft-n-max``, the lookup's included."""
    return {"spec_type": f"ngram-simple,{draft_spec_type}", "extra": _ngram_args(n, num_speculative_tokens)}


def _ngram_args(n: int, m: int) -> list[str]:
    """ngram-simple's settings: match the last ``n`` tokens, draft ``m``."""
    return ["--spec-ngram-simple-size-n", str(n), "--spec-ngram-simple-size-m", str(m)]


def sum_counts(parts: Sequence[dict]) -> dict:
    k = len(parts[0]["accepted_per_pos"]) if parts else 0
    return {"num_drafts": sum(p["num_drafts"] for p in parts),
            "num_accepted_tokens": sum(p["num_accepted_tokens"] for p in parts),
            "accepted_per_pos": [sum(p["accepted_per_pos"][j] for p in parts) for j in range(k)],
            "past_budget": sum(p["past_budget"] for p in parts)}


def serve(target_gguf: str | Path, prompts: Sequence[dict], max_new: int, runs: Sequence[dict],
          threads: int = 1) -> dict:
    """Every run on every aligned prompt (``aligned_prompts``), ``max_new`` tokens counted from t0 as the harness
    counts them. A run: ``name``, ``spec_type`` (None: the engine's AR), ``draft`` (a GGUF or None),
    ``num_speculative_tokens``.
    Returns {name: {ok, error, texts, tokens_per_s, counts}}; a run the engine refuses is ok=false with its reason
    (the tool's last stderr lines), not an exception."""
    out = {}
    for r in runs:
        try:
            res = [run_spec(target_gguf, p["text"], max_new - 1, r["spec_type"], r["num_speculative_tokens"],
                            r.get("draft"), threads, r.get("extra", ()))
                   if r.get("spec_type") else run_ar(target_gguf, p["text"], max_new - 1, threads) for p in prompts]
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out[r["name"]] = {"ok": False, "error": str(e)}
            continue
        row = {"ok": True, "error": None, "texts": [x["text"] for x in res],
               "num_speculative_tokens": r.get("num_speculative_tokens"),
               "tokens_per_s": sum(x["decoded"] for x in res) / max(sum(x["decode_s"] for x in res), 1e-9)}
        if r.get("spec_type"):
            per = [counts(x["rounds"], max_new - 1, r["num_speculative_tokens"]) for x in res]
            row["counts"] = sum_counts(per)
            row["accepted_by_round"] = [c["accepted_by_round"] for c in per]  # per prompt, rounds that drafted
        out[r["name"]] = row
    return out


def matches_harness(tokenizer, prompts: Sequence[dict], harness_outputs: Sequence[Sequence[int]],
                    texts: Sequence[str]) -> list[int]:
    """Indices of prompts where the engine's text does not continue exactly as the harness's tokens (t0 first):
    decode(prompt + harness) must be a prefix of prompt text + engine text (the engine may add its one round past
    the budget, never anything before it)."""
    bad = []
    for i, (p, h, t) in enumerate(zip(prompts, harness_outputs, texts)):
        want = tokenizer.decode([*p["input_ids"], *h])
        if not (p["text"] + t).startswith(want):
            bad.append(i)
    return bad
