"""``kvopt recommend`` (kvopt.eval.recommend): every printed spec fits by ``kvopt memory``'s own numbers, the ranking
follows the rows it cites, ``--prompts`` ranks by agreement with full (resumably), and bad input is one line, exit 2.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
from typer.testing import CliRunner

from kvopt.cli.main import app, main
from kvopt.errors import KVOptError
from kvopt.eval import recommend as module
from kvopt.eval.report import Retention
from kvopt.eval.recommend import measured_rows, recommend
from kvopt.eval.report import retention

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


def memory_cli_bytes(spec: str, context: int, batch: int) -> int:
    """What ``kvopt memory --method SPEC`` prints as the spec's theoretical bytes (default model, float16)."""
    result = runner.invoke(app, ["memory", "--seq-len", str(context), "--batch", str(batch), "--method", spec])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "(theoretical)" in line)
    return int(re.search(r"([\d,]{4,})", line.split("(theoretical)")[1]).group(1).replace(",", ""))


def test_every_listed_spec_fits_by_the_memory_command():
    found = recommend("60MB", 4096, batch=2)
    assert found.model == "SmolLM2-135M-Instruct" and found.measured_on == found.model and found.nearest is None
    assert len(found.candidates) > 5
    for candidate in found.candidates:
        assert candidate.kv_bytes <= 60_000_000
        assert candidate.kv_bytes == memory_cli_bytes(candidate.spec, 4096, 2), candidate.spec
    assert "full" not in [c.spec for c in found.candidates]  # 4096 x 2 full tokens need 188 MB


def test_ranking_follows_the_cited_rows():
    found = recommend("1GB", 4096, quality=0.9)
    rows = [r for r in measured_rows(module.RESULTS)["smollm2-135m-instruct"] if r["length"] <= 4096]
    by_spec: dict[str, list] = {}
    for row in rows:
        by_spec.setdefault(row["method"], []).append(row)
    qualities = []
    for candidate in found.candidates:
        expected = None if candidate.spec == "full" else retention(by_spec[candidate.spec], by_spec["full"])
        assert candidate.kept == expected
        qualities.append((-candidate.quality, candidate.kv_bytes))
    assert qualities == sorted(qualities)
    assert found.choice == next(c for c in found.candidates if c.quality >= 0.9)
    assert found.serve_command() == (f"kvopt serve --kv-method {shlex.quote(found.choice.spec)} --kv-memory 1000000000 "
                                     "--max-model-len 4096 --max-num-seqs 1")  # fmt: skip


# -- a tiny model with rows of its own --------------------------------------------------------------


