"""The embedded corpus: the Python standard library's own source.

Every machine with Python has it, so the embedded default target (`tiny-code`) can be
trained and evaluated with no network. The standard library differs between Python
versions, so the *held-out* split is shipped in the repo (``models/tiny_code/heldout.jsonl``)
and evaluation always reads that file; only training reads the live standard library.

Split rule: a file is held out when ``sha256(relative path) mod HELDOUT_MOD == 0`` — by whole
file, by name, so the same path is held out on every Python version.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from models.core.target import EMBEDDED_DIR

# Non-code bulk (codec tables, generated pydoc topics), the test suites (17 MB of fixtures
# and odd syntax) and anything installed into site-packages (not the standard library).
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "encodings",
        "pydoc_data",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "ensurepip",
        "turtledemo",
    }
)
MAX_FILE_BYTES = 400_000  # a few generated modules (e.g. unicode tables) are pure data
HELDOUT_MOD = 25  # ~4 % of files by name: ~30 files, ~430 KB
HELDOUT_FILE = EMBEDDED_DIR / "heldout.jsonl"


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, '/'-separated
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MOD == 0


def iter_stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """All kept ``.py`` files under the stdlib root, sorted by relative path."""
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            if full.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = full.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a handful of files are deliberately not UTF-8
            if not text.strip():
                continue
            out.append(SourceFile(full.relative_to(root).as_posix(), text))
    out.sort(key=lambda f: f.path)
    return out


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.path)]
    held = [f for f in files if is_heldout(f.path)]
    return train, held


def write_heldout(files: list[SourceFile], path: Path = HELDOUT_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for f in files:
            fh.write(json.dumps({"path": f.path, "text": f.text}) + "\n")


def load_heldout(path: Path = HELDOUT_FILE) -> list[SourceFile]:
    """The shipped held-out files (identical on every machine)."""
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the embedded held-out split ships with the repo "
            "(rebuild it with `python -m train.build_tiny_code --stage data`)."
        )
    with open(path, encoding="utf-8") as fh:
        return [SourceFile(**json.loads(line)) for line in fh if line.strip()]


def manifest(train: list[SourceFile], held: list[SourceFile]) -> dict:
    return {
        "python_version": sys.version.split()[0],
        # where the files were read, without this machine's path: file paths below are relative to it
        "stdlib_root": "sysconfig.get_paths()['stdlib']",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "max_file_bytes": MAX_FILE_BYTES,
        "heldout_rule": f"sha256(relpath) % {HELDOUT_MOD} == 0",
        "train_bytes": sum(len(f.text.encode()) for f in train),
        "heldout_bytes": sum(len(f.text.encode()) for f in held),
        "train_files": [{"path": f.path, "sha256": f.sha256} for f in train],
        "heldout_files": [{"path": f.path, "sha256": f.sha256} for f in held],
    }


MIN_WINDOW = 8  # tokens: a window (or a file's tail) of fewer teaches nothing and is dropped


def file_windows(tokenizer, files: list[SourceFile], max_len: int, max_rows: int | None = None) -> list[dict]:
    """Training rows from whole files: ``<bos> text <eos>`` (each where the tokenizer has one) cut into windows
    of ``max_len`` tokens.

    Every real token is a training target (loss_mask 1): code completion has no prompt/response split.
    """
    rows: list[dict] = []
    # Qwen2/3 and gpt-oss tokenizers have no bos (and a tokenizer may lack eos): leave out what is not defined
    # rather than put None into every row.
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for f in files:
        ids = [*bos, *tokenizer(f.text, add_special_tokens=False)["input_ids"], *eos]
        for s in range(0, len(ids) - 1, max_len):
            w = ids[s : s + max_len]
            if len(w) >= MIN_WINDOW:
                rows.append({"input_ids": w, "loss_mask": [1] * len(w)})
            if max_rows is not None and len(rows) >= max_rows:
                return rows
    return rows


def heldout_prompts(tokenizer, n: int, prompt_tokens: int, path: Path = HELDOUT_FILE) -> list[dict]:
    """Evaluation prompts: prefixes of the shipped held-out files, spread evenly over them.

    Each prompt is ``prompt_tokens`` long and starts at a line boundary inside a file so the
    continuation is code, not a license header; deterministic for a given tokenizer.
    """
    files = load_heldout(path)
    out: list[dict] = []
    per_file = max(1, -(-n // len(files)))
    for f in files:
        lines = f.text.splitlines(keepends=True)
        for j in range(per_file):
            start_line = (j * len(lines)) // per_file
            text = "".join(lines[start_line:])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
            if len(ids) == prompt_tokens:
                out.append({"path": f.path, "line": start_line, "input_ids": ids})
    return out[:n]


def as_dataset(rows: list[dict]):
    """Rows (training windows or prompts) as a ``datasets.Dataset`` for users who stream, map or
    shard with the HF datasets API; the training loop itself indexes the plain list."""
    import datasets

    if not rows:
        raise ValueError("no rows: the corpus filter left nothing (check the file list / max_len)")
    return datasets.Dataset.from_list(rows)
