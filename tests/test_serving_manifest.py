"""The serving-mode manifest: every export records the target revision / fingerprints, the chat template hash and
the thinking mode it was trained with; validate / ``--check`` refuse a mismatched thinking mode or target head, and
warn on another chat template: a drafter served with another target or mode than it was trained with raises no
error, it only drafts worse."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from models.export.api import export
from models.export.serving import template_hash, training_serving
from models.export.shared.common import CONFIG, SIDECAR, ExportError
from models.export.validate import validate
from tests.test_export_engines import make_drafter, target  # noqa: F401 - the module fixture


def _side(out):
    return json.loads((out / SIDECAR).read_text())


def test_every_export_records_the_serving_mode(target, tmp_path):  # noqa: F811
    meta = {"serving": training_serving(target, None, True, "chat")}
    out = export(make_drafter(target), "eagle3_native", tmp_path / "e3", target, meta=meta)
    m = _side(out)["serving"]
    assert m["enable_thinking"] is True and m["uses_chat_template"] is True
    assert m["chat_template_sha256"] == template_hash(target.tokenizer.chat_template)
    assert m["target_embed_fingerprint"] == target.fingerprint() and m["target_head_fingerprint"]
    # in config.json too: only config + weights travel to a model hub
    assert json.loads((out / CONFIG).read_text())["draftsmith_target"]["serving"] == m
    # an old checkpoint (no serving meta): the template at export time, marked so
    old = export(make_drafter(target), "eagle3_native", tmp_path / "old", target)
    assert "predates" in _side(old)["serving"]["recorded_at"]


def test_check_refuses_another_thinking_mode_and_head_warns_on_template(target, tmp_path):  # noqa: F811
    meta = {"serving": training_serving(target, None, True, "chat")}
    out = export(make_drafter(target), "eagle3_speculators", tmp_path / "e3s", target, meta=meta)
    assert validate(out, None, target, enable_thinking=True) == "eagle3_speculators"
    with pytest.raises(ExportError, match="trained with thinking on, to be served with it off"):
        validate(out, None, target, enable_thinking=False)
    with pytest.warns(UserWarning, match="not the one the drafter was trained with"):
        validate(out, None, target, chat_template="{{ messages[0]['content'] }}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(out, None, target)  # the trained template: silent
    # same embedding, another lm_head (a fine-tune / another revision): refused
    head = target.model.get_output_embeddings().weight
    saved = head.detach().clone()
    try:
        with torch.no_grad():
            head.add_(0.01)
        with pytest.raises(ExportError, match="lm_head fingerprint differs"):
            validate(out, None, target)
    finally:
        with torch.no_grad():
            head.copy_(saved)


def test_code_data_records_no_template(target):  # noqa: F811
    m = training_serving(target, None, None, "code")
    assert m["uses_chat_template"] is False and m["chat_template_sha256"] is None


def test_cli_check_takes_the_serving_mode(target, tmp_path, capsys):  # noqa: F811
    from train.export import main

    meta = {"serving": training_serving(target, None, False, "chat")}
    out = export(make_drafter(target), "eagle3_native", tmp_path / "e3", target, meta=meta)
    tdir = target.model.config._name_or_path
    assert main(["--check", str(out), "--target", tdir, "--thinking", "off"]) == 0
    assert main(["--check", str(out), "--target", tdir, "--thinking", "on"]) == 2
    assert "trained with thinking off" in capsys.readouterr().err
    tmpl = tmp_path / "other.jinja"
    tmpl.write_text("{{ messages[0]['content'] }}")
    assert main(["--check", str(out), "--target", tdir, "--chat-template", str(tmpl)]) == 0
    assert "warning:" in capsys.readouterr().err
