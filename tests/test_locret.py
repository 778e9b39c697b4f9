"""locret (issue 39): the importance target against a slow reference, eviction inside the chunked prefill (equal to
a chunk-by-chunk prefill, bytes bounded while the prompt streams), the heads file (cached, damaged, another
model's), bad input, composition with kivi, and the engine."""

import copy
from pathlib import Path

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvopt
from kvopt.cache.prerope import to_pairs
from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError
from kvopt.methods import locret_data, locret_heads, parse
from kvopt.methods.locret import Locret
from kvopt.models.forward import cache_kwargs

SPEC = "locret:budget=48,window=8,chunk=32"


def text_ids(count: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return kvopt.prepare(tiny := tiny_model("llama")) or tiny


@pytest.fixture(scope="module")
def trained(model):
    """Heads fitted once on random ids (the tiny model has no tokenizer), shared by the tests that only use them."""
    method = parse(SPEC)[0]
    method.fit(model, text_ids(2048), sequence=256, steps_per_sequence=2)
    return method.trained


def locret(spec: str, trained) -> Locret:
    method = parse(spec)[0]
    method.trained = trained
    return method


# -- the importance target ------------------------------------------------------------------------
def test_importance_target_and_features_match_a_slow_reference(model):
    """CIS = max over the answer's positions and the GQA group of the logit q.k * scale the model computes (after
    RoPE, as the paper's labels; format 2 took it before RoPE), and the features start with the pre-RoPE queries,
    HF's own projections of the layer's normed input."""
    ids = text_ids(40)[None]
    answer, context = 8, 32
    features, targets = locret_heads.example(model, ids, answer)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        hidden = reference(ids, output_hidden_states=True).hidden_states
        for index, block in enumerate(reference.model.layers):
            attention = block.self_attn
            x = block.input_layernorm(hidden[index])
            q = attention.q_proj(x).view(1, 40, -1, attention.head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(1, 40, -1, attention.head_dim).transpose(1, 2)
            cos, sin = reference.model.rotary_emb(x, torch.arange(40)[None])
            rotated_q, rotated_k = apply_rotary_pos_emb(q, k, cos, sin)
            group = q.shape[1] // k.shape[1]
            for head in range(k.shape[1]):
                for token in range(context):
                    best = max(
                        sum(a * b for a, b in zip(rotated_q[0, h, p].tolist(), rotated_k[0, head, token].tolist()))
                        * attention.scaling
                        for h in range(head * group, (head + 1) * group)
                        for p in range(context, 40)
                    )
                    assert targets[index, token, head].item() == pytest.approx(best, abs=1e-4)
            # The features start with the pre-RoPE queries (pair order): the projections themselves.
            table = locret_heads.rope_table(attention, index, attention.head_dim, torch.device("cpu"))
            raw = to_pairs(q[0], table).transpose(0, 1).reshape(40, -1)[:context]
            torch.testing.assert_close(features[index, :, : raw.shape[1]], raw, atol=1e-5, rtol=1e-5)


def test_training_lowers_the_loss_below_untrained_heads(model, trained):
    """The fit learns: its held-out loss is below that of the same heads before training."""
    untrained = locret_heads.RetainingHeads(*trained.heads.fc1.shape[:2], trained.heads.fc2.shape[-1],
                                            trained.heads.fc1.shape[-1])  # fmt: skip
    untrained.load_state_dict({**trained.heads.state_dict(), "fc1": untrained.fc1, "fc2": untrained.fc2})
    features, targets = locret_heads.example(model, text_ids(256, seed=9)[None])
    with torch.no_grad():
        fitted = locret_heads.loss_terms(trained.heads, features, targets)[0]
        before = locret_heads.loss_terms(untrained, features, targets)[0]
    assert fitted < 0.9 * before


# -- training sequences ---------------------------------------------------------------------------------
def test_planted_facts_are_in_the_context_and_asked_back_in_the_answer():
    """Each fact's statement lies before the answer tokens, which ask for it and state its value; sequences have the
    length asked for, most of them with planted facts and the rest consecutive prose."""
    import random

    from kvopt.local_text import real_text
    from kvopt.models import load_tokenizer

    tokenizer, text = load_tokenizer(), real_text()[0]
    rng = random.Random(4)
    facts = [locret_data.draw_fact(rng) for _ in range(3)]
    sentences = ["The sky was grey that day.", "Nobody came to the meeting.", "It rained until the evening."]
    piece = locret_data.retrieval_sequence(rng, tokenizer, sentences, 300, facts)
    assert piece.ids.shape == (1, 300)
    context, answer = (tokenizer.decode(part) for part in (piece.ids[0, : -piece.answer], piece.ids[0, -piece.answer :]))
    for fact in facts:
        assert fact.statement in context and fact.question in answer and fact.answer in answer
        assert fact.statement not in answer
    pieces = locret_data.training_sequences(tokenizer, text, 8, 256, 64)
    assert [p.ids.shape for p in pieces] == [(1, 256)] * 8
    prose = tokenizer(text, add_special_tokens=False)["input_ids"]
    consecutive = [p for p in pieces if p.ids[0].tolist() in (prose[i : i + 256] for i in range(0, 8 * 256, 256))]
    assert len(consecutive) == 8 - round(8 * locret_data.RETRIEVAL_SHARE) and all(p.answer == 64 for p in consecutive)


# -- eviction inside the chunked prefill ------------------------------------------------------------
def kept_positions(cache) -> list[torch.Tensor]:
    return [layer.store.positions.clone() for layer in cache.layers]


def test_one_forward_equals_a_chunk_by_chunk_prefill(trained, monkeypatch):
    """The hooks split the prompt inside each attention module: the same kept tokens and logits as feeding the
    chunks one forward at a time (the prompt's length declared up front)."""
    model = kvopt.prepare(tiny := tiny_model("llama", dtype=torch.float64)) or tiny
    heads = copy.deepcopy(trained)
    heads.heads.double()
    prompt = text_ids(200, seed=5)[None]
    whole = kvopt.cache([locret(SPEC, heads)], model)
    with torch.no_grad():
        logits = model(prompt, **cache_kwargs(model, whole)).logits[:, -1]
    start = Locret.start_prompt
    monkeypatch.setattr(Locret, "start_prompt", lambda self, cache, layer, hidden, mask: start(
        self, cache, layer, hidden.new_zeros(1, prompt.shape[1], 1), mask))  # fmt: skip
    chunked = kvopt.cache([locret(SPEC, heads)], model)
    with torch.no_grad():
        for begin in range(0, 200, 32):
            positions = torch.arange(begin, min(begin + 32, 200))[None]
            out = model(prompt[:, begin : begin + 32], position_ids=positions, **cache_kwargs(model, chunked))
    for mine, reference in zip(kept_positions(whole), kept_positions(chunked)):
        assert torch.equal(mine, reference)
    torch.testing.assert_close(logits, out.logits[:, -1])


def test_bytes_stay_within_budget_plus_a_chunk_while_the_prompt_streams(model, trained, monkeypatch):
    """Peak held tokens per layer <= budget + chunk at every chunk, and the bytes drop to the budget's after."""
    held, peak_bytes = [], [0]
    act = Locret.after_attention

    def watched(self, layer, step):
        held.append(len(layer.store))
        peak_bytes[0] = max(peak_bytes[0], sum(other.nbytes() for other in layer.siblings))
        act(self, layer, step)

    monkeypatch.setattr(Locret, "after_attention", watched)
    prompt = text_ids(500, seed=6)[None]
    cache = kvopt.cache([locret(SPEC, trained)], model)
    full = kvopt.cache("full", model)
    with torch.no_grad():
        model(prompt, **cache_kwargs(model, cache))
        model(prompt, **cache_kwargs(model, full))
    assert len(held) == 3 * 16 and max(held) == 48 + 32  # 3 layers x 16 chunks
    assert all(layer.kept == 48 for layer in cache.stats())
    assert peak_bytes[0] < full.nbytes() * (48 + 32) / 500 * 1.2
    assert cache.nbytes() < full.nbytes() * 48 / 500 * 1.2


def test_ratio_budget_is_fixed_from_the_whole_prompt_and_later_tokens_come_on_top(model, trained):
    cache = kvopt.cache([locret("locret:ratio=0.75,chunk=64", trained)], model)
    prompt = text_ids(300, seed=7)[None]
    out = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False)
    assert out.shape[1] == 306
    assert [layer.kept for layer in cache.stats()] == [75 + 5] * 3  # a quarter of the prompt, then 5 decoded
    assert all(not layer.store.has_extra("locret.scores") for layer in cache.layers)  # freed with the prompt


def test_the_first_tokens_are_kept_as_attention_sinks(model, trained, monkeypatch):
    """Heads scoring the oldest tokens lowest still leave the first ``sinks`` of the prompt in every layer and head."""
    monkeypatch.setattr(Locret, "score_new", lambda self, layer, step: step.query_positions.float().expand(
        1, layer.store.keys.shape[1], -1))  # fmt: skip
    for sinks in (4, 0):
        cache = kvopt.cache([locret(f"locret:ratio=0.75,chunk=64,sinks={sinks}", trained)], model)
        with torch.no_grad():
            model(text_ids(300, seed=7)[None], **cache_kwargs(model, cache))
        for layer in cache.layers:
            first = layer.store.positions[..., :4]
            assert torch.equal(first, torch.arange(4).expand_as(first)) == (sinks == 4)


def test_pooling_keeps_a_high_scored_tokens_neighbours(model, trained, monkeypatch):
    """With ``pool=5`` the two tokens either side of the one the heads score highest are kept with it."""
    def score(self, layer, step):
        positions = step.query_positions.float()
        return torch.where(positions == 100, 1e6, positions).expand(1, layer.store.keys.shape[1], -1)

    monkeypatch.setattr(Locret, "score_new", score)
    for pool in (5, 0):
        cache = kvopt.cache([locret(f"locret:ratio=0.75,chunk=64,pool={pool}", trained)], model)
        with torch.no_grad():
            model(text_ids(300, seed=7)[None], **cache_kwargs(model, cache))
        for layer in cache.layers:
            held = layer.store.positions
            assert bool((held == 100).any(-1).all())
            assert bool(torch.isin(torch.tensor([98, 99, 101, 102]), held).all()) == (pool == 5)


def test_composes_with_kivi_keeping_the_same_tokens(model, trained):
    """locret+kivi: kivi waits for the last chunk, so the tokens kept are locret's own, then quantized."""
    prompt = text_ids(400, seed=8)[None]
    alone = kvopt.cache([locret("locret:ratio=0.75,chunk=64", trained)], model)
    both = parse("locret:ratio=0.75,chunk=64+kivi:bits=4,residual=32")
    both[0].trained = trained
    mixed = kvopt.cache(both, model)
    with torch.no_grad():
        model(prompt, **cache_kwargs(model, alone))
        model(prompt, **cache_kwargs(model, mixed))
    for plain, quantized in zip(alone.layers, mixed.layers):
        part = quantized.parts_of(QuantizedKV)[0]
        assert torch.equal(torch.cat([part.positions, quantized.store.positions], dim=-1), plain.store.positions)
    assert mixed.nbytes() < 0.5 * alone.nbytes()


def saved_heads(model, trained, folder) -> str:
    path = folder / "heads.pt"
    locret_heads.save(path, trained, locret_heads.model_fingerprint(model))
    return str(path)


@pytest.mark.parametrize("quantizer", ["", "+kivi:bits=4,residual=8"])
def test_engine_outputs_equal_generate_with_the_same_cache(model, trained, tmp_path, quantizer):
    """Per request and engine-wide, the engine's own-cache sequences give generate's tokens (prompts of several
    chunks, run in the same steps), alone and with a quantizer after the eviction."""
    from kvopt.engine import LLM, SamplingParams

    spec = f"locret:ratio=0.5,window=4,chunk=24,heads={saved_heads(model, trained, tmp_path)}{quantizer}"
    prompts = [text_ids(n, seed=n).tolist() for n in (90, 140, 60)]
    expected = []
    for prompt in prompts:
        cache = kvopt.cache(spec, model)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    per_request = LLM(copy.deepcopy(model), tokenizer=None, kv_memory="4MB", max_num_batched_tokens=96)
    engine_wide = LLM(copy.deepcopy(model), tokenizer=None, kv_method=spec, kv_memory="4MB", max_num_batched_tokens=96)
    for llm, kv_method in ((per_request, spec), (engine_wide, None)):
        params = SamplingParams(max_tokens=8, ignore_eos=True, kv_method=kv_method)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [out.error for out in outputs] == [None] * 3
        assert [out.outputs[0].token_ids for out in outputs] == expected


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    ("locret:ratio=0.5,budget=100", "exactly one of ratio"),
    ("locret:budget=100,window=128", "window=128 must be smaller than budget=100"),
    ("locret:ratio=0.5,chunk=0", "chunk=0 must be a positive integer"),
    ("locret:ratio=0.5,sinks=-1", "sinks=-1 must be >= 0"),
    ("locret:ratio=0.5,pool=4", "pool=4 0 or odd"),
])  # fmt: skip
def test_bad_specs_fail_with_one_line(spec, words):
    with pytest.raises(MethodParameterError) as error:
        parse(spec)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_another_eviction_in_the_spec_is_refused(model, trained):
    methods = parse("locret:ratio=0.5,chunk=32+snapkv:ratio=0.5")
    methods[0].trained = trained
    cache = kvopt.cache(methods, model)
    with pytest.raises(kvopt.errors.CacheUsageError, match="shares a spec with quantizers only, not with snapkv"):
        model(text_ids(100)[None], **cache_kwargs(model, cache))


