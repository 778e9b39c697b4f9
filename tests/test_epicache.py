"""epicache: segments, embeddings, clustering, routing and block-wise eviction against slow references on tiny
models with the default model's tokenizer; the bytes held drop to the budget; the engine serves it as ``generate``
does; bad input is one line each."""

import copy
import itertools
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvopt
from kvopt.cache.attention import prepare
from kvopt.cache.ragged import RaggedKV
from kvopt.engine import LLM, SamplingParams
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.eval.tasks import build_sample, format_prompt
from kvopt.methods.epicache import INSTRUCTION, EpiCache, kmeans, plan_conversation, route
from kvopt.methods.segment_spaces import SPACES, StatesSpace, TfidfSpace, space_from_state
from kvopt.models.forward import cache_kwargs


def tiny(tokenizer, layers: int, kv_heads: int, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prepare(model)
    return model


def conversation(tokenizer, length: int = 1536, depth: float = 0.5, index: int = 0) -> list[int]:
    """A conversation task prompt (history + question + answer prefix) as token ids."""
    context, question = format_prompt(tokenizer, build_sample("conversation", tokenizer, length, depth, index))
    return context + question


@pytest.fixture(scope="module")
def tokenizer(tiny_with_tokenizer):
    return tiny_with_tokenizer[1]


# -- segments -------------------------------------------------------------------------------------
def test_segments_are_groups_of_lines_and_the_question_is_the_tail(tokenizer):
    """Reference from the text: a line ends where the decoded prefix ends with a line break."""
    ids = conversation(tokenizer)[:-1]
    plan = plan_conversation(ids, tokenizer, utterances=3, window=64)
    starts = [0] + [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\n")]
    question = next(s for s in starts if s >= len(ids) - 64)
    assert tokenizer.decode(ids[question:]).startswith("Earlier we discussed")
    lines, joined = [], None  # a line of at most 4 tokens (a chat header) starts the next one
    for a, b in zip(starts, starts[1:] + [question]):
        if b <= question:
            a = a if joined is None else joined
            joined = a if b - a <= 4 else None
            if joined is None:
                assert b - a <= 256  # no line long enough to be cut here
                lines.append((a, b))
    assert tokenizer.decode(ids[lines[0][0] : lines[0][1]]).startswith("<|im_start|>system")
    expected = [(lines[i][0], lines[min(i + 3, len(lines)) - 1][1]) for i in range(0, len(lines), 3)]
    assert plan.segments == expected and plan.question_start == question


def test_text_without_line_breaks_is_cut_into_fixed_blocks(tokenizer):
    ids = tokenizer(" word" * 700, add_special_tokens=False)["input_ids"]
    plan = plan_conversation(ids, tokenizer, utterances=2, window=32)
    assert plan.question_start == len(ids) - 32
    assert plan.segments == [(0, 512), (512, len(ids) - 32)]


# -- embeddings, clustering, routing ----------------------------------------------------------------
def test_states_are_the_middle_layer_mean_centred_on_the_history_and_normalised(tokenizer):
    model = tiny(tokenizer, layers=4, kv_heads=2)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in
              ("The licence grants rights.", "Patents are a risk to free software.", "A cat sat.", "What was it?")]  # fmt: skip
    pooled = []
    for piece in pieces:
        with torch.no_grad():
            states = eager(torch.tensor([piece]), output_hidden_states=True).hidden_states[3][0]  # after layer 2 of 4
        pooled.append(states[1:].mean(dim=0))
    pooled = torch.stack(pooled)
    centred = pooled - pooled[:-1].mean(dim=0)
    expected = centred / centred.norm(dim=-1, keepdim=True)
    space, points = StatesSpace.fit(model, pieces[:-1])  # the history's segments; then a question placed in it
    torch.testing.assert_close(torch.cat([points, space.points(model, pieces[-1:])]), expected, atol=1e-5, rtol=1e-5)


def test_tfidf_is_log_counts_times_smoothed_idf_over_the_segments():
    """Written out with dicts: a token's weight in a piece is (1 + ln count) * ln((1 + n) / (1 + df)), df over the
    history's n segments; tokens the history never saw count nothing; rows are unit vectors."""
    segments = [[5, 5, 9, 2], [9, 3, 3, 3], [7, 9, 5], [2, 8]]
    pieces = [*segments, [3, 3, 7, 40, 40], [40, 41]]
    df = {t: sum(t in segment for segment in segments) for t in {t for segment in segments for t in segment}}
    vocabulary = sorted(df)
    expected = []
    for piece in pieces:
        row = [(1 + math.log(piece.count(t))) * math.log(5 / (1 + df[t])) if t in piece else 0.0 for t in vocabulary]
        norm = math.sqrt(sum(v * v for v in row))
        expected.append([v / norm if norm else 0.0 for v in row])
    space, points = TfidfSpace.fit(None, segments)
    assert space.tokens.tolist() == vocabulary and space.dim == len(vocabulary)
    torch.testing.assert_close(torch.cat([points, space.points(None, pieces[4:])]), torch.tensor(expected))
    again = space_from_state(json.loads(json.dumps(space.state())))  # as a session file carries it
    assert torch.equal(again.points(None, pieces), space.points(None, pieces))


def test_tfidf_routes_the_task_questions_to_their_facts_episode(tokenizer):
    """TF-IDF needs no model weights, so the real tokenizer shows what it does on the long-conversation task: the
    question names its topic's words, and the episode holding the asked fact is the one it reaches."""
    method = EpiCache(ratio=0.75)
    hits = 0
    for index, depth in enumerate((0.1667, 0.5, 0.8333, 0.1667, 0.5, 0.8333)):
        sample = build_sample("conversation", tokenizer, 4096, depth=depth, index=index)
        ids = [token for part in format_prompt(tokenizer, sample, True) for token in part]
        plan = plan_conversation(ids, tokenizer, method.utterances, method.window)
        space, _, labels, centroids = method.cluster(None, [ids[a:b] for a, b in plan.segments])
        fact = next(i for i, (a, b) in enumerate(plan.segments) if sample.answers[0] in tokenizer.decode(ids[a : b + 12]))
        hits += route(space.points(None, [ids[plan.question_start :]])[0], centroids) == int(labels[fact])
    assert hits >= 5  # chance is 1 in 4


def test_kmeans_finds_the_least_inertia_partition():
    """Against every assignment of 7 points to 3 clusters (the partition of least inertia)."""
    points = torch.nn.functional.normalize(torch.randn(7, 5, generator=torch.Generator().manual_seed(3)), dim=-1)

    def inertia(labels) -> float:
        total = 0.0
        for j in set(labels):
            members = points[[i for i, label in enumerate(labels) if label == j]]
            total += float(((members - members.mean(dim=0)) ** 2).sum())
        return total

    best = min(itertools.product(range(3), repeat=7), key=inertia)
    labels, centroids = kmeans(points, 3)
    assert inertia(labels.tolist()) == pytest.approx(inertia(best), abs=1e-9)
    groups = lambda labels: sorted(sorted(i for i in range(7) if labels[i] == j) for j in set(labels))  # noqa: E731
    assert groups(labels.tolist()) == groups(best)
    for j in range(3):
        torch.testing.assert_close(centroids[j], points[labels == j].mean(dim=0).float())


def test_route_picks_the_largest_dot_product():
    generator = torch.Generator().manual_seed(4)
    centroids, query = torch.randn(5, 7, generator=generator), torch.randn(7, generator=generator)
    dots = [sum(float(a) * float(b) for a, b in zip(centroid, query)) for centroid in centroids]
    assert route(query, centroids) == dots.index(max(dots))


# -- block-wise eviction -------------------------------------------------------------------------
def held_positions(layer) -> list[list[int]]:
    """The positions a layer holds per KV head (batch row 0): its ragged segments, then its dense store's."""
    heads = [[] for _ in range(layer.store.keys.shape[1] if not layer.parts else layer.parts[0].kv_heads)]
    for part in layer.parts_of(RaggedKV):
        for head, (a, b) in enumerate(itertools.pairwise(part.offsets[: len(heads) + 1].tolist())):
            heads[head] += part.positions[a:b].tolist()
    if not layer.store.is_empty:
        for head, row in enumerate(layer.store.positions[0].tolist()):
            heads[head] += row
    return heads


def head_mask(visible: torch.Tensor) -> torch.Tensor:
    """An additive eager-attention mask from ``visible [query heads, queries, keys]``."""
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None]


