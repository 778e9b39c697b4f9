"""The engine core: requests in, one scheduled forward pass per ``step``, outputs out.

A server drives it from its event loop (``add_request`` / ``abort`` / ``step``);
:class:`kvopt.LLM` drives it in a loop for offline batches.

Speculative decoding (``EngineConfig.speculate``): a sequence's drafts are computed in the step that computes
its newest token, so one forward pass both scores the drafts and gives the token after the last accepted
one. The keys and values of rejected drafts sit in slots past the sequence's computed tokens, where the
next step overwrites them (blocks that held only those are given back); prefix-cache hashes only ever
name computed tokens.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch

from kvopt.api import local_prose
from kvopt.chunks import Chunk, ChunkError, ChunkStore, blend, check_settings
from kvopt.engine import sampler
from kvopt.engine.block_manager import BlockManager
from kvopt.engine.conversations import EpisodicKV, Session, SessionPrompt, Sessions
from kvopt.engine.config import CPU_SPECULATE_MAX_BATCH, EngineConfig, EngineConfigError, parse_memory
from kvopt.engine.detokenizer import IncrementalDetokenizer
from kvopt.engine.kv.base import SequenceKV
from kvopt.engine.kv.cache_backed import CacheBackedKV
from kvopt.engine.kv.compressed import CodeFormat, CompressedKV
from kvopt.engine.kv.headwise import HeadwiseKV
from kvopt.engine.kv.lossless import LosslessKV
from kvopt.engine.kv.paged import PagedKVPool
from kvopt.engine.metrics import EngineStats
from kvopt.engine.model_runner import ModelRunner
from kvopt.engine.offload import KVOffload
from kvopt.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvopt.engine.sampling_params import SamplingParams
from kvopt.engine.scheduler import Drafting, Scheduler
from kvopt.engine.step_budget import StepClock
from kvopt.engine.sequence import Sequence
from kvopt.codec.fingerprint import model_fingerprint
from kvopt.errors import CacheUsageError, KVOptError
from kvopt.methods import parse
from kvopt.methods.full import Full
from kvopt.methods.spec import storage
from kvopt.models.info import ModelInfo
from kvopt.models.packed_linear import PackedLinear


logger = logging.getLogger("kvopt.engine")
#: The scratch request that times this machine's steps when the engine starts with a latency target.
WARM_UP_ID = "kvopt-warm-up"
WARM_UP_PROMPT_TOKENS = 64
WARM_UP_DECODE_STEPS = 8


class RequestError(KVOptError):
    """A request cannot be served as given (too long, empty, unknown tokens); it alone fails."""


@dataclass(frozen=True)
class Compression:
    """A compressing spec as the engine serves it: its methods and how a sequence of it is held."""

    methods: list
    #: Makes one sequence's KV object (:mod:`kvopt.engine.kv`).
    new_kv: Callable[[], SequenceKV]


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    error: str | None = None
    #: The named conversation this request is a turn of (:mod:`kvopt.engine.conversations`).
    session: Session | None = None

    @property
    def finished(self) -> bool:
        # Siblings (n > 1) exist before any sequence can finish (forked after the prompt, or made with the request),
        # so "all finished" means all n.
        return self.error is not None or all(seq.is_finished for seq in self.seqs)


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt ``preamble + history + chunks + prompt``: ``chunks`` (retrieved documents: text or token ids) have
    their KV reused wherever they appear (:mod:`kvopt.chunks`), ``prompt`` is the question. Needs chunk caching."""

    chunks: tuple[str | tuple[int, ...], ...]
    prompt: str | list[int]
    #: Text opening the prompt (a system prompt, a chat template's head): reused by content too, and what each
    #: document is computed after, so a document right after it is exact and the others saw what prompts start with.
    preamble: str | list[int] = ()
    #: Text between the preamble and the documents (earlier turns of a conversation), computed as new text.
    history: str | list[int] = ()


