"""The converted-model cache heals itself (issue "Hardening" #4) and bad GGUF files fail in one line (#7).

The slow part of a conversion (transformers reading the GGUF) is replaced by a stub writing the
same files, so these tests exercise the marker, verification, reconversion, staging and lock.
"""

import json
import threading
import time

import numpy as np
import pytest

from kvopt.errors import KVOptError, ModelFileError
from kvopt.models import loading

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 4096, "tokenizer.json": b"{}" * 100}


def write_gguf(path, tensors: int = 3):
    """A small valid GGUF file (metadata plus a few float tensors)."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", "tiny")
    for index in range(tensors):
        writer.add_tensor(f"t{index}", np.full((16, 8), index, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def converter(tmp_path, monkeypatch):
    """KVOPT_CACHE in tmp_path, a small GGUF, and a stub conversion that counts its runs."""
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "cache"))
    runs = []

    def convert(gguf, folder, delay: float = 0.0):
        runs.append(gguf)
        time.sleep(delay)
        for name, data in FILES.items():
            (folder / name).write_bytes(data)

    monkeypatch.setattr(loading, "convert_gguf", convert)
    return write_gguf(tmp_path / "tiny.gguf"), runs


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda folder: (folder / "model.safetensors").write_bytes(b"w" * 10), "model.safetensors has 10 of 4096"),
        (lambda folder: (folder / "config.json").write_bytes(b"{"), "config.json has 1 of"),
        (lambda folder: (folder / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda folder: (folder / loading.COMPLETE_MARKER).unlink(), "conversion was interrupted"),
    ],
)
def test_damaged_conversion_is_detected_and_converted_again(converter, capsys, damage, reason):
    gguf, runs = converter
    folder = loading.converted_gguf_dir(gguf)
    assert len(runs) == 1 and loading.conversion_damage(folder) is None
    assert loading.converted_gguf_dir(gguf) == folder and len(runs) == 1  # a whole folder is reused
    damage(folder)
    capsys.readouterr()
    assert loading.converted_gguf_dir(gguf) == folder and len(runs) == 2
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and "is damaged" in notice[0] and reason in notice[0] and "converting it again" in notice[0]
    assert loading.conversion_damage(folder) is None


def test_interrupted_conversion_leaves_no_staging_and_stale_staging_is_removed(converter, monkeypatch):
    gguf, runs = converter
    models = loading.cache_dir() / "models"

    def interrupted(gguf, folder):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    original = loading.convert_gguf
    monkeypatch.setattr(loading, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loading.converted_gguf_dir(gguf)
    assert not list(models.glob(".converting-*"))
    stale = models / ".converting-killed"  # what a conversion killed with SIGKILL leaves
    (stale / "sub").mkdir(parents=True)
    monkeypatch.setattr(loading, "convert_gguf", original)
    loading.converted_gguf_dir(gguf)
    assert not stale.exists() and len(runs) == 1


def test_concurrent_conversions_run_once_under_the_lock(converter, monkeypatch, capsys):
    gguf, runs = converter
    original = loading.convert_gguf
    monkeypatch.setattr(loading, "convert_gguf", lambda gguf, folder: original(gguf, folder, delay=0.5))
    results = []
    threads = [threading.Thread(target=lambda: results.append(loading.converted_gguf_dir(gguf))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(runs) == 1 and len(set(results)) == 1 and loading.conversion_damage(results[0]) is None
    assert "waiting for another process" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda path: path.write_bytes(b""), "is empty, not a GGUF file"),
        (lambda path: path.write_bytes(np.random.default_rng(0).bytes(5000)), "is not a GGUF file"),
        (lambda path: path.write_bytes(write_gguf(path).read_bytes()[:-100]), r"is truncated: \d+ of \d+ bytes"),
        (lambda path: path.write_bytes(write_gguf(path).read_bytes()[:40]), "truncated: 40 bytes end inside its header"),
    ],
)
def test_bad_gguf_fails_in_one_line_before_converting(converter, tmp_path, make, message):
    _, runs = converter
    path = tmp_path / "bad.gguf"
    make(path)
    with pytest.raises(ModelFileError, match=message):
        loading.resolve_model_dir(path)
    assert not runs


def test_gguf_expected_size_is_exact(tmp_path):
    from kvopt.models.gguf_check import check_gguf

    path = write_gguf(tmp_path / "whole.gguf")
    check_gguf(path)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ModelFileError, match="truncated"):
        check_gguf(path)


def test_cache_folder_setting_expands_home_and_refuses_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVOPT_CACHE", "~/kvopt-cache")
    assert loading.cache_dir() == tmp_path / "kvopt-cache" and loading.cache_dir().is_dir()
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(KVOptError, match="KVOPT_CACHE .* is a file, not a folder"):
        loading.cache_dir()


def test_a_conversion_of_another_format_is_converted_again(converter, capsys):
    gguf, runs = converter
    folder = loading.converted_gguf_dir(gguf)
    marker = folder / loading.COMPLETE_MARKER
    marker.write_text(json.dumps({"files": json.loads(marker.read_text())["files"]}))  # as kvopt wrote it before formats
    assert "another format (1, this one writes" in loading.conversion_damage(folder)
    capsys.readouterr()
    assert loading.converted_gguf_dir(gguf) == folder and len(runs) == 2
    assert "converting it again" in capsys.readouterr().err and loading.conversion_damage(folder) is None