def write_rows(folder, label: str, scores: dict[str, list[float]]) -> None:
    """Synthetic committed rows: per spec, one score per prompt (niah at 256 tokens, depths 0..n-1)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "eval.jsonl").open("w") as out:
        for spec, values in scores.items():
            for depth, score in enumerate(values):
                row = {"task": "niah", "length": 256, "depth": depth, "sample": 0, "seed": 0, "mode": "query_agnostic",
                       "method": spec, "family": "kvopt", "model": label, "score": score, "decode_tok_s": 10.0}  # fmt: skip
                out.write(json.dumps(row) + "\n")


SCORES = {"full": [1, 1, 1, 1], "snapkv:ratio=0.9,window=4": [1, 0, 0, 0], "window:ratio=0.75": [1, 1, 0, 0]}


def test_prompts_rank_full_first_and_resume(model_folder, tmp_path, monkeypatch):
    write_rows(tmp_path / "results", str(model_folder), SCORES)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun near the old barn. "
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}: " + text * (2 + i)}) + "\n" for i in range(4))
                       + json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")  # fmt: skip
    calls = []
    kwargs = dict(model=str(model_folder), prompts=prompts, results=tmp_path / "results", top=2, max_tokens=6,
                  progress=lambda done, total, spec: calls.append((done, total)))  # fmt: skip
    found = recommend("1MB", 256, **kwargs)
    assert found.candidates[0].spec == "full" and found.candidates[0].quality == 1.0
    assert found.choice.spec == "full"
    ran = [c for c in found.candidates if c.agreement is not None]
    assert len(ran) == 3 and all(c.agreement.prompts == 5 for c in ran)
    assert [c.quality for c in found.candidates[1:]] == sorted([c.quality for c in found.candidates[1:]], reverse=True)
    assert calls[-1] == (15, 15)
    stored = (tmp_path / "mine.recommend.jsonl").read_text().splitlines()
    assert len(stored) == 15
    # A rerun reads the stored answers: no model is loaded, the same ranking comes back.
    monkeypatch.setattr("kvopt.api.load_model", lambda *a, **k: pytest.fail("answers were computed again"))
    again = recommend("1MB", 256, **kwargs)
    assert [(c.spec, c.agreement) for c in again.candidates] == [(c.spec, c.agreement) for c in found.candidates]
    # The command prints the same, from the stored answers, ending with the spec to use and its serve line.
    result = runner.invoke(app, ["recommend", "--memory", "1MB", "--context", "256", "--model", str(model_folder),
                                 "--prompts", str(prompts), "--results", str(tmp_path / "results"), "--top", "2",
                                 "--max-tokens", "6"], terminal_width=200)  # fmt: skip
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-2:]
    assert last[0].startswith("use: full (100% [")
    assert last[1] == f"kvopt serve --model {model_folder} --kv-method full --kv-memory 1000000 --max-model-len 256 --max-num-seqs 1"


def test_prompts_take_full_as_the_reference_when_it_does_not_fit(model_folder, tmp_path):
    """A budget too small for ``full``: it still answers every prompt (the reference), and only the candidates that
    fit are ranked by agreement with it (was a KeyError)."""
    write_rows(tmp_path / "results", str(model_folder), SCORES)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}: the cat sleeps in the warm sun near the old barn. " * 6})
                               + "\n" for i in range(3)))  # fmt: skip
    full = recommend("1GB", 256, model=str(model_folder), results=tmp_path / "results").candidates
    squeezed = min(c.kv_bytes for c in full if c.spec != "full")
    found = recommend(squeezed, 256, model=str(model_folder), prompts=prompts, results=tmp_path / "results", top=1,
                      max_tokens=4)  # fmt: skip
    assert "full" not in [c.spec for c in found.candidates]
    ran = [c for c in found.candidates if c.agreement is not None]
    assert len(ran) == 1 and ran[0].agreement.prompts == 3
    stored = [json.loads(line)["spec"] for line in (tmp_path / "mine.recommend.jsonl").read_text().splitlines()]
    assert stored.count("full") == 3 and stored.count(ran[0].spec) == 3


def test_with_prompts_only_a_candidate_checked_on_them_is_chosen():
    """Checked candidates below the floor are not passed over for one the prompts never saw (its grid share meets
    the floor): nothing is chosen, and the no-fit message names the best checked one."""
    grid = Retention(prompts=10, answered=10, accuracy=0.95, reference_accuracy=1.0, kept=0.95, low=0.7, high=0.99)
    checked = module.Candidate("kivi", 10, grid, None, None, module.Agreement(prompts=20, same=7, prefix=0.5))
    unchecked = module.Candidate("mixedkv", 20, grid, None, None)
    found = module.Recommendation("m", 64, 1024, 8, 0.9, "float16", "m", None, "rows", (checked, unchecked), "p.jsonl")
    assert found.choice is None and found.serve_command() is None
    without_prompts = module.Recommendation("m", 64, 1024, 8, 0.9, "float16", "m", None, "rows", (unchecked,))
    assert without_prompts.choice is unchecked


def test_nearest_measured_model_is_said(model_folder, tmp_path):
    other = tmp_path / "sibling"
    shutil.copytree(model_folder, other)
    write_rows(tmp_path / "results", str(model_folder), SCORES)
    found = recommend("1MB", 256, model=str(other), results=tmp_path / "results")
    assert found.measured_on == str(model_folder)
    assert found.nearest == f"{other} has no measured rows; ranked on the nearest measured llama model, {model_folder}"
    assert [c.spec for c in found.candidates][:2] == ["full", "window:ratio=0.75"]


# -- bad input: one line each, exit 2 ---------------------------------------------------------------


def run_cli(monkeypatch, capsys, *args: str) -> str:
    monkeypatch.setattr("sys.argv", ["kvopt", "recommend", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_is_one_line(monkeypatch, capsys, tmp_path):
    assert "--quality 1.5 is outside (0, 1]" in run_cli(monkeypatch, capsys, "--memory", "1GB", "--context", "2048", "--quality", "1.5")
    assert "--quality 0.0 is outside (0, 1]" in run_cli(monkeypatch, capsys, "--memory", "1GB", "--context", "2048", "--quality", "0")
    assert "--context 100000 is beyond SmolLM2-135M-Instruct's 8192 positions; give at most 8192" in run_cli(
        monkeypatch, capsys, "--memory", "1GB", "--context", "100000"
    )
    line = run_cli(monkeypatch, capsys, "--memory", "100kB", "--context", "4096")
    assert re.search(r"--memory 100.00 kB fits no spec at 4096 tokens x batch 1: the smallest, \S+, needs", line)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n{"text": "no prompt"}\n\n{"prompt": "fine too"}\n')
    line = run_cli(monkeypatch, capsys, "--memory", "1GB", "--context", "2048", "--prompts", str(bad))
    assert "lines 2, 3 not a JSON object" in line and "(nothing was run)" in line
    assert not (tmp_path / "bad.recommend.jsonl").exists()


def test_unmeasured_model_type_offers_prompts(model_folder, tmp_path):
    other = tmp_path / "qwen-like"
    shutil.copytree(model_folder, other)
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (other / "config.json").write_text(json.dumps(config))
    write_rows(tmp_path / "results", str(model_folder), SCORES)
    with pytest.raises(KVOptError, match=r"has no measured rows, nor does a measured model of its type \(qwen2; .*--prompts my.jsonl"):
        recommend("1MB", 256, model=str(other), results=tmp_path / "results")