# -- the heads file -------------------------------------------------------------------------------------
@pytest.fixture
def named_model(tiny_with_tokenizer, monkeypatch, tmp_path):
    """A tiny llama named after the default model's folder (whose tokenizer reads the local text), its heads cached
    in ``tmp_path``, trained on few tokens."""
    from kvopt.models.loading import resolve_model_dir

    model = copy.deepcopy(tiny_with_tokenizer[0])
    model.name_or_path = str(resolve_model_dir(None))
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path))
    monkeypatch.setattr(locret_heads, "TRAIN_TOKENS", 3 * 512)
    monkeypatch.setattr(locret_heads, "SEQUENCE", 512)
    return model


def heads_file(folder: Path) -> Path:
    (found,) = (folder / "locret").glob("*.pt")
    return found


def test_heads_are_trained_on_first_use_then_loaded_from_the_cache(named_model, tmp_path, capsys):
    first = kvopt.cache("locret:ratio=0.5", named_model).methods[0]
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "training locret's retaining heads" in notice
    assert first.trained.report.text_source.startswith(("python-docs", "common-licenses", "stdlib"))
    again = kvopt.cache("locret:ratio=0.5", named_model).methods[0]
    assert capsys.readouterr().err == ""
    assert again.trained.path == heads_file(tmp_path)
    for name, tensor in first.trained.heads.state_dict().items():
        assert torch.equal(tensor, again.trained.heads.state_dict()[name])


