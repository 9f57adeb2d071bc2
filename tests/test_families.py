"""The family matrix: ten target families (tests/families.py) through capture, data, train, decode and export.

Per family: hidden-state capture equals ``output_hidden_states``; code rows and chat masks are built with the
family's tokenizer and template; an EAGLE-3 checkpoint reloads with the shapes it was trained with; every
method (DSpark and P-EAGLE too) decodes losslessly past the sliding window (batch 2 too); DSpark and P-EAGLE train 2
steps, decode and export on the Llama and Qwen3 targets; (slow) a 2-step train of every recipe and an export + check
of every format, with refusals asserted where a format cannot hold the family. Chat data (data=sharegpt) as a user
runs it: gpt-oss regeneration in harmony channels, DFlash on Phi-3's few assistant tokens, validation rows and the
tree sizing that reads them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from data.corpus import SourceFile, file_windows
from eval.decode.batch import decode_ar_batch, speculative_decode_batch
from eval.decode.single import decode_ar, speculative_decode
from models.core.target import FrozenTarget
from models.core.vocab import build_draft_vocab
from models.methods.dflash.config import DFlashConfig
from models.methods.dflash.net import DFlashDrafter
from models.methods.dflash.proposers import DFlashProposer
from models.methods.eagle3.config import Eagle3Config
from models.methods.eagle3.net import Eagle3Drafter
from models.methods.eagle3.proposers import Eagle3ChainProposer, Eagle3TreeProposer
from models.methods.medusa.config import MedusaConfig
from models.methods.medusa.net import MedusaHeads
from models.methods.medusa.proposers import MedusaProposer
from models.methods.medusa.tree import default_medusa_choices
from models.methods.mtp.config import MTPConfig
from models.methods.mtp.net import MTPDrafter
from models.methods.mtp.proposers import MTPProposer
from models.methods.ngram import NGramProposer
from models.methods.peagle.config import PEagleConfig
from models.methods.peagle.net import PEagleDrafter
from models.methods.peagle.proposers import PEagleProposer
from tests.families import CONVERSATION, FAMILIES, SPECS, WINDOW, make_family, save_family
from tests.test_decode import batched
from train.loop import run

FAM = pytest.mark.parametrize("family", FAMILIES)
SLIDING = [f for f in FAMILIES if SPECS[f].sliding]


@functools.cache
def target_of(family: str) -> FrozenTarget:
    model, tok = make_family(family)
    return FrozenTarget(model, tok)


@functools.cache
def drafters_of(family: str) -> dict:
    """Untrained drafters of every method (random proposals: the lossless check does not need good ones)."""
    t = target_of(family)
    tc, V = t.model.config, t.vocab_size
    torch.manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.arange(V).flip(0).float(), 64)
    eagle = Eagle3Drafter(Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=64, ttt_steps=2), tc,
                          t.embed.weight.detach().clone(), d2t, t2d).eval()
    medusa = MedusaHeads(MedusaConfig(num_heads=2), tc, t.model.get_output_embeddings().weight.detach()).eval()
    mtp = MTPDrafter.from_target(MTPConfig(num_modules=2), t).eval()
    head = t.model.get_output_embeddings().weight.detach()
    dspark = DFlashDrafter(DFlashConfig(layer_ids=[1, 2, 3], block_size=4, mask_token_id=V - 1, block_head="markov",
                                        sample_from_anchor=True, markov_rank=8), tc, t.embed.weight, head).eval()
    with torch.no_grad():
        dspark.block_head.markov_head.markov_w2.weight.normal_()  # a head that changes the drafts
    peagle = PEagleDrafter(PEagleConfig(layer_ids=[1, 2, 3], num_depths=3, mask_token_id=V - 1), tc,
                           t.embed.weight, head).eval()
    return {"eagle3": eagle, "medusa": medusa, "mtp": mtp, "dspark": dspark, "peagle": peagle}


@FAM
def test_hidden_capture_equals_output_hidden_states(family):
    t = target_of(family)
    ids = torch.randint(len(t.tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    ref = t.model(ids, output_hidden_states=True)
    out = t(ids, layer_ids=list(range(t.num_layers + 1)))
    torch.testing.assert_close(out.logits, ref.logits)
    for k in range(t.num_layers + 1):
        torch.testing.assert_close(out.hidden[k], ref.hidden_states[k], msg=f"{family} hidden state {k}")


@FAM
def test_code_rows_with_the_familys_bos_and_eos(family):
    tok = target_of(family).tokenizer
    rows = file_windows(tok, [SourceFile("a.py", "def add(a, b):\n    return a + b\n" * 4)], max_len=16)
    ids = [i for r in rows for i in r["input_ids"]]
    assert rows and None not in ids and all(0 <= i < len(tok) for i in ids)
    assert (ids[0] == tok.bos_token_id) == (tok.bos_token_id is not None)  # qwen*/gpt-oss: no bos


@FAM
def test_eagle3_checkpoint_reloads_with_its_shapes(family, tmp_path):
    from models.registry import load_drafter
    from train.checkpoint import save_drafter

    t = target_of(family)
    d = drafters_of(family)["eagle3"]
    save_drafter(tmp_path, d, {"method": "eagle3", "draft": d.config_dict(), "target": t.identity()})
    back, _ = load_drafter(tmp_path, t)
    assert back.head_dim == d.head_dim == (getattr(t.model.config, "head_dim", None) or d.hidden_size // 4)
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items(), strict=True):
        assert a.shape == b.shape, n
        torch.testing.assert_close(a, b, msg=n)


def _proposer(name: str, dr: dict):
    if name == "ngram":
        return NGramProposer(num_speculative_tokens=4)
    if name == "eagle3":
        return Eagle3ChainProposer(dr["eagle3"], num_speculative_tokens=3)
    if name == "eagle3_tree":
        return Eagle3TreeProposer(dr["eagle3"], depth=3, top_k=3, total_tokens=10)
    if name == "medusa":
        return MedusaProposer(dr["medusa"], choices=default_medusa_choices(2, top_k=3, num_nodes=8))
    if name == "dspark":
        return DFlashProposer(dr["dspark"])
    if name == "peagle":
        return PEagleProposer(dr["peagle"])
    return MTPProposer(dr["mtp"], num_speculative_tokens=2)


METHODS = ("ngram", "eagle3", "eagle3_tree", "medusa", "mtp", "dspark", "peagle")


@FAM
def test_lossless_greedy_decode_past_the_window(family):
    """Prompt + generation run well past the sliding window (16): verification, KV commit and the batched
    engine must see exactly what the no-cache model sees."""
    t, dr = target_of(family), drafters_of(family)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(len(t.tokenizer), (WINDOW + 4,), generator=g),
               torch.randint(len(t.tokenizer), (WINDOW + 9,), generator=g)]
    n = 2 * WINDOW
    x = prompts[0][None]
    for _ in range(n):  # the reference: no cache at all
        x = torch.cat([x, t.model(x).logits[:, -1:].argmax(-1)], 1)
    ref = decode_ar(t, prompts[0], n).tokens
    assert ref == x[0, prompts[0].numel():].tolist()
    for m in METHODS:
        assert speculative_decode(t, _proposer(m, dr), prompts[0], n).tokens == ref, m
    single = [decode_ar(t, p, n).tokens for p in prompts]
    assert [r.tokens for r in decode_ar_batch(t, prompts, n)] == single
    for m in ("ngram", "eagle3", "mtp", "dspark"):
        out = speculative_decode_batch(t, batched(m, [_proposer(m, dr), _proposer(m, dr)]), prompts, n)
        assert [r.tokens for r in out] == single, m


@pytest.mark.parametrize("family", SLIDING)
def test_cost_model_measures_sliding_targets_past_the_window(family):
    from eval.bench.cost_model import measure_costs

    costs = measure_costs(target_of(family), prefix_len=WINDOW + 8, widths=(1, 4), batch_sizes=(1, 2),
                          k_max_batch=2, reps=1)
    assert set(costs["verify"]) >= {0, 3} and set(costs["batch"][2]) == {0, 1, 2}


def test_eagle3_rope_takes_gemma3_full_attention_parameters():
    """Gemma-3's rope_parameters are per layer type; the drafter (full attention) must use theta 1e6, not 1e4."""
    d = drafters_of("gemma3")["eagle3"]
    hd = d.head_dim
    torch.testing.assert_close(d._inv_freq, 1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd)))
    assert d.config_dict()["rope_parameters"]["rope_theta"] == 1e6


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_medusa_and_mtp_logits_are_soft_capped_like_the_target(family):
    t, dr = target_of(family), drafters_of(family)
    cap = t.model.config.final_logit_softcapping
    h = 500 * torch.randn(1, 3, t.hidden_size)  # large states: uncapped logits would exceed the cap
    raw = torch.nn.functional.linear(h, t.model.get_output_embeddings().weight)
    assert raw.abs().max() > cap
    for logits in (dr["medusa"](h), dr["mtp"].logits(0, h)):
        assert logits.abs().max() <= cap
    x = dr["mtp"].mtp[0].shared_head.norm(h)
    raw_mtp = torch.nn.functional.linear(x, dr["mtp"].lm_head_weight)
    torch.testing.assert_close(dr["mtp"].logits(0, h), torch.tanh(raw_mtp / cap) * cap)


