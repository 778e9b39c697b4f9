"""One contender, one fresh process: decode speed, KV bytes and the peak process memory of decoding.

    python benchmarks/decode_memory.py --spec kivi:bits=4 --length 4096 --new-tokens 64

Prints one JSON line. A fresh process per contender keeps allocator caches of other runs out
of the measurement. Peak memory: Linux's resident high-water mark (VmHWM) is reset after the
prefill (``/proc/self/clear_refs``), so ``decode_peak_rss_mb`` is the highest RSS *during
decoding* and ``decode_rss_growth_mb`` its excess over the RSS when decoding started (the
transient memory decoding needs: dequantized copies, attention buffers, cache growth).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model name or folder; default: the embedded model")
    args = parser.parse_args()

    from kvopt.eval.contenders import parse_contender
    from kvopt.eval.decoding import forward
    from kvopt.api import load_model
    from kvopt.local_text import real_text

    model, tokenizer = load_model(args.model)
    contender = parse_contender(args.spec)
    ids = tokenizer(real_text()[0], add_special_tokens=False)["input_ids"]
    ids = (ids * (args.length // len(ids) + 1))[: args.length]
    with torch.inference_mode():
        cache = contender.new_cache(model)
        started = time.perf_counter()
        with contender.compressing(model):
            logits = forward(model, ids, cache, 0)
        prefill_s = time.perf_counter() - started
        Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
        rss_start = rss_kb("VmRSS")
        seen = len(ids)
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            token = int(logits.argmax())
            logits = forward(model, [token], cache, seen)
            seen += 1
        decode_s = time.perf_counter() - started
        peak = rss_kb("VmHWM")
    print(
        json.dumps(
            {
                "method": contender.spec,
                "length": args.length,
                "new_tokens": args.new_tokens,
                "prefill_s": round(prefill_s, 3),
                "decode_tok_s": round(args.new_tokens / decode_s, 3),
                "kv_bytes": contender.held_bytes(cache),
                "decode_peak_rss_mb": round(peak / 1024, 1),
                "decode_rss_growth_mb": round((peak - rss_start) / 1024, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