def test_a_damaged_heads_file_is_retrained_or_refused_with_one_line(named_model, tmp_path, capsys, monkeypatch):
    kvopt.cache("locret:ratio=0.5", named_model)
    path = heads_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    capsys.readouterr()
    kvopt.cache("locret:ratio=0.5", named_model)
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "is damaged" in notice and "training them again" in notice
    locret_heads.load(path, locret_heads.model_fingerprint(named_model), torch.device("cpu"))  # whole again
    path.write_bytes(path.read_bytes()[:-100])
    monkeypatch.setattr(locret_heads, "QUICK_SECONDS", 0.0)  # as for a model whose training takes minutes
    with pytest.raises(MethodParameterError) as refusal:
        kvopt.cache("locret:ratio=0.5", named_model)
    message = str(refusal.value)
    assert "is damaged" in message and f"kvopt train locret --model {named_model.name_or_path}" in message
    assert "\n" not in message


def test_heads_whose_weights_changed_after_saving_fail_their_checksum(named_model, tmp_path):
    kvopt.cache("locret:ratio=0.5", named_model)
    path = heads_file(tmp_path)
    saved = torch.load(path, weights_only=True)
    saved["state"]["fc1"][0, 0, 0] += 1.0  # a whole file torch reads back, one weight flipped
    torch.save(saved, path)
    with pytest.raises(locret_heads.HeadsFileError, match="checksum does not match its weights"):
        locret_heads.load(path, locret_heads.model_fingerprint(named_model), torch.device("cpu"))


