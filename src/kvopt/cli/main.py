"""The ``kvopt`` command line: generate, chat, batch, serve, memory, methods, eval, report, bench.

User mistakes (bad spec, missing model, too-long prompt) print one line and exit with code 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvopt.cli.batch import batch
from kvopt.cli.chat import chat
from kvopt.cli.options import DeviceOption, DtypeOption, ModelOption, WeightsOption
from kvopt.cli.serve import serve
from kvopt.errors import KVOptError

app = typer.Typer(add_completion=False, help="KV-cache optimization for Hugging Face causal LMs.")
err = Console(stderr=True)
console = Console()

MethodOption = Annotated[str, typer.Option("--method", help="method spec, e.g. full, window:size=1024")]
#: Exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def _exception_types(name: str) -> tuple[type[BaseException], ...]:
    """Class ``name`` of every click that typer may run on: its bundled copy (typer >= 0.20) and click itself."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


USAGE_ERRORS = _exception_types("ClickException")
ABORTS = (typer.Abort, *_exception_types("Abort"))


def main() -> None:
    """Run the CLI; anything but success is one line on stderr: usage errors and user mistakes exit 2, Ctrl-C 130."""
    try:
        status = app(standalone_mode=False)
    except KVOptError as error:
        _fail(str(error), 2)
    except (KeyboardInterrupt, *ABORTS):
        _interrupted()
    except USAGE_ERRORS as error:
        _fail(_usage_message(error), error.exit_code)
    if status == INTERRUPTED:  # typer turns Ctrl-C into this exit status when not standalone
        _interrupted()
    if isinstance(status, int) and status:
        sys.exit(status)


def _fail(message: str, status: int) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(status)


def _interrupted() -> None:
    err.print("interrupted", highlight=False)
    sys.exit(INTERRUPTED)


def _usage_message(error: Exception) -> str:
    """Click's message on one line, pointing at the command's ``--help`` (click prints usage + hint + message)."""
    message = " ".join(error.format_message().split()).rstrip(".")
    context = getattr(error, "ctx", None)
    command = context.command_path if context is not None else "kvopt"
    return f"{message}; see `{command} --help`"


@app.callback(invoke_without_command=True)
def _root(context: typer.Context) -> None:
    """KV-cache optimization for Hugging Face causal LMs."""
    if context.invoked_subcommand is None:
        console.print(context.get_help(), highlight=False, markup=False)
        commands = ", ".join(sorted(context.command.commands))
        raise KVOptError(f"no command given; run `kvopt COMMAND`, one of: {commands} (e.g. kvopt generate \"Hello\")")


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="the prompt (a user message when --chat)")],
    model: ModelOption = None,
    method: MethodOption = "full",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate")] = 128,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="wrap the prompt in the chat template")] = True,
    dtype: DtypeOption = None,
    weights: WeightsOption = None,
    device: DeviceOption = "auto",
    speculate: Annotated[
        Optional[str],
        typer.Option(help="speculative decoding: prompt_lookup:k=4, self:layers=8,k=4 or draft:model=PATH,k=4"),
    ] = None,
) -> None:
    """Stream an answer token by token, then print one stats line (with --speculate: the answer once done)."""
    from kvopt.engine.streaming import stream_through_engine

    if speculate is not None:
        from kvopt.speculative.text import speculate_text, summary

        text, output = speculate_text(prompt, speculate, model, method, max_new_tokens, chat, dtype, device=device,
                                      weights=weights)
        _echo(text)
        console.print()
        console.print(summary(method, speculate, output), style="dim", highlight=False, markup=False, soft_wrap=True)
        return
    result = stream_through_engine(
        prompt, model=model, method=method, max_new_tokens=max_new_tokens, chat=chat, dtype=dtype, device=device,
        weights=weights, sink=_echo,
    )
    console.print()
    console.print(result.summary(), style="dim", highlight=False, markup=False, soft_wrap=True)


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@app.command()
def memory(
    model: ModelOption = None,
    layers: Annotated[Optional[int], typer.Option(min=1, help="layers (explicit shape instead of --model)")] = None,
    kv_heads: Annotated[Optional[int], typer.Option(min=1, help="KV heads per layer (GQA)")] = None,
    head_dim: Annotated[Optional[int], typer.Option(min=1, help="dimension of one head")] = None,
    dtype: Annotated[str, typer.Option(help="KV dtype: float16, bfloat16, float32")] = "float16",
    seq_len: Annotated[int, typer.Option(min=1, help="tokens per sequence")] = 2048,
    batch: Annotated[int, typer.Option(min=1, help="sequences")] = 1,
    method: Annotated[Optional[str], typer.Option("--method", help="also show the size under this spec")] = None,
) -> None:
    """KV bytes per token and in total, for a model or an explicit shape."""
    from kvopt.memory import bytes_per_token, estimate, human_bytes
    from kvopt.methods import parse, spec_text
    from kvopt.models.info import ModelInfo, parse_dtype

    torch_dtype = parse_dtype(dtype)
    explicit = [layers, kv_heads, head_dim]
    if any(v is not None for v in explicit):
        if None in explicit:
            raise KVOptError("give all of --layers, --kv-heads and --head-dim (or --model instead)")
        info = ModelInfo(layers, kv_heads, kv_heads, head_dim, dtype=torch_dtype)
        source = f"{layers} layers x {kv_heads} KV heads x head_dim {head_dim}"
    else:
        from kvopt.models.loading import load_config, resolve_model_dir

        folder = _model_folder(model, resolve_model_dir)
        info = ModelInfo.from_config(load_config(folder), dtype=torch_dtype)
        source = f"{model or 'SmolLM2-135M-Instruct (default)'}: {info.num_layers} layers, {info.num_heads} query / {info.num_kv_heads} KV heads, head_dim {info.head_dim}"
    methods = parse(method) if method else []
    for m in methods:
        m.check_model(info)
    full = estimate(info, seq_len, batch)
    per_token = bytes_per_token(info)
    table = Table(title=f"KV cache, {source}, {dtype}", show_header=True)
    table.add_column("quantity")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    table.add_row("per token (all layers, K+V)", f"{per_token:,}", human_bytes(per_token))
    table.add_row(f"full, {seq_len} tokens x batch {batch}", f"{full.total_bytes:,}", human_bytes(full.total_bytes))
    if methods:
        spec = spec_text(methods)
        reduced = estimate(info, seq_len, batch, methods)
        ratio = reduced.total_bytes / full.total_bytes
        table.add_row(f"{spec} (theoretical)", f"{reduced.total_bytes:,}", f"{human_bytes(reduced.total_bytes)} ({ratio:.3f}x)")
    console.print(table)


