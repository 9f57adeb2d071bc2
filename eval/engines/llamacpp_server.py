"""llama.cpp served the way users run it: one ``llama-server`` process per configuration, requests over HTTP.

    with Server(target_gguf, threads=1, draft=draft_gguf, spec_type="draft-eagle3", num_speculative_tokens=3) as s:
        s.complete(text, n)   # {"text", "decoded", "decode_s", "draft_n", "draft_n_accepted"}

The same prompts as eval/engines/llamacpp.py (prompt text + the target's first greedy token t0, so that the server's
first speculative round drafts where the harness's first round does), greedy (``temperature 0``), one slot
(``-np 1``), no prompt cache. The server reports, per request, what users see in its ``timings``: generated tokens
and their milliseconds (prompt processing excluded), the tokens drafted and those accepted. At trace verbosity
(``-lv 4``: a few lines per request, none per token) its log adds, after each request, the per-position acceptance
of that request (``acc per pos``) and each speculative implementation's cumulative call counts and milliseconds
spent drafting (``dur(b,g,a)``: refresh, generate, accept): ``spec_stats`` reads them, so a round's cost has its
parts (eval/engines/breakdown.py).
"""

from __future__ import annotations

import json
import re
import socket
import statistics
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
               "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", "--seed", "0", "-lv", "4"]
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
        if not self._stderr.closed:
            self._stderr.seek(0)
            self.log = self._stderr.read()
            self._stderr.close()

    def log_text(self) -> str:
        """The server's log so far (its stderr file; after exit, what it had written)."""
        if self._stderr.closed:
            return self.log.decode(errors="replace")
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def wait_for_stats(self, n_requests: int, n_impls: int, timeout: float = 10) -> str:
        """The log once it holds ``n_requests`` requests' statistics lines (``n_impls`` each): llama.cpp's logger
        writes from its own thread, after the response may already have reached us."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_text()
            if len(STATS_LINE.findall(text)) >= n_requests * n_impls or time.monotonic() > deadline:
                return text
            time.sleep(0.05)

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, text: str | list[int], n: int, n_probs: int = 0, timeout: float = 600) -> dict:
        """Greedy ``/completion`` of ``text`` (or token ids, taken as they are): exactly ``n`` new tokens unless the
        model ends first. ``n_probs`` 2 adds ``top2_gaps``: at each generated position the engine's top-2
        log-probability gap (= its logit gap)."""
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


STATS_LINE = re.compile(r"statistics\s+(\S+): #calls\(b,g,a\) =\s+(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s+(\d+), "
                        r"#acc drafts =\s+(\d+), #gen tokens =\s+(\d+), #acc tokens =\s+(\d+)[^\n]*?"
                        r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")
ACC_LINE = re.compile(r"acc per pos = \(([^)]*)\)")


def spec_stats(log: str) -> dict:
    """Each speculative implementation's latest cumulative statistics in a server log: calls and milliseconds of
    refresh (b), draft generation (g) and accept (a), drafted and accepted tokens. {type: {...}}."""
    out = {}
    for m in STATS_LINE.finditer(log):
        v = m.groups()
        out[v[0]] = {"calls_b": int(v[1]), "calls_g": int(v[2]), "calls_a": int(v[3]), "gen_tokens": int(v[6]),
                     "acc_tokens": int(v[7]), "ms_b": float(v[8]), "ms_g": float(v[9]), "ms_a": float(v[10])}
    return out


def stats_delta(after: dict, before: dict) -> dict:
    """What the requests between two ``spec_stats`` snapshots cost (the warm-up request excluded)."""
    zero = dict.fromkeys(next(iter(after.values()), {}), 0)
    return {t: {k: a[k] - before.get(t, zero)[k] for k in a} for t, a in after.items()}


def acc_per_pos(log: str) -> list[list[float]]:
    """Per request (in order), the server's per-position acceptance: accepted at depth k / verification rounds."""
    return [[float(x) for x in m.group(1).split(",") if x.strip()] for m in ACC_LINE.finditer(log)]


