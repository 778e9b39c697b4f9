"""The evaluation runner, bench and contenders on a tiny random model with the real tokenizer (seconds)."""

import json

import pytest

from kvopt.errors import KVOptError, MethodParameterError
from kvopt.eval.bench import run_bench, summarize
from kvopt.eval.contenders import parse_contender, split_specs
from kvopt.eval.decoding import QUERY_AGNOSTIC, QUERY_AWARE, run_prompt
from kvopt.eval.runner import EvalGrid, run_eval



def test_split_specs_keeps_parameters_together():
    assert split_specs("full,window:size=512,ratio=0.5,hf,kvpress:snapkv:ratio=0.5") == [
        "full", "window:size=512,ratio=0.5", "hf", "kvpress:snapkv:ratio=0.5",
    ]  # fmt: skip


def test_contender_specs():
    assert parse_contender("window:ratio=0.5").ratio == 0.5
    assert parse_contender("kvpress:adakv-snapkv:ratio=0.25").method_name == "kvpress:adakv-snapkv"
    with pytest.raises(MethodParameterError, match="outside"):
        parse_contender("kvpress:snapkv:ratio=1.5")
    with pytest.raises(MethodParameterError, match="unknown kvpress press"):
        parse_contender("kvpress:nosuch:ratio=0.5")


def test_full_and_hf_decode_the_same_tokens(tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    context, question = list(range(100, 300)), list(range(400, 420))
    for mode in (QUERY_AGNOSTIC, QUERY_AWARE):
        ours = run_prompt(model, parse_contender("full"), context, question, 8, mode, set())
        peer = run_prompt(model, parse_contender("hf"), context, question, 8, mode, set())
        assert ours.token_ids == peer.token_ids
        assert ours.kv_bytes_peak >= peer.kv_bytes_peak * 0.99
    window = run_prompt(model, parse_contender("window:ratio=0.75"), context, question, 8, QUERY_AWARE, set())
    assert window.compression > 0.6


@pytest.mark.parametrize("spec", ["hf", "hf-quanto:bits=2", "kivi:bits=2"])
def test_a_replayed_prefill_answers_as_a_direct_one(tiny_with_tokenizer, spec):
    """HF's caches replay the shared lossless prefill too (its quantized cache quantizes after attention): the same
    tokens and bytes as a prefill of their own; a press that hooks the forward pass refuses to replay."""
    from kvopt.eval.decoding import shared_prefill

    contender = parse_contender(spec)
    if reason := contender.missing():
        pytest.skip(reason)
    model, _ = tiny_with_tokenizer
    context, question = list(range(100, 300)), list(range(400, 420))
    direct = run_prompt(model, contender, context, question, 8, QUERY_AGNOSTIC, set())
    shared = shared_prefill(model, context)
    replayed = run_prompt(model, contender, context, question, 8, QUERY_AGNOSTIC, set(), shared=shared)
    assert replayed.token_ids == direct.token_ids
    assert replayed.kv_bytes_peak == direct.kv_bytes_peak
    press = parse_contender("kvpress:snapkv:ratio=0.5")
    with pytest.raises(MethodParameterError, match="changes the prefill"):
        press.replay_prefill(press.new_cache(model), shared.cache)


def test_saved_contenders_answer_from_a_cache_that_went_through_the_codec(tiny_with_tokenizer):
    """``saved:<encoding>:<spec>``: prefill, save, load, then the question; raw gives exactly the unsaved tokens,
    int4 answers from really re-quantized keys (close to the saved ones, not equal)."""
    import torch

    from kvopt.eval.decoding import forward

    model, _ = tiny_with_tokenizer
    context, question = list(range(100, 300)), list(range(400, 420))
    saved = parse_contender("saved:int4:snapkv:ratio=0.5")
    assert (saved.spec, saved.family, saved.ratio) == ("saved:int4:snapkv:ratio=0.5", "kvopt", 0.5)
    plain = run_prompt(model, parse_contender("snapkv:ratio=0.5"), context, question, 8, QUERY_AGNOSTIC, set())
    raw = run_prompt(model, parse_contender("saved:raw:snapkv:ratio=0.5"), context, question, 8, QUERY_AGNOSTIC, set())
    assert raw.token_ids == plain.token_ids
    assert len(run_prompt(model, saved, context, question, 8, QUERY_AGNOSTIC, set()).token_ids) == 8
    cache = saved.new_cache(model)
    with torch.inference_mode():
        forward(model, context, cache, 0)
    before = cache.layers[1].store.keys.clone()
    after = saved.reloaded(model, cache).layers[1].store.keys
    assert before.shape == after.shape and not torch.equal(before, after)
    assert (after - before).norm() < 0.1 * before.norm()
    for spec, match in (("saved:zip:full", "encoding"), ("saved:int4:hf", "only kvopt caches"), ("saved:int4", "encoding")):
        with pytest.raises(MethodParameterError, match=match):
            parse_contender(spec)


def test_eval_grid_is_resumable(tiny_with_tokenizer, tmp_path):
    grid = EvalGrid(
        tasks=["passkey"], lengths=[300], methods=["full", "window:ratio=0.5", "hf"], depths=2,
        modes=[QUERY_AGNOSTIC, QUERY_AWARE],
    )  # fmt: skip
    path = run_eval(grid, tmp_path, loaded=tiny_with_tokenizer, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3
    assert {r["method"] for r in rows} == {"full", "window:ratio=0.5", "hf"}
    assert all(0.0 <= r["score"] <= 1.0 and r["prompt_tokens"] <= 300 for r in rows)
    # Interrupted run: keep the first rows, re-run, only the missing rows are added.
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:5]))
    run_eval(grid, tmp_path, loaded=tiny_with_tokenizer, progress=False)
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(again) == 12 and len({(r["depth"], r["mode"], r["method"]) for r in again}) == 12
    run_eval(grid, tmp_path, loaded=tiny_with_tokenizer, progress=False)
    assert len(path.read_text().splitlines()) == 12