def _model_folder(model: str | None, resolve) -> Path:
    path = Path(model) if model else None
    if path is not None and path.is_file() and path.name == "config.json":
        return path.parent
    return resolve(model)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str, option: str) -> list[int]:
    try:
        return [int(part) for part in _csv(text)]
    except ValueError:
        raise KVOptError(f"{option} takes comma-separated integers, e.g. {option} 1024,2048") from None


@app.command("eval")
def evaluate(
    task: Annotated[str, typer.Option("--task", help="comma-separated task names, e.g. passkey,niah,prose_needle,retrieval,conversation,ppl (an unknown name lists them all)")] = "passkey,niah",
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] = "1024,2048",
    depths: Annotated[int, typer.Option(help="needle depths: centres of equal slices of the context (3 -> 1/6, 1/2, 5/6)")] = 3,
    samples: Annotated[int, typer.Option(help="samples per (task, length, depth)")] = 1,
    methods: Annotated[str, typer.Option(help="kvopt specs and peers (hf, hf-quanto:bits=4, kvpress:snapkv:ratio=0.5), comma-separated")] = "full",
    mode: Annotated[str, typer.Option(help="query_agnostic (compress the context before the question), query_aware, or both comma-separated")] = "query_agnostic",
    out: Annotated[Path, typer.Option(help="results folder (eval.jsonl is appended; re-runs resume)")] = Path("results"),
    model: ModelOption = None,
    seed: Annotated[int, typer.Option(help="seed for task generation")] = 0,
    ppl_tokens: Annotated[int, typer.Option(help="tokens of real text streamed for the ppl task")] = 4096,
    ppl_chunk: Annotated[int, typer.Option(help="tokens per forward in the ppl task (1 = pure decode)")] = 1,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="format prompts with the chat template")] = True,
    share_prefill: Annotated[bool, typer.Option("--share-prefill/--no-share-prefill", help="kvopt methods and HF caches replay one lossless prefill per prompt (same results, less time)")] = True,
    device: DeviceOption = "auto",
) -> None:
    """Run an accuracy grid (resumable) and write one JSONL row per sample."""
    from kvopt.eval.contenders import split_specs
    from kvopt.eval.runner import EvalGrid, run_eval

    grid = EvalGrid(
        tasks=_csv(task), lengths=_ints(lengths, "--lengths"), methods=split_specs(methods), depths=depths,
        samples=samples, modes=_csv(mode), seed=seed, chat=chat, ppl_tokens=ppl_tokens, ppl_chunk=ppl_chunk,
        share_prefill=share_prefill,
    )  # fmt: skip
    path = run_eval(grid, out, model_name=model, device=device,
                    log=lambda text: err.print(text, highlight=False, soft_wrap=True))  # fmt: skip
    console.print(f"results: {path}")


