"""``dtype="auto"``: bf16 only on a CPU with bf16 arithmetic (flags mocked), ``--dtype`` parsing, and the lossless
claims restated in bf16 (kvopt's ``full`` cache vs HF's DynamicCache; the engine vs ``model.generate``)."""

import copy
import json
import warnings

import pytest
import torch
from conftest import random_batch
from test_batch_cli import run
from test_engine import NEW_TOKENS, mixed_prompts
from test_hardening_cli import run_main
from tiny_models import CONFIGS, tiny_model
from transformers import DynamicCache

import kvopt
from kvopt.engine import LLM, SamplingParams
from kvopt.errors import KVOptError
from kvopt.models import cpu_features
from kvopt.models.cpu_features import check_model_dtype, model_dtype
from kvopt.models.loading import load_pretrained
from kvopt.models.packed_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16", "amx_int8"})
AVX2_ONLY = frozenset({"avx", "avx2", "fma"})


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU flags ``cpu_features`` sees."""

    def use(found: frozenset[str]) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: found)

    return use


@pytest.mark.parametrize("found, expected", [(ZEN4, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16),
                                             (AVX2_ONLY, torch.float32), (frozenset(), torch.float32)])  # fmt: skip
def test_auto_is_bf16_only_with_bf16_arithmetic(flags, found, expected):
    flags(found)
    assert model_dtype("auto", None) == model_dtype("auto", CPU) == expected


def test_auto_keeps_the_checkpoint_dtype_on_an_accelerator(flags):
    flags(ZEN4)
    assert model_dtype("auto", torch.device("cuda", 0)) is None
    assert model_dtype(None, CPU) is None  # the default: the checkpoint's dtype, as before


def test_flags_are_torchs_reading_of_the_cpu(monkeypatch):
    found = {"avx2": True, "avx512_bf16": True, "amx_tile": False, "num_sockets": 1, "cpu_name": "AMD EPYC"}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: found)
    cpu_features.cpu_flags.cache_clear()
    try:
        assert cpu_features.cpu_flags() == {"avx2", "avx512_bf16"}  # flags only: no counts, no names
        assert cpu_features.native_on_cpu(torch.bfloat16) and not cpu_features.native_on_cpu(torch.float16)
        monkeypatch.delattr(torch.cpu, "get_capabilities")
        cpu_features.cpu_flags.cache_clear()
        assert cpu_features.cpu_flags() == frozenset()  # a torch that cannot tell: nothing native but fp32
        assert not cpu_features.native_on_cpu(torch.bfloat16) and cpu_features.native_on_cpu(torch.float32)
    finally:
        cpu_features.cpu_flags.cache_clear()


@pytest.fixture
def onednn_without_bf16(monkeypatch):
    """A CPU with bf16 flags whose oneDNN cannot run bf16 kernels (AVX2 EPYC faking the flags): any packing fails."""
    import kvopt.models.packed_linear as packed_linear

    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(packed_linear, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(packed_linear, "_REORDER", refuse)


def test_an_emulated_dtype_is_honoured_with_one_warning(flags):
    flags(AVX2_ONLY)
    with pytest.warns(UserWarning, match=r"running in bfloat16 on a CPU without .*avx512_bf16.*auto picks float32"):
        assert model_dtype("bf16", CPU) == torch.bfloat16
    flags(ZEN4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model_dtype("bf16", CPU) == model_dtype(torch.bfloat16, CPU) == torch.bfloat16
        assert model_dtype("fp32", CPU) == torch.float32
        assert model_dtype("bf16", torch.device("cuda", 0)) == torch.bfloat16  # an accelerator: no CPU flags asked


@pytest.mark.parametrize("name, message", [("fp64", "unknown dtype 'fp64'; use --dtype fp32, bf16 or auto"),
                                           ("fp8", "cannot run in float8_e4m3fn"),
                                           ("AUTO", "unknown dtype 'AUTO'")])  # fmt: skip
def test_bad_dtypes_fail_in_one_line(name, message):
    with pytest.raises(KVOptError, match=message) as error:
        check_model_dtype(name)
    assert "\n" not in str(error.value)


def test_load_model_auto_follows_the_flags(model_folder, flags, onednn_without_bf16):
    """Faked flags on a CPU whose oneDNN has no bf16 kernels (an AVX2 EPYC): ``auto`` follows the flags, and nothing
    asks oneDNN for a kernel it lacks (the weights stay in the plain layout)."""
    flags(ZEN4)
    model, _ = load_pretrained(model_folder, dtype="auto")
    assert model.dtype == torch.bfloat16 and not any(isinstance(m, PackedLinear) for m in model.modules())
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
    flags(AVX2_ONLY)
    model, _ = load_pretrained(model_folder, dtype="auto")
    assert model.dtype == torch.float32


def test_batch_dtype_reaches_the_model_and_the_pool(model_folder, tmp_path, monkeypatch, capsys, flags,
                                                    onednn_without_bf16):
    """``kvopt batch --dtype auto`` on a bf16 CPU: bf16 weights and a bf16 KV pool."""
    import kvopt.engine

    engines = []

    class Recording(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self.engine)

    monkeypatch.setattr(kvopt.engine, "LLM", Recording)
    flags(ZEN4)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "The capital of France is", "max_tokens": 3, "ignore_eos": True}) + "\n")
    out = tmp_path / "out.jsonl"
    code, stderr = run([str(source), "-o", str(out), "--model", str(model_folder), "--kv-memory", "8MB", "--dtype",
                        "auto", "--no-metrics"], monkeypatch, capsys)  # fmt: skip
    assert code == 0, stderr
    (engine,) = engines
    assert engine.dtype == torch.bfloat16 and engine.runner.pool.keys[0].dtype == torch.bfloat16
    assert json.loads(out.read_text())["response"]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("command", [["batch", "in.jsonl", "-o", "out.jsonl"], ["serve"], ["generate", "Hi"]])
def test_cli_bad_dtype_is_one_line_and_exit_2(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    code, stderr = run_main([*command, "--dtype", "fp64", "--device", "cpu"], monkeypatch, capsys)
    assert code == 2
    assert "unknown dtype 'fp64'; use --dtype fp32, bf16 or auto" in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("lengths", [[17], [19, 11, 5]], ids=["batch1", "leftpad3"])
def test_full_matches_dynamic_cache_in_bf16(arch, lengths):
    """The lossless claim in bf16: the same tokens as HF's DynamicCache, logits equal to bf16's resolution, up to
    the first step where HF's two candidates tie within that resolution (as the engine's test allows). On a CPU with
    bf16 arithmetic (avx512_bf16) gemma2's eager bf16 attention, which rounds its scores and probabilities where
    kvopt's keeps them in fp32, parts from kvopt's at such a tie on the first prompt; on other CPUs none does."""
    reference = tiny_model(arch, dtype=torch.bfloat16)
    ours = copy.deepcopy(reference)
    ids, mask = random_batch(lengths)
    steps = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = reference.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=reference.config),
                                  **steps)  # fmt: skip
    cache = kvopt.cache("full", ours)
    got = ours.generate(ids, attention_mask=mask, past_key_values=cache, **steps)
    parted = len(expected.logits)  # the first step where some row's tokens part (none: every step is compared)
    for row in range(ids.shape[0]):
        want, have = (output.sequences[row, ids.shape[1] :].tolist() for output in (expected, got))
        if want != have:
            step = next(index for index, (a, b) in enumerate(zip(want, have)) if a != b)
            logits = expected.logits[step][row].float()
            assert within_bf16(logits[want[step]], logits[have[step]], logits), f"row {row} parts at step {step}"
            parted = min(parted, step)
    if arch != "gemma2":
        assert parted == len(expected.logits)  # the sdpa models never part
    for a, b in zip(expected.logits[:parted], got.logits[:parted]):  # exactly equal on the sdpa models
        assert within_bf16(a, b, a)


#: How far bf16 logits of two attention implementations may lie apart, in bf16 steps of the logits' scale: kvopt's
#: attention keeps scores and probabilities in fp32 where an eager bf16 reference rounds them (gemma2: ~2 steps).
BF16_STEPS = 4


def within_bf16(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= BF16_STEPS * torch.finfo(torch.bfloat16).eps * scale.abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
def test_engine_equals_generate_in_bf16(arch):
    """Per prompt, the bf16 engine's greedy tokens are HF ``generate``'s in bf16, up to the first step where HF's two
    candidates tie within bf16's resolution; the engine's attention runs in fp32 over a bf16 pool, so such a tie may
    resolve the other way. Most prompts have none: at least 80% must match entirely."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    prompts = mixed_prompts(16) + mixed_prompts(6, seed=5, shared=40)
    engine_model = copy.deepcopy(model)
    pack_linears(engine_model)  # as load_model packs bf16 on a CPU with bf16 arithmetic (bit-equal; a no-op elsewhere)
    llm = LLM(engine_model, kv_memory="4MB", max_num_batched_tokens=96)
    assert llm.engine.runner.pool.keys[0].dtype == torch.bfloat16
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    same = 0
    for prompt, output in zip(prompts, outputs):
        got = output.outputs[0].token_ids
        result = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        expected = result.sequences[0, len(prompt) :].tolist()
        if got == expected:
            same += 1
            continue
        step = next(index for index, (a, b) in enumerate(zip(expected, got)) if a != b)
        logits = result.logits[step][0].float()
        assert within_bf16(logits[expected[step]], logits[got[step]], logits), f"prompt {prompt[:5]}..., step {step}"
    assert same >= 0.8 * len(prompts)


def test_a_loaded_model_refuses_a_dtype():
    with pytest.raises(KVOptError, match="dtype='bf16' applies to a model loaded by name"):
        LLM(tiny_model("llama"), dtype="bf16", kv_memory="4MB")


def test_bf16_holds_half_the_bytes():
    """Same ``kv_memory``: a bf16 pool has twice the blocks of an fp32 one; a bf16 ``full`` cache holds half the
    bytes of an fp32 one after the same prompt."""
    model = tiny_model("llama")
    half = copy.deepcopy(model).to(torch.bfloat16)
    fp32, bf16 = LLM(copy.deepcopy(model), kv_memory="4MB"), LLM(half, kv_memory="4MB")
    assert bf16.engine.block_manager.num_blocks in (2 * fp32.engine.block_manager.num_blocks,
                                                    2 * fp32.engine.block_manager.num_blocks + 1)  # fmt: skip
    ids, _ = random_batch([40])
    caches = [kvopt.cache("full", m) for m in (model, half)]
    for cache, m in zip(caches, (model, half)):
        m(ids, past_key_values=cache)
    assert caches[1].nbytes() * 2 == caches[0].nbytes()
