"""``kvopt chat --session NAME``: a conversation on stdin whose KV cache outlives the process.

Each line read is a user turn; the answer is generated greedily with ``--method`` and streamed.
After every turn the cache and the conversation's token ids are saved atomically to
``SESSIONS_DIR/NAME.kvc`` (``--sessions-dir``; default ``$KVOPT_SESSIONS``, else
``$KVOPT_CACHE/sessions``, i.e. ``~/.cache/kvopt/sessions``). Restarted with the same name, the
chat loads that cache and computes only the new turn's tokens, never the stored ones again.

The conversation is the exact token sequence the model has seen: a new turn appends the chat
template's rendering of the user message (the difference between the template applied to the
conversation with and without it) to the stored tokens, so nothing stored is re-tokenized.

With ``--method epicache:...`` the session keeps the conversation's episodes instead of one cache
(:mod:`kvopt.episodes`): each question is answered from its own episode's compressed cache, and the
turns since the history was last clustered are computed again on top of it (at most one block).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvopt.cli.options import DeviceOption, DtypeOption, ModelOption
from kvopt.errors import KVOptError
from kvopt.models.forward import cache_kwargs

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def sessions_dir(option: Path | None) -> Path:
    from kvopt.models.loading import cache_dir
    from kvopt.paths import writable_folder

    if option is not None:
        return writable_folder(option, "--sessions-dir")
    if os.environ.get("KVOPT_SESSIONS"):
        return writable_folder(os.environ["KVOPT_SESSIONS"], "KVOPT_SESSIONS")
    return writable_folder(cache_dir() / "sessions", "KVOPT_CACHE")


def turn_tokens(tokenizer, messages: list[dict], text: str) -> list[int]:
    """Token ids the new user turn ``text`` appends to a conversation of ``messages`` (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(("\n" if messages else "") + text + "\n", add_special_tokens=not messages)["input_ids"]
    turn = [*messages, {"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    before = tokenizer.apply_chat_template(messages, tokenize=False) if messages else ""
    if not rendered.startswith(before):
        raise KVOptError("this model's chat template rewrites earlier turns; kvopt chat needs one that only appends")
    return tokenizer(rendered[len(before) :], add_special_tokens=False)["input_ids"]


def chat(
    session: Annotated[str, typer.Option("--session", help="session name; its cache is saved after every turn and resumed on restart")],
    model: ModelOption = None,
    method: Annotated[Optional[str], typer.Option("--method", help="method spec of a new session (a resumed one keeps its own), default full")] = None,
    sessions: Annotated[Optional[Path], typer.Option("--sessions-dir", help="folder of session files; default $KVOPT_SESSIONS or $KVOPT_CACHE/sessions")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens generated per answer at most")] = 128,
    encoding: Annotated[str, typer.Option(help="session file encoding: raw (lossless), int8, int4, cachegen")] = "raw",
    dtype: DtypeOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Chat on stdin, one user turn per line; the conversation's KV cache persists across restarts."""
    import torch
    from transformers import TextStreamer

    from kvopt.api import load_model
    from kvopt.codec import ENCODINGS, container

    if not NAME.fullmatch(session):
        raise KVOptError(f"--session {session!r}: use letters, digits, '.', '_' or '-' (a file name)")
    if encoding not in ENCODINGS:
        raise KVOptError(f"--encoding {encoding!r}: use one of {', '.join(ENCODINGS)}")
    path = sessions_dir(sessions) / f"{session}.kvc"
    model, tokenizer = load_model(model, dtype=dtype, device=device)
    if path.exists():
        state, meta = resume(path, model, method, encoding)
        tokens, messages = meta["tokens"], meta["messages"]
        _note(f"[session {session}: resumed {len(tokens)} tokens, {state.spec}, from {path}]")
    else:
        state, tokens, messages = new_state(method or "full", model, encoding), [], []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for line in sys.stdin:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        ids = tokens + turn_tokens(tokenizer, messages, text)
        with torch.inference_mode():
            cache, where = state.turn_cache(model, tokenizer, ids)
            cached = cache.get_seq_length()
            prompt = torch.tensor([ids], device=model.device)
            output = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(model, cache), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
            )  # fmt: skip
        answer = output[0, len(ids) :]
        tokens = output[0].tolist()
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}]
        container.write_atomic(path, state.file_bytes(model, {"tokens": tokens, "messages": messages}))
        _note(
            f"[session {session}: {cached} tokens reused{where}, {len(ids) - cached} prompt tokens computed, "
            f"{answer.numel()} generated; saved {path.stat().st_size:,} bytes]"
        )


class OneCache:
    """A conversation held in one cache that grows turn by turn (every method but epicache)."""

    def __init__(self, cache, encoding: str) -> None:
        self.cache, self.encoding, self.spec = cache, encoding, cache.spec

    def turn_cache(self, model, tokenizer, ids: list[int]):
        """The cache to feed the turn's prompt ``ids`` to, and a note on where its reused tokens come from."""
        import torch

        self.cache.run_prompt_pass(model, torch.tensor([ids], device=model.device), tokenizer)  # kvzip: the first prompt
        return self.cache, ""

    def file_bytes(self, model, meta: dict) -> bytes:
        from kvopt.codec.session import cache_bytes

        return cache_bytes(self.cache, model, self.encoding, meta)


class Episodes:
    """A conversation kept as epicache's episodes, each question answered from its own (:mod:`kvopt.episodes`)."""

    def __init__(self, conversation) -> None:
        self.conversation, self.spec = conversation, conversation.spec

    def turn_cache(self, model, tokenizer, ids: list[int]):
        built = len(self.conversation.episodes), self.conversation.history
        self.conversation.prepare(model, tokenizer, ids)
        if (len(self.conversation.episodes), self.conversation.history) != built:
            _note(f"[{len(self.conversation.episodes)} episodes built over {self.conversation.history} tokens]")
        cache, episode = self.conversation.cache_for(model, tokenizer, ids)
        return cache, "" if episode is None else f" (episode {episode + 1} of {len(self.conversation.episodes)})"

    def file_bytes(self, model, meta: dict) -> bytes:
        return self.conversation.to_bytes(model, meta)


def new_state(spec: str, model, encoding: str) -> OneCache | Episodes:
    from kvopt.api import build_cache
    from kvopt.episodes import EpisodicConversation, is_episodic

    if is_episodic(spec):
        return Episodes(EpisodicConversation(spec, encoding=encoding))
    return OneCache(build_cache(spec, model), encoding)


def resume(path: Path, model, method: str | None, encoding: str) -> tuple[OneCache | Episodes, dict]:
    """The saved conversation at ``path`` and its meta (tokens, messages), saved from now on in ``encoding``; a file
    that holds none is refused."""
    from kvopt.codec import container
    from kvopt.codec.errors import CacheFileError
    from kvopt.codec.session import KIND, cache_from_container
    from kvopt.episodes import KIND as EPISODES, EpisodicConversation
    from kvopt.methods import canonical_spec

    try:
        data = path.read_bytes()
    except OSError as error:
        raise CacheFileError(f"cannot read the session file {path}: {error.strerror}") from None
    header, chunks = container.unpack(data, str(path))
    if header.get("kind") == EPISODES:
        conversation = EpisodicConversation.from_header(header, chunks, model, str(path))
        conversation.encoding = encoding
        state, meta = Episodes(conversation), header.get("meta")
    elif header.get("kind") == KIND:
        cache, meta = cache_from_container(header, chunks, model, str(path))
        state = OneCache(cache, encoding)
    else:
        raise KVOptError(f"{path} holds {header.get('kind')!r}, not a chat session; give --session another name")
    if not isinstance(meta, dict) or not {"tokens", "messages"} <= set(meta):
        raise KVOptError(f"{path} is a saved cache, not a chat session (no conversation in it); give --session "
                         "another name, or move that file away")  # fmt: skip
    if method is not None and canonical_spec(method) != state.spec:
        raise KVOptError(f"session {path.stem!r} runs {state.spec!r}; omit --method or start a new session")
    return state, meta


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