@app.command()
def report(
    results: Annotated[Path, typer.Argument(help="results folder with eval.jsonl and/or bench.jsonl")],
    out: Annotated[Path, typer.Option(help="report folder (REPORT.md and PNG plots)")] = Path("report"),
) -> None:
    """Write a Markdown report with tables and plots from a results folder."""
    from kvopt.eval.report import write_report

    if not results.is_dir():
        raise KVOptError(f"results folder {results} does not exist; run `kvopt eval --out {results}` first")
    console.print(f"report: {write_report(results, out)}")


@app.command()
def bench(
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] = "512,2048",
    methods: Annotated[str, typer.Option(help="kvopt specs and peers; hf is always included")] = "full",
    new_tokens: Annotated[int, typer.Option(min=2, help="tokens decoded per run")] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="runs per contender (median reported)")] = 3,
    out: Annotated[Path, typer.Option(help="results folder (bench.jsonl is overwritten)")] = Path("results"),
    model: ModelOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Prefill time, decode tok/s and KV bytes vs plain HF generation, median of repeats."""
    from kvopt.eval.bench import run_bench, summarize
    from kvopt.eval.contenders import split_specs
    from kvopt.memory import human_bytes

    rows = run_bench(
        _ints(lengths, "--lengths"), split_specs(methods), out, new_tokens, repeats, model, device=device,
        log=lambda text: err.print(text, highlight=False, soft_wrap=True),
    )  # fmt: skip
    table = Table(title=f"median of {repeats}, {new_tokens} decoded tokens")
    for column in ("length", "method", "prefill s", "decode tok/s", "decode vs hf", "KV held", "bytes vs hf"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for entry in summarize(rows):
        table.add_row(
            str(entry["length"]), entry["method"], f"{entry['prefill_s']:.2f}", f"{entry['decode_tok_s']:.1f}",
            f"{entry['decode_vs_hf']:.2f}x", human_bytes(entry["kv_bytes"]), f"{entry['bytes_vs_hf']:.3f}x",
        )  # fmt: skip
    console.print(table)


@app.command("methods")
def list_methods(
    name: Annotated[Optional[str], typer.Argument(help="show one method's description and parameters")] = None,
) -> None:
    """List registered methods (or describe one), with parameters and budget convention."""
    import dataclasses
    import inspect

    from kvopt.methods import available, get

    if name is not None:
        cls = get(name)
        console.print(f"[bold]{cls.name}[/]: {cls.summary}", highlight=False)
        console.print(inspect.getdoc(inspect.getmodule(cls)) or "", highlight=False, markup=False)
        table = Table("parameter", "default", "meaning")
        for f in dataclasses.fields(cls):
            table.add_row(f.name, str(f.default), f.metadata.get("help", ""))
        console.print(table)
        console.print(f"budget: {cls.budget_convention}", highlight=False)
        return
    table = Table(show_header=True, caption="`kvopt methods NAME` describes one method")
    table.add_column("method", style="bold")
    table.add_column("what it does")
    table.add_column("parameters (default)")
    for cls in available():
        params = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))
        table.add_row(cls.name, cls.summary, params or "-")
    console.print(table)
    console.print(
        "Budgets: ratio = fraction of the prompt removed at the prefill, later tokens added on top (kvpress "
        "convention); budget = tokens kept per sequence, head and layer (of the prompt for prefill-time methods, at "
        "all times for decode-time ones), recent window included "
        "(the papers' convention). Quantizers keep every token in fewer bits; methods compose with '+'.",
        highlight=False,
    )


app.command("batch")(batch)
app.command("chat")(chat)
app.command("serve")(serve)
from kvopt.cli.recommend import recommend  # noqa: E402  (kvopt recommend)
app.command("recommend")(recommend)
from kvopt.cli.train import train  # noqa: E402  (kvopt train locret)
app.add_typer(train, name="train")


if __name__ == "__main__":
    main()