def _once(s: Server, prompts: Sequence[dict], max_new: int, n_impls: int) -> dict:
    """Every prompt once on a running server, after one warm-up request (the first forward pays one-off costs)."""
    s.complete(prompts[0]["text"], max_new - 1)
    before = spec_stats(s.wait_for_stats(1, n_impls)) if n_impls else {}
    res = [s.complete(p["text"], max_new - 1) for p in prompts]
    log = s.wait_for_stats(1 + len(prompts), n_impls) if n_impls else s.log_text()
    out = {"res": res, "tokens_per_s": sum(x["decoded"] for x in res) / max(sum(x["decode_s"] for x in res), 1e-9),
           "decode_ms": 1000 * sum(x["decode_s"] for x in res)}
    if n_impls:
        out["spec_ms"] = stats_delta(spec_stats(log), before)
        out["acc_per_pos"] = acc_per_pos(log)[-len(prompts):]
    return out


def serve(target_gguf: str | Path, prompts: Sequence[dict], max_new: int, runs: Sequence[dict],
          threads: int = 1, repetitions: int = 1) -> dict:
    """eval/engines/llamacpp.serve through llama-server: each run (``name``, ``spec_type`` or None for the
    engine's AR, ``draft``, ``num_speculative_tokens``, ``extra``) in its own server process, every prompt once a
    repetition. Repetitions interleave (every run once, then every run again), so that drift on the machine reaches
    every row alike; ``tokens_per_s`` is the median over repetitions, each repetition's in ``tokens_per_s_reps``.
    Returns {name: {ok, error, texts, tokens, tokens_per_s, server_counts, spec_ms}}; a configuration the server
    refuses is ok=false with its reason."""
    done: dict[str, list[dict]] = {r["name"]: [] for r in runs}
    out = {}
    for _ in range(max(1, repetitions)):
        for r in runs:
            if r["name"] in out:  # refused once: refused
                continue
            n_impls = len(r["spec_type"].split(",")) if r.get("spec_type") else 0
            try:
                with Server(target_gguf, threads, r.get("draft"), r.get("spec_type"), r.get("num_speculative_tokens"),
                            r.get("extra", ())) as s:
                    done[r["name"]].append(_once(s, prompts, max_new, n_impls))
            except (RuntimeError, OSError) as e:
                out[r["name"]] = {"ok": False, "error": str(e)}
    for r in runs:
        if r["name"] not in out:
            out[r["name"]] = _row(r, done[r["name"]])
    return out


def _row(r: dict, reps: list[dict]) -> dict:
    """One run's result over its repetitions: the first repetition's tokens and counters (greedy decoding repeats
    them; ``same_across_reps`` says whether it did), the median speed and the per-round parts."""
    res = reps[0]["res"]
    row = {"ok": True, "error": None, "texts": [x["text"] for x in res], "tokens": [x["tokens"] for x in res],
           "tokens_per_s": statistics.median(x["tokens_per_s"] for x in reps),
           "tokens_per_s_reps": [x["tokens_per_s"] for x in reps],
           "same_across_reps": all([y["tokens"] for y in x["res"]] == [y["tokens"] for y in res] for x in reps)}
    if r.get("spec_type"):
        row["server_counts"] = round_counts(res)
        row["accepted_by_request"] = [x["draft_n_accepted"] for x in res]  # per prompt: the server's totals
        row["drafted_by_request"] = [x["draft_n"] for x in res]
        rounds = [max(x["decoded"] - 1 - x["draft_n_accepted"], 0) for x in res]
        row["server_rates"] = pooled_rates(reps[0]["acc_per_pos"], rounds)
        row["round_ms_reps"] = [x["decode_ms"] / max(sum(rounds), 1) for x in reps]
        row["spec_ms_reps"] = [x["spec_ms"] for x in reps]
    else:
        row["step_ms_reps"] = [x["decode_ms"] / max(sum(y["decoded"] for y in x["res"]), 1) for x in reps]
    return row


def pooled_rates(per_request: Sequence[Sequence[float]], rounds: Sequence[int]) -> list[float] | None:
    """Per-position acceptance over all requests, each request's rates weighted by its rounds. Approximate: the
    server prints rates per request (3 decimals) over its rounds that drafted, and a request's last round may not
    draft (no budget left), so this reads up to ~1/rounds low; the totals (``server_counts``) are exact."""
    if len(per_request) != len(rounds) or not sum(rounds):
        return None
    k = max((len(x) for x in per_request), default=0)
    return [sum(x[j] * n for x, n in zip(per_request, rounds) if j < len(x)) / sum(rounds) for j in range(k)]


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
