"""The README's table of methods, one row per registered method (``kvopt.methods.available()``).

``python docs/readme_methods.py`` rewrites the table between the README's ``<!-- methods:start -->`` and
``<!-- methods:end -->`` markers; ``--check`` exits 1 when the README's table differs from the registry's rows.
The facts (paper, kind, how the engine serves it) are read from the code; the headline number, with its model and
its BENCHMARKS.md section, is the one hand-kept part (``HEADLINES``): a method without one reads "not measured yet".
The docs' hook (``docs/hooks.py``) reads the same facts for the methods' pages.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- methods:start -->", "<!-- methods:end -->"
PAPER = re.compile(r"arXiv[ :]*(\d{4}\.\d{4,5})")

#: BENCHMARKS.md sections, by the anchor GitHub and mkdocs both give their headings.
WHAT_HOLDS = "what-holds-on-both-models"
STREAMING = "streaming-perplexity-at-a-1024-token-cache"
AGNOSTIC = "query-agnostic-prefill-cheap-surprisal-shallowzip-locret-vs-kvzip"
LEARNED = "locrets-trained-heads-against-the-query-agnostic-methods-both-models"
FASTKV = "prefill-fastkvs-token-selective-propagation"
CUT_TIME = "methods-that-cut-time-fastkv-prefill-rocketkv-decode-treekv-streaming-a-prefill-cheap-rival-to-kvzip"
TWO_BIT = "2-bit-kv-kvquant-and-aquakv-pre-rope-keys-non-uniform-levels-exact-outliers-cross-layer-prediction"
BYTES = "measured-kv-bytes-vs-the-theoretical-size-4096-token-prefill"
SHARE = "share-of-the-full-caches-answers-kept"
CONVERSATIONS = "long-conversations-epicache-and-measured-layer-budgets-xkv"

#: One number per method: (what was measured, on which model, BENCHMARKS.md anchor).
HEADLINES = {
    "full": ("same greedy tokens and logits as HF's DynamicCache", "both models", WHAT_HOLDS),
    "window": ("perplexity 27.31 at a 1,024-token window vs `full`'s 15.08", "SmolLM2-135M", WHAT_HOLDS),
    "streamingllm": ("perplexity +2.2% over `full` at a 1,024-token cache", "SmolLM2-135M", WHAT_HOLDS),
    "h2o": ("perplexity 15.552 at a 1,024-token cache (`full` 15.08)", "SmolLM2-135M", STREAMING),
    "tova": ("perplexity 15.512 at a 1,024-token cache (`full` 15.08)", "SmolLM2-135M", STREAMING),
    "treekv": ("perplexity 15.417 at a 1,024-token cache (`full` 15.08)", "SmolLM2-135M", STREAMING),
    "snapkv": ("query-aware, 50% removed: 86% of `full`'s answers kept", "Qwen2.5-Coder-0.5B", WHAT_HOLDS),
    "pyramidkv": ("75% removed: 0.260x `full`'s bytes held", "SmolLM2-135M", BYTES),
    "adakv": ("75% removed: 0.25x `full`'s bytes held (kvpress's AdaKV 1.00x)", "both models", WHAT_HOLDS),
    "kvzip": ("query-agnostic, 75% removed: 94% [87–98] of `full`'s answers kept", "Qwen2.5-Coder-0.5B", WHAT_HOLDS),
    "shallowzip": ("query-agnostic, 75% removed: 64% [43–80] of `full`'s answers kept (`kvzip` 73%) at 1.78x "
                   "`full`'s prefill at 2k (`kvzip` 4.02x)", "SmolLM2-135M", AGNOSTIC),
    "locret": ("query-agnostic, 75% removed, 24 prompts per length: 97% [81–100] of `full`'s answers kept at 4k and "
               "98% [82–100] at 8k (`kvzip` 97%, 96%; `tova` 79%, 75%), at 1.02x and 1.00x `full`'s prefill (`kvzip` "
               "3.57x, 4.43x); 90% removed: 91%, 90% (`kvzip` 86%, 84%; `tova` 66%, 57%); a 16k prompt under "
               "`budget=1024` peaks at 1/15.1 of `full`'s KV",
               "Qwen2.5-Coder-0.5B", LEARNED),
    "surprisal": ("query-agnostic, 75% removed: 68% [48–83] of `full`'s answers kept at 1.28x `full`'s prefill at 2k",
                  "SmolLM2-135M", AGNOSTIC),
    "fastkv": ("prefill 1.78x faster than `full` at 8k tokens", "SmolLM2-135M", FASTKV),
    "rocketkv": ("decode 1.52x `full`'s at 8k tokens, `full`'s query-aware accuracy", "SmolLM2-135M", CUT_TIME),
    "kivi": ("4-bit: 99% [90–100] of `full`'s answers kept (quanto 83%)", "Qwen2.5-Coder-0.5B", WHAT_HOLDS),
    "kvquant": ("prose needles included, at 4k: 3-bit 99% [95–100] of `full`'s answers kept, 2-bit 95% [89–98] "
                "(120 prompts), perplexity +1.3% and +9.6%", "Qwen2.5-Coder-0.5B", TWO_BIT),
    "aquakv": ("2-bit, prose needles included: 99% [95–100] of `full`'s answers kept on Qwen2.5-Coder-0.5B at 4k, "
               "98% [93–99] at 8k (120 prompts each; `kvquant` 2-bit 95% / 93%, `kivi` 2-bit 91% / 87%, HF quanto 0%), "
               "85% [79–90] on SmolLM2-135M at 2k/4k (240 prompts; `kvquant` 52%, `kivi` 35%), in 0.186x fp16 bytes",
               "both models", TWO_BIT),
    "tokenquant": ("4-bit: 0.141x `full`'s fp32 bytes", "SmolLM2-135M", BYTES),
    "mixedkv": ("83% [52–96] of `full`'s answers kept (query-agnostic)", "SmolLM2-135M", SHARE),
    "minikv": ("2 bits, the most sensitive quarter of layers at 4, prose needles included: 100% [96–100] of `full`'s "
               "answers kept at 4k (120 prompts) in 0.219x fp16 bytes", "Qwen2.5-Coder-0.5B", TWO_BIT),
    "minicache": ("`minicache+kivi`: 0.151x `full`'s fp32 bytes, but 0% [0–18] of `full`'s answers kept (adjacent "
                  "layers' KV nearly orthogonal on these models)", "SmolLM2-135M", BYTES),
    "epicache": ("long conversations at 4k: 91% [72–97] of `full`'s answers kept at 4x and at 6x (`kvzip` 100%, 86%)",
                 "Qwen2.5-Coder-0.5B", CONVERSATIONS),
}


def papers(cls) -> list[str]:
    """The arXiv ids a method's module and class docstrings cite, first cited first."""
    text = (sys.modules[cls.__module__].__doc__ or "") + (cls.__doc__ or "")
    return list(dict.fromkeys(PAPER.findall(text)))