def _masked_runs(tok, row) -> list[str]:
    runs, cur = [], []
    for t, m in zip(row["input_ids"], row["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False).strip() for r in runs]


@FAM
def test_chat_masks_are_reply_plus_turn_end_on_multi_turn_with_system_prompt(family):
    """Every family's template (Qwen3 think blocks, Mistral's folded system prompt, Gemma-2's refused system role,
    Phi-3's trailing eos, gpt-oss <|end|>/<|return|>) masks exactly each reply and the token that closes it."""
    from data.chat import tokenize_conversation
    from tests.families import CONVERSATION

    tok = target_of(family).tokenizer
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    last_end = SPECS[family].turn_end
    earlier_end = "<|end|>" if family == "gpt_oss" else last_end
    want = [r + earlier_end for r in replies[:-1]] + [replies[-1] + last_end]
    for thinking in (None, False, True):
        row = tokenize_conversation(tok, CONVERSATION, max_len=4096, enable_thinking=thinking)
        assert _masked_runs(tok, row) == want, (family, thinking)


@FAM
def test_regeneration_stops_at_the_templates_turn_end(family):
    from data.regenerate import stop_token_ids, turn_end_token_id

    model, tok = target_of(family).model, target_of(family).tokenizer
    end = turn_end_token_id(tok)
    assert tok.convert_ids_to_tokens(end) == SPECS[family].turn_end  # gpt-oss: <|return|>, not <|end|>
    stops = stop_token_ids(tok, model)
    assert end in stops and tok.eos_token_id in stops
    assert set(model.generation_config.eos_token_id) <= set(stops)


def test_qwen3_enable_thinking_and_a_template_override_are_data_config_keys(tmp_path):
    from data.chat import render_chat
    from data.sources import DataConfig, build_rows

    tok = target_of("qwen3").tokenizer
    user = [{"role": "user", "content": "hi"}]
    thinking_off = render_chat(tok, user, True, enable_thinking=False)
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(tok, user, True).endswith("<|im_start|>assistant\n")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    assert render_chat(tok, user, chat_template=str(tmp_path / "t.jinja")) == "<|im_start|>hi<|im_end|>"
    import json

    from tests.families import CONVERSATION

    src = tmp_path / "c.jsonl"
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "never rendered"}]
    src.write_text("\n".join(json.dumps({"messages": c}) for c in [CONVERSATION] * 3 + [bad]) + "\n")
    drop = tmp_path / "drop.jinja"  # leaves out replies containing "never": that row's mask is not derivable
    drop.write_text("{% for m in messages %}{% if 'never' not in m['content'] %}<|im_start|>{{ m['content'] }}"
                    "<|im_end|>{% endif %}{% endfor %}")
    cfg = DataConfig(kind="chat", source=str(src), max_len=256, val_rows=0, enable_thinking=False)
    train, _ = build_rows(cfg, tok)
    assert len(train) == 4
    with pytest.raises(ValueError, match="conversation 3: turn 1 .*data.skip_malformed"):
        build_rows(DataConfig(kind="chat", source=str(src), max_len=256, val_rows=0, chat_template=str(drop)), tok)
    train, _ = build_rows(DataConfig(kind="chat", source=str(src), max_len=256, val_rows=0, chat_template=str(drop),
                                     skip_malformed=True), tok)
    assert len(train) == 3  # the unmaskable row skipped (and counted in the log), the others kept