class BlendedKV(CacheBackedKV):
    """A sequence whose prompt is reused chunks blended with new text (:func:`kvopt.chunks.blend`) into its own cache,
    then served as any cache-backed sequence; recomputed after a preemption, it blends again with its output so far
    as more new text."""

    #: Its state depends on how the chunks were blended, not only on the spec and the tokens a tier key holds.
    keeps_prompt_state: ClassVar[bool] = False

    def __init__(self, pieces: list, store: ChunkStore, settings: dict, model, tokenizer, pool: PagedKVPool) -> None:
        super().__init__(parse(store.method), model, tokenizer, pool)
        self.pieces, self.store, self.settings = pieces, store, settings
        self.prompt_tokens = sum(len(piece.tokens if isinstance(piece, Chunk) else piece) for piece in pieces)

    def compute_prompt(self, seq: Sequence, count: int) -> torch.Tensor:
        assert count >= self.prompt_tokens, "a blended prompt is computed in one pass"
        extra = seq.token_ids[self.prompt_tokens : count]
        blended = blend(self.model, [*self.pieces, extra] if extra else self.pieces, self.store, **self.settings)
        return self.continue_prompt(blended.cache, blended.input_ids[:, -1:])


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer = model, tokenizer
        self.info = ModelInfo.from_config(model.config)
        positions = self.info.max_positions or config.max_model_len or 2048
        self.max_model_len = min(config.max_model_len or positions, positions)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        block_bytes = PagedKVPool.block_bytes(self.info, config.block_size, dtype)
        num_blocks = parse_memory(config.kv_memory, device) // block_bytes
        minimum = -(-self.max_model_len // config.block_size)
        if num_blocks < minimum:
            raise EngineConfigError(
                f"kv_memory={config.kv_memory!r} holds {num_blocks} blocks of {config.block_size} tokens, but one sequence "
                f"of max_model_len={self.max_model_len} tokens needs {minimum} ({minimum * block_bytes:,} bytes); "
                "raise kv_memory or lower max_model_len"
            )
        # Stable across processes and machines (tier keys derive from it): the model's fingerprint, not its path.
        self.fingerprint = model_fingerprint(model)
        salt = f"{json.dumps(self.fingerprint, sort_keys=True)}|{config.kv_method}"
        self.block_bytes = block_bytes
        self.dtype = dtype
        self._compressions: dict[str, Compression | None] = {}
        #: The model's twin that preparations off the step run on (:meth:`preparation`), made when first needed.
        self._twin = None
        try:
            self._compression(config.kv_method)
        except KVOptError as error:
            raise EngineConfigError(str(error)) from None
        self.block_manager = BlockManager(num_blocks, config.block_size, salt, config.enable_prefix_caching)
        self.runner = ModelRunner(model, self.info, num_blocks, config.block_size)
        self.offload = None
        if config.kv_tiers:
            self.offload = KVOffload.from_specs(config.kv_tiers, model, self.runner.pool, self.block_manager,
                                                self.fingerprint, config.kv_tier_encoding)  # fmt: skip
        self.scheduler = Scheduler(config, self.block_manager, self.runner, self.offload, self._drafting(device),
                                   StepClock(config.itl_target_ms))  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.stop_token_ids = _eos_ids(model, tokenizer)
        self.generator = torch.Generator()
        self.generator.seed()  # its own nondeterministic seed; the process-wide generator is left alone
        self._seq_ids = itertools.count()
        self._failed: list[RequestOutput] = []
        #: Blend settings once :meth:`enable_chunk_caching` ran (None: chunked prompts are refused), stores per spec.
        self._chunk_settings: dict | None = None
        self._chunk_stores: dict[str, ChunkStore] = {}
        self.conversations = Sessions(parse_memory(config.session_memory, torch.device("cpu"), "session_memory"))
        if config.itl_target_ms is not None:
            self._time_decode_step()

    def enable_chunk_caching(self, blend_ratio: float = 0.15, strategy: str = "cacheblend", epic_tokens: int = 16,
                             memory: str | int | float = "256MB", check_layer: int | None = None) -> None:  # fmt: skip
        """Serve :class:`ChunkedPrompt` requests: chunk KV kept by content, up to ``memory`` bytes in this process per
        KV method (least recently used first out; more in the KV tiers), and blended (:func:`kvopt.chunks.blend`)."""
        try:
            check_settings(blend_ratio, strategy, epic_tokens, check_layer, self.info.num_layers)
        except ChunkError as error:
            raise EngineConfigError(str(error)) from None
        self._chunk_memory = parse_memory(memory, next(self.model.parameters()).device, "chunk_memory")
        self._chunk_settings = {"blend_ratio": blend_ratio, "strategy": strategy, "epic_tokens": epic_tokens,
                                "check_layer": check_layer}  # fmt: skip

    def _drafting(self, device: torch.device) -> Drafting | None:
        """Speculative decoding as configured (None without ``speculate``); on a CPU, by default only while at most
        :data:`~kvopt.engine.config.CPU_SPECULATE_MAX_BATCH` sequences run."""
        proposer = self.config.proposer()
        if proposer is None:
            return None
        if self._compression(self.config.kv_method) is not None:
            warnings.warn(
                f"speculate={self.config.speculate!r} drafts for lossless sequences only, and kv_method="
                f"{self.config.kv_method!r} compresses every request that does not name its own kv_method: only "
                "requests with SamplingParams(kv_method='full') will draft", UserWarning, stacklevel=4,
            )  # fmt: skip
        limit = self.config.speculate_max_batch
        if limit is None and device.type == "cpu":
            limit = CPU_SPECULATE_MAX_BATCH
        return Drafting(proposer, limit, self.max_model_len)

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0,
    ) -> None:  # fmt: skip
        """Queue a request; one that cannot be served fails alone (its output carries the error)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use; give each request its own id")
        spec = params.kv_method or self.config.kv_method
        text, ids, new_kv, problem = self._resolve(prompt, params, spec)
        now = time.perf_counter()
        request = Request(request_id, text, ids, params, RequestMetrics(arrival_time=now))
        self.requests[request_id] = request
        problem = problem or self._check(ids, params) or self._begin_session(request, prompt, spec)
        if problem:
            request.error = problem
            request.metrics.finished_time = now
            self._count_finished("error")
            self._failed.append(self._output(request))
            del self.requests[request_id]
            return
        compression = self._compression(spec)
        if request.session is not None:
            new_kv = partial(EpisodicKV, request.session, parse(spec), self.model, self.tokenizer, self.runner.pool)
        elif new_kv is None:
            new_kv = LosslessKV if compression is None else compression.new_kv
        # A lossless request's n completions fork after its prompt and share its blocks; a compressed one's each
        # hold their own compressed prompt from the start (what a method keeps is no block to share).
        for index in range(1 if new_kv is LosslessKV else params.n):
            seed = None if params.seed is None else params.seed + index  # as a fork seeds its stream
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            kv = new_kv()
            seq = Sequence(next(self._seq_ids), request_id, list(ids), len(ids), params, now, index=index,
                           priority=priority, generator=generator, kv=kv)  # fmt: skip
            request.seqs.append(seq)
            self._add_detokenizer(request, seq)
            self.scheduler.add(seq)
            if self.offload is not None:
                self.offload.prefetch(seq)

    def _resolve(self, prompt, params: SamplingParams, spec: str) -> tuple:
        """``(text, ids, new_kv, problem)`` of a prompt: its text (None for ids), its token ids, what makes its
        sequences' KV when the prompt's kind decides it (None: the spec's), and why it cannot be served (None)."""
        if isinstance(prompt, ChunkedPrompt):
            pieces, problem = self._chunk_pieces(prompt, params)
            ids = [token for piece in pieces for token in (piece.tokens if isinstance(piece, Chunk) else piece)]
            store = self._chunk_stores.get(spec)
            return None, ids, partial(BlendedKV, pieces, store, self._chunk_settings, self.model, self.tokenizer,
                                      self.runner.pool), problem  # fmt: skip
        if isinstance(prompt, SessionPrompt):
            text, ids = self._tokenize(prompt.prompt)
            return text, ids, None, None  # the session is checked with the request (_begin_session)
        return *self._tokenize(prompt), None, None

    def _begin_session(self, request: Request, prompt, spec: str) -> str | None:
        """A session's turn (after :meth:`_check`, which checked the spec): ``request.session``, now busy; or why the
        turn cannot be served."""
        if not isinstance(prompt, SessionPrompt):
            return None
        if self.tokenizer is None:
            return f"session {prompt.session!r}: sessions route questions by their text; pass the tokenizer"
        session, problem = self.conversations.begin(prompt.session, spec, request.params.n)
        request.session = session
        return problem

    def _chunk_pieces(self, prompt: ChunkedPrompt, params: SamplingParams) -> tuple[list, str | None]:
        """The request's pieces (the preamble and each document as a :class:`Chunk`, the history and question as ids),
        or why it cannot be served."""
        if self._chunk_settings is None:
            raise RequestError("chunks need an engine with chunk caching: kvopt.LLM(enable_chunk_caching=True) or "
                               "`kvopt serve --chunk-caching`")  # fmt: skip
        spec = params.kv_method or self.config.kv_method
        tiers = self.offload.chain if self.offload is not None else None
        try:
            if spec not in self._chunk_stores:
                self._chunk_stores[spec] = ChunkStore(self.model, spec, tiers, self._chunk_memory)
            preamble = tuple(self._tokenize(prompt.preamble)[1])  # opens the prompt: special tokens as a prompt's
            history = self._piece_ids(prompt.history)
            documents = [Chunk(tuple(self._piece_ids(document)), preamble) for document in prompt.chunks]
            opening = [Chunk(preamble)] if preamble else []
        except ChunkError as error:
            return [], str(error)
        return [*opening, *([history] if history else []), *documents, self._piece_ids(prompt.prompt)], None

    def _piece_ids(self, piece: str | list[int] | tuple[int, ...]) -> list[int]:
        """A chunked prompt's piece as ids: text without special tokens (pieces are joined as they are)."""
        if isinstance(piece, str):
            if self.tokenizer is None:
                raise RequestError("a text chunk needs a tokenizer; pass tokenizer= or give token ids")
            return list(self.tokenizer(piece, add_special_tokens=False).input_ids)
        return [int(token) for token in piece]

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; pass tokenizer= or give token ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        ids = [int(token) for token in prompt]
        return None, ids

    def _check(self, ids: list[int], params: SamplingParams) -> str | None:
        vocab = self.model.config.get_text_config().vocab_size
        if not ids:
            return "the prompt is empty; give at least one token"
        if min(ids) < 0 or max(ids) >= vocab:
            return f"prompt token ids must lie in [0, {vocab}); got {min(ids)}..{max(ids)}"
        if len(ids) >= self.max_model_len:
            return (
                f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                "(prompt plus at least one new token); shorten the prompt"
            )
        spec = params.kv_method or self.config.kv_method
        try:
            self._compression(spec)
        except KVOptError as error:
            return str(error)
        return None

    def check_kv_method(self, spec: str) -> None:
        """Raise :class:`KVOptError` (naming why) unless this engine can serve ``spec`` on its model (checked once per
        spec: the methods' model checks and one-time preparation, e.g. a calibration; see :meth:`preparation`)."""
        self._compression(spec)

    def preparation(self, spec: str) -> Callable[[], list] | None:
        """The one-time work serving ``spec`` needs first that may take minutes (its methods' :meth:`prepare`: a
        calibration), as a function to run on another thread while the engine steps; hand what it returns to
        :meth:`adopt_kv_method`. None when there is none: ``spec`` is served already, lossless, quick to prepare, or
        refused (the request's own check says why). Call it on the engine's thread.

        The work runs on a twin of the model (:func:`_twin`): a calibration hooks modules (to capture keys, the final
        hidden states), and hooks on the engine's own modules would see the engine's forward passes too."""
        if spec in self._compressions:
            return None
        try:
            methods = self._checked_methods(spec)
        except KVOptError:
            return None
        if not any(method.needs_preparation() for method in methods):
            return None
        if self._twin is None:
            self._twin = _twin(self.model)
        return partial(_prepare, methods, self._twin)

    def adopt_kv_method(self, spec: str, methods: list) -> None:
        """Serve ``spec`` with the ``methods`` its :meth:`preparation` returned (on the engine's thread: preparing them
        again on the engine's model is then quick, and attaches what they attach, e.g. locret's chunking hooks)."""
        if spec not in self._compressions:
            self._compressions[spec] = self._check_compression(methods)

    def keeps_prompt_state(self, spec: str) -> bool:
        """Whether a request of ``spec`` keeps its state after the prompt in the KV tiers (compressed sequences, where
        their storage kind can; lossless ones share their blocks instead)."""
        compression = self._compression(spec)
        return compression is not None and compression.new_kv().keeps_prompt_state

    def _compression(self, spec: str) -> Compression | None:
        """The methods of ``spec``, checked for this model, prepared on it (here, on the caller's thread, unless
        :meth:`adopt_kv_method` handed them over prepared) and fitted to the engine's blocks (None: lossless); cached
        per spec."""
        if spec not in self._compressions:
            self._compressions[spec] = self._check_compression(self._checked_methods(spec))
        return self._compressions[spec]

    def _checked_methods(self, spec: str) -> list:
        """The methods of ``spec``, checked for this model and this engine (quick: nothing is prepared)."""
        methods = parse(spec)
        for method in methods:
            method.check_model(self.info)
            if method.needs_tokenizer and self.tokenizer is None:
                raise CacheUsageError(
                    f"{method.name} needs the model's tokenizer, and this engine has none: pass tokenizer= to kvopt.LLM "
                    "(or load the model from a folder that has one)"
                )
        return methods

    def _check_compression(self, methods: list) -> Compression | None:
        """The table of kinds: lossless; the block layouts where the methods' tokens fit them (layer by layer,
        at full precision or in one code format, no sliding-window layers); otherwise each sequence's own cache."""
        if all(type(method) is Full for method in methods):
            return None
        _prepare(methods, self.model)
        block_size = self.config.block_size
        fits_blocks = all(method.runs_in_engine for method in methods) and all(
            window is None for window in self.info.sliding_windows
        )
        quantizers = [method for method in methods if storage(method) == "quantized"]
        headwise = not all(method.uniform_budgets for method in methods)
        if fits_blocks and headwise and not quantizers:
            return Compression(methods, lambda: HeadwiseKV(methods, self.runner.pool))
        if fits_blocks and not headwise:
            code_format = self._code_format(quantizers[0]) if quantizers else None
            if code_format is not None or not quantizers:
                num_layers = self.info.num_layers
                return Compression(methods, partial(CompressedKV, methods, num_layers, block_size, code_format))
        return Compression(methods, lambda: CacheBackedKV(methods, self.model, self.tokenizer, self.runner.pool))

    def _code_format(self, quantizer) -> CodeFormat | None:
        """How ``quantizer``'s groups fill blocks (None when they cannot: the sequence keeps its own cache)."""
        try:
            return CodeFormat.probe(self.info, self.dtype, self.config.block_size, quantizer.bits, quantizer.group,
                                    quantizer.key_mode)  # fmt: skip
        except CacheUsageError:
            return None

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (unknown or finished ids are ignored); the next step returns its final
        output, with ``finish_reason="abort"``."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self._end_session(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._count_finished("abort")
        self._failed.append(self._output(request))

    def _time_decode_step(self) -> None:
        """With a latency target: a short scratch request run through the engine as the first, so the step-time model
        starts from this machine's own prompt and decode steps and ``auto`` sets the target from one sequence's
        decode step. It leaves nothing behind: its blocks are freed uncached, no KV tier sees it, counts restart."""
        clock, offload = self.scheduler.clock, self.scheduler.offload
        vocab = self.model.config.get_text_config().vocab_size
        prompt = [index % vocab for index in range(WARM_UP_PROMPT_TOKENS)]
        self.scheduler.offload = None
        try:
            self.add_request(WARM_UP_ID, prompt, SamplingParams(max_tokens=WARM_UP_DECODE_STEPS + 1, ignore_eos=True))
            decodes = []
            while self.has_unfinished_requests():
                started = time.perf_counter()
                prompt_step = any(seq.num_uncomputed_tokens > 1 for seq in self.scheduler.waiting)
                self.step()
                if not prompt_step:
                    decodes.append(time.perf_counter() - started)
        finally:
            self.scheduler.offload = offload
        self.block_manager.forget_cached_blocks()
        self.stats = EngineStats()
        step = statistics.median(decodes)
        if clock.auto:
            clock.set_auto_target(step)
        elif clock.target < step:
            warnings.warn(f"kvopt: itl_target_ms={clock.target * 1000:g} is below one decode step of this engine "
                          f"({step * 1000:.1f} ms measured at start-up): every step will miss it, and prompts get the "
                          f"smallest budget; give at least {step * 1000:.0f} ms, or auto", UserWarning, stacklevel=2)  # fmt: skip
        clock.forget_counts()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._failed)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; outputs (cumulative so far) of every request it advanced or ended.

        A failure while handling one request's tokens (sampling it alone, detokenizing, its method) fails that
        request alone; a failure of the whole step (scheduling, the forward pass) fails the step's requests. Either
        way they end with ``finish_reason="error"`` and their blocks go back to the pool: the engine goes on.
        """
        outputs, self._failed = self._failed, []
        batch = None
        try:
            batch = self.scheduler.schedule()
            if not batch.seqs and not batch.restored:
                return outputs
            sampled = self._compute(batch) if batch.seqs else []
            for seq, logits in batch.restored:  # compressed prompts found in the KV tiers: their stored logits
                sampled.append((seq, logits[None], sampler.sample(logits[None], [seq], self.generator)))
        except Exception as error:  # noqa: BLE001 - an invariant broke for the whole step
            seqs = [*batch.seqs, *(seq for seq, _ in batch.restored)] if batch is not None else None
            ids = {seq.request_id for seq in seqs} if seqs is not None else set(self.requests)
            return outputs + [self._fail(self.requests[id_], error) for id_ in ids if id_ in self.requests]
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        for seq, logits, tokens in sampled:
            request = self.requests.get(seq.request_id)
            if request is None:  # failed with a sibling sequence earlier in this loop
                continue
            touched[request.request_id] = request
            try:
                if self.offload is not None and seq.kv.keeps_prompt_state and seq.num_output_tokens == 0:
                    self.offload.save_state(seq, logits[0])  # its prompt's one-pass prefill just ended
                if request.params.n > 1 and seq.num_output_tokens == 0 and len(request.seqs) == 1:
                    self._fork(request, seq, logits)
                self._emit(request, seq, tokens, logits, now)
            except Exception as error:  # noqa: BLE001 - this request alone fails
                outputs.append(self._fail(touched.pop(request.request_id), error))
        for request in touched.values():
            outputs.append(self._output(request))
            if request.finished:
                self._finish_request(request)
        return outputs

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """End ``request`` with ``finish_reason="error"`` after an internal failure, freeing its blocks."""
        logger.error("request %s failed in an engine step", request.request_id, exc_info=error)
        request.error = (f"the engine failed on this request ({type(error).__name__}: {error}); other requests are "
                         "unaffected; retry, or report it if it persists")  # fmt: skip
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        output = self._output(request)
        self._finish_request(request)
        return output

    def _compute(self, batch) -> list[tuple[Sequence, torch.Tensor, list[int]]]:
        """The batch's forward pass: ``(sequence, its logits [tokens, vocab], the tokens it emits)`` of those that
        sample (one token, or the drafts the model accepted and one of its own)."""
        started = time.perf_counter()
        copies, self.block_manager.pending_copies = self.block_manager.pending_copies, []
        logits = self.runner.run(batch, copies)
        sampling = [seq for index, seq in enumerate(batch.seqs) if batch.samples(index)]
        rows = logits.split([len(seq.draft_token_ids) + 1 for seq in sampling])
        emitted = self._sample(logits, rows, sampling)  # before committing: a failure changes nothing
        accepted = {seq.seq_id: len(tokens) - 1 for seq, tokens in zip(sampling, emitted)}
        for seq in sampling:
            if seq.draft_token_ids:
                self.stats.speculation.record(len(seq.draft_token_ids), accepted[seq.seq_id])
                self.scheduler.drafting.verified(seq, len(seq.draft_token_ids), accepted[seq.seq_id])
        for seq, count in zip(batch.seqs, batch.num_tokens):
            drafts = len(seq.draft_token_ids)
            seq.num_computed_tokens += count - drafts  # accepted drafts count as they are emitted (_emit)
            seq.draft_token_ids = []
            self.block_manager.release(seq.kv.commit(seq, drafts, accepted.get(seq.seq_id, 0), self.config.block_size))
            if seq.kv.shares_blocks:
                self.block_manager.cache_full_blocks(seq)
        seconds = time.perf_counter() - started
        self.stats.busy_seconds += seconds
        self.scheduler.clock.observe(self.scheduler.budget, seconds)
        return list(zip(sampling, rows, emitted))

    def _sample(self, logits: torch.Tensor, rows: tuple[torch.Tensor, ...], seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's tokens from its ``rows`` of ``logits`` (one row each, plus one per draft): sequences
        without drafts sample together; drafts are verified per sequence (:func:`sampler.verify_drafts`)."""
        if not any(seq.draft_token_ids for seq in seqs):
            return [[token] for token in sampler.sample(logits, seqs, self.generator)]
        emitted = []
        for seq, own in zip(seqs, rows):
            if not seq.draft_token_ids:
                emitted.append(sampler.sample(own, [seq], self.generator))
                continue
            emitted.append(sampler.verify_drafts(own, seq, self.generator))
        return emitted

    def _fork(self, request: Request, parent: Sequence, logits: torch.Tensor) -> None:
        """Parallel sampling: ``n - 1`` siblings share the prompt's blocks and draw their own first token."""
        for index in range(1, request.params.n):
            child = parent.fork(next(self._seq_ids), index)
            self.block_manager.fork(parent, child)
            request.seqs.append(child)
            self._add_detokenizer(request, child)
            self.scheduler.running.append(child)
            token = sampler.sample(logits, [child], self.generator)[0]
            self._append(request, child, token, logits, time.perf_counter())

    def _emit(self, request: Request, seq: Sequence, tokens: list[int], logits: torch.Tensor, now: float) -> None:
        """Append the step's tokens (``logits``: a row each) until one ends the sequence. Each token but the last
        is an accepted draft whose keys and values this step wrote: it counts as computed once the next is out."""
        for position, token in enumerate(tokens):
            if position:
                seq.num_computed_tokens += 1
            self._append(request, seq, token, logits[position : position + 1], now)
            if seq.is_finished:
                return
        if len(tokens) > 1:
            self.block_manager.cache_full_blocks(seq)

    def _append(self, request: Request, seq: Sequence, token: int, logits: torch.Tensor, now: float) -> None:
        seq.append_token(token, now)
        self.stats.generation_tokens += 1
        if seq.num_output_tokens == 1 and seq.index == 0:
            self.stats.prompt_tokens += seq.num_prompt_tokens
        params = seq.params
        if params.logprobs is not None:
            seq.logprobs.extend(sampler.logprobs(logits, [token], params.logprobs))
        detokenizer = request.detokenizers[seq.seq_id]
        before = len(detokenizer.text)
        stopped_by_text = detokenizer.add(token)
        if token in params.stop_token_ids and not params.include_stop_str_in_output:
            detokenizer.text = detokenizer.text[:before]  # a stop token's own text is not output (vLLM)
        reason = None
        if stopped_by_text or token in params.stop_token_ids or (not params.ignore_eos and token in self.stop_token_ids):
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)

    def _add_detokenizer(self, request: Request, seq: Sequence) -> None:
        params = seq.params
        request.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output
        )

    def _count_finished(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _finish_request(self, request: Request) -> None:
        """Count a request once (by its first completion's finish reason) and observe its latencies."""
        now = time.perf_counter()
        request.metrics.finished_time = now
        self._count_finished("error" if request.error is not None else request.seqs[0].finish_reason)
        for seq in request.seqs:
            for gap in seq.inter_token_latencies:
                self.stats.itl.observe(gap)
        if request.metrics.time_to_first_token is not None:
            self.stats.ttft.observe(request.metrics.time_to_first_token)
        self.stats.e2e.observe(request.metrics.e2e_latency)
        self._end_session(request)
        del self.requests[request.request_id]

    def _end_session(self, request: Request) -> None:
        if request.session is not None:
            self.conversations.end(request.session)

    def _output(self, request: Request) -> RequestOutput:
        metrics = request.metrics
        first = request.seqs[0] if request.seqs else None
        if first is not None:
            metrics.first_token_time = first.first_token_time
            metrics.cached_tokens = first.num_cached_tokens
            metrics.inter_token_latencies = first.inter_token_latencies
        completions = [
            CompletionOutput(
                seq.index, request.detokenizers[seq.seq_id].text, seq.output_token_ids, seq.finish_reason,
                seq.logprobs if seq.params.logprobs is not None else None,
            )
            for seq in request.seqs
        ]  # fmt: skip
        if request.error is not None:
            completions = [CompletionOutput(0, "", [], "error")]
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, completions, request.finished, metrics,
            request.error,
        )  # fmt: skip

    # -- metrics ------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """A snapshot with Prometheus-style names (see :mod:`kvopt.engine.metrics`)."""
        manager, scheduler, stats = self.block_manager, self.scheduler, self.stats
        clock = scheduler.clock
        allocated, used = self.slot_usage()
        return {
            "kv_cache_usage_perc": manager.num_used_blocks / manager.num_blocks,
            "kv_blocks_total": manager.num_blocks,
            "kv_blocks_used": manager.num_used_blocks,
            "kv_blocks_free": manager.num_free_blocks,
            "kv_block_size": manager.block_size,
            "kv_pool_bytes": self.runner.pool.nbytes(),
            "kv_slots_allocated": allocated,
            "kv_slots_used": used,
            "kv_memory_waste_perc": 1.0 - used / allocated if allocated else 0.0,
            "kv_bytes_held": manager.num_used_blocks * self.block_bytes,
            "kv_bytes_saved_by_compression": self.bytes_saved(),
            "prefix_cache_queries_total": manager.prefix_stats.queries,
            "prefix_cache_hits_total": manager.prefix_stats.hits,
            "num_preemptions_total": scheduler.num_preemptions,
            "num_requests_running": len({seq.request_id for seq in scheduler.running}),
            "num_requests_waiting": len({seq.request_id for seq in scheduler.waiting}),
            "num_requests_swapped": len({seq.request_id for seq, _ in scheduler.swapped}),
            "prompt_tokens_total": stats.prompt_tokens,
            "generation_tokens_total": stats.generation_tokens,
            "request_success_total": dict(stats.finished),
            "generation_tokens_per_second": stats.generation_tokens / stats.busy_seconds if stats.busy_seconds else 0.0,
            "time_to_first_token_seconds": stats.ttft.snapshot(),
            "inter_token_latency_seconds": stats.itl.snapshot(),
            "e2e_request_latency_seconds": stats.e2e.snapshot(),
            "spec_decode_num_drafts_total": stats.speculation.drafts,
            "spec_decode_num_draft_tokens_total": stats.speculation.draft_tokens,
            "spec_decode_num_accepted_tokens_total": stats.speculation.accepted_tokens,
            "step_itl_target_seconds": clock.last_target or 0.0,
            "step_prefill_budget_tokens": clock.prompt_budget,
            "step_target_missed_total": clock.missed,
            "step_time_predicted_over_measured": clock.prediction_ratio.snapshot(),
            "kv_tiers": self.offload.metrics() if self.offload is not None else {},
        }

    def close(self) -> None:
        """Finish writing finished requests' blocks to the KV tiers (a restarted engine then finds them)."""
        if self.offload is not None:
            self.offload.close()
            self.offload = self.scheduler.offload = None

    def slot_usage(self) -> tuple[int, int]:
        """Token slots in blocks held by running sequences, and how many of them hold stored tokens
        (a block of quantized groups counts the share of its records in use)."""
        size, filled = self.block_manager.block_size, {}
        for seq in self.scheduler.running:
            for block_id, slots in seq.kv.filled_slots(seq, size).items():
                filled[block_id] = max(filled.get(block_id, 0), slots)  # shared blocks count once
        return len(filled) * size, sum(filled.values())

    def bytes_saved(self) -> int:
        """Bytes the running compressed sequences would take in full precision, less the blocks they hold."""
        token_bytes = self.block_bytes // self.block_manager.block_size
        return sum(
            max(0, seq.num_computed_tokens * token_bytes - seq.kv.nbytes(seq, self.block_bytes))
            for seq in self.scheduler.running
        )


def _prepare(methods: list, model) -> list:
    """``methods`` after their one-time preparation on ``model`` (a calibration calibrates on local prose)."""
    for method in methods:
        method.prepare(model, local_prose)
    return methods


def _twin(model):
    """A copy of ``model``'s modules around its own weights and buffers (no second copy of them, nor of the packed
    weights :mod:`kvopt.models.packed_linear` reads), so a forward on it computes what the model computes while
    the hooks added to its modules reach no forward of the model's."""
    shared = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, shared)
    for module, copied in zip(model.modules(), twin.modules()):
        if isinstance(module, PackedLinear):  # copies leave the packed weight out, to pack it again on first use
            copied.packed, copied.packed_from = module.packed, module.packed_from
    return twin


def _eos_ids(model, tokenizer) -> set[int]:
    """Tokens that end a sequence, as ``model.generate`` decides them (generation config, else tokenizer)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is None and tokenizer is not None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return set()
    return set(configured) if isinstance(configured, (list, tuple)) else {int(configured)}
