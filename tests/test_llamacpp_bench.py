"""benchmarks/llamacpp.py's report: each workload's rows set against kvopt.LLM's fastest run, and a run's rows replace
only rows of the same setting (the bindings are not needed for either)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llamacpp  # noqa: E402


def row(system, weights, kv, parallel, tok_s, **more):
    return {"step": "batched", "system": system, "weights": weights, "kv": kv, "parallel": parallel, "requests": 16,
            "prompt_range": "100-200", "new_tokens": 256, "prompt_tokens": 2638, "seconds": 16 * 256 / tok_s,
            "tok_s": tok_s, "threads": 1, "conditions": "one thread"} | more  # fmt: skip


def test_each_row_is_set_against_the_fastest_kvopt_run():
    rows = [row("kvopt.LLM fp32", "float32", "float32", 16, 50.0), row("kvopt.LLM auto", "bfloat16", "bfloat16", 16, 100.0),
            row("llama.cpp", "F16", "f16", 16, 80.0, compared_with="kvopt.LLM fp32", same_as_kvopt=15)]  # fmt: skip
    text = llamacpp.render(rows)
    assert "| system | weights | KV | parallel | wall time | output tok/s | kvopt.LLM auto vs this |" in text
    assert "| kvopt.LLM fp32 | float32 | float32 | 16 | 82 s | 50.0 | 2.00x | – |" in text
    assert "| kvopt.LLM auto | bfloat16 | bfloat16 | 16 | 41 s | 100.0 | – | – |" in text
    assert "| llama.cpp | F16 | f16 | 16 | 51 s | 80.0 | 1.25x | 15/16 `kvopt.LLM fp32` |" in text
    assert "kvopt.LLM's fastest run (`auto`) against llama.cpp's fastest (F16, 16 at a time): 1.25x" in text


def test_a_run_replaces_only_rows_of_its_setting(tmp_path):
    path = tmp_path / "rows.jsonl"
    old = [row("kvopt.LLM auto", "bfloat16", "bfloat16", 16, 90.0), row("llama.cpp", "F16", "f16", 16, 80.0),
           row("llama.cpp", "F16", "f16", 8, 70.0)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    llamacpp.save(path, [row("llama.cpp", "F16", "f16", 16, 85.0)])
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["system"], r["parallel"], r["tok_s"]) for r in kept] == [
        ("kvopt.LLM auto", 16, 90.0), ("llama.cpp", 8, 70.0), ("llama.cpp", 16, 85.0)]


def test_single_requests_list_every_system_by_length_against_llama_cpp_f16_and_q8_0_of_the_same_run():
    def single(system, weights, kv, length, decode, conditions, **more):
        return {"step": "single", "system": system, "weights": weights, "kv": kv, "length": length,
                "prefill_tok_s": 300.0, "decode_tok_s": decode, "threads": 1, "conditions": conditions} | more

    rows = [single("llama.cpp", "F16", "f16", 512, 50.0, "run two"),
            single("llama.cpp", "Q8_0", "f16", 512, 80.0, "run two"),
            single("kvopt.LLM auto", "bfloat16", "bfloat16", 512, 35.5, "run two", timed="per token", interleaved=True),
            single("kvopt.LLM auto int8", "int8", "bfloat16", 512, 60.0, "run two", timed="per token"),
            single("HF generate (auto)", "bfloat16", "bfloat16", 512, 14.0, "run one"),  # another run: no ratio
            single("llama.cpp", "F16", "f16", 2048, 40.0, "run two")]  # fmt: skip
    text = llamacpp.render(rows)
    table = text[text.index("| system | weights | KV | prompt tokens |") :].splitlines()
    assert table[2:8] == ["| HF generate (auto) | bfloat16 | bfloat16 | 512 | 300.0 | 14.0 | – | – |",
                          "| kvopt.LLM auto | bfloat16 | bfloat16 | 512 | 300.0 | 35.5 (per token, interleaved) | 0.71x | 0.44x |",
                          "| kvopt.LLM auto int8 | int8 | bfloat16 | 512 | 300.0 | 60.0 (per token) | 1.20x | 0.75x |",
                          "| llama.cpp | F16 | f16 | 512 | 300.0 | 50.0 | 1.00x | 0.62x |",
                          "| llama.cpp | Q8_0 | f16 | 512 | 300.0 | 80.0 | 1.60x | 1.00x |",
                          "| llama.cpp | F16 | f16 | 2,048 | 300.0 | 40.0 | 1.00x | – |"]  # fmt: skip
    assert "Measured with run one; run two." in text


def test_hf_one_at_a_time_stays_in_its_workload_and_counts_only_the_requests_it_ran():
    rows = [row("kvopt.LLM auto", "bfloat16", "bfloat16", 16, 100.0),
            row("HF one at a time (auto)", "bfloat16", "bfloat16", 1, 20.0, ran=8, compared_with="kvopt.LLM auto",
                same_as_kvopt=7)]  # fmt: skip
    text = llamacpp.render(rows)
    assert text.count("### 16 requests of 100-200 tokens") == 1
    assert "| HF one at a time (auto) | bfloat16 | bfloat16 | 1 | 205 s | 20.0 | 5.00x | 7/8 `kvopt.LLM auto` |" in text


def test_llama_server_gets_a_slot_per_request_and_room_for_the_longest_one(tmp_path):
    import argparse

    import load

    binary = tmp_path / "llama-server"
    args = argparse.Namespace(llama_server=str(binary), llama_parallel=8, llama_kv="q8_0", prompt_tokens=(100, 200),
                              max_tokens=256, threads=1)  # fmt: skip
    command = load.server_command("llama-server:Q4_1", Path("unused"), 8123, args)
    value = lambda flag: command[command.index(flag) + 1]  # noqa: E731
    assert command[0] == str(binary) and value("--model").endswith(".gguf")
    assert value("--parallel") == "8" and value("--ctx-size") == str(8 * (200 + 256 + 16))
    assert value("--cache-type-k") == value("--cache-type-v") == "q8_0" and value("--flash-attn") == "on"
    assert "--kv-unified" in command and value("--port") == "8123"


def test_a_missing_llama_server_names_how_to_build_it(monkeypatch):
    import argparse

    import load
    import pytest

    monkeypatch.setenv("PATH", "")
    args = argparse.Namespace(llama_server=None, llama_parallel=8, llama_kv="f16", prompt_tokens=(100, 200),
                              max_tokens=16, threads=1)  # fmt: skip
    with pytest.raises(SystemExit, match="no llama-server binary: build it"):
        load.server_command("llama-server:Q4_1", Path("unused"), 8123, args)


def test_repeats_are_listed_round_by_round_under_their_workload_and_stay_out_of_its_table():
    rows = [row("kvopt.LLM auto", "bfloat16", "bfloat16", 16, 120.0), row("llama.cpp", "F16", "f16", 16, 100.0)]
    rows += [row("kvopt.LLM auto", "bfloat16", "bfloat16", 16, tok_s, round=n) for n, tok_s in ((1, 130.0), (2, 110.0))]
    rows += [row("llama.cpp", "F16", "f16", 16, tok_s, round=n) for n, tok_s in ((1, 100.0), (2, 100.0))]
    text = llamacpp.render(rows)
    assert text.count("| kvopt.LLM auto |") == 1 and "| 130.0 |" not in text
    assert ("Repeated in 2 more runs, the systems alternating (output tok/s by round): kvopt.LLM auto 130.0 / 110.0; "
            "llama.cpp F16 (f16 KV) 100.0 / 100.0. kvopt against llama.cpp by round: 1.30x / 1.10x (median 1.20x).") in text


def test_perplexity_rows_are_read_against_their_own_systems_full_precision_run():
    """kvopt's formats against kvopt's fp32 run, llama.cpp's against its F16 GGUF (their kernels differ)."""
    def ppl(system, weights, computes, value):
        return {"step": "perplexity", "system": system, "weights": weights, "kv": "-", "computes": computes,
                "length": 1024, "texts": 8, "predicted": 8184, "perplexity": value, "threads": 1,
                "conditions": "one thread"}  # fmt: skip

    rows = [ppl("kvopt fp32", "float32", "float32", 20.0), ppl("kvopt auto/int8", "int8", "bfloat16", 20.5),
            ppl("llama.cpp", "F16", "its own kernels", 21.0), ppl("llama.cpp", "Q8_0", "its own kernels", 21.21)]
    text = llamacpp.render(rows)
    assert "### Perplexity of the weight formats (8 windows of 1,024 tokens)" in text
    assert "| kvopt fp32 | float32 | float32 | 20.000 | +0.00% |" in text
    assert "| kvopt auto/int8 | int8 | bfloat16 | 20.500 | +2.50% |" in text
    assert "| llama.cpp | Q8_0 | its own kernels | 21.210 | +1.00% |" in text
