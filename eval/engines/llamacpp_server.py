"""llama.cpp served the way users run it: one ``llama-server`` process per configuration, requests over HTTP.

    with Server(target_gguf, threads=1, draft=draft_gguf, spec_type="draft-eagle3", num_speculative_tokens=3) as s:
        s.complete(text, n)   # {"text", "decoded", "decode_s", "draft_n", "draft_n_accepted"}

The same prompts as eval/engines/llamacpp.py (prompt text + the target's first greedy token t0, so that the server's
first speculative round drafts where the harness's first round does), greedy (``temperature 0``), one slot
(``-np 1``), no prompt cache. The server reports, per request, what users see in its ``timings``: generated tokens
and their milliseconds (prompt processing excluded), the tokens drafted and those accepted. It has no per-position
counters; a round's acceptance comes out as a mean (``tokens_per_round``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from eval.engines.llamacpp import binary, crash_line

TOOL = "llama-server"


def available() -> bool:
    return binary(TOOL).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``llama-server`` child process on a free local port, stopped on exit (and on any error while starting)."""

    def __init__(self, model: str | Path, threads: int = 1, draft: str | Path | None = None,
                 spec_type: str | None = None, num_speculative_tokens: int | None = None, extra: Sequence[str] = (),
                 ctx: int = 2048, start_timeout: float = 180):
        self.port = _free_port()
        cmd = [str(binary(TOOL)), "-m", str(model), "-t", str(threads), "-c", str(ctx), "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", "--seed", "0"]
        if spec_type:
            cmd += ["--spec-type", spec_type]
        if num_speculative_tokens is not None:
            cmd += ["--spec-draft-n-max", str(num_speculative_tokens)]
        if draft is not None:
            cmd += ["-md", str(draft), "-td", str(threads)]
        self.cmd = [*cmd, *extra]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log = b""
        # the server logs every request: a file, not a pipe nobody reads while it serves (a full pipe blocks it)
        self._stderr = tempfile.TemporaryFile()

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self._stderr)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # refused its arguments or its model: say why, in its words
                self._stderr.seek(0)
                self.log = self._stderr.read()
                self._stderr.close()
                if self.proc.returncode < 0:
                    raise RuntimeError(crash_line(TOOL, self.proc.returncode, self.cmd[self.cmd.index("-m") + 1]))
                tail = [ln for ln in self.log.decode(errors="replace").splitlines() if ln.strip()][-3:]
                raise RuntimeError(f"llama-server exited (rc {self.proc.returncode}): {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become healthy within {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, text: str, n: int, n_probs: int = 0, timeout: float = 600) -> dict:
        """Greedy ``/completion`` of ``text``: exactly ``n`` new tokens unless the model ends first. ``n_probs`` 2
        adds ``top2_gaps``: at each generated position the engine's top-2 log-probability gap (= its logit gap)."""
        body = json.dumps({"prompt": text, "n_predict": n, "temperature": 0.0, "cache_prompt": False,
                           "seed": 0, "return_tokens": True, "n_probs": n_probs}).encode()
        req = urllib.request.Request(self._url("/completion"), data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                res = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server /completion: HTTP {e.code}: {e.read()[:200]!r}") from e
        t = res["timings"]
        out = {"text": res["content"], "tokens": res.get("tokens", []), "decoded": int(t["predicted_n"]),
               "decode_s": float(t["predicted_ms"]) / 1000, "draft_n": int(t.get("draft_n", 0)),
               "draft_n_accepted": int(t.get("draft_n_accepted", 0))}
        if n_probs >= 2:
            out["top2_gaps"] = [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"]
                                for p in res["completion_probabilities"]]
        return out


def round_counts(results: Sequence[dict]) -> dict:
    """Totals over requests. The first generated token comes from the prompt's own forward, every later one from a
    verification round that yields its accepted drafts + 1, so rounds = generated - 1 - accepted (per request)."""
    drafted = sum(x["draft_n"] for x in results)
    accepted = sum(x["draft_n_accepted"] for x in results)
    rounds = sum(max(x["decoded"] - 1 - x["draft_n_accepted"], 0) for x in results)
    return {"draft_n": drafted, "draft_n_accepted": accepted, "rounds": rounds,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": (rounds + accepted) / rounds if rounds else None}


def serve(target_gguf: str | Path, prompts: Sequence[dict], max_new: int, runs: Sequence[dict],
          threads: int = 1) -> dict:
    """eval/engines/llamacpp.serve through llama-server: each run (``name``, ``spec_type`` or None for the
    engine's AR, ``draft``, ``num_speculative_tokens``, ``extra``) in its own server process, every prompt once.
    Returns {name: {ok, error, texts, tokens_per_s, server_counts}}; a configuration the server refuses is
    ok=false with its reason."""
    out = {}
    for r in runs:
        try:
            with Server(target_gguf, threads, r.get("draft"), r.get("spec_type"), r.get("num_speculative_tokens"),
                        r.get("extra", ())) as s:
                res = [s.complete(p["text"], max_new - 1) for p in prompts]
        except (RuntimeError, OSError) as e:
            out[r["name"]] = {"ok": False, "error": str(e)}
            continue
        row = {"ok": True, "error": None, "texts": [x["text"] for x in res], "tokens": [x["tokens"] for x in res],
               "tokens_per_s": sum(x["decoded"] for x in res) / max(sum(x["decode_s"] for x in res), 1e-9)}
        if r.get("spec_type"):
            row["server_counts"] = round_counts(res)
            row["accepted_by_request"] = [x["draft_n_accepted"] for x in res]  # per prompt: the server's totals
            row["drafted_by_request"] = [x["draft_n"] for x in res]
        out[r["name"]] = row
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (one ending early counts), or None when equal."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if len(a) == len(b) == i else i


def divergences(target_gguf: str | Path, prompts: Sequence[dict], max_new: int, ar_tokens: Sequence[Sequence[int]],
                tokens: Sequence[Sequence[int]], threads: int = 1) -> list[dict]:
    """Where a speculative run's tokens leave the engine's own AR: per diverging prompt, the position and the AR
    step's top-2 logit gap there (from the AR rerun with ``n_probs``). A verify batch that sums in another order
    flips a near tie (gap ~1e-3..1e-2); a wrong draft integration diverges at ordinary gaps."""
    where = {i: d for i, (a, b) in enumerate(zip(ar_tokens, tokens)) if (d := first_difference(a, b)) is not None}
    if not where:
        return []
    out = []
    with Server(target_gguf, threads) as s:
        for i, pos in where.items():
            gaps = s.complete(prompts[i]["text"], max_new - 1, n_probs=2)["top2_gaps"]
            out.append({"prompt": i, "position": pos, "top2_logit_gap": gaps[pos] if pos < len(gaps) else None})
    return out
