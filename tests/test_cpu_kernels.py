"""The CPU decode-attention kernel (kvopt.kernels.cpu): against a float64 softmax reference over scattered runs of
slots, its build and its fallback, and the engine through it against the engine through PyTorch's flash kernel."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from conftest import tiny_llama

from kvopt.cache import attention_math
from kvopt.kernels import cpu

COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def kernel():
    """The built op; on a machine with a C++ compiler it must build (the fallback is for machines without one)."""
    op = cpu.decode_attention()
    if op is None:
        if COMPILER is not None and not cpu.switched_off():
            pytest.fail("a C++ compiler is present but the CPU decode kernel did not build (see the warning)")
        pytest.skip("no C++ compiler here: the flash kernel serves (tested by the engine's own tests)")
    return op


def reference(query, keys, values, runs, offsets, scale):
    """Softmax attention of each sequence's query over its runs' slots, in float64: ``[S, heads, D]``, ``[S, heads]``."""
    count, heads, dim = query.shape
    kv_heads = keys.shape[0]
    outputs, lses = [], []
    for s in range(count):
        slots = torch.cat([torch.arange(a, b) for a, b in runs[offsets[s] : offsets[s + 1]].tolist()])
        k, v = keys[:, slots].double(), values[:, slots].double()  # [kv_heads, T, D]
        q = query[s].double().view(kv_heads, heads // kv_heads, dim)
        scores = q @ k.transpose(-1, -2) * scale
        lses.append(torch.logsumexp(scores, -1).reshape(heads))
        outputs.append((torch.softmax(scores, -1) @ v).reshape(heads, dim))
    return torch.stack(outputs), torch.stack(lses)


def scattered_runs(lengths: list[int], slots: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's context as blocks of ``block`` slots at random places (merged where adjacent, as the
    engine's runs are), the last one partly filled."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(slots // block, generator=generator).tolist()
    runs, offsets = [], [0]
    for length in lengths:
        mine = []
        for start in range(0, length, block):
            first = free.pop() * block
            stop = first + min(block, length - start)
            if mine and mine[-1][1] == first:
                mine[-1] = (mine[-1][0], stop)
            else:
                mine.append((first, stop))
        runs.extend(mine)
        offsets.append(len(runs))
    return torch.tensor(runs, dtype=torch.long).view(-1, 2), torch.tensor(offsets, dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 32), (8, 2, 128), (6, 1, 80)])
def test_kernel_equals_softmax_attention_over_scattered_runs(kernel, dtype, heads, kv_heads, dim):
    # lengths below one vector of keys, across a work unit's boundary (256 keys) and several units
    lengths = [1, 7, 16, 17, 255, 256, 700]
    keys = torch.randn(kv_heads, 4096, dim).to(dtype)
    values = torch.randn(kv_heads, 4096, dim).to(dtype)
    query = torch.randn(len(lengths), heads, dim)
    runs, offsets = scattered_runs(lengths, 4096, 16, seed=dim + heads)
    output, lse = attention_math.decode_over_runs(query, keys, values, runs, offsets, 0.125)
    expected, expected_lse = reference(query, keys, values, runs, offsets, 0.125)
    assert output.dtype == torch.float32 and output.shape == (len(lengths), heads, dim)
    torch.testing.assert_close(output.double(), expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-5, rtol=1e-6)


def test_the_registered_ops_are_the_bound_functions(kernel):
    """The engine calls the extension module's functions (no dispatcher per call); the same kernels stay registered as
    ``torch.ops.kvopt_cpu`` ops (for what traces or compiles), with the same results."""
    keys, values = torch.randn(3, 64, 64), torch.randn(3, 64, 64)
    query, runs, offsets = torch.randn(2, 9, 64), torch.tensor([[0, 40], [40, 64]]), torch.tensor([0, 1, 2])
    folded = query.view(2, 3, 3, 64)
    bound = kernel(folded, keys, values, runs, offsets, 0.125)
    registered = torch.ops.kvopt_cpu.decode_attention(folded, keys, values, runs, offsets, 0.125)
    assert kernel is not torch.ops.kvopt_cpu.decode_attention
    for got, expected in zip(bound, registered):
        assert torch.equal(got, expected)
    rows, weight = torch.randn(2, 96), torch.randn(40, 96)
    assert torch.equal(cpu.linear_rows()(rows, weight), torch.ops.kvopt_cpu.linear_rows(rows, weight))
    assert torch.equal(cpu.layer_glue().silu_mul(rows), torch.ops.kvopt_cpu.silu_mul(rows))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_coded_kernel_equals_attention_over_the_dequantized_groups(kernel, bits, dtype):
    """KIVI's groups written into code blocks by the engine's own format, read in place by the kernel: equal to
    softmax attention (float64) over the same groups gathered and dequantized by the torch path."""
    from kvopt.engine.kv.compressed import CodeFormat
    from kvopt.models.info import ModelInfo

    info = ModelInfo(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=64)
    code_format = CodeFormat.probe(info, dtype, 16, bits, 32, "channel")
    assert code_format.kernel_layout is not None

    class Pool:  # one layer's key and value pools, as the engine's PagedKVPool lays them out
        keys = [torch.zeros(2, 64 * 16, 64, dtype=dtype)]
        values = [torch.zeros(2, 64 * 16, 64, dtype=dtype)]

    from kvopt.cache.quantized import QuantizedKV

    counts = [3, 1, 5]  # groups per sequence; rows padded to the longest with a repeated real group
    free = torch.randperm(64).tolist()
    blocks, records = [], []
    for count in counts:
        keys, values = torch.randn(1, 2, count * 32, 64) * 2, torch.randn(1, 2, count * 32, 64)
        positions = torch.arange(count * 32, dtype=torch.int32).expand(1, 2, -1)
        valid = torch.ones(1, 2, count * 32, dtype=torch.bool)
        part = QuantizedKV.encode(keys.to(dtype), values.to(dtype), positions, valid, bits, 32, "channel")
        where = code_format.locate([free.pop() for _ in range(code_format.blocks_for(count))], 0, count, "cpu")
        code_format.write(Pool, 0, part, where)
        blocks.append(torch.cat([where[0], where[0][:1].expand(max(counts) - count)]))
        records.append(torch.cat([where[1], where[1][:1].expand(max(counts) - count)]))
    blocks, records = torch.stack(blocks), torch.stack(records)
    query = torch.randn(len(counts), 6, 64)
    from kvopt.engine.kv.compressed import CodedTokens

    valid = (torch.arange(max(counts) * 32) < torch.tensor(counts)[:, None] * 32)[:, None]
    groups = CodedTokens(Pool, code_format, (blocks, records), valid).group_records(0)
    assert groups.counts.tolist() == counts
    output, lse = attention_math.decode_over_codes(query, Pool.keys[0], Pool.values[0], groups, 0.125)
    for s, count in enumerate(counts):
        part = code_format.read(Pool, 0, (blocks[s, :count], records[s, :count]))
        keys, values = (tensor.double()[0] for tensor in part.dequantize(dtype=torch.float32))  # [kv_heads, T, D]
        scores = query[s].double().view(2, 3, 64) @ keys.transpose(-1, -2) * 0.125
        expected = (torch.softmax(scores, -1) @ values).reshape(6, 64)
        torch.testing.assert_close(output[s].double(), expected, atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(lse[s].double(), torch.logsumexp(scores, -1).reshape(6), atol=2e-5, rtol=1e-6)


def test_kernel_is_exact_where_one_score_dominates(kernel):
    """Scores hundreds apart (exp underflows to 0 for all but one key) and equal scores (a uniform average)."""
    keys = torch.zeros(1, 64, 64)
    values = torch.arange(64, dtype=torch.float32)[:, None].expand(64, 64).contiguous()[None]
    keys[0, 40, 0] = 1.0
    query = torch.zeros(2, 1, 64)
    query[0, 0, 0] = 900.0
    runs, offsets = torch.tensor([[0, 64], [0, 64]]), torch.tensor([0, 1, 2])
    output, lse = attention_math.decode_over_runs(query, keys, values, runs, offsets, 1.0)
    assert torch.equal(output[0], torch.full((1, 64), 40.0))
    torch.testing.assert_close(output[1], torch.full((1, 64), 31.5))
    torch.testing.assert_close(lse, torch.tensor([[900.0], [torch.log(torch.tensor(64.0)).item()]]))


def test_kernel_rejects_what_it_cannot_read(kernel):
    keys = torch.randn(2, 64, 64)
    runs, offsets = torch.tensor([[0, 8]]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="head_dim 48"):
        kernel(torch.randn(1, 2, 1, 48), torch.randn(2, 64, 48), torch.randn(2, 64, 48), runs, offsets, 1.0)
    with pytest.raises(RuntimeError, match="match the query's heads"):
        kernel(torch.randn(1, 3, 1, 64), keys, keys, runs, offsets, 1.0)
    with pytest.raises(RuntimeError, match="offsets"):
        kernel(torch.randn(1, 2, 1, 64), keys, keys, runs, torch.tensor([0]), 1.0)
    assert not cpu.decode_attention_serves(torch.float16, 64, 3)
    assert not cpu.decode_attention_serves(torch.float32, 48, 3)


def test_a_failed_build_warns_once_and_the_flash_kernel_serves(monkeypatch):
    def broken() -> None:
        raise RuntimeError("Error building extension 'kvopt_cpu': c++: command not found")

    monkeypatch.setattr(cpu, "_build", broken)
    cpu._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="cannot be built on this machine.*command not found.*KVOPT_CPU_KERNELS=0"):
            assert cpu.decode_attention() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu.decode_attention() is None  # warned once: the answer is kept
            assert not attention_math.decode_kernel_serves("cpu", torch.float32, 4, 2, 64)
    finally:
        cpu._library.cache_clear()


def test_switched_off_nothing_is_built(monkeypatch):
    monkeypatch.setenv(cpu.ENV_SWITCH, "off")
    monkeypatch.setattr(cpu, "_build", lambda: pytest.fail("built although switched off"))
    cpu._library.cache_clear()
    try:
        assert cpu.decode_attention() is None
    finally:
        cpu._library.cache_clear()


def test_the_build_is_kept_per_source_torch_and_cpu(monkeypatch):
    source = b"\0".join(path.read_bytes() for path in (*cpu.SOURCES, *cpu.HEADERS))
    key = cpu._build_key(source)
    assert key == cpu._build_key(source) and len(key) == 16
    assert cpu._build_key(source + b"\n") != key
    monkeypatch.setenv("CXX", "clang++")
    assert cpu._build_key(source) != key


@pytest.fixture(scope="module")
def wide_heads(tiny_with_tokenizer):
    """A tiny random llama whose heads are as wide as real models' (32), GQA groups of 3: the kernel's shapes."""
    _, tokenizer = tiny_with_tokenizer
    return tiny_llama(tokenizer, hidden_size=192, intermediate_size=128, num_attention_heads=6), tokenizer


PROMPTS = ["the cat sat on the mat " * 9, "a b c d e f g " * 23, "the cat sat on the mat " * 9 + "and then"]


def engine_outputs(model, tokenizer, kernel_on: bool, monkeypatch, kv_method: str = "full") -> list:
    from kvopt.engine import LLM, SamplingParams

    monkeypatch.setattr(cpu, "_library", lambda: kernel_on)  # both ops, or PyTorch's kernels
    # small blocks and prefix caching (on by default): the shared prompt's blocks are reused, runs come in pieces
    llm = LLM(model, tokenizer=tokenizer, kv_memory="8MB", block_size=4, max_num_seqs=3, kv_method=kv_method)
    assert llm.engine.runner.decode_kernel is kernel_on
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, ignore_eos=True)
    return [output.outputs[0] for output in llm.generate(PROMPTS, params)]


def chosen_logprobs(output) -> torch.Tensor:
    return torch.tensor([entry[token] for entry, token in zip(output.logprobs, output.token_ids)])


def test_engine_through_the_kernel_equals_hf_generate_in_fp32(kernel, wide_heads, monkeypatch):
    """The engine's greedy tokens through the kernel equal HF ``generate``'s per prompt, and its log-probabilities
    equal those through PyTorch's flash kernel within 1e-5."""
    model, tokenizer = wide_heads
    through_kernel = engine_outputs(model, tokenizer, True, monkeypatch)
    through_flash = engine_outputs(model, tokenizer, False, monkeypatch)
    for prompt, output, flash_output in zip(PROMPTS, through_kernel, through_flash):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=40, do_sample=False, min_new_tokens=40)[0, ids.shape[1] :]
        assert output.token_ids == expected.tolist()
        assert flash_output.token_ids == output.token_ids
        torch.testing.assert_close(chosen_logprobs(output), chosen_logprobs(flash_output), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_method", ["kivi:bits=4,residual=16,group=16", "kivi:bits=2,residual=32,group=32", "h2o:budget=48"])
def test_compressed_sequences_through_the_kernel_equal_them_through_flash(kernel, wide_heads, monkeypatch, kv_method):
    """A compressed sequence's kept slots and its quantized groups (read in place from their records) go through the
    kernels: the same tokens as through PyTorch's kernels, log-probabilities within 1e-5 (fp32)."""
    model, tokenizer = wide_heads
    through_kernel = engine_outputs(model, tokenizer, True, monkeypatch, kv_method)
    through_flash = engine_outputs(model, tokenizer, False, monkeypatch, kv_method)
    for output, flash_output in zip(through_kernel, through_flash):
        assert output.token_ids == flash_output.token_ids
        torch.testing.assert_close(chosen_logprobs(output), chosen_logprobs(flash_output), atol=1e-5, rtol=0)


def test_a_step_mixing_quantized_and_lossless_sequences_reads_all_in_one_call(kernel, wide_heads, monkeypatch):
    """Requests with and without KIVI decode in the same steps: the kernel reads the quantized members' groups
    beside every member's slots in one call per layer (no merge), with the tokens PyTorch's kernels give."""
    from kvopt.engine import LLM, SamplingParams

    model, tokenizer = wide_heads
    calls = []
    original = attention_math.decode_over_runs
    monkeypatch.setattr(attention_math, "decode_over_runs",
                        lambda *args, **kwargs: calls.append(args[6] if len(args) > 6 else None) or original(*args, **kwargs))
    outputs = {}
    for kernel_on in (True, False):
        monkeypatch.setattr(cpu, "_library", lambda on=kernel_on: on)
        llm = LLM(model, tokenizer=tokenizer, kv_memory="8MB", block_size=4, max_num_seqs=3)
        methods = ["kivi:bits=4,residual=16,group=16", "full", "kivi:bits=4,residual=16,group=16"]
        params = [SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, ignore_eos=True, kv_method=method)
                  for method in methods]  # fmt: skip
        outputs[kernel_on] = [output.outputs[0] for output in llm.generate(PROMPTS, params)]
    assert any(groups is not None and groups.counts.tolist().count(0) == 1 for groups in calls)
    for output, flash_output in zip(outputs[True], outputs[False]):
        assert output.token_ids == flash_output.token_ids
        torch.testing.assert_close(chosen_logprobs(output), chosen_logprobs(flash_output), atol=1e-5, rtol=0)


def test_engine_through_the_kernel_in_bf16_stays_with_fp32(kernel, wide_heads, monkeypatch):
    """In bf16 the kernel keeps scores and probabilities in fp32 (the flash kernel rounds them to bf16): its
    log-probabilities are as close to the fp32 engine's as the flash kernel's are."""
    model, tokenizer = wide_heads
    reference = engine_outputs(model, tokenizer, False, monkeypatch)
    model.to(torch.bfloat16)
    try:
        deviations = {}
        for kernel_on in (True, False):
            outputs = engine_outputs(model, tokenizer, kernel_on, monkeypatch)
            first = [output.token_ids[:8] for output in outputs]
            assert first == [output.token_ids[:8] for output in reference]
            deviations[kernel_on] = max(
                (chosen_logprobs(output)[:8] - chosen_logprobs(fp32)[:8]).abs().max().item()
                for output, fp32 in zip(outputs, reference)
            )  # fmt: skip
    finally:
        model.float()
    assert deviations[True] <= 1.5 * deviations[False] + 1e-3