def paper_links(cls) -> str:
    return ", ".join(f"[{p}](https://arxiv.org/abs/{p})" for p in papers(cls)) or "-"


def kind(cls) -> str:
    """What a method does to the cache, read from its place in the class tree."""
    from kvopt.methods.base import Method
    from kvopt.methods.eviction import Eviction
    from kvopt.methods.quantization import Quantization

    if cls.name == "full":
        return "lossless"
    if cls.owns_layer is not Method.owns_layer:
        return "cross-layer merge"
    if issubclass(cls, Eviction) or cls.kept_tokens is not Method.kept_tokens:
        return "eviction"
    if issubclass(cls, Quantization) or cls.layer_bytes is not Method.layer_bytes:
        return "quantization"
    return "other"


def engine_path(cls) -> str:
    """How the serving engine holds a sequence compressed by this method (every method is served)."""
    in_blocks = cls.runs_in_engine
    if isinstance(in_blocks, property):  # decided by the instance's parameters (streamingllm's rolling)
        return "paged blocks or its own cache, by parameters"
    if not in_blocks:
        return "its own cache, held in pool blocks"
    if isinstance(cls.uniform_budgets, property):  # budgets=uniform|pyramid|xkv (kvopt.methods.budgets)
        return "paged blocks, or head blocks for unequal layer budgets"
    return "paged blocks" if cls.uniform_budgets else "head blocks"


def methods():
    sys.path.insert(0, str(ROOT / "src"))
    import kvopt.methods

    return kvopt.methods.available()


def headline(cls) -> str:
    if cls.name not in HEADLINES:
        return "not measured yet"
    what, model, anchor = HEADLINES[cls.name]
    return f"{what} ({model}; [§](BENCHMARKS.md#{anchor}))"


def source(cls) -> str:
    """The method's file, relative to the repository root (its page on the site is generated from it)."""
    return Path(sys.modules[cls.__module__].__file__).resolve().relative_to(ROOT).as_posix()


SHORT_PATH = {
    "paged blocks": "yes",
    "head blocks": "yes (head blocks)",
    "paged blocks, or head blocks for unequal layer budgets": "yes",
    "its own cache, held in pool blocks": "yes (own cache)",
}


def table() -> str:
    rows = [
        f"| [`{cls.name}`]({source(cls)}) | {paper_links(cls)} | {kind(cls)} | "
        f"{SHORT_PATH.get(engine_path(cls), 'yes')} | {headline(cls)} |"
        for cls in methods()
    ]
    header = "| method | paper | kind | engine | headline (model; BENCHMARKS.md section) |"
    return "\n".join([header, "|---|---|---|---|---|", *rows])


def rewritten(text: str) -> str:
    start, end = text.index(START) + len(START), text.index(END)
    return f"{text[:start]}\n{table()}\n{text[end:]}"


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print("README.md's table of methods differs from the registry: run python docs/readme_methods.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
