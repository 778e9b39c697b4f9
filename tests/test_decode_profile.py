"""benchmarks/decode_profile.py's accounting: which op lands in which group, the FLOPs and bytes its shapes imply,
and a section that says its rates against the measured limits."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_profile  # noqa: E402

VOCAB = 49152


def test_a_weight_matmul_is_counted_from_its_shapes():
    group, flops, read = decode_profile.classify("aten::mm", [[16, 576], [576, 1536]], VOCAB)
    assert (group, flops, read) == ("weight matmuls", 2.0 * 16 * 576 * 1536, 4.0 * 576 * 1536)


def test_the_vocabulary_matmul_is_the_output_projection_and_addmm_reads_past_its_bias():
    assert decode_profile.classify("aten::mm", [[16, 576], [576, VOCAB]], VOCAB)[0] == "output projection"
    addmm = [[1536], [4, 576], [576, 1536], [], []]  # as the profiler records it: bias, inputs, beta, alpha
    assert decode_profile.classify("aten::addmm", addmm, VOCAB)[1:] == (2.0 * 4 * 576 * 1536, 4.0 * 576 * 1536)
    assert decode_profile.classify("aten::mm", [[4, 576], [576, 1536]], VOCAB, element=2)[2] == 2.0 * 576 * 1536


def test_a_packed_bf16_linear_is_a_weight_matmul_counted_from_its_shapes():
    packed = [[16, 576], [1536, 576], [], [], [], []]  # input, weight [N, K] (packed), bias, then the op's options
    assert decode_profile.classify("mkldnn::_linear_pointwise", packed, VOCAB, element=2) == (
        "weight matmuls", 2.0 * 16 * 576 * 1536, 2.0 * 576 * 1536)
    assert decode_profile.classify("mkldnn::_linear_pointwise", [[16, 576], [VOCAB, 576]], VOCAB)[0] == "output projection"


def test_flash_attention_counts_its_keys_and_values_and_small_ops_count_nothing():
    shapes = [[2, 3, 3, 64], [2, 3, 176, 64], [2, 3, 176, 64], [], []]
    group, flops, read = decode_profile.classify("aten::_scaled_dot_product_flash_attention_for_cpu", shapes, VOCAB)
    assert (group, flops, read) == ("attention", 4.0 * 2 * 3 * 3 * 176 * 64, 2 * 4.0 * 2 * 3 * 176 * 64)
    assert decode_profile.classify("aten::logsumexp", [[2, 3, 3, 176]], VOCAB) == ("attention", 0.0, 0.0)
    # SDPA's dispatcher sits above the kernel: its time is attention's, its FLOPs are the kernel's (not counted twice)
    assert decode_profile.classify("aten::scaled_dot_product_attention", shapes, VOCAB) == ("attention", 0.0, 0.0)
    assert decode_profile.classify("aten::transpose", [[2, 3]], VOCAB) == ("other torch ops", 0.0, 0.0)


def test_the_section_states_rates_against_the_limits():
    groups = {name: {"ms": 0.0, "gflop": 0.0, "mb": 0.0, "calls": 0.0} for name in decode_profile.GROUPS}
    groups["weight matmuls"] = {"ms": 100.0, "gflop": 2.0, "mb": 400.0, "calls": 210.0}
    groups["outside torch ops"]["ms"] = 100.0
    row = {"sequences": 16, "context_tokens": 160, "step_ms": 180.0, "tok_s": 88.9, "profiled_step_ms": 200.0,
           "threads": 1, "groups": groups, "limits": {"matmul_gflops": 40.0, "read_gbs": 8.0}}  # fmt: skip
    text = decode_profile.render([row])
    assert text.startswith("## A decode step against this CPU's limits")
    assert "| weight matmuls | 100.0 | 50% | 210 | 20.0 | 50% | 4.00 | 50% |" in text
    assert "The matmuls take 50% of the profiled step at 20.0 GFLOP/s, 50% of what a large matmul reaches" in text


def test_the_limits_are_positive_rates():
    limits = decode_profile.limits(repeats=1, read_mb=16)
    assert limits["matmul_gflops"] > 0 and limits["read_gbs"] > 0


def test_a_run_replaces_only_rows_of_its_sequence_count_and_dtype(tmp_path):
    import json

    path = tmp_path / "rows.jsonl"
    old = [{"sequences": 16, "step_ms": 1.0}, {"sequences": 16, "dtype": "bfloat16", "step_ms": 2.0},
           {"sequences": 64, "dtype": "float32", "step_ms": 3.0}]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in old))
    decode_profile.save(path, [{"sequences": 16, "dtype": "float32", "step_ms": 4.0}])
    assert [json.loads(line)["step_ms"] for line in path.read_text().splitlines()] == [2.0, 3.0, 4.0]
