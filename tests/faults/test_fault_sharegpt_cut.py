"""A ShareGPT JSON array read through a package alias (the streaming reader, data/packaged.py) that is cut off is
said on one line with the records read, wherever the cut fell: inside a record or between two (no closing ']')."""

from __future__ import annotations

import json

import pytest

from data.chat import load_rows
from tests.faults.fault_helpers import package_source

RECS = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(5)]


@pytest.fixture()
def package_file(tmp_path, monkeypatch):
    """An importable package shipping ``data/cut.json``, registered as the alias ``test-cut``."""
    return package_source(tmp_path, monkeypatch, "test-cut", "cut_pkg_for_faults", "data/cut.json")


def _text(recs) -> tuple[str, list[int]]:
    """The array text and where each record ends."""
    parts, ends = ["[\n"], []
    for i, r in enumerate(recs):
        parts.append(("" if i == 0 else ",\n") + json.dumps(r))
        ends.append(sum(map(len, parts)))
    return "".join(parts) + "\n]\n", ends


def _said(capsys) -> list[str]:
    return [x for x in capsys.readouterr().out.splitlines() if x.startswith("data: test-cut:")]


@pytest.mark.parametrize("tail", ["", ",", ",\n", ",\n  "])
def test_cut_between_two_records_is_said_with_the_count(package_file, capsys, tail):
    text, ends = _text(RECS)
    package_file.write_text(text[: ends[2]] + tail, encoding="utf-8")
    assert load_rows("test-cut") == RECS[:3]
    said = _said(capsys)
    assert len(said) == 1, said
    assert "3 complete records read" in said[0] and "cut off between two records" in said[0]
    assert "without its closing ']'" in said[0]


def test_cut_inside_a_record_is_said_with_the_count(package_file, capsys):
    text, ends = _text(RECS)
    package_file.write_text(text[: ends[3] - 10], encoding="utf-8")
    assert load_rows("test-cut") == RECS[:3]
    said = _said(capsys)
    assert len(said) == 1 and "3 complete records read" in said[0] and "inside its last record" in said[0]


def test_a_whole_file_says_nothing(package_file, capsys):
    package_file.write_text(_text(RECS)[0], encoding="utf-8")
    assert load_rows("test-cut") == RECS and _said(capsys) == []