def reference_kept(model, tokenizer, ids: list[int], method: EpiCache) -> list[list[int]]:
    """Positions a one-layer model keeps per KV head: routing and the patched prompt written out, then each block
    scored by an eager forward whose mask lets the patched prompt see, in each KV head's query heads, only that
    head's retained tokens, the block and itself (the history's keys see their whole past, as the one lossless
    prefill computed them); ``level=pair`` ranks the heads' candidates together."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    kv_heads = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv_heads
    n = len(ids)
    plan = plan_conversation(ids, tokenizer, method.utterances, method.window)
    history = plan.question_start
    budget = int(n * (1 - method.ratio)) - (n - history)
    space, points = SPACES[method.embedding].fit(model, [ids[a:b] for a, b in plan.segments])  # each space's own test
    labels, centroids = kmeans(points, method.episodes)
    query = space.points(model, [ids[history:]])[0]
    dots = [float(centroid @ query) for centroid in centroids]
    episode = dots.index(max(dots))
    members = [i for i in range(len(plan.segments)) if labels[i] == episode]
    nearest = sorted(members, key=lambda i: -float(points[i] @ centroids[episode]))[: method.medoids]
    patched, room = [], method.patch
    for i in nearest:
        if room <= 0:
            break
        a, b = plan.segments[i]
        patched.append((i, ids[a : min(b, a + room)]))
        room -= b - a
    prompt = tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"] + [t for _, p in sorted(patched) for t in p]
    kept: list[list[int]] = [[] for _ in range(kv_heads)]
    for start in range(0, history, method.block):
        stop = min(start + method.block, history)
        candidates = [held + list(range(start, stop)) for held in kept]
        counts = [len(c) for c in candidates]
        if (max(counts) <= budget) if method.level == "pair-uniform" else (sum(counts) <= budget * kv_heads):
            kept = candidates
            continue
        total = stop + len(prompt)
        visible = torch.ones(kv_heads * group, total, total).tril().bool()
        visible[:, stop:, :stop] = False
        for head in range(kv_heads):
            visible[head * group : (head + 1) * group, stop:, candidates[head]] = True
        with torch.no_grad():
            attention = eager(torch.tensor([ids[:stop] + prompt]), attention_mask=head_mask(visible),
                              output_attentions=True, logits_to_keep=1).attentions[0]  # fmt: skip
        scored = [(float(score), head, position) for head in range(kv_heads)
                  for score, position in zip(attention[0, head * group : (head + 1) * group, stop:][..., candidates[head]]
                                             .amax(dim=(0, 1)).tolist(), candidates[head])]  # fmt: skip
        if method.level == "pair-uniform":
            winners = [entry for head in range(kv_heads)
                       for entry in sorted((e for e in scored if e[1] == head), reverse=True)[:budget]]  # fmt: skip
        else:
            winners = sorted(scored, reverse=True)[: budget * kv_heads]
        kept = [sorted(position for _, h, position in winners if h == head) for head in range(kv_heads)]
    return [held + list(range(history, n)) for held in kept]


@pytest.mark.parametrize(
    "block, embedding, kv_heads, level",
    [(256, "tfidf", 1, "pair"), (5000, "tfidf", 1, "pair"), (256, "states", 1, "pair"), (256, "tfidf", 2, "pair"),
     (256, "tfidf", 2, "pair-uniform"), (256, "tfidf", 2, "global")],
)  # fmt: skip
def test_kept_tokens_match_the_slow_reference(tokenizer, block, embedding, kv_heads, level):
    model = tiny(tokenizer, layers=1, kv_heads=kv_heads, seed=2)
    ids = conversation(tokenizer, depth=0.2)[:-1]
    method = EpiCache(ratio=0.75, episodes=3, utterances=2, medoids=3, block=block, patch=200, embedding=embedding,
                      level=level)  # fmt: skip
    cache = kvopt.cache([method], model)
    cache.prefill(model, torch.tensor([ids]), tokenizer=tokenizer)
    (layer,) = cache.layers
    kept = reference_kept(model, tokenizer, ids, method)
    assert held_positions(layer) == kept
    if kv_heads > 1 and level != "pair-uniform":
        assert len({len(head) for head in kept}) > 1  # the heads shared the budget unequally
    assert layer.seen == len(ids) and not layer.store.has_extra("kvzip")
    # Decoding reads exactly the kept tokens: the next token's logits are an eager forward's that sees only them.
    following = tokenizer(" The", add_special_tokens=False)["input_ids"]
    assert len(following) == 1
    with torch.no_grad():
        logits = model(torch.tensor([following]), **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    total = len(ids) + 1
    visible = torch.ones(model.config.num_attention_heads, total, total).tril().bool()  # earlier rows: causal
    visible[:, -1] = False
    group = model.config.num_attention_heads // kv_heads
    for head in range(kv_heads):
        visible[head * group : (head + 1) * group, -1, kept[head] + [len(ids)]] = True
    with torch.no_grad():
        expected = eager(torch.tensor([ids + following]), attention_mask=head_mask(visible)).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("level", ["pair", "pair-uniform", "global"])
def test_bytes_drop_to_the_budget_and_match_snapkv(tokenizer, tiny_with_tokenizer, level):
    """Every layer holds the budget per KV head (question included; ``pair``: on average over its heads, which
    choose their own counts; ``global``: on average over every layer's heads), nothing of the patched prompt; the
    bytes are those of its tokens and their positions (and the ragged segments' offsets), as snapkv's at the same
    budget, under a third of full's."""
    model = tiny_with_tokenizer[0]
    ids = torch.tensor([conversation(tokenizer, depth=0.9)])
    held = {}
    for spec in ("full", "snapkv:budget=300", f"epicache:budget=300,block=512,level={level}"):
        cache = kvopt.cache(spec, model)
        with torch.no_grad():
            cache.prefill(model, ids, tokenizer=tokenizer)
        held[spec] = cache
    epi = held[f"epicache:budget=300,block=512,level={level}"]
    config = model.config
    heads = config.num_key_value_heads
    held_per_layer = []
    for layer in epi.layers:
        positions = held_positions(layer)
        held_per_layer.append(sum(map(len, positions)))
        assert max(map(max, positions)) < ids.shape[1]
        assert len({tuple(head) for head in positions}) == heads  # heads choose their own
        assert level != "pair-uniform" or {len(head) for head in positions} == {300}
    assert sum(held_per_layer) == 300 * heads * config.num_hidden_layers
    assert level == "global" or set(held_per_layer) == {300 * heads}
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = heads * (2 * head_dim * 4 + 4)  # fp32 keys and values, int32 positions
    offsets = 0 if level == "pair-uniform" else (heads + 1) * 8  # int64, one per ragged segment and one more
    assert epi.nbytes() == config.num_hidden_layers * (300 * per_token + offsets)
    assert epi.nbytes() <= held["snapkv:budget=300"].nbytes() < held["full"].nbytes() / 3  # snapkv: ~3% room to grow


@pytest.mark.parametrize("budgets", ["pyramid", "xkv"])
def test_layers_share_the_budget_by_the_allocator(tokenizer, budgets):
    """budgets=pyramid|xkv: each layer keeps what :mod:`kvopt.methods.budgets` allocates it (question included),
    the same total as uniform; xkv reads measured curves (set here as a calibration would)."""
    model = tiny(tokenizer, layers=4, kv_heads=2)
    ids = conversation(tokenizer, depth=0.5)[:-1]
    method = EpiCache(ratio=0.75, block=512, window=48, budgets=budgets, beta=4, level="pair")
    if budgets == "xkv":  # concave retention curves, one layer's attention far more spread than the others'
        gains = torch.linspace(1, 0, 64, dtype=torch.float64)[None] ** torch.tensor([[1.0], [4.0], [8.0], [16.0]])
        curves = torch.cat([torch.zeros(4, 1, dtype=torch.float64), gains.cumsum(-1)], -1)
        method.retention = curves / curves[:, -1:]
    cache = kvopt.cache([method], model)
    cache.prefill(model, torch.tensor([ids]), tokenizer=tokenizer)
    uniform = int(len(ids) * 0.25)
    expected = [method.layer_budget(uniform, len(ids), index, 4) for index in range(4)]
    assert [sum(map(len, held_positions(layer))) // 2 for layer in cache.layers] == expected
    assert sum(expected) == 4 * uniform and len(set(expected)) > 1
    uniform_cache = kvopt.cache("epicache:ratio=0.75,block=512,window=48,level=pair", model)
    uniform_cache.prefill(model, torch.tensor([ids]), tokenizer=tokenizer)
    assert cache.nbytes() == uniform_cache.nbytes()


# -- the engine -------------------------------------------------------------------------------------
def generate_with_cache(model, tokenizer, spec: str, prompt: list[int], new_tokens: int = 8) -> list[int]:
    cache = kvopt.cache(spec, model)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        cache.prefill(model, ids[:, :-1], tokenizer=tokenizer)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return output[0, len(prompt) :].tolist()


def test_engine_outputs_equal_generate(tokenizer, tiny_with_tokenizer):
    model = tiny_with_tokenizer[0]
    spec = "epicache:ratio=0.75,block=256,episodes=3"
    prompts = [conversation(tokenizer, 1024, depth, index) for index, depth in enumerate((0.1, 0.5, 0.9))]
    llm = LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_method=spec, kv_memory="8MB", max_num_batched_tokens=96)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [out.error for out in outputs] == [None] * 3
    assert [out.outputs[0].token_ids for out in outputs] == [generate_with_cache(model, tokenizer, spec, p) for p in prompts]
    assert llm.metrics()["kv_blocks_used"] == 0


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, message",
    [
        ("epicache:budget=300,episodes=0", "episodes=0 must be >= 1"),
        ("epicache:budget=300,block=8", "block=8 must be >= 16"),
        ("epicache:budget=300,utterances=0", "utterances=0 must be >= 1"),
        ("epicache:episodes=4", "give exactly one of ratio"),
        ("epicache:ratio=0.75,embedding=bert", "embedding='bert' is not a segment space; use one of tfidf, states"),
        ("epicache:ratio=0.75,level=head", "level='head' is not a budget level; use one of global, pair, pair-uniform"),
        ("epicache:ratio=0.75,budgets=xkv", "ranks every layer's tokens together, so budgets=xkv has no layer shares"),
    ],
)
def test_bad_parameters_are_one_line(tiny_with_tokenizer, spec, message):
    with pytest.raises(MethodParameterError, match=message) as error:
        kvopt.cache(spec, tiny_with_tokenizer[0])
    assert "\n" not in str(error.value)


def test_sliding_window_models_are_refused():
    from tiny_models import tiny_model

    with pytest.raises(MethodParameterError, match="sliding-window layers") as error:
        kvopt.cache("epicache:ratio=0.5", tiny_model("mistral"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("problem", ["batch", "no tokenizer"])
def test_bad_use_is_one_line(tokenizer, tiny_with_tokenizer, problem):
    model = tiny_with_tokenizer[0]
    ids = torch.tensor([conversation(tokenizer, 1024)])
    kwargs = {"tokenizer": tokenizer}
    if problem == "batch":
        ids = ids.expand(2, -1)
    else:
        kwargs = {}
    with pytest.raises(CacheUsageError) as error:
        kvopt.cache("epicache:ratio=0.75", model).prefill(model, ids, **kwargs)
    assert "\n" not in str(error.value) and "epicache" in str(error.value)


@pytest.mark.parametrize("ratio", [0.99, 0.5])
def test_short_budgets_keep_the_question_end_within_the_budget(tokenizer, tiny_with_tokenizer, ratio):
    """A budget under the question keeps the question's last tokens only; a prompt under the window still
    compresses to its share (never more than the budget held)."""
    model = tiny_with_tokenizer[0]
    ids = conversation(tokenizer, 1024)[:-1] if ratio == 0.99 else conversation(tokenizer, 1024)[-60:]
    cache = kvopt.cache(f"epicache:ratio={ratio}", model)
    cache.prefill(model, torch.tensor([ids]), tokenizer=tokenizer)
    keep = int(len(ids) * (1 - ratio))
    for layer in cache.layers:
        assert held_positions(layer) == [list(range(len(ids) - keep, len(ids)))] * 2