def test_gpu_recipe_is_a_file_with_the_gpu_settings():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        c = compose(config_name="config", overrides=["+recipe=eagle3_gpu", "data.source=x.jsonl"])
    assert (c.data.max_len, c.data.kind, c.draft.config.ttt_steps, c.draft.config.draft_vocab_size) == \
        (2048, "chat", 7, 32000)
    assert c.optim.optimizer.lr == 1e-4 and c.target.dtype == "bfloat16" and c.output_dir == "runs/eagle3_gpu"
    assert "+recipe=eagle3_gpu" in (conf.parent / "docs" / "training.md").read_text()


def test_exporter_refuses_k_zero_from_results(tmp_path):
    import json

    from models.export.shared.common import ExportError, num_speculative_tokens_from_results

    p = tmp_path / "r.json"
    p.write_text(json.dumps({"recommended_num_speculative_tokens": 0, "best_positive_num_speculative_tokens": 2}))
    with pytest.raises(ExportError, match="slower than plain decoding"):
        num_speculative_tokens_from_results(p)


def test_fingerprint_does_not_depend_on_the_load_dtype(tmp_path):
    """A drafter trained on a bf16-loaded target is accepted by the same target loaded in fp32 or fp16."""
    from models.registry import load_drafter
    from tests.families import save_family
    from train.checkpoint import save_drafter

    save_family("qwen3", tmp_path / "t")  # stored in fp32
    loads = {dt: FrozenTarget.from_pretrained(str(tmp_path / "t"), dtype=dt) for dt in ("bfloat16", "float32")}
    assert loads["bfloat16"].fingerprint() == loads["float32"].fingerprint()
    assert loads["bfloat16"].legacy_fingerprint() != loads["float32"].legacy_fingerprint()  # what used to break
    FrozenTarget.from_pretrained(str(tmp_path / "t"), dtype="float16").model.save_pretrained(tmp_path / "h")
    loads["float32"].tokenizer.save_pretrained(tmp_path / "h")  # an fp16-stored target: every load agrees
    assert len({FrozenTarget.from_pretrained(str(tmp_path / "h"), dtype=dt).fingerprint()
                for dt in ("bfloat16", "float32", "float16")}) == 1
    t16 = loads["bfloat16"]
    torch.manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.arange(t16.vocab_size).flip(0).float(), 64)
    d = Eagle3Drafter(Eagle3Config(layer_ids=[1, 2, 3], draft_vocab_size=64), t16.model.config,
                      t16.embed.weight.detach().clone(), d2t, t2d)
    save_drafter(tmp_path / "d", d, {"method": "eagle3", "draft": d.config_dict(), "target": t16.identity()})
    back, _ = load_drafter(tmp_path / "d", loads["float32"])
    assert back.head_dim == d.head_dim


