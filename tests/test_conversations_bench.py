"""benchmarks/conversations.py: the specs hold the same bytes per compression, the section pairs each method with
full on the same prompts and says whether #40's targets hold, and a step's rows replace only that model's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import conversations  # noqa: E402


def test_every_compressed_spec_parses_and_names_its_ratio():
    from kvopt.methods import parse

    specs = conversations.conversation_specs()
    assert conversations.with_ratio("epicache:budgets=xkv", 0.75) == "epicache:ratio=0.75,budgets=xkv"
    for spec in specs[1:]:
        (method,) = parse(spec)
        assert method.ratio in conversations.COMPRESSIONS.values()
    assert [m.budgets for spec in conversations.xkv_specs()[1:] for m in parse(spec)] == ["uniform", "pyramid", "xkv"] * 4
    assert conversations.canonical("snapkv:ratio=0.9,budgets=uniform") == "snapkv:ratio=0.9"  # as rows name it


def row(model, step, method, depth, score, sample=0, ratio=None, task="conversation"):
    return {"model": model, "step": step, "task": task, "length": 4096, "depth": depth, "sample": sample, "seed": 0,
            "mode": "query_aware", "method": method, "ratio": ratio, "score": score, "kv_bytes_peak": 4e6,
            "conditions": "one thread"}  # fmt: skip


def test_the_conversation_table_pairs_with_full_and_states_the_targets():
    rows = []
    for depth, full, epi, snap in ((0.1667, 1, 1, 0), (0.5, 1, 1, 1), (0.8333, 0, 1, 0)):
        rows += [row("m", "conversation", "full", depth, full),
                 row("m", "conversation", "epicache:ratio=0.75", depth, epi, ratio=0.75),
                 row("m", "conversation", "snapkv:ratio=0.75", depth, snap, ratio=0.75),
                 row("m", "conversation", "epicache:ratio=0.8333", depth, snap, ratio=0.8333),
                 row("m", "conversation", "snapkv:ratio=0.8333", depth, 0, ratio=0.8333)]  # fmt: skip
    text = conversations.render(rows)
    assert "### m: questions about an early, middle or late topic" in text
    assert "| early topic answered | middle topic answered | late topic answered |" in text
    # epicache answers the late topic full misses: no credit for it (kept 2 of full's 2)
    assert "| 4x | `epicache:ratio=0.75` | 100% [44–100] (n=3) | 100% [34–100] of 2 | 1/1 | 1/1 | 1/1 | 4.0 |" in text
    assert "| 4x | `snapkv:ratio=0.75` | 33% [6–79] (n=3) | 50% [9–91] of 2 | 0/1 | 1/1 | 0/1 | 4.0 |" in text
    assert "keeps 100% of `full`'s answers (target ≥ 90%: not judged yet: 3 of 24 conversations)" in text
    assert "`snapkv:ratio=0.75`, keeps 50%: a lead of +50 points" in text
    assert "6x: the better epicache (`epicache:ratio=0.8333`) keeps 50%" in text
    assert "a lead of +50 points (target ≥ +10: not judged yet: 3 of 24 conversations)" in text
    # a complete cell (24 conversations, each repeated here 8 times) is judged
    complete = conversations.render([{**r, "sample": sample} for r in rows for sample in range(8)])
    assert "(target ≥ 90%: holds)" in complete and "(target ≥ +10: holds)" in complete


def test_the_xkv_table_compares_budgets_at_the_same_ratio():
    rows = [row("q", "xkv", "full", 0.5, 1, sample=s, task="niah") for s in range(4)]
    for spec, scores in (("snapkv:ratio=0.9", (1, 1, 0, 0)), ("snapkv:ratio=0.9,budgets=pyramid", (1, 0, 0, 0)),
                         ("snapkv:ratio=0.9,budgets=xkv", (1, 1, 1, 0))):  # as the harness names them
        rows += [row("q", "xkv", spec, 0.5, score, sample=s, ratio=0.9, task="niah")
                 for s, score in enumerate(scores)]  # fmt: skip
    text = conversations.render(rows)
    assert "| SnapKV's scoring (last 64 queries, average pooling over 5) | 90% | `xkv` | 75% [30–95] (n=4) | 75% [30–95] of 4 |" in text
    assert "| SnapKV's scoring (last 64 queries, average pooling over 5) | 90% | `uniform` | 50% [15–85] (n=4) |" in text
    assert "average pooling over 5), 90% removed: `xkv` +25 points of accuracy against `uniform` (target ≥ +5: holds)." in text


def test_a_finished_step_replaces_only_its_own_model_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(conversations, "ROWS", tmp_path / "rows.jsonl")
    monkeypatch.setattr(conversations, "WORK", tmp_path / "work")
    conversations.ROWS.write_text("".join(json.dumps(r) + "\n" for r in (
        row("a", "xkv", "full", 0.5, 1), row("b", "xkv", "full", 0.5, 0), row("a", "conversation", "full", 0.5, 1))))
    work = conversations.work_file("a", "xkv")
    work.parent.mkdir(parents=True)
    fresh = {k: v for k, v in row("a", "xkv", "full", 0.5, 0, sample=1).items() if k not in ("step", "conditions")}
    work.write_text(json.dumps(fresh) + "\n")
    conversations.merge("a", "xkv")
    rows = [json.loads(line) for line in conversations.ROWS.read_text().splitlines()]
    assert [(r["model"], r["step"], r["sample"]) for r in rows] == [("b", "xkv", 0), ("a", "conversation", 0), ("a", "xkv", 1)]
    assert rows[-1]["conditions"] == conversations.CONDITIONS and rows[-1]["date"]


def test_a_fresh_machine_resumes_a_step_from_its_committed_rows(tmp_path, monkeypatch):
    from kvopt.eval.runner import load_done, row_key

    monkeypatch.setattr(conversations, "ROWS", tmp_path / "rows.jsonl")
    monkeypatch.setattr(conversations, "WORK", tmp_path / "work")
    committed = [row("a", "conversation", "full", 0.5, 1), row("a", "xkv", "full", 0.5, 0), row("b", "conversation", "full", 0.5, 0)]
    conversations.ROWS.write_text("".join(json.dumps(r) + "\n" for r in committed))
    conversations.seed("a", "conversation")
    work = conversations.work_file("a", "conversation")
    assert load_done(work) == {row_key(committed[0])}  # only this model's and step's rows, as the harness keys them
    assert "step" not in json.loads(work.read_text())
    work.write_text("")  # a working file already there is the newer record: left alone
    conversations.seed("a", "conversation")
    assert work.read_text() == ""


def test_the_routing_table_counts_questions_sent_to_their_facts_episode():
    rows = [{"model": "m", "step": "routing", "method": "epicache", "length": 4096, "depth": 0.5, "sample": s,
             "segments": 10, "episodes": 4, "routed": routed, "fact_episode": 1, "conditions": "one thread"}
            for s, routed in enumerate((1, 0, 2, 1))]  # fmt: skip
    text = conversations.render(rows)
    assert "### m: does `epicache` send the question to its fact's episode?" in text
    assert "| `epicache` | 4 | 10 | 4 | 2/4 = 50% [15–85] | 25% |" in text
