"""``kvopt batch``: a JSONL file through the engine; every bad line is one error line and exit code 2."""

import json
import sys

import pytest

from kvopt.cli.main import main


def run(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["kvopt", "batch", *args])
    try:
        main()
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


def test_batch_writes_one_result_per_line_in_order(model_folder, tmp_path, monkeypatch, capsys):
    system = {"role": "system", "content": "You answer briefly."}
    lines = [
        {"custom_id": "chat", "body": {"messages": [system, {"role": "user", "content": "Hi"}], "max_tokens": 5}},
        {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True, "logprobs": 1},
        {"prompt": "Once upon a time", "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 4, "ignore_eos": True},
        {"prompt": " hello" * 2500, "max_tokens": 4},  # longer than the context (2048 positions): fails alone
        {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True, "kv_method": "kivi:bits=4"},
        {"prompt": "Hi there", "kv_method": "kvzip:ratio=0.5", "max_tokens": 3},  # in its own cache
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    out = tmp_path / "out.jsonl"
    code, stderr = run([str(source), "-o", str(out), "--model", str(model_folder), "--kv-memory", "8MB"],
                       monkeypatch, capsys)  # fmt: skip
    assert code == 0, stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat", "line-2", "line-3", "line-4", "line-5", "line-6"]
    assert results[1]["response"]["usage"]["completion_tokens"] == 6
    assert len(results[1]["response"]["choices"][0]["logprobs"]) == 6
    assert [c["index"] for c in results[2]["response"]["choices"]] == [0, 1]
    assert results[3]["response"] is None and "shorten the prompt" in results[3]["error"]
    assert results[4]["response"]["usage"]["completion_tokens"] == 6  # its own method, a short prompt: lossless
    assert results[4]["response"]["choices"][0]["text"] == results[1]["response"]["choices"][0]["text"]
    assert results[5]["response"]["usage"]["completion_tokens"] == 3
    assert "prefix_cache_queries_total" in stderr and "wrote 6 results" in stderr


def test_batch_with_speculation_writes_what_plain_decoding_gives(model_folder, tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"{words} {words}", "max_tokens": 12, "ignore_eos": True}) + "\n"
                              for words in ("one two three four", "red green blue")))  # fmt: skip
    texts = {}
    for name, extra in (("plain", []), ("drafted", ["--speculate", "prompt_lookup:k=3,ngram=2"])):
        out = tmp_path / f"{name}.jsonl"
        code, stderr = run([str(source), "-o", str(out), "--model", str(model_folder), "--kv-memory", "8MB", *extra],
                           monkeypatch, capsys)  # fmt: skip
        assert code == 0, stderr
        texts[name] = [json.loads(line)["response"]["choices"][0]["text"] for line in out.read_text().splitlines()]
    assert texts["drafted"] == texts["plain"]
    assert "spec_decode_num_accepted_tokens_total" in stderr
    code, stderr = run([str(source), "-o", str(tmp_path / "x.jsonl"), "--model", str(model_folder), "--speculate",
                        "draft:model=x"], monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "the engine drafts with prompt_lookup" in stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json\n", "in.jsonl:1: not valid JSON"),
        ('{"max_tokens": 3}\n', "give exactly one of \"prompt\""),
        ('{"prompt": "a", "messages": []}\n', "give exactly one of \"prompt\""),
        ('{"prompt": "a", "temprature": 0.5}\n', "in.jsonl:1: unknown field 'temprature'"),
        ('{"prompt": "a", "max_tokens": 0}\n', "in.jsonl:1: max_tokens: input should be greater than or equal to 1"),
        ('{"prompt": "a", "top_p": 2}\n', "in.jsonl:1: top_p: input should be less than or equal to 1"),
        ('{"prompt": 5}\n', "in.jsonl:1: prompt: must be a string or a list of token ids"),
        ("[1, 2]\n", "expected a JSON object"),
        ("\n\n", "holds no requests"),
    ],
)
def test_bad_lines_exit_2_with_one_line(content, fragment, tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    code, stderr = run([str(source), "-o", str(tmp_path / "out.jsonl")], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and fragment in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("target", ["missing/out.jsonl", "."])
def test_unwritable_output_is_refused_before_loading(target, tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n')
    code, stderr = run([str(source), "-o", str(tmp_path / target)], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "--output" in stderr, stderr