REFUSED = {  # formats that cannot hold the family, with the reason the exporter must give
    **{("mtp-nextn", f): "DeepSeek-V3 block" for f in FAMILIES if f != "deepseek_v3"},
    ("mtp-nextn", "deepseek_v3"): "exactly 1 MTP module",  # trained with 2 here
    ("mtp", "qwen3_moe"): "per-expert checkpoint layout is only verified for",
    ("mtp", "gpt_oss"): "per-expert checkpoint layout is only verified for",
    ("eagle3", "gpt_oss"): "attention_bias=True cannot be loaded by SGLang",  # its qkv bias; speculators format works
}


@pytest.mark.slow
@FAM
def test_train_every_recipe_two_steps_then_export_and_check(family, tmp_path):
    """2 steps of eagle3/medusa/mtp through train/loop.py on code data, then every export format + --check."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from models.export.shared.common import ExportError
    from models.registry import load_drafter
    from tests.families import save_family
    from train.export import main as export_main
    from train.loop import run

    conf = Path(__file__).resolve().parent.parent / "conf"
    tdir = save_family(family, tmp_path / "target")
    formats = {"eagle3": ["eagle3", "eagle3-speculators"], "medusa": ["medusa", "medusa-vllm"],
               "mtp": ["mtp", "mtp-nextn"]}
    for method, extra in (("eagle3", ["draft.config.draft_vocab_size=64", "draft.config.ttt_steps=2",
                                      "draft.config.layer_ids=[1,2,3]"]),
                          ("medusa", ["draft.config.num_heads=2"]), ("mtp", ["draft.config.num_modules=2"])):
        out = tmp_path / method
        over = [f"target.name_or_path={tdir}", f"output_dir={out}", "tracking=none", "data.max_rows=6",
                "data.val_rows=2", "data.max_len=32", f"data.cache_dir={out}/data", "train.steps=2",
                "train.batch_size=2", "train.ckpt_every=100", "train.eval_every=100", "optim.warmup_steps=1",
                f"draft={method}", *extra]
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            res = run(compose(config_name="config", overrides=over))
        assert res["method"] == method and "acc_0" in res["val"]
        load_drafter(out / "final", target_of(family))  # reload with the same shapes (another load of the target)
        for fmt in formats[method]:
            e = tmp_path / f"x_{fmt}"
            argv = [str(out / "final"), "--format", fmt, "--out", str(e), "--target", str(tdir)]
            if (fmt, family) in REFUSED:
                with pytest.raises(ExportError, match=REFUSED[(fmt, family)]):
                    from models.export.api import export

                    d, meta = load_drafter(out / "final", target_of(family))
                    export(d, fmt, e, target_of(family), meta=meta)
                continue
            assert export_main(argv) == 0, (family, fmt)
            assert export_main(["--check", str(e), "--target", str(tdir)]) == 0, (family, fmt)


def test_regeneration_cache_is_per_target(tmp_path):
    """Two targets never share regenerated data: same family, shape and tokenizer but other weights (only the
    embedding fingerprint tells them apart) and another family each get their own cache file; the same target
    again gets the same file (a reuse)."""
    from data.regen_cache import regen_cache_path
    from data.sources import DataConfig

    cfg = DataConfig(cache_dir=str(tmp_path))
    prompts = [[5, 6, 7], [8, 9]]
    a, tok = make_family("llama", seed=0)
    b, tok_b = make_family("llama", seed=1)
    q, tok_q = make_family("qwen2")
    assert tok.get_vocab() == tok_b.get_vocab() and a.config.to_dict() == b.config.to_dict()
    pa = regen_cache_path(cfg, a, tok, "code", prompts)
    assert regen_cache_path(cfg, a, tok, "code", prompts) == pa
    others = {regen_cache_path(cfg, b, tok_b, "code", prompts), regen_cache_path(cfg, q, tok_q, "code", prompts)}
    assert len({pa, *others}) == 3


# ------------------------------------------------------------------------- chat data (data=sharegpt)
CONF = Path(__file__).resolve().parent.parent / "conf"


def _chat_file(path: Path, n: int, conv=CONVERSATION) -> Path:
    path.write_text("".join(json.dumps({"messages": conv}) + "\n" for _ in range(n)))
    return path


def _cfg(tdir, out, src, *extra):
    over = [f"target.name_or_path={tdir}", f"output_dir={out}", "tracking=none", "data=sharegpt",
            f"data.source={src}", "data.max_len=64", "data.val_rows=2", "train.steps=2", "train.batch_size=2",
            "train.ckpt_every=100", "train.eval_every=100", "optim.warmup_steps=1", *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=over)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return save_family("phi3", tmp_path_factory.mktemp("phi3"))


def test_dflash_on_phi3_chat_skips_and_counts_batches_with_no_trainable_block(phi3_dir, tmp_path):
    """Few assistant tokens per row and a small draft vocabulary: some batches have no scored slot at all. They
    are skipped and counted (metrics.jsonl), never a 'does not require grad' crash."""
    short = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris"}]
    src = _chat_file(tmp_path / "c.jsonl", 8, short)
    res = run(_cfg(phi3_dir, tmp_path / "run", src, "+recipe=dflash", "draft.config.layer_ids=[1,2,3]",
                   "draft.config.block_size=4", "draft.config.draft_vocab_size=8", "train.steps=4",
                   "data.regenerate=0", "train.log_every=1"))
    assert res["steps"] == 4
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("train/skipped_batches", 0) for r in recs) >= 1


def test_gpt_oss_regeneration_splits_harmony_channels_as_the_template_expects(tmp_path):
    """gpt-oss answers in channels; its template refuses <|channel|> text in content. Regenerated replies keep the
    analysis in 'thinking' and the final answer in 'content', and a whole run on them trains (before: the
    template's TemplateError under a Hydra traceback)."""
    from data.chat import render_chat, tokenize_conversation
    from data.regenerate import regenerate_conversations
    from tests.families import HARMONY_REPLY, harmony_speaker

    model, tok = harmony_speaker()
    with pytest.raises(Exception, match="containing <\\|channel\\|> tags in the content field"):
        render_chat(tok, [*CONVERSATION[:2], {"role": "assistant", "content": HARMONY_REPLY}])
    out = regenerate_conversations(model, tok, [CONVERSATION], tmp_path / "r.jsonl", max_new_tokens=48)
    replies = [m for m in out[0] if m["role"] == "assistant"]
    assert [(m["thinking"], m["content"]) for m in replies] == [("The user asks a question.", "Here it is.")] * 2
    row = tokenize_conversation(tok, out[0], max_len=512)
    assert row is not None and any(row["loss_mask"])
    tdir = tmp_path / "gpt_oss"
    model.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    src = _chat_file(tmp_path / "c.jsonl", 4)
    res = run(_cfg(tdir, tmp_path / "run", src, "+recipe=eagle3", "data.regenerate=1", "data.regen_new_tokens=48",
                   "data.regen_temperature=0", "data.max_len=256", "data.val_rows=1", "draft.config.layer_ids=[1,2,3]",
                   "draft.config.draft_vocab_size=64", "draft.config.ttt_steps=2"))
    assert res["steps"] == 2


def test_chat_val_rows_are_honoured_and_tree_sizing_falls_back_without_eval_json(phi3_dir, tmp_path, caplog):
    """8 conversations with data.val_rows=2 hold out 2 (before: 0, so no final/eval.json); and a checkpoint without
    eval.json still gets an EAGLE-2 tree under total_tokens: auto (a fixed size, with a warning), not exit 2."""
    from models.core.target import FrozenTarget
    from models.registry import load_drafter, make_proposer_factory

    src = tmp_path / "c.jsonl"  # 8 distinct conversations: a held-out copy of a training one is not held out
    src.write_text("".join(json.dumps({"messages": [{**m, "content": f"{m['content']} ({i})"} for m in CONVERSATION]})
                           + "\n" for i in range(8)))
    out = tmp_path / "run"
    over = ["draft.config.layer_ids=[1,2,3]", "draft.config.draft_vocab_size=64", "draft.config.ttt_steps=2",
            "train.eval_rows=2"]
    run(_cfg(phi3_dir, out, src, *over))
    stats = json.loads((out / "data_stats.json").read_text())
    assert (stats["train_rows"], stats["val_rows"]) == (6, 2)
    assert (out / "final" / "eval.json").is_file()
    (out / "final" / "eval.json").unlink()  # as a run with data.val_rows=0 leaves it
    target = FrozenTarget.from_pretrained(str(phi3_dir))
    drafter, _ = load_drafter(out / "final", target)
    with caplog.at_level("WARNING"):
        make, o = make_proposer_factory("eagle3_tree", drafter, target, str(out / "final"),
                                        {"total_tokens": "auto"})
    assert o["total_tokens"] == 10 and "no held-out rank metrics" in caplog.text
    assert make(None) is not None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("recipe", ["dspark", "peagle"])
def test_block_drafters_train_decode_and_export_on_family_targets(family, recipe, tmp_path):
    """DSpark (DFlash + Markov/confidence head) and P-EAGLE on the family matrix's Llama and Qwen3 targets: a
    2-step train through the loop, a lossless greedy decode past the sliding window (B=1 and batched), every
    export format of the recipe + --check."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from models.registry import load_drafter, make_proposer_factory
    from tests.families import save_family
    from train.export import main as export_main
    from train.loop import run

    conf = Path(__file__).resolve().parent.parent / "conf"
    tdir = save_family(family, tmp_path / "target")
    extra = {"dspark": ["draft.config.block_size=4", "draft.config.markov_rank=8", "draft.config.num_anchors=4",
                        "draft.config.draft_vocab_size=null"],
             "peagle": ["draft.config.num_depths=3", "draft.config.draft_vocab_size=64"]}[recipe]
    out = tmp_path / recipe
    over = [f"target.name_or_path={tdir}", f"output_dir={out}", "tracking=none", "data.max_rows=6",
            "data.val_rows=2", "data.max_len=32", f"data.cache_dir={out}/data", "data.regenerate=0",
            "train.steps=2", "train.batch_size=2", "train.ckpt_every=100", "train.eval_every=100",
            "optim.warmup_steps=1", f"+recipe={recipe}", "draft.config.layer_ids=[1,2,3]", *extra]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        res = run(compose(config_name="config", overrides=over))
    assert "acc_2" in res["val"]
    t = target_of(family)
    d, _ = load_drafter(out / "final", t)
    make, _ = make_proposer_factory("dflash" if recipe == "dspark" else "peagle", d, t, str(out / "final"), {})
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(len(t.tokenizer), (WINDOW + 3,), generator=g),
               torch.randint(len(t.tokenizer), (WINDOW + 7,), generator=g)]
    n = WINDOW + 4
    single = [decode_ar(t, p, n).tokens for p in prompts]
    assert speculative_decode(t, make(), prompts[0], n).tokens == single[0]
    method = "dflash" if recipe == "dspark" else "peagle"
    assert [r.tokens for r in speculative_decode_batch(t, batched(method, [make(), make()]), prompts,
                                                                    n)] == single
    formats = {"dspark": ["dspark-speculators", "dspark"], "peagle": ["peagle-speculators"]}[recipe]
    for fmt in formats:
        e = tmp_path / f"x_{fmt}"
        assert export_main([str(out / "final"), "--format", fmt, "--out", str(e), "--target", str(tdir)]) == 0
        assert export_main(["--check", str(e), "--target", str(tdir)]) == 0, (family, fmt)
