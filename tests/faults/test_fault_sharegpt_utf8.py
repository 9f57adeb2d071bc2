"""A ShareGPT JSON array read through a package alias (the streaming reader, data/packaged.py) holding a byte that
is not UTF-8 is one ``error:`` line naming the file, the byte, its offset and the fix, wherever the chunks fall;
a file cut inside a multi-byte character reads as any cut file does."""

from __future__ import annotations

import json

import pytest

from data.chat import load_rows
from data.packaged import iter_json_array
from tests.faults.fault_helpers import cfg_for, one_error_line, package_source

RECS = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i} café"}, {"from": "gpt", "value": f"a{i} é"}]}
        for i in range(4)]


@pytest.fixture()
def package_file(tmp_path, monkeypatch):
    """An importable package shipping ``data/sg.json``, registered as the alias ``test-utf8``."""
    return package_source(tmp_path, monkeypatch, "test-utf8", "utf8_pkg_for_faults", "data/sg.json")


def _bad_bytes() -> tuple[bytes, int]:
    """The records as UTF-8 with one byte of the third record's reply replaced by 0xff, and that byte's offset."""
    data = json.dumps(RECS, ensure_ascii=False).encode()
    at = data.index(b"a2 ") + 1
    return data[:at] + b"\xff" + data[at + 1:], at


def test_bad_utf8_in_a_package_file_is_one_line_naming_it(package_file, target_dir, tmp_path, capsys):
    from train.__main__ import main

    data, at = _bad_bytes()
    package_file.write_bytes(data)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main.__wrapped__(cfg_for(target_dir, tmp_path / "run", "data=sharegpt", "data.source=test-utf8"))
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert f"{package_file}: not valid UTF-8 (byte 0xff at byte offset {at})" in line
    assert "re-encode the file as UTF-8" in line


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_bad_utf8_offset_holds_wherever_the_chunks_fall(package_file, chunk):
    data, at = _bad_bytes()
    package_file.write_bytes(data)
    with pytest.raises(ValueError, match=rf"sg\.json: not valid UTF-8 \(byte 0xff at byte offset {at}\)"):
        list(iter_json_array(package_file, {}, chunk_chars=chunk))


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_cut_inside_a_multibyte_character_is_a_cut_tail(package_file, chunk):
    data = json.dumps(RECS, ensure_ascii=False).encode()
    cut = data.index("a3 é".encode()) + len(b"a3 ") + 1  # the first of é's two bytes
    package_file.write_bytes(data[:cut])
    stats: dict = {}
    assert list(iter_json_array(package_file, stats, chunk_chars=chunk)) == RECS[:3]
    assert stats["truncated_tail"] == 1
    assert load_rows("test-utf8") == RECS[:3]