def test_missing_heads_name_the_command_when_training_is_long_or_cannot_be_stored(named_model, tmp_path, monkeypatch):
    monkeypatch.setattr(locret_heads, "QUICK_SECONDS", 0.0)
    with pytest.raises(MethodParameterError, match="no retaining heads are trained .* run `kvopt train locret --model"):
        kvopt.cache("locret:ratio=0.5", named_model)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "file"))
    with pytest.raises(MethodParameterError, match="is a file.*run `kvopt train locret --model"):
        kvopt.cache("locret:ratio=0.5", named_model)


def test_heads_cached_in_a_folder_this_process_cannot_write_are_loaded(named_model, tmp_path, monkeypatch):
    import kvopt.paths

    kvopt.cache("locret:ratio=0.5", named_model)  # trained into tmp_path/locret

    def read_only(path, what):  # as for a cache folder mounted read-only (tests run as root: chmod would not do)
        raise kvopt.errors.KVOptError(f"{what} {path} is not writable; pass a folder you can write to")

    monkeypatch.setattr(kvopt.paths, "writable_folder", read_only)
    assert kvopt.cache("locret:ratio=0.5", named_model).methods[0].trained.path == heads_file(tmp_path)
    heads_file(tmp_path).unlink()
    with pytest.raises(MethodParameterError, match="is not writable.*run `kvopt train locret --model") as refusal:
        kvopt.cache("locret:ratio=0.5", named_model)
    assert "\n" not in str(refusal.value)


