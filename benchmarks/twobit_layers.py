"""Where 2-bit KV loses a needle in real prose, and what wins it back (issue 42): layers, outliers, bits.

    python benchmarks/twobit_layers.py            # default model, prose_needle and prose_multikey at 2k tokens,
                                                  # 8 depths each; rows appended to benchmarks/results/twobit_layers.jsonl

Per prompt the context is prefilled once at full precision and every variant replays that prefill
(:func:`kvopt.eval.decoding.shared_prefill`; quantizers act after attention, so this is their prefill), query-agnostic:
the question and the reference answer then run through the compressed cache in one forward (teacher forcing). A row
holds the answer's log-probability minus ``full``'s (nats, summed over the answer's tokens: how far the cache moved
the model off the needle) and whether greedy decoding reproduces the answer token for token (its score).

A variant is ``SPEC`` or ``SPEC|OTHER@LAYERS``: the layers in ``LAYERS`` (``10-19``, or ``0-9,20-29``) hold ``OTHER``'s
methods instead (``full``: no method, full precision). So ``kivi:bits=2|full@0-9,20-29`` quantizes layers 10-19 alone,
and ``kvquant:bits=2|kvquant:bits=4@10-19`` gives them 4 bits. Layer groups split the model into ``--group`` layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sections import conditions_line, opening, row_dates

ROWS = Path(__file__).parent / "results" / "twobit_layers.jsonl"
TASKS = ("prose_needle", "prose_multikey")
SPECS = ("kivi:bits=2", "kvquant:bits=2")
REMEDIES = ("kvquant:bits=2,outliers=0.05", "kvquant:bits=2|kvquant:bits=4@10-19", "kivi:bits=2|kivi:bits=4@10-19",
            "minikv", "minikv:sensitive=0.33", "kvquant:bits=3")  # fmt: skip


def layer_set(text: str) -> set[int]:
    """``"0-9,20-29"`` -> the layers named (ranges inclusive)."""
    layers = set()
    for span in text.split(","):
        first, _, last = span.partition("-")
        layers.update(range(int(first), int(last or first) + 1))
    return layers


def variant_cache(variant: str, model):
    """The cache a variant names: ``SPEC``'s, with ``OTHER``'s methods (none for ``full``) in the layers after ``@``."""
    from kvopt.api import build_cache

    spec, _, override = variant.partition("|")
    cache = build_cache(spec, model)
    if override:
        other, _, layers = override.partition("@")
        donor = build_cache(other, model)
        for index in layer_set(layers):
            cache.layers[index].methods = donor.layers[index].methods
    return cache


def describe(label: str) -> str:
    """A variant as the report names it: ``SPEC|OTHER@LAYERS`` -> ``SPEC, layers LAYERS as OTHER`` (a table cell)."""
    spec, _, override = label.partition("|")
    other, _, layers = override.partition("@")
    return f"{spec}, layers {layers} as {other}" if override else spec


def group_variants(spec: str, layers: int, group: int) -> dict[str, str]:
    """``spec`` in one group of layers at a time, the others at full precision: variant -> how the report names it."""
    variants = {}
    for first in range(0, layers, group):
        last = min(first + group, layers) - 1
        rest = [f"{a}-{b}" for a, b in ((0, first - 1), (last + 1, layers - 1)) if a <= b]
        if rest:
            variants[f"{spec}|full@{','.join(rest)}"] = f"{spec} in layers {first}-{last} only"
    return variants


@torch.inference_mode()
def answer_logprob(model, shared, variant: str, question: list[int], answer: list[int]) -> tuple[float, bool]:
    """The answer's summed log-probability after ``question`` over the variant's cache, and whether greedy
    decoding gives it token for token."""
    from kvopt.models.forward import cache_kwargs

    cache = variant_cache(variant, model)
    cache.replay_prefill(shared.cache)
    start = len(shared.ids)
    ids = torch.tensor([question + answer], device=model.device)
    positions = torch.arange(start, start + ids.shape[-1], device=model.device)[None]
    logits = model(input_ids=ids, **cache_kwargs(model, cache), position_ids=positions, use_cache=True).logits[0]
    span = logits[len(question) - 1 : len(question) - 1 + len(answer)].float()
    target = torch.tensor(answer, device=span.device)
    return float(span.log_softmax(-1).gather(1, target[:, None]).sum()), bool((span.argmax(-1) == target).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--depths", type=int, default=8, help="needle depths, evenly spread over RULER's 40")
    parser.add_argument("--group", type=int, default=10, help="layers per group in the where-it-sits variants")
    parser.add_argument("--specs", default=";".join(SPECS), help="2-bit specs to locate (';'-separated)")
    parser.add_argument("--remedies", default=";".join(REMEDIES), help="variants to try (';'-separated)")
    parser.add_argument("--conditions", default="", help="what else ran on the machine (stated under the tables)")
    parser.add_argument("--out", type=Path, default=ROWS)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import kvopt
    from kvopt.eval.decoding import shared_prefill
    from kvopt.eval.tasks import build_sample
    from kvopt.eval.tasks.build import format_prompt
    from kvopt.eval.tasks.niah import DEPTH_GRID

    model, tokenizer = kvopt.load_model(args.model)
    name = args.model or "SmolLM2-135M-Instruct"
    layers = model.config.num_hidden_layers
    specs = args.specs.split(";")
    labels = {spec: spec for spec in specs}
    for spec in specs:
        labels |= group_variants(spec, layers, args.group)
    labels |= {remedy: remedy for remedy in args.remedies.split(";")}
    variants = list(labels)
    for variant in variants:
        variant_cache(variant, model)  # a malformed variant (or a calibration) fails before the grid
    depths = DEPTH_GRID[:: max(1, len(DEPTH_GRID) // args.depths)][: args.depths]
    done = {(row["task"], row["length"], row["depth"], row["variant"])
            for row in map(json.loads, args.out.read_text().splitlines() if args.out.exists() else [])
            if row.get("model") == name}  # fmt: skip
    stamp = {"model": name, "date": time.strftime("%Y-%m-%d"), **({"conditions": args.conditions} if args.conditions else {})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for length in map(int, args.lengths.split(",")):
        for task in args.tasks.split(","):
            for depth in depths:
                todo = [variant for variant in variants if (task, length, depth, variant) not in done]
                if not todo:
                    continue
                sample = build_sample(task, tokenizer, length, depth=depth)
                context, question = format_prompt(tokenizer, sample)
                answer = list(tokenizer(" " + sample.answers[0], add_special_tokens=False).input_ids)
                shared = shared_prefill(model, context)
                reference, reference_greedy = answer_logprob(model, shared, "full", question, answer)
                with args.out.open("a") as sink:
                    for variant in todo:
                        logprob, greedy = answer_logprob(model, shared, variant, question, answer)
                        row = {"task": task, "length": length, "depth": depth, "sample": 0, "seed": 0,
                               "variant": variant, "label": labels[variant], "logprob_drop": round(logprob - reference, 4), "score": int(greedy),
                               "full_score": int(reference_greedy), "answer_tokens": len(answer)}  # fmt: skip
                        sink.write(json.dumps(stamp | row) + "\n")
                print(f"{length} {task} depth {depth}: done", flush=True)


def render(rows: list[dict]) -> str:
    """Markdown for the committed rows (``committed_section`` in benchmarks/run.py)."""
    from kvopt.eval.report import retention

    lines = ["## Where 2-bit KV loses a needle in real prose, and what wins it back", "",
             opening("python benchmarks/twobit_layers.py", row_dates(ROWS), ROWS), "",
             "Query-agnostic: the context is compressed before the question is seen; the question and the reference "
             "answer then run through the cache (teacher forcing). Drop: the answer's log-probability minus a full "
             "cache's, in nats, mean over prompts (0 = no harm). Kept: of the prompts where a full cache decodes the "
             "answer token for token, the share the variant also does, with its 95% Wilson interval. "
             "\"Layers L as OTHER\": those layers hold OTHER's methods; \"in layers L only\": the others hold full "
             "precision.", ""]  # fmt: skip
    for model, length in dict.fromkeys((row["model"], row["length"]) for row in rows):
        mine = [row for row in rows if row["model"] == model and row["length"] == length]
        reference = [row | {"score": row["full_score"]} for row in mine]
        prompts = len({(row["task"], row["depth"]) for row in mine})
        tasks = ", ".join(dict.fromkeys(row["task"] for row in mine))
        lines += [f"### {model}, {length:,}-token prompts ({prompts}: {tasks})", "",
                  "| variant | prompts | answer log-prob drop (nats) | kept of full's answers |",
                  "|---|---:|---:|---|"]  # fmt: skip
        for variant in dict.fromkeys(row["variant"] for row in mine):
            ran = [row for row in mine if row["variant"] == variant]
            kept = retention(ran, [row for row in reference if row["variant"] == variant])
            drop = statistics.mean(row["logprob_drop"] for row in ran)
            lines.append(f"| {describe(ran[0]['label'])} | {len(ran)} | {drop:.2f} | {kept.cell() if kept else '–'} |")
        lines.append("")
    return "\n".join([*lines, *conditions_line(rows), ""])


if __name__ == "__main__":
    main()
