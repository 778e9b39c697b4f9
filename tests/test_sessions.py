"""Sessions: ``kvopt.save_cache`` / ``kvopt.load_cache``, and ``kvopt chat --session`` resuming after a restart."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvopt

ROOT = Path(__file__).resolve().parents[1]


def test_save_then_load_cache_continues_the_sequence(tiny_with_tokenizer, tmp_path):
    model, _ = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (1, 50), generator=torch.Generator().manual_seed(3))
    cache = kvopt.cache("window:size=32", model)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache)
        path = kvopt.save_cache(cache, tmp_path / "new folder" / "session.kvc")
        resumed = kvopt.load_cache(path, model)
        expected = model(ids[:, 40:], past_key_values=cache).logits
        logits = model(ids[:, 40:], past_key_values=resumed).logits
    assert torch.equal(logits, expected)
    assert sorted(p.name for p in path.parent.iterdir()) == ["session.kvc"]  # no temporary file left


def test_an_unknown_encoding_is_refused_before_writing(tiny_with_tokenizer, tmp_path):
    model, _ = tiny_with_tokenizer
    cache = kvopt.cache("full", model)
    with pytest.raises(kvopt.KVOptError, match="unknown cache encoding 'zip'.*raw, int8, int4, cachegen"):
        kvopt.save_cache(cache, tmp_path / "x.kvc", encoding="zip")
    assert not list(tmp_path.iterdir())


def chat(folder: Path, sessions: Path, name: str, lines: list[str], *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvopt.cli.main", "chat", "--session", name, "--sessions-dir", str(sessions),
               "--model", str(folder), "--max-new-tokens", "6", *options]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(command, input="".join(f"{line}\n" for line in lines), capture_output=True, text=True, env=env, timeout=300)


TURN = re.compile(r"\[session \S+: (\d+) tokens reused, (\d+) prompt tokens computed, (\d+) generated")


@pytest.mark.parametrize("method", ["full", "snapkv:ratio=0.5+kivi:bits=4"])
def test_chat_resumes_after_a_restart_computing_only_the_new_turn(model_folder, tmp_path, method):
    first = chat(model_folder, tmp_path, "restarted", ["Tell me about the sea."], "--method", method)
    second = chat(model_folder, tmp_path, "restarted", ["And about mountains?"])
    together = chat(model_folder, tmp_path, "one-process", ["Tell me about the sea.", "And about mountains?"], "--method", method)
    for run in (first, second, together):
        assert run.returncode == 0, run.stderr
    assert f"resumed {int(TURN.search(first.stderr)[1]) + int(TURN.search(first.stderr)[2]) + int(TURN.search(first.stderr)[3])} tokens" in second.stderr
    resumed_turn = [int(n) for n in TURN.search(second.stderr).groups()]
    continuous_turn = [int(n) for n in TURN.findall(together.stderr)[1]]
    assert resumed_turn == continuous_turn  # the same work as if the process had never stopped...
    assert resumed_turn[0] > 0 and resumed_turn[1] < resumed_turn[0]  # ...reusing the stored tokens, computing the new turn
    assert first.stdout + second.stdout == together.stdout
    # Both sessions hold the same cache and conversation, byte for byte.
    assert (tmp_path / "restarted.kvc").read_bytes() == (tmp_path / "one-process.kvc").read_bytes()


def test_chat_refuses_another_method_for_a_stored_session(model_folder, tmp_path):
    assert chat(model_folder, tmp_path, "kept", ["Hello"], "--method", "full").returncode == 0
    run = chat(model_folder, tmp_path, "kept", ["Hello again"], "--method", "window:size=64")
    assert run.returncode == 2
    assert "session 'kept' runs 'full'; omit --method or start a new session" in run.stderr
    assert chat(model_folder, tmp_path, "kept", ["Hello again"], "--method", "full").returncode == 0  # its own method


EPISODE_TURN = re.compile(r"(\d+) tokens reused \(episode (\d) of (\d)\), (\d+) prompt tokens computed")


def test_an_epicache_chat_answers_from_episodes_and_resumes_them(model_folder, tmp_path):
    spec = "epicache:ratio=0.5,window=16,episodes=2,utterances=1,block=48"  # as the cache names it
    turns = [f"Tell me about the {topic} number {i}." for i in range(3) for topic in ("river", "hill")]
    first = chat(model_folder, tmp_path, "episodic", turns[:4], "--method", spec)
    assert first.returncode == 0, first.stderr
    built = [int(n) for n in re.findall(r"\[2 episodes built over (\d+) tokens\]", first.stderr)]
    answered = [[int(n) for n in found] for found in EPISODE_TURN.findall(first.stderr)]
    assert built and answered
    assert answered[-1][0] == built[-1]  # a turn reuses its episode's history, computing only the turns after it
    second = chat(model_folder, tmp_path, "episodic", turns[4:])
    assert second.returncode == 0, second.stderr
    assert f"{spec}, from" in second.stderr and EPISODE_TURN.search(second.stderr)
    refused = chat(model_folder, tmp_path, "episodic", turns[:1], "--method", "full")
    assert refused.returncode != 0 and f"runs {spec!r}" in refused.stderr