def test_heads_of_another_model_are_refused_with_one_line(model, trained, tmp_path):
    other = kvopt.prepare(tiny := tiny_model("llama", seed=1)) or tiny  # same configuration, other weights
    path = saved_heads(model, trained, tmp_path)
    kvopt.cache(f"locret:ratio=0.5,heads={path}", model)
    with pytest.raises(MethodParameterError) as refusal:
        kvopt.cache(f"locret:ratio=0.5,heads={path}", other)
    assert "was trained for another model" in str(refusal.value) and "\n" not in str(refusal.value)


# -- training: resumable, and the command ---------------------------------------------------------------
def test_an_interrupted_training_resumes_to_the_same_heads(model, tmp_path):
    pieces = locret_data.prose_sequences(text_ids(6 * 256, seed=11), 256, 64)
    straight = locret_heads.train(model, pieces, steps_per_sequence=2)
    checkpoint = tmp_path / "heads.partial"

    def stop_after_two(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        locret_heads.train(model, pieces, checkpoint, progress=stop_after_two, steps_per_sequence=2)
    seen = []
    resumed = locret_heads.train(model, pieces, checkpoint, progress=lambda done, total: seen.append(done),
                                 steps_per_sequence=2)  # fmt: skip
    assert seen[0] == 2 and seen[-1] == 5  # 6 sequences: 5 to train on, 1 held out
    for name, tensor in straight.heads.state_dict().items():
        assert torch.equal(tensor, resumed.heads.state_dict()[name]), name


def test_train_command_stores_heads_that_caches_then_load(tiny_with_tokenizer, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvopt.cli.main import app
    from kvopt.models import load_tokenizer

    folder = tmp_path / "model"
    tiny_with_tokenizer[0].save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(locret_heads, "SEQUENCE", 512)
    result = CliRunner().invoke(app, ["train", "locret", "--model", str(folder), "--tokens", "1536", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "validation loss" in result.output and "1,536 tokens (3 sequences" in result.output
    loaded, _ = kvopt.load_model(str(folder))
    method = kvopt.cache("locret:ratio=0.5", loaded).methods[0]
    assert method.trained.path == heads_file(tmp_path / "cache") and method.trained.report.tokens == 1536
