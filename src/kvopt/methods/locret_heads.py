"""Locret's retaining heads: the importance target, its training on local text, and the per-model heads file.

Locret (Huang et al., arXiv 2410.01805) trains one small MLP per layer on a frozen model, the
*retaining head* ``S^ = W2 act(W1 [q; k; v])``, reading a token's pre-RoPE query, key and value
(all heads concatenated) and predicting one *causal importance score* per KV head.

**Target (CIS).** For a sequence split into a context and an answer, the importance of context
token ``j`` for KV head ``h`` is the largest pre-softmax attention logit ``q_p . k_j * scale``
over the answer's positions ``p`` and the query heads of ``h``'s GQA group (the paper's
``data_gen.py``): the logits the model computes, after RoPE. The paper uses SFT prompt/answer
pairs; we have no downloads, so the sequences (:mod:`kvopt.methods.locret_data`) are mostly facts
planted in the machine's prose and asked back at the end (the question and answer are the answer),
the rest prose continuations whose last :data:`ANSWER` tokens are the answer. Queries and keys come
from a lossless kvopt prefill recorded layer by layer (:func:`~kvopt.methods.recording.record_prefill`);
the features are un-rotated to pre-RoPE (:func:`pre_rope`), exactly as the method computes them while
prefilling. Format 2 took the target's logits before RoPE too and trained on prose alone: on passkey
and needle prompts at 2k its heads ranked the answer's tokens below the average token (mean
percentile 0.29 to 0.50 over layers and heads) where the logits of the question's queries after
RoPE rank them at 0.63 to 0.76 and before RoPE at 0.39 to 0.58, and it kept 1.2 of ``full``'s 17.8
answers at 75% removed; format 3's heads rank them at 0.62 to 0.74 (measurements: :mod:`kvopt.methods.locret`).

**Training** follows ``train.py``: the model frozen, SmoothL1 between prediction and target plus
``0.0025 x`` the MSE between neighbouring tokens' predictions, AdamW (lr 5e-4, betas 0.9/0.95),
linear warm-up then decay, gradients clipped at 0.5. Deviations, for a CPU in minutes: hidden
width :data:`HIDDEN` (the paper's 1024 would make the heads a fifth of a 135M model; the paper
finds the width unimportant), SiLU for every model, sequences of :data:`SEQUENCE` tokens, each
recorded once and stepped on :data:`STEPS_PER_SEQUENCE` times (no dataset on disk), features
standardized and targets standardized per layer and KV head with statistics of the first
sequence (an affine map per head leaves every head's ranking, all eviction reads, unchanged).
The last tenth of the sequences is held out; its loss is the reported validation loss.

**Heads file.** ``$KVOPT_CACHE/locret/<fingerprint>.pt``, keyed by :func:`model_fingerprint`
(configuration + sampled weights), holding that fingerprint, the weights, a checksum of them and
the training report (seconds, tokens, validation loss); written atomically. Training keeps a
``.partial`` checkpoint after every sequence, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvopt.cache.attention_math import default_scale, grouped_logits
from kvopt.cache.kv_cache import recorded_step
from kvopt.cache.prerope import RopeTable, rope_inv_freq, rotate, to_pairs
from kvopt.errors import KVOptError, MethodParameterError
from kvopt.local_text import real_text
from kvopt.methods.locret_data import TrainingSequence, training_sequences
from kvopt.methods.recording import record_prefill
from kvopt.models.info import ModelInfo

#: Version of what training computes and of the file's layout (part of the file name: a change retrains).
FORMAT = 3
HIDDEN = 128
#: Tokens of a training sequence; its last ANSWER tokens are the answer whose queries define the target.
SEQUENCE = 1024
ANSWER = 128
TRAIN_TOKENS = 32768
STEPS_PER_SEQUENCE = 2
SMOOTHNESS = 0.0025
LEARNING_RATE = 5e-4
CLIP = 0.5
#: Fewest sequences a run trains on (one more is held out for validation).
MIN_SEQUENCES = 2
#: Sampled elements of each parameter in :func:`model_fingerprint`.
FINGERPRINT_SAMPLES = 64


class HeadsFileError(MethodParameterError):
    """A heads file that cannot be used (damaged, another model's, another format)."""


class RetainingHeads(torch.nn.Module):
    """Every layer's head as one batched MLP: ``fc1 [L, F, hidden]``, ``fc2 [L, hidden, H_kv]``, no biases."""

    def __init__(self, layers: int, features: int, kv_heads: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = torch.nn.Parameter(torch.randn(layers, features, hidden) * features**-0.5)
        self.fc2 = torch.nn.Parameter(torch.randn(layers, hidden, kv_heads) * hidden**-0.5)
        self.register_buffer("feature_mean", torch.zeros(layers, features))
        self.register_buffer("feature_std", torch.ones(layers, features))
        self.register_buffer("target_mean", torch.zeros(layers, kv_heads))
        self.register_buffer("target_std", torch.ones(layers, kv_heads))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Standardized scores ``[L, T, H_kv]`` of every layer's features ``[L, T, F]`` (training)."""
        normal = (features - self.feature_mean[:, None]) / self.feature_std[:, None]
        return torch.bmm(F.silu(torch.bmm(normal, self.fc1)), self.fc2)

    def score(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """Scores ``[B, H_kv, T]`` of one layer's token features ``[B, T, F]`` (higher is kept)."""
        normal = (features.float() - self.feature_mean[layer]) / self.feature_std[layer]
        return (F.silu(normal @ self.fc1[layer]) @ self.fc2[layer]).transpose(1, 2)

    def standardize(self, features: torch.Tensor, targets: torch.Tensor) -> None:
        """Fix the statistics from one sequence's ``features [L, T, F]`` and ``targets [L, T, H_kv]``."""
        self.feature_mean.copy_(features.mean(dim=1))
        self.feature_std.copy_(features.std(dim=1).clamp_min(1e-4))
        self.target_mean.copy_(targets.mean(dim=1))
        self.target_std.copy_(targets.std(dim=1).clamp_min(1e-4))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


@dataclass
class TrainingReport:
    """What a training run cost and reached (kept in the heads file, printed by ``kvopt train locret``)."""

    seconds: float
    tokens: int
    sequences: int
    validation_loss: float
    head_bytes: int
    text_source: str


@dataclass
class TrainedHeads:
    heads: RetainingHeads
    report: TrainingReport
    path: Path | None = None


# -- features and target ------------------------------------------------------------------------
def rope_table(module, layer: int, head_dim: int, device: torch.device) -> RopeTable:
    """The RoPE table of attention ``module`` (layer ``layer``), to un-rotate its queries and keys."""
    return RopeTable(rope_inv_freq(getattr(module, "config", None), layer, head_dim).to(device))


def pre_rope(x: torch.Tensor, positions: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Post-RoPE queries or keys ``[B, H, T, D]`` un-rotated at RoPE ``positions [B, 1, T]`` (fp32, pair order)."""
    return rotate(to_pairs(x, table), positions, table, inverse=True)


def concat_heads(*parts: torch.Tensor) -> torch.Tensor:
    """``[B, T, sum of H D]``: each token's vectors of every head of ``parts`` (each ``[B, H, T, D]``) side by side."""
    batch, tokens = parts[0].shape[0], parts[0].shape[2]
    return torch.cat([p.float().transpose(1, 2).reshape(batch, tokens, -1) for p in parts], dim=-1)


def token_features(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   table: RopeTable) -> torch.Tensor:  # fmt: skip
    """``[B, T, (H + 2 H_kv) D]`` head inputs of ``T`` tokens from their post-RoPE ``query [B, H, T, D]`` and
    ``keys [B, H_kv, T, D]``, un-rotated at RoPE ``positions [B, 1, T]`` (pre-RoPE, pair order), and ``values``."""
    return concat_heads(pre_rope(query, positions, table), pre_rope(keys, positions, table), values)


def importance_target(query: torch.Tensor, keys: torch.Tensor, context: int, scale: float,
                      softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """CIS ``[B, H_kv, context]``: for each of the first ``context`` keys, the largest pre-softmax logit of the
    answer's queries (positions ``context...`` of ``query [B, H, T, D]``) over the GQA group's query heads."""
    logits = grouped_logits(query[:, :, context:], keys[:, :, :context], scale, softcap)  # [B, H_kv, g * A, ctx]
    return logits.amax(dim=2)


def example(model, ids: torch.Tensor, answer: int = ANSWER) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [L, C, F], targets [L, C, H_kv])`` of the ``C = T - answer`` context tokens of ``ids [1, T]``,
    from one recorded lossless prefill: pre-RoPE features, the target from the logits after RoPE."""
    context = ids.shape[1] - answer
    cache, _ = record_prefill(model, ids, logits_to_keep=1)
    features, targets = [], []
    for layer in cache.layers:
        step, store = recorded_step(layer), layer.store
        table = rope_table(step.module, layer.index, store.keys.shape[-1], store.keys.device)
        positions = step.query_positions[None, None, :].long()
        features.append(token_features(step.query, store.keys, store.values, positions, table)[0, :context])
        softcap = getattr(getattr(step.module, "config", None), "attn_logit_softcapping", None)
        scale = default_scale(step.query, step.scaling)
        targets.append(importance_target(step.query.float(), store.keys.float(), context, scale, softcap)[0].T)
    return torch.stack(features), torch.stack(targets)


# -- training -----------------------------------------------------------------------------------
def prose_length(model, tokens: int) -> int:
    """Tokens per prose sequence for ``tokens`` of text: :data:`SEQUENCE`, fewer when the text would not make
    :data:`MIN_SEQUENCES` + 1 or the model's context is shorter."""
    info = ModelInfo.from_config(model.config)
    return min(SEQUENCE, tokens // (MIN_SEQUENCES + 1), info.max_positions or SEQUENCE)


def answer_length(sequence: int) -> int:
    """Answer tokens of a prose sequence: :data:`ANSWER`, a quarter of the sequence at most."""
    return min(ANSWER, sequence // 4)


def loss_terms(heads: RetainingHeads, features: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(SmoothL1 to the standardized target, MSE between neighbouring tokens' predictions)``."""
    predicted = heads(features)
    standard = (targets - heads.target_mean[:, None]) / heads.target_std[:, None]
    return F.smooth_l1_loss(predicted, standard), F.mse_loss(predicted[:, 1:], predicted[:, :-1])


def train(model, pieces: list[TrainingSequence], checkpoint: Path | None = None, text_source: str = "token ids",
          progress: Callable[[int, int], None] | None = None,
          steps_per_sequence: int = STEPS_PER_SEQUENCE) -> TrainedHeads:  # fmt: skip
    """Train heads for ``model`` on ``pieces`` (the last tenth held out), resuming from (and saving after every
    sequence to) ``checkpoint``.

    ``progress(done, total)`` is called after every training sequence (resumed ones counted as done).
    """
    info = ModelInfo.from_config(model.config)
    if len(pieces) < MIN_SEQUENCES + 1 or min(p.answer for p in pieces) < 4:
        raise MethodParameterError(
            f"locret: training needs at least {MIN_SEQUENCES + 1} sequences of text with answers of 4 tokens or more "
            f"({MIN_SEQUENCES} to train on, one to validate), got {len(pieces)}; pass more"
        )
    device = next(model.parameters()).device
    pieces = [TrainingSequence(p.ids.to(device), p.answer) for p in pieces]
    held_out = max(1, len(pieces) // 10)
    training, validation = pieces[:-held_out], pieces[-held_out:]
    width = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
    torch.manual_seed(0)
    with torch.device(device):  # made where they train, never on a default device set elsewhere
        heads = RetainingHeads(info.num_layers, width, info.num_kv_heads)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95))
    total = len(training) * steps_per_sequence
    warmup = max(1, total // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup)))
    )
    tokens = sum(p.ids.numel() for p in pieces)
    settings = {"format": FORMAT, "fingerprint": model_fingerprint(model), "tokens": tokens,
                "steps": steps_per_sequence, "ids": _digest(pieces)}  # fmt: skip
    done, spent = 0, 0.0
    if checkpoint is not None and checkpoint.exists():
        saved = _read(checkpoint)
        if saved is not None and saved.get("settings") == settings:
            heads.load_state_dict(saved["heads"])
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
            done, spent = saved["done"], saved["seconds"]
    if progress is not None:
        progress(done, len(training))
    started = time.perf_counter() - spent
    for index in range(done, len(training)):
        with torch.no_grad():
            features, targets = example(model, training[index].ids, training[index].answer)
        if index == 0:
            heads.standardize(features, targets)
        for _ in range(steps_per_sequence):
            with torch.enable_grad():
                fit, smooth = loss_terms(heads, features, targets)
                optimizer.zero_grad()
                (fit + SMOOTHNESS * smooth).backward()
            torch.nn.utils.clip_grad_value_(heads.parameters(), CLIP)
            optimizer.step()
            schedule.step()
        if checkpoint is not None:
            state = {"settings": settings, "heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                     "schedule": schedule.state_dict(), "done": index + 1, "seconds": time.perf_counter() - started}  # fmt: skip
            _write(checkpoint, state)
        if progress is not None:
            progress(index + 1, len(training))
    with torch.no_grad():
        losses = [loss_terms(heads, *example(model, piece.ids, piece.answer))[0].item() for piece in validation]
    report = TrainingReport(
        seconds=round(time.perf_counter() - started, 2), tokens=tokens, sequences=len(pieces),
        validation_loss=sum(losses) / len(losses), head_bytes=heads.nbytes(), text_source=text_source,
    )  # fmt: skip
    return TrainedHeads(heads.requires_grad_(False), report)


# -- the heads file -----------------------------------------------------------------------------
def model_fingerprint(model) -> str:
    """Hex digest of the configuration and of :data:`FINGERPRINT_SAMPLES` evenly spaced values of every parameter
    (with its name, shape and dtype): the heads read every layer's activations, so any changed tensor counts."""
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    hasher = hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=16)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            flat = tensor.detach().reshape(-1)
            count = min(FINGERPRINT_SAMPLES, flat.numel())
            picks = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
            hasher.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            hasher.update(flat[picks].float().cpu().numpy().tobytes())
    return hasher.hexdigest()


def heads_path(folder: Path, fingerprint: str) -> Path:
    return folder / f"v{FORMAT}-{fingerprint}.pt"


def save(path: Path, trained: TrainedHeads, fingerprint: str) -> None:
    """Write ``trained`` for the model of ``fingerprint`` to ``path`` atomically, with a checksum of the weights."""
    state = {name: t.detach().cpu() for name, t in trained.heads.state_dict().items()}
    _write(path, {"format": FORMAT, "fingerprint": fingerprint, "state": state, "checksum": _checksum(state),
                  "report": asdict(trained.report)})  # fmt: skip


def load(path: Path, fingerprint: str, device: torch.device) -> TrainedHeads:
    """The heads in ``path``, refused with :class:`HeadsFileError` when damaged or trained for another model."""
    saved = _read(path)
    if saved is None or not isinstance(saved, dict) or saved.get("format") != FORMAT or "state" not in saved:
        raise HeadsFileError(f"locret: the heads file {path} is damaged or of another format")
    state = saved["state"]
    if _checksum(state) != saved.get("checksum"):
        raise HeadsFileError(f"locret: the heads file {path} is damaged (its checksum does not match its weights)")
    if saved.get("fingerprint") != fingerprint:
        raise HeadsFileError(f"locret: the heads file {path} was trained for another model (fingerprint differs)")
    layers, features, hidden = state["fc1"].shape
    with torch.device("cpu"):  # the file's tensors are on the CPU; moved to ``device`` below
        heads = RetainingHeads(layers, features, state["fc2"].shape[-1], hidden)
    heads.load_state_dict(state)
    return TrainedHeads(heads.to(device).requires_grad_(False), TrainingReport(**saved["report"]), path)


def _checksum(state: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        hasher.update(name.encode())
        hasher.update(state[name].contiguous().numpy().tobytes())
    return hasher.hexdigest()


def _digest(pieces: list[TrainingSequence]) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for piece in pieces:
        hasher.update(piece.ids.cpu().numpy().tobytes())
        hasher.update(piece.answer.to_bytes(8, "little"))
    return hasher.hexdigest()


def _write(path: Path, payload: dict) -> None:
    """``torch.save`` through a temporary file renamed over ``path``: a killed run leaves the old file whole."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(buffer.getvalue())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _read(path: Path) -> dict | None:
    """The payload of a :func:`_write` file, or None when it cannot be read back (truncated, not torch's)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any unreadable file is a damaged one
        return None


# -- heads for a model: the cache, or training on first use -------------------------------------
#: Training on first use only when its estimate stays under this (seconds); longer runs are left to the command.
QUICK_SECONDS = 60.0
#: The heads' folder under ``$KVOPT_CACHE``: read from as it is, written into once made writable.
HEADS_FOLDER = "locret"
#: Floating-point operations per second assumed for the estimate: about half of what one busy CPU thread reached
#: while training the default model's heads (196 s of CPU time for 32,768 tokens; 95 s on a quieter machine), so the
#: default model (~8 min by this estimate) is left to the command and tiny models train on first use.
ASSUMED_FLOPS = 2e10


def train_command(model) -> str:
    source = getattr(model, "name_or_path", "") or ""
    return f"kvopt train locret --model {source}" if source else "kvopt train locret --model PATH"


def estimated_seconds(model, tokens: int = TRAIN_TOKENS) -> float:
    """Rough training time: the recorded prefills (2 flops per decoder weight and token, attention over half a
    sequence) plus the heads' steps (6 flops per head weight, token and step)."""
    info = ModelInfo.from_config(model.config)
    tables = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
              if m is not None}  # looked up, and the LM head run for the last token only
    weights = sum(p.numel() for p in model.parameters()) - sum(tables.values())
    attention = 2 * info.num_layers * info.num_heads * info.head_dim * SEQUENCE
    width = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
    heads = info.num_layers * (width * HIDDEN + HIDDEN * info.num_kv_heads)
    return tokens * (2 * weights + attention + 6 * heads * STEPS_PER_SEQUENCE) / ASSUMED_FLOPS


def text_tokenizer(model):
    """``model``'s own tokenizer (found in its folder), which turns the training text into its token ids."""
    from kvopt.models.loading import model_tokenizer

    return model_tokenizer(
        model, "locret trains its heads on real text and needs the model's tokenizer: load the model from its folder "
        "(kvopt.load_model(PATH)), or train on token ids with Locret.fit(model, ids)",
    )  # fmt: skip


def heads_folder(model) -> Path:
    """``$KVOPT_CACHE/locret``, writable, or the error naming the training command."""
    from kvopt.models.loading import cache_dir
    from kvopt.paths import writable_folder

    try:
        return writable_folder(cache_dir() / HEADS_FOLDER, "KVOPT_CACHE")
    except KVOptError as error:
        raise MethodParameterError(
            f"locret: no retaining heads can be kept for this model ({error}); with a writable KVOPT_CACHE, "
            f"run `{train_command(model)}`"
        ) from None


def train_for_model(model, text: Callable[[], str], tokens: int | None = None,
                    progress: Callable[[int, int], None] | None = None) -> TrainedHeads:  # fmt: skip
    """Train heads for ``model`` on ``tokens`` (default :data:`TRAIN_TOKENS`) of sequences made from ``text()``
    (:func:`~kvopt.methods.locret_data.training_sequences`) and store them in the cache, resuming an interrupted
    run of the same settings."""
    path = heads_path(heads_folder(model), model_fingerprint(model))
    prose, tokens = text(), tokens or TRAIN_TOKENS
    length = prose_length(model, tokens)
    pieces = training_sequences(text_tokenizer(model), prose, tokens // length, length, answer_length(length))
    source = real_text()[1] if prose == real_text()[0] else "the caller's text"
    partial = path.with_suffix(".partial")
    trained = train(model, pieces, partial, f"{source} with planted facts", progress)
    save(path, trained, model_fingerprint(model))
    partial.unlink(missing_ok=True)
    trained.path = path
    return trained


def cached_or_trained(model, text: Callable[[], str], notice: Callable[[str], None]) -> TrainedHeads:
    """The cached heads of ``model`` (read even from a cache folder this process cannot write); missing or damaged
    ones are trained now when that is quick (with a ``notice``), else the error names the training command."""
    from kvopt.models.loading import cache_root

    fingerprint = model_fingerprint(model)
    path = heads_path(cache_root() / HEADS_FOLDER, fingerprint)
    damage = None
    if path.is_file():
        try:
            return load(path, fingerprint, next(model.parameters()).device)
        except HeadsFileError as error:
            damage = str(error)
    folder = heads_folder(model)  # training stores its heads: a folder that cannot take them names the command
    if estimated_seconds(model, TRAIN_TOKENS) > QUICK_SECONDS:
        found = damage or "locret: no retaining heads are trained for this model yet"
        raise MethodParameterError(f"{found}; training takes minutes: run `{train_command(model)}` once")
    notice(f"kvopt: {damage}; training them again" if damage else
           f"kvopt: training locret's retaining heads for this model once into {folder} (under a minute)")  # fmt: skip
    return train_for_model(model, text)