def test_missing_peer_is_skipped_with_install_hint(tiny_with_tokenizer, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))
    messages = []
    grid = EvalGrid(tasks=["passkey"], lengths=[300], methods=["kvpress:snapkv:ratio=0.5"], depths=1)
    path = run_eval(grid, tmp_path, loaded=tiny_with_tokenizer, progress=False, log=messages.append)
    assert "pip install -e '.[compare]'" in messages[0]
    assert path.read_text() == ""


def test_bad_grid_errors(tiny_with_tokenizer, tmp_path):
    with pytest.raises(KVOptError, match="unknown task"):
        run_eval(EvalGrid(["nosuch"], [300], ["full"]), tmp_path, loaded=tiny_with_tokenizer, progress=False)
    with pytest.raises(KVOptError, match="exceeds the model's maximum"):
        run_eval(EvalGrid(["passkey"], [9000], ["full"]), tmp_path, loaded=tiny_with_tokenizer, progress=False)


def test_ppl_row_and_bench(tiny_with_tokenizer, tmp_path):
    grid = EvalGrid(
        tasks=["ppl"], lengths=[], methods=["full", "hf", "window:size=32"], ppl_tokens=96, ppl_chunk=8, ppl_first=40
    )  # fmt: skip
    path = run_eval(grid, tmp_path, loaded=tiny_with_tokenizer, progress=False)
    by_method = {r["method"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert by_method["full"]["tokens"] == 95 and by_method["full"]["ppl"] > 1
    assert by_method["full"]["ppl"] == pytest.approx(by_method["hf"]["ppl"], rel=1e-5)
    assert by_method["window:size=32"]["kv_bytes_end"] < by_method["full"]["kv_bytes_end"]
    bench = run_bench([64], ["full"], tmp_path, new_tokens=4, repeats=2, loaded=tiny_with_tokenizer, log=lambda _: None)
    assert len(bench) == 2 * 2
    summary = summarize(bench)
    assert summary[0]["method"] == "hf" and summary[0]["decode_vs_hf"] == 1.0
