"""bf16 and int8 weights against fp32 on the same prompts (#36, #65): what running the model and its KV in bf16
(``dtype="auto"`` on a CPU with bf16 arithmetic), or its linear layers in int8 (``weights="int8"``, computing in
``auto``), does to the answers.

    python benchmarks/precision.py                                   # default model, every setting (resumable)
    python benchmarks/precision.py --model qwen2.5-coder-0.5b
    python benchmarks/precision.py --dtypes int8                     # one setting (fp32's rows stay)

The evaluation harness, query-agnostic (the context is compressed before the question is seen): passkey, niah and
niah_multivalue at ``--length`` tokens, ``--samples`` prompts each, for ``full``, ``kvzip:ratio=0.75`` and
``kivi:bits=4``, once with the model loaded in fp32 and once in bf16 (weights, activations and KV; the attention
math stays fp32 in both). The same prompts in both, so each bf16 cell is paired with its fp32 cell: of the prompts
fp32 answers, the share bf16 answers too (Wilson interval), and how many answers are the same text; ``int8`` rows
likewise (the linears' weights in int8 with one scale per output channel, activations and KV in ``auto``).

Rows: benchmarks/results/precision.jsonl, each tagged with its ``dtype``; the harness's resumable working files live
under results/precision/<model>/<dtype>/ (ignored) and replace that model's and dtype's rows as each run ends; on a
machine without them, a run starts from its committed rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvopt.eval.report import KEPT_RULE, accuracy_score, retention
from sections import conditions_line, merge_working_rows, opening, read_rows, row_dates, seed_working_rows

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "precision.jsonl"
WORK = ROOT / "results" / "precision"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
CONDITIONS = "1 torch thread; another one-thread job ran on the other core"
TASKS = ["passkey", "niah", "niah_multivalue"]
METHODS = ["full", "kvzip:ratio=0.75", "kivi:bits=4"]
DTYPES = ["fp32", "bf16", "int8"]
#: How each setting loads the model (``kvopt.load_model`` arguments).
LOADS = {"fp32": {"dtype": "fp32"}, "bf16": {"dtype": "bf16"}, "int8": {"dtype": "auto", "weights": "int8"}}
#: The row fields that name a prompt (the same prompt in both dtypes).
PROMPT = ("task", "length", "depth", "sample", "mode", "method", "seed")


def grid(length: int, samples: int):
    from kvopt.eval.decoding import QUERY_AGNOSTIC
    from kvopt.eval.runner import EvalGrid

    return EvalGrid(TASKS, [length], METHODS, depths=1, samples=samples, modes=[QUERY_AGNOSTIC])


def work_file(model: str, dtype: str) -> Path:
    return WORK / model / dtype / "eval.jsonl"


def seed(model: str, dtype: str) -> None:
    """A fresh machine resumes a run from its committed rows (:func:`sections.seed_working_rows`)."""
    seed_working_rows(ROWS, work_file(model, dtype), {"model": model, "dtype": dtype})


def merge(model: str, dtype: str, conditions: str = CONDITIONS) -> None:
    """The run's working rows replace this model's rows in this dtype (other models' and dtypes' rows stay)."""
    merge_working_rows(ROWS, work_file(model, dtype), {"model": model, "dtype": dtype}, conditions)


# -- the section ------------------------------------------------------------------------------------------------


def render(rows: list[dict]) -> str:
    """The BENCHMARKS.md section for these rows (markdown)."""
    if not rows:
        return ""
    lines = [
        "## bf16 and int8 weights against fp32: the same prompts' answers",
        "",
        opening("python benchmarks/precision.py [--model qwen2.5-coder-0.5b]", row_dates(ROWS), ROWS),
        "",
        "The model loaded in fp32, in bf16 (`dtype=\"auto\"` on this CPU, which has bf16 arithmetic: weights, "
        "activations and KV in bf16, attention math in fp32) and with int8 weights (`weights=\"int8\"`: every linear "
        "layer in int8 with one scale per output channel, computing in bf16); query-agnostic; the same prompts in "
        "each. `keeps` is the share of the fp32 run's correct answers the other run also gives, with its 95% Wilson "
        f"interval. {KEPT_RULE}",
        "",
    ]
    for model in dict.fromkeys(row["model"] for row in rows):
        lines += _model_part(model, [row for row in rows if row["model"] == model])
    return "\n".join(lines) + "\n"


def _model_part(model: str, rows: list[dict]) -> list[str]:
    by_dtype = {dtype: [r for r in rows if r["dtype"] == dtype] for dtype in DTYPES}
    tasks = sorted({r["task"] for r in rows})
    lengths = ", ".join(f"{n:,}" for n in sorted({r["length"] for r in rows}))
    lines = [
        f"### {model}",
        "",
        f"{', '.join(tasks)} at {lengths} tokens.",
        "",
        "| method | setting | prompts | fp32 accuracy | its accuracy | keeps of fp32's | same answer text |",
        "|---|---|---:|---|---|---|---:|",
    ]
    for method in dict.fromkeys(r["method"] for r in rows):
        fp32 = {_key(r): r for r in by_dtype["fp32"] if r["method"] == method}
        for setting in DTYPES[1:]:
            other = {_key(r): r for r in by_dtype[setting] if r["method"] == method}
            both = sorted(fp32.keys() & other.keys())
            if not both:
                continue
            first, second = [fp32[k] for k in both], [other[k] for k in both]
            same = sum(a["prediction"].strip() == b["prediction"].strip() for a, b in zip(first, second))
            kept = retention(second, first)
            lines.append(f"| `{method}` | {setting} | {len(both)} | {accuracy_score(first).cell()} | "
                         f"{accuracy_score(second).cell()} | {kept.cell() if kept else '–'} | {same}/{len(both)} |")  # fmt: skip
    return [*lines, "", *conditions_line(rows), ""]


def _key(row: dict) -> tuple:
    return tuple(row.get(field) for field in PROMPT)


# -- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model kvopt.load_model knows; default: the embedded one")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--samples", type=int, default=8, help="prompts per task (3 tasks)")
    parser.add_argument("--collect", action="store_true", help="copy the working rows in without running")
    parser.add_argument("--conditions", default=CONDITIONS, help="what else ran on the machine (stated with the rows)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    import kvopt
    from kvopt.eval.runner import run_eval

    label = args.model or DEFAULT_MODEL
    for dtype in args.dtypes.split(","):
        if dtype not in DTYPES:
            parser.error(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        if not args.collect:
            seed(label, dtype)
            loaded = kvopt.load_model(args.model, **LOADS[dtype])
            run_eval(grid(args.length, args.samples), work_file(label, dtype).parent, model_name=label, loaded=loaded,
                     progress=False)  # fmt: skip
        merge(label, dtype, args.conditions)
    print(render(read_rows(ROWS)))


if __name__ == "__main__":
    main()
