"""Text in, text out: what ``kvopt generate --speculate`` runs (one prompt, greedy, stats line)."""

from __future__ import annotations

from kvopt.speculative.generate import GenerateOutput, generate


def speculate_text(
    prompt: str, speculate: str, model=None, method: str = "full", max_new_tokens: int = 128, chat: bool = True,
    dtype: str | None = None, tokenizer=None, device: str | None = None, weights: str | None = None,
) -> tuple[str, GenerateOutput]:  # fmt: skip
    """Greedy answer to ``prompt`` through a ``method`` cache with ``speculate`` drafts; ``(text, output)``.

    The speculation spec is checked before the model loads, so a typo fails fast.
    """
    from kvopt.api import load_model
    from kvopt.methods import parse
    from kvopt.runtime import encode_prompt
    from kvopt.speculative.spec import parse_proposer

    proposer = parse_proposer(speculate)
    parse(method)
    if tokenizer is None:
        model, tokenizer = load_model(model, dtype=dtype, device=device, weights=weights)
    ids = encode_prompt(tokenizer, prompt, chat)
    output = generate(model, ids, cache=method, speculate=proposer, max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    return tokenizer.decode(output.tokens, skip_special_tokens=True), output


def summary(method: str, speculate: str, output: GenerateOutput) -> str:
    stats = output.stats
    return (
        f"[{method} | {speculate}] prompt {output.prompt_tokens} tok | new {len(output.tokens)} tok | "
        f"decode {output.decode_tokens_per_second:.1f} tok/s | drafts {stats.proposed} proposed, {stats.accepted} "
        f"accepted ({stats.acceptance_rate:.0%}), {stats.mean_accepted_length:.2f} per verification, "
        f"{stats.plain_steps} plain steps"
    )
