import copy
import os

import torch

# Without a GPU, Triton kernels can only run in its interpreter (tests/test_kernels.py). It is chosen when
# Triton is imported, which transformers does: so before importing it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiny_models import CONFIGS, VOCAB, tiny_model  # noqa: E402

# Tiny models run many small ops: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)


@pytest.fixture(params=sorted(CONFIGS))
def arch(request) -> str:
    return request.param


@pytest.fixture
def model_pair(arch):
    """(reference HF model, identical copy for kvopt): separate objects so attention settings never leak."""
    reference = tiny_model(arch)
    return reference, copy.deepcopy(reference)


def random_batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask for prompts of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    ids[mask == 0] = 0
    return ids, mask


def generate_rows_alone(model, spec: str, lengths: list[int], seed: int, new_tokens: int = 8):
    """Left-padded rows generated as one batch and each alone through ``spec`` caches; asserts every row's new
    tokens equal its lone run's. Returns ``(batch cache, lone caches, width)`` for the caller's storage checks."""
    import kvopt

    ids, mask = random_batch(lengths, seed=seed)
    width = ids.shape[1]
    steps = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    cache = kvopt.cache(spec, model)
    batch_out = model.generate(ids, attention_mask=mask, past_key_values=cache, **steps)
    alone = []
    for row, length in enumerate(lengths):
        alone.append(kvopt.cache(spec, model))
        single = model.generate(ids[row : row + 1, width - length :], past_key_values=alone[-1], **steps)
        assert torch.equal(batch_out[row, width:], single[0, length:]), f"row {row}"
    return cache, alone, width


def tiny_llama(tokenizer, **sizes) -> LlamaForCausalLM:
    """A random 2-layer llama for ``tokenizer`` (seeded), prepared for kvopt; ``sizes`` override its shape."""
    from kvopt.cache.attention import prepare

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2} | sizes
    config = LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, **shape)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prepare(model)
    return model


@pytest.fixture(scope="session")
def tiny_with_tokenizer():
    """A tiny random llama sized to the default model's real tokenizer (prompts need real text)."""
    from kvopt.models import load_tokenizer

    tokenizer = load_tokenizer()
    return tiny_llama(tokenizer), tokenizer


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct and its tokenizer, loaded once per test session."""
    import kvopt

    return kvopt.load_model()


@pytest.fixture(scope="module")
def model_folder(tiny_with_tokenizer, tmp_path_factory):
    """The tiny llama with the real tokenizer (and its chat template), saved as an HF folder (for CLI tests)."""
    model, tokenizer = tiny_with_tokenizer
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose a lot on a busy machine
    (a module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
