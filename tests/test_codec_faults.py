"""Damaged, foreign or interrupted cache files: a clear error or the previous file, never a wrong cache."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvopt
from kvopt.codec import CacheCorruptError, CacheModelMismatchError, CacheVersionError, load_cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(tiny_with_tokenizer, tmp_path_factory):
    """(model, path of a saved snapkv+kivi cache, its bytes)."""
    model, _ = tiny_with_tokenizer
    cache = kvopt.cache("snapkv:ratio=0.5+kivi:bits=4", model)
    with torch.no_grad():
        model(torch.randint(100, 5000, (1, 400), generator=torch.Generator().manual_seed(1)), past_key_values=cache)
    path = kvopt.save_cache(cache, tmp_path_factory.mktemp("saved") / "cache.kvc")
    return model, path, path.read_bytes()


def damaged(tmp_path, data: bytes) -> Path:
    path = tmp_path / "damaged.kvc"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("tenths", range(10))
def test_a_truncated_file_is_refused(saved, tmp_path, tenths):
    model, _, data = saved
    with pytest.raises(CacheCorruptError, match="truncated|not a kvopt cache"):
        load_cache(damaged(tmp_path, data[: len(data) * tenths // 10]), model)


def test_a_flipped_byte_anywhere_is_refused(saved, tmp_path):
    model, _, data = saved
    for offset in range(0, len(data), max(1, len(data) // 97)):
        flipped = bytearray(data)
        flipped[offset] ^= 0x40
        with pytest.raises((CacheCorruptError, CacheVersionError)):
            load_cache(damaged(tmp_path, bytes(flipped)), model)


def test_a_file_from_another_format_version_names_both_versions(saved, tmp_path):
    model, _, data = saved
    newer = bytearray(data)
    struct.pack_into("<I", newer, 8, 99)
    with pytest.raises(CacheVersionError, match="version 99.*reads version 1"):
        load_cache(damaged(tmp_path, bytes(newer)), model)


def test_a_file_from_other_weights_or_another_shape_names_the_mismatch(saved):
    model, path, _ = saved
    other = LlamaForCausalLM(model.config).eval()  # same shape, other random weights
    with pytest.raises(CacheModelMismatchError, match="different weights"):
        load_cache(path, other)
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(CacheModelMismatchError, match="num_hidden_layers=2, this model has num_hidden_layers=3"):
        load_cache(path, LlamaForCausalLM(config).eval())
    with pytest.raises(CacheModelMismatchError, match="bfloat16"):
        load_cache(path, LlamaForCausalLM(model.config).eval().to(torch.bfloat16))


def test_a_header_naming_a_class_outside_kvopt_cache_is_refused(saved, tmp_path):
    """Objects are rebuilt from an allow-list only: a forged header cannot make the loader build anything else."""
    from kvopt.codec import container

    model, _, data = saved
    header, chunks = container.unpack(data, "test")
    text = json.dumps(header).replace("kvopt.cache.quantized:QuantizedKV", "subprocess:Popen")
    assert "subprocess:Popen" in text
    forged = container.pack({k: v for k, v in json.loads(text).items() if k != "chunks"}, [bytes(c) for c in chunks])
    with pytest.raises(CacheCorruptError, match="subprocess:Popen"):
        load_cache(damaged(tmp_path, forged), model)


SAVER = textwrap.dedent(
    """
    import os, resource, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    import kvopt
    from tiny_models import tiny_model
    model = tiny_model("llama")
    cache = kvopt.cache("full", model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 300)), past_key_values=cache)
    mode = sys.argv[1]
    if mode == "stall":  # stop inside the save, after the temporary file is written, until killed
        real_fsync = os.fsync
        def stalled(fd):
            real_fsync(fd)
            print("writing", flush=True)
            signal.pause()
        os.fsync = stalled
    else:  # a file size limit standing in for a full disk: writes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        kvopt.save_cache(cache, sys.argv[2])
    except kvopt.KVOptError as error:
        print("error:", error, flush=True)
    """
)


def run_saver(tmp_path, mode: str, target: Path) -> subprocess.Popen:
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, str(script), mode, str(target)], stdout=subprocess.PIPE, text=True, env=env)


def test_a_save_killed_midway_leaves_the_previous_session_intact(saved, tmp_path):
    model, source, data = saved
    target = tmp_path / "session.kvc"
    target.write_bytes(data)
    process = run_saver(tmp_path, "stall", target)
    try:
        assert process.stdout.readline().strip() == "writing"
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert target.read_bytes() == data
    assert load_cache(target, model).get_seq_length() == 400
    assert [p.name for p in tmp_path.glob(".session.kvc.*.tmp")]  # the kill left its temporary file, nothing else


def test_a_full_disk_fails_cleanly_and_keeps_the_old_file(saved, tmp_path):
    _, _, data = saved
    target = tmp_path / "session.kvc"
    target.write_bytes(data)
    process = run_saver(tmp_path, "full", target)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    assert "error: writing" in output and "previous file there is untouched" in output
    assert target.read_bytes() == data
    assert not list(tmp_path.glob(".session.kvc.*.tmp"))
