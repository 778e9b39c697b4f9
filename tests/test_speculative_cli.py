"""``kvopt generate --speculate``: the answer and a stats line; a bad spec is one line, exit code 2."""

from __future__ import annotations

from test_cli import run_cli
from typer.testing import CliRunner

from kvopt.cli.main import app


def test_generate_with_speculation_prints_its_statistics(tiny_with_tokenizer, tmp_path):
    model, tokenizer = tiny_with_tokenizer
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    args = ["generate", "one two three one two three one two", "--model", str(tmp_path), "--no-chat"]
    result = CliRunner().invoke(app, [*args, "--speculate", "prompt_lookup:k=3", "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert "[full | prompt_lookup:k=3] prompt" in result.output
    assert "proposed" in result.output and "per verification" in result.output


def test_a_bad_speculation_spec_fails_before_loading_the_model():
    result = run_cli("generate", "hi", "--speculate", "prompt_lookup:k=0", "--model", "/no/such/model")
    assert result.returncode == 2
    assert "prompt_lookup: k=0" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_generate_runs_on_the_device_named(tiny_with_tokenizer, tmp_path):
    """``--device cpu`` and the default ``auto`` (the CPU where there is no accelerator) answer alike."""
    model, tokenizer = tiny_with_tokenizer
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    args = ["generate", "one two three one two", "--model", str(tmp_path), "--no-chat", "--max-new-tokens", "6"]
    results = [CliRunner().invoke(app, [*args, *device]) for device in ([], ["--device", "cpu"])]
    assert all(result.exit_code == 0 for result in results), [result.output for result in results]
    assert results[0].output.splitlines()[0] == results[1].output.splitlines()[0]
