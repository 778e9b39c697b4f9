"""A GGUF file's tokenizer as the file itself defines it, whatever transformers version converts it.

transformers builds the tokenizer from the file's vocabulary (``gguf_file=``), but how it reads the special
tokens changed between the 5.x releases kvopt supports. Measured on the default model's GGUF, transformers 5.2
swaps a llama file's BOS and EOS (its EOS became ``<|im_start|>``), adds a BOS the file says not to add
(``tokenizer.ggml.add_bos_token = false``), and appends CodeLlama's five fill-in-the-middle tokens past the
model's vocabulary; on Qwen2.5 it named ``<|endoftext|>`` as EOS instead of the file's ``<|im_end|>``. 5.23 follows
the file. Text encodes to the same ids in both. So the ids, the decoded text and the chat template are taken
from transformers, and the special tokens, the tokens added after the vocabulary and whether a BOS opens a
prompt from the file's metadata: the converted model behaves the same under every supported version.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Tokenizer roles and the GGUF metadata keys (``tokenizer.ggml.*``) holding their token ids.
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}  # fmt: skip


def gguf_metadata(gguf: Path) -> tuple[int, dict[str, object]]:
    """The number of tokens in ``gguf``'s vocabulary and its scalar ``tokenizer.ggml.*`` fields (memory-mapped)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    prefix = "tokenizer.ggml."
    scalars = {key.removeprefix(prefix): field.contents() for key, field in fields.items()
               if key.startswith(prefix) and len(field.data) == 1}  # fmt: skip
    return len(fields[prefix + "tokens"].data), scalars


def load_gguf_tokenizer(gguf: Path):
    """``gguf``'s tokenizer with the special tokens, vocabulary size and BOS rule its metadata gives."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    converted = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    vocabulary, fields = gguf_metadata(gguf)
    state = json.loads(converted.backend_tokenizer.to_str())
    state["added_tokens"] = [token for token in state["added_tokens"] if token["id"] < vocabulary]
    if fields.get("add_bos_token") is False and not fields.get("add_eos_token"):
        state["post_processor"] = None  # the file adds nothing around a prompt
    specials = {role: converted.convert_ids_to_tokens(int(fields[key])) for role, key in SPECIAL_TOKEN_IDS.items()
                if isinstance(fields.get(key), int) and 0 <= fields[key] < vocabulary}  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)),
                                   chat_template=converted.chat_template, **specials)  # fmt: skip
