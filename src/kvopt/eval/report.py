"""REPORT.md and PNG plots from an evaluation run's ``eval.jsonl`` and ``bench.jsonl``.

Every accuracy figure carries a 95% Wilson interval and its sample count, because runs here
use few samples per cell and a bare mean invites reading noise as signal. Tables are keyed by
the full method spec (``kvpress:snapkv:ratio=0.5``) so two budgets of one method never merge;
plots group specs by ``method_name`` so a method's budgets form one line.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvopt.errors import KVOptError
from kvopt.eval.rows import BENCH_ROW_KEYS, EVAL_ROW_KEYS, Row, load_rows
from kvopt.memory import human_bytes
from kvopt.paths import writable_file

#: Method names that are the uncompressed reference; "hf" first because it is what users compare to.
BASELINES = ("hf", "full")
#: Known modes first, in the order a reader expects them; other modes follow alphabetically.
MODE_ORDER = ("query_agnostic", "query_aware")
MAX_HEATMAPS = 12
DPI = 150
#: Budgets of one method share a colour and differ by marker.
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
#: How a "kept" share is computed, said wherever one is shown (:class:`Retention`).
KEPT_RULE = (
    "`of N`: the reference's answers on the paired prompts (its summed score: a prompt it half answers, such as "
    "2 of niah_multivalue's 4 values, counts half, and the method is credited at most as much on it); answers only "
    "the method gives do not count, so no share exceeds 100%."
)
CAVEAT = (
    "With few samples per cell, differences of a few points are noise: compare the 95% Wilson "
    "intervals in brackets, not the means."
)

#: What sections say when their results are absent (an earlier run's section may replace them).
NO_BENCH = "No bench.jsonl rows: no speed measurements in this run."
NO_TASKS = "No scored task rows in eval.jsonl."
NO_PLOTS = "Skipped: matplotlib is not installed (`pip install 'kvopt[plot]'`)."
PLACEHOLDERS = (NO_BENCH, NO_TASKS, NO_PLOTS)


def wilson_interval(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a success rate; stays inside [0, 1] and is sane at 0/n and n/n.

    ``successes`` (and ``n``, for a share of summed partial scores) may be fractional, which treats
    the mean score as a proportion: an approximation, but the right width for the 0/1 scores most
    tasks produce.
    ``n == 0`` gives (0, 1): nothing is known.
    """
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    z2 = z * z
    denominator = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    # The bounds contain p by construction; min/max keep a rounding error at 0/n or n/n from crossing it.
    return min(max(0.0, centre - half), p), max(min(1.0, centre + half), p)


# --------------------------------------------------------------------------- grouping helpers


@dataclass(frozen=True)
class MethodInfo:
    """What the report knows about one method spec, gathered over all its rows."""

    spec: str
    name: str
    family: str
    ratios: tuple[float, ...]

    @property
    def is_baseline(self) -> bool:
        return self.name in BASELINES

    @property
    def is_peer(self) -> bool:
        return self.family != "kvopt"

    def sort_key(self) -> tuple:
        """Baselines first, then kvopt before peers, then by method and budget."""
        family_rank = (0, self.family) if self.family == "kvopt" else (1, self.family)
        baseline_rank = BASELINES.index(self.name) if self.is_baseline else len(BASELINES)
        return (baseline_rank, family_rank, self.name, min(self.ratios, default=-1.0), self.spec)

    def ratio_text(self) -> str:
        if not self.ratios:
            return ""
        low, high = min(self.ratios), max(self.ratios)
        return f"{low:g}" if low == high else f"{low:g}–{high:g}"


def _spec(row: Row) -> str:
    return str(row.get("method") or row.get("method_name") or "unknown")


def _methods(rows: Iterable[Row]) -> dict[str, MethodInfo]:
    """Spec -> MethodInfo, so every table and plot sorts and labels methods the same way."""
    names: dict[str, str] = {}
    families: dict[str, str] = {}
    ratios: dict[str, set[float]] = defaultdict(set)
    for row in rows:
        spec = _spec(row)
        names.setdefault(spec, str(row.get("method_name") or spec))
        families.setdefault(spec, str(row.get("family") or "kvopt"))
        if row.get("ratio") is not None:
            ratios[spec].add(float(row["ratio"]))
    return {spec: MethodInfo(spec, names[spec], families[spec], tuple(sorted(ratios[spec]))) for spec in names}


def _ordered(methods: dict[str, MethodInfo]) -> list[MethodInfo]:
    return sorted(methods.values(), key=MethodInfo.sort_key)


def _group(rows: Iterable[Row], key: Callable[[Row], Any]) -> dict[Any, list[Row]]:
    groups: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return groups


def _modes(rows: Iterable[Row]) -> list[str]:
    found = {str(row.get("mode")) for row in rows}
    return [m for m in MODE_ORDER if m in found] + sorted(found - set(MODE_ORDER))


def _baseline(specs: Iterable[str], methods: dict[str, MethodInfo]) -> str | None:
    """The reference spec among ``specs``: "hf" if present, else "full"."""
    present = {methods[s].name: s for s in specs if methods[s].is_baseline}
    return next((present[name] for name in BASELINES if name in present), None)


def _kept_fraction(row: Row) -> float | None:
    """Fraction of the full cache's bytes held at peak; from ``compression`` if bytes are absent."""
    full = row.get("kv_bytes_full")
    if full and row.get("kv_bytes_peak") is not None:
        return float(row["kv_bytes_peak"]) / float(full)
    if row.get("compression") is not None:
        return 1.0 - float(row["compression"])
    return None


@dataclass(frozen=True)
class Score:
    mean: float
    low: float
    high: float
    n: int

    def cell(self) -> str:
        return f"{self.mean:.0%} [{self.low * 100:.0f}–{self.high * 100:.0f}] (n={self.n})"


def accuracy_score(rows: list[Row]) -> Score | None:
    """Mean score with its Wilson interval; successes = sum of (possibly partial) scores."""
    if not rows:
        return None
    total = sum(float(row["score"]) for row in rows)
    low, high = wilson_interval(total, len(rows))
    return Score(total / len(rows), low, high, len(rows))


def _median(values: Iterable[Any]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


def _slug(text: str) -> str:
    """File-name-safe form of a spec: no ':' '=' ',' or spaces, which break links and some file systems."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "method"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


# --------------------------------------------------------------------------- markdown sections


def _header(title: str, results_dir: Path, eval_rows: list[Row], tasks: list[Row], bench: list[Row]) -> list[str]:
    models = sorted({str(r["model"]) for r in eval_rows + bench if r.get("model")})
    task_names = sorted({str(r.get("task")) for r in tasks})
    ppl_count = len(eval_rows) - len(tasks)
    return [
        f"# {title}",
        "",
        f"- Results: `{results_dir}`",
        f"- Model(s): {', '.join(models) or 'not recorded'}",
        f"- Rows: {len(eval_rows)} in eval.jsonl ({len(tasks)} scored task rows, {ppl_count} other), "
        f"{len(bench)} in bench.jsonl",
        f"- Tasks: {', '.join(task_names) or 'none'}",
        f"- Modes: {', '.join(_modes(tasks)) or 'none'}",
        "",
        f"> {CAVEAT} Cells read `mean% [low–high] (n=samples)`.",
        "",
    ]


def _accuracy_table(rows: list[Row], methods: dict[str, MethodInfo]) -> list[str]:
    """Methods x lengths, plus an all-lengths column, so a budget's cost reads along a row."""
    lengths = sorted({r.get("length") for r in rows if r.get("length") is not None})
    cells = _group(rows, lambda r: (_spec(r), r.get("length")))
    by_spec = _group(rows, _spec)
    body = []
    for info in _ordered({s: methods[s] for s in by_spec}):
        scores = [accuracy_score(cells.get((info.spec, length), [])) for length in lengths]
        scores.append(accuracy_score(by_spec[info.spec]))
        cells_text = [score.cell() if score else "–" for score in scores]
        held = _median(_kept_fraction(r) for r in by_spec[info.spec])
        held_text = f"{held:.2f}" if held is not None else "–"
        body.append([f"`{info.spec}`", info.family, info.ratio_text(), held_text, *cells_text])
    header = ["method", "family", "ratio", "KV held"] + [str(n) for n in lengths] + ["all lengths"]
    return _table(header, body)


def _accuracy_section(tasks: list[Row], methods: dict[str, MethodInfo]) -> list[str]:
    if not tasks:
        return ["## Accuracy", "", NO_TASKS, ""]
    lines = ["## Accuracy", "", "Columns are context lengths in tokens; `ratio` is the nominal fraction of context "
             "tokens removed; `KV held` is the median peak KV bytes over a full cache's bytes at the same length "
             "(measured from the tensors).", ""]
    for mode in _modes(tasks):
        in_mode = [r for r in tasks if str(r.get("mode")) == mode]
        by_task = _group(in_mode, lambda r: str(r.get("task")))
        lines += [f"### Mode `{mode}`", ""]
        if len(by_task) > 1:
            for task in sorted(by_task):
                lines += [f"#### {task}", ""] + _accuracy_table(by_task[task], methods) + [""]
            lines += ["#### all tasks", ""]
        lines += _accuracy_table(in_mode, methods) + [""]
    return lines


def _prompt_key(row: Row) -> tuple:
    return tuple(row.get(k) for k in ("mode", "task", "length", "depth", "sample", "seed"))


def _scores_by_prompt(rows: Iterable[Row]) -> dict[tuple, float]:
    """Score per prompt identity, the first row of a prompt counting (a re-run prompt is not weighed twice)."""
    scores: dict[tuple, float] = {}
    for row in rows:
        scores.setdefault(_prompt_key(row), min(max(float(row["score"]), 0.0), 1.0))
    return scores


@dataclass(frozen=True)
class Retention:
    """A method's answers next to the reference's on the prompts both ran: the one definition of "kept".

    ``kept`` is the share of the reference's correct answers the method also gives: over the
    prompts both ran (paired by prompt identity), the sum of min(method, reference) over the sum of
    the reference's scores (``answered``). With 0/1 scores that is exactly "of the prompts the
    reference answers, the share the method answers too"; a prompt with a partial score (RULER's
    niah_multivalue finds 2 of 4 values: 0.5) counts with the reference's weight, and the method is
    credited at most that much, so gains on prompts the reference misses never count and no share
    exceeds 100%. The 95% Wilson interval treats ``answered`` as the number of trials. ``accuracy``
    (the method's own mean score on the same prompts) goes beside it, because a method can keep
    little of the reference's answers while scoring as high on other prompts.
    """

    prompts: int
    answered: float
    accuracy: float
    reference_accuracy: float
    kept: float
    low: float
    high: float

    def cell(self) -> str:
        """``kept% [low–high] of N``: the share, its interval and the reference answers it is a share of."""
        return f"{self.kept:.0%} [{self.low * 100:.0f}–{self.high * 100:.0f}] of {self.answered:.4g}"

    def with_accuracy(self, reference: str = "full") -> str:
        """:meth:`cell` with both accuracies beside it, for summaries that have no accuracy column."""
        return f"{self.cell()} (accuracy {self.accuracy:.0%} vs {reference}'s {self.reference_accuracy:.0%})"


def retention(rows: list[Row], reference: list[Row]) -> Retention | None:
    """``rows`` (one method's) against ``reference``'s, paired by prompt; None when the reference solved none."""
    reference_scores = _scores_by_prompt(reference)
    pairs = [(mine, reference_scores[key]) for key, mine in _scores_by_prompt(rows).items() if key in reference_scores]
    answered = sum(ref for _, ref in pairs)
    if not answered:
        return None
    kept = sum(min(mine, ref) for mine, ref in pairs)
    low, high = wilson_interval(kept, answered)
    accuracy = sum(mine for mine, _ in pairs) / len(pairs)
    return Retention(len(pairs), answered, accuracy, answered / len(pairs), kept / answered, low, high)


def _retention_table(rows: list[Row], methods: dict[str, MethodInfo]) -> list[str]:
    """Each method against the reference on the prompts both answered, so unequal sample sets never mix."""
    by_spec = _group(rows, _spec)
    reference = _baseline(by_spec, methods)
    if reference is None:
        return []
    body = []
    for info in _ordered({s: methods[s] for s in by_spec if s != reference}):
        kept = retention(by_spec[info.spec], by_spec[reference])
        if kept is None:
            continue
        body.append([
            f"`{info.spec}`", info.family, info.ratio_text(), str(kept.prompts),
            f"{kept.accuracy:.0%} vs {kept.reference_accuracy:.0%}", kept.cell(),
        ])  # fmt: skip
    header = ["method", "family", "ratio", "prompts", f"accuracy vs `{reference}`", f"kept of `{reference}`'s answers"]
    return _table(header, body)


def _retention_section(tasks: list[Row], methods: dict[str, MethodInfo]) -> list[str]:
    lines = []
    for mode in _modes(tasks):
        table = _retention_table([r for r in tasks if str(r.get("mode")) == mode], methods)
        if table:
            lines += [f"### Mode `{mode}`", "", *table, ""]
    if not lines:
        return []
    intro = ("Paired on the prompts each method and the reference both ran (all tasks and lengths): `kept` is the "
             f"share of the reference's correct answers the method also gives, with its 95% Wilson interval. {KEPT_RULE}")
    return ["## Share of the full cache's answers kept", "", intro, "", *lines]


def _pooled_ppl(rows: list[Row], ppl_key: str, tokens_key: str) -> tuple[float, int] | None:
    """Token-weighted geometric mean of perplexities (= exp of the pooled mean NLL) and token count."""
    usable = [(float(r[ppl_key]), int(r.get(tokens_key) or 1)) for r in rows if r.get(ppl_key) is not None]
    tokens = sum(t for _, t in usable)
    if not usable or tokens <= 0:
        return None
    return math.exp(sum(t * math.log(p) for p, t in usable) / tokens), tokens


def _ppl_section(ppl_rows: list[Row], methods: dict[str, MethodInfo]) -> list[str]:
    if not ppl_rows:
        return []
    body = []
    for length, at_length in sorted(_group(ppl_rows, lambda r: r.get("length") or 0).items()):
        by_spec = _group(at_length, _spec)
        pooled = {spec: _pooled_ppl(rows, "ppl", "tokens") for spec, rows in by_spec.items()}
        base = _baseline(by_spec, methods)
        for info in _ordered({s: methods[s] for s in by_spec}):
            rows, value = by_spec[info.spec], pooled[info.spec]
            first = _pooled_ppl(rows, "ppl_first", "first_tokens")
            gap = first_gap = "–"
            if value and base and pooled.get(base):
                gap = "baseline" if info.spec == base else f"{(value[0] / pooled[base][0] - 1) * 100:+.1f}%"
                base_first = _pooled_ppl(by_spec[base], "ppl_first", "first_tokens")
                if first and base_first and info.spec != base:
                    first_gap = f"{(first[0] / base_first[0] - 1) * 100:+.1f}%"
            peak = _median(r.get("kv_bytes_peak") for r in rows)
            body.append([
                f"`{info.spec}`",
                str(length or "–"),
                str(value[1]) if value else "–",
                f"{value[0]:.3f}" if value else "–",
                f"{first[0]:.3f} (first {first[1]})" if first else "–",
                gap,
                first_gap,
                human_bytes(peak) if peak is not None else "–",
            ])
    return [
        "## Perplexity",
        "",
        "Pooled over samples as exp(mean NLL per token). Gap is (ppl / baseline ppl − 1) × 100 at the "
        "same length, baseline `hf` if present else `full`.",
        "",
        *_table(
            ["method", "length", "tokens", "ppl", "ppl (first N tokens)", "gap vs baseline", "gap, first N", "peak KV"],
            body,
        ),
        "",
    ]


def _bench_summary(bench: list[Row]) -> dict[tuple[str, Any], dict[str, float | None]]:
    """Median over repeats per (spec, length): robust to the warm-up outlier a first repeat often is."""
    return {
        key: {
            "prefill_s": _median(r.get("prefill_s") for r in rows),
            "decode_tok_s": _median(r.get("decode_tok_s") for r in rows),
            "kv_bytes": _median(r.get("kv_bytes") for r in rows),
            "repeats": len(rows),
        }
        for key, rows in _group(bench, lambda r: (_spec(r), r.get("length"))).items()
    }


def _relative(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}×" if value is not None and reference else "–"


def _bench_section(bench: list[Row], methods: dict[str, MethodInfo]) -> list[str]:
    if not bench:
        return ["## Speed", "", NO_BENCH, ""]
    summary = _bench_summary(bench)
    order = {info.spec: rank for rank, info in enumerate(_ordered(methods))}
    body = []
    for length in sorted({length for _, length in summary}, key=lambda n: (n is None, n)):
        specs = [spec for spec, n in summary if n == length]
        base = _baseline(specs, methods)
        for spec in sorted(specs, key=order.__getitem__):
            stats = summary[(spec, length)]
            ref = summary[(base, length)] if base else {}
            body.append([
                f"`{spec}`",
                str(length),
                str(stats["repeats"]),
                f"{stats['prefill_s']:.3f}" if stats["prefill_s"] is not None else "–",
                f"{stats['decode_tok_s']:.1f}" if stats["decode_tok_s"] is not None else "–",
                human_bytes(stats["kv_bytes"]) if stats["kv_bytes"] is not None else "–",
                _relative(stats["decode_tok_s"], ref.get("decode_tok_s")),
                _relative(stats["kv_bytes"], ref.get("kv_bytes")),
            ])
    return [
        "## Speed",
        "",
        "Medians over repeats. Relative columns divide by the `hf` row at the same length (`full` if no `hf`).",
        "",
        *_table(
            ["method", "length", "repeats", "prefill s", "decode tok/s", "KV bytes",
             "decode vs baseline", "KV vs baseline"],
            body,
        ),
        "",
    ]


# --------------------------------------------------------------------------- plots


def _figure(width: float = 9.0, height: float = 5.0):
    """A figure on an explicit Agg canvas: no pyplot, so no global backend switch or figure registry."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _colours(methods: dict[str, MethodInfo]) -> dict[str, Any]:
    """One colour per method_name, fixed over all plots, so budgets of a method read as a family."""
    from matplotlib import colormaps

    names = list(dict.fromkeys(info.name for info in _ordered(methods)))
    palette = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: palette(i % palette.N) for i, name in enumerate(names)}


def _plot_frontier(tasks: list[Row], methods: dict[str, MethodInfo], mode: str, path: Path) -> bool:
    """Accuracy vs bytes kept: the trade-off a method's budgets buy, with intervals to judge overlap."""
    points = []
    for spec, rows in _group(tasks, _spec).items():
        kept = [k for k in map(_kept_fraction, rows) if k is not None]
        if kept:
            points.append((methods[spec], statistics.fmean(kept), accuracy_score(rows)))
    if not points:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    by_name = _group(points, lambda p: p[0].name)
    ordered_names = sorted(by_name, key=lambda n: min(p[0].sort_key() for p in by_name[n]))
    colours = _colours(methods)
    compressed = [n for n in ordered_names if n not in BASELINES]
    for name in ordered_names:
        group = sorted(by_name[name], key=lambda p: p[1])
        info = group[0][0]
        # Methods sharing a budget would stack their error bars; a small sideways dodge separates them.
        dodge = (compressed.index(name) - (len(compressed) - 1) / 2) * 0.006 if name in compressed else 0.0
        xs = [p[1] + dodge for p in group]
        ys = [p[2].mean * 100 for p in group]
        errors = [[(p[2].mean - p[2].low) * 100 for p in group], [(p[2].high - p[2].mean) * 100 for p in group]]
        label = f"{name} ({info.family})" if info.is_peer and info.family not in name else name
        if info.is_baseline:  # hf is drawn first and bigger, so an identical full stays visible on top
            size = 20 - 7 * BASELINES.index(name)
            axes.axhline(ys[0], color=colours[name], linestyle=":", linewidth=1)
            axes.errorbar(
                xs, ys, yerr=errors, fmt="*", markersize=size, capsize=4, color=colours[name],
                label=f"{label} (baseline)",
            )
            continue
        axes.errorbar(
            xs, ys, yerr=errors, fmt="o", linestyle="--" if info.is_peer else "-",
            capsize=3, color=colours[name], label=label,
        )
        for (member, x, _), y in zip(group, ys):
            if member.ratios:
                axes.annotate(
                    f"r={member.ratio_text()}", (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color=colours[name],
                )
    axes.set_xlim(0, 1.05)
    axes.set_ylim(-3, 108)  # headroom for the ratio labels of points at 100%
    axes.set_xlabel("KV cache kept (peak bytes / full-cache bytes; points dodged sideways slightly)")
    axes.set_ylabel("accuracy (mean score, %)")
    axes.set_title(f"Accuracy vs KV memory, mode {mode} (all tasks and lengths; bars: 95% Wilson)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides data
    figure.savefig(path, dpi=DPI)
    return True


def _heatmap_choice(depth_rows: list[Row], methods: dict[str, MethodInfo]) -> list[tuple[str, str]]:
    """(spec, mode) pairs to draw, capped: the baseline first, then each method's harshest budget.

    Returned in reading order (mode, then method) rather than priority order.
    """
    pairs = sorted({(_spec(r), str(r.get("mode"))) for r in depth_rows})
    baseline = _baseline({spec for spec, _ in pairs}, methods)
    harshest: dict[str, MethodInfo] = {}
    for info in (methods[s] for s, _ in pairs):
        best = harshest.get(info.name)
        if best is None or max(info.ratios, default=-1) > max(best.ratios, default=-1):
            harshest[info.name] = info
    mode_rank = {mode: i for i, mode in enumerate(_modes(depth_rows))}

    def reading_order(pair: tuple[str, str]) -> tuple:
        return (mode_rank[pair[1]], methods[pair[0]].sort_key())

    def priority(pair: tuple[str, str]) -> tuple:
        info = methods[pair[0]]
        tier = 0 if info.spec == baseline else 1 if harshest[info.name] is info and not info.is_baseline else 2
        return (tier, *reading_order(pair))

    return sorted(sorted(pairs, key=priority)[:MAX_HEATMAPS], key=reading_order)


def _plot_heatmap(rows: list[Row], spec: str, mode: str, path: Path) -> None:
    """The needle-in-a-haystack picture: where in the context (depth) and at which length retrieval fails."""
    import numpy as np

    lengths = sorted({r["length"] for r in rows if r.get("length") is not None})
    depths = sorted({float(r["depth"]) for r in rows})
    cells = _group(rows, lambda r: (r.get("length"), float(r["depth"])))
    grid = np.full((len(depths), len(lengths)), np.nan)
    counts = np.zeros_like(grid, dtype=int)
    for (length, depth), members in cells.items():
        if length in lengths:
            grid[depths.index(depth), lengths.index(length)] = statistics.fmean(float(r["score"]) for r in members)
            counts[depths.index(depth), lengths.index(length)] = len(members)
    figure = _figure(max(4.5, 1.1 * len(lengths) + 2.5), max(3.5, 0.55 * len(depths) + 2))
    axes = figure.add_subplot()
    image = axes.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    axes.set_facecolor("lightgrey")
    for (y, x), value in np.ndenumerate(grid):
        text = "no data" if np.isnan(value) else f"{value:.2f}\nn={counts[y, x]}"
        axes.text(x, y, text, ha="center", va="center", fontsize=8)
    axes.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    axes.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("needle depth (% of context)")
    tasks = ", ".join(sorted({str(r.get("task")) for r in rows}))
    axes.set_title(f"{spec}, {mode}\ntasks: {tasks}", fontsize=9)
    figure.colorbar(image, ax=axes, label="mean score (0–1)")
    figure.savefig(path, dpi=DPI)


def _plot_by_length(
    series: dict[str, dict[Any, float]], methods: dict[str, MethodInfo], ylabel: str, title: str, path: Path
) -> bool:
    """One line per method over context length; log2 x because lengths are usually powers of two."""
    series = {spec: points for spec, points in series.items() if points}
    if not series:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    specs = [info.spec for info in _ordered({s: methods[s] for s in series})]
    colours = _colours(methods)
    budget_index: dict[str, int] = defaultdict(int)
    for rank, spec in enumerate(specs):
        lengths = sorted(series[spec])
        info = methods[spec]
        marker = "*" if info.is_baseline else MARKERS[budget_index[info.name] % len(MARKERS)]
        budget_index[info.name] += 1
        # Earlier lines are wider, so identical series (hf and full) remain distinguishable.
        axes.plot(
            lengths, [series[spec][n] for n in lengths], marker=marker,
            linestyle="--" if info.is_peer else "-", color=colours[info.name], label=spec,
            linewidth=max(1.5, 3.5 - rank), markersize=max(6, 12 - 3 * rank), alpha=0.9,
        )
    all_lengths = sorted({n for points in series.values() for n in points})
    if len(all_lengths) > 1 and all_lengths[0] > 0:
        axes.set_xscale("log", base=2)
    axes.set_xticks(all_lengths, [str(n) for n in all_lengths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides data
    figure.savefig(path, dpi=DPI)
    return True


def _plots_section(
    tasks: list[Row], bench: list[Row], methods: dict[str, MethodInfo], out_dir: Path
) -> list[str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ["## Plots", "", NO_PLOTS, ""]
    lines = ["## Plots: accuracy", ""]
    for mode in _modes(tasks):
        name = f"frontier_{_slug(mode)}.png"
        if _plot_frontier([r for r in tasks if str(r.get("mode")) == mode], methods, mode, out_dir / name):
            lines += [f"![Accuracy vs KV bytes kept, {mode}]({name})", ""]

    depth_rows = [r for r in tasks if r.get("depth") is not None]
    chosen = _heatmap_choice(depth_rows, methods)
    cells = _group(depth_rows, lambda r: (_spec(r), str(r.get("mode"))))
    used: set[str] = set()
    for spec, mode in chosen:
        name = f"heatmap_{_slug(spec)}_{_slug(mode)}.png"
        if name in used:  # two specs differing only in punctuation
            name = name.replace(".png", f"-{len(used)}.png")
        used.add(name)
        _plot_heatmap(cells[(spec, mode)], spec, mode, out_dir / name)
        lines += [f"![Score by length and depth, {spec}, {mode}]({name})", ""]
    skipped = len({(_spec(r), str(r.get("mode"))) for r in depth_rows}) - len(chosen)
    if skipped > 0:
        lines += [f"{skipped} more (method, mode) heatmaps omitted to keep the report small; "
                  "the tables cover them.", ""]
    if len(lines) == 2:
        lines = []

    # A section of its own: its plots come from other results than the accuracy plots.
    by_length = ["## Plots: memory and speed", ""]
    memory, speed, source = _length_series(tasks, bench)
    memory_title = f"KV memory vs context length ({source})"
    if _plot_by_length(memory, methods, "KV cache (MB, 10^6 bytes)", memory_title, out_dir / "memory_vs_length.png"):
        by_length += ["![KV memory vs context length](memory_vs_length.png)", ""]
    speed_title = "Decode speed vs context length (median over repeats)"
    if _plot_by_length(speed, methods, "decode speed (tokens/s)", speed_title, out_dir / "speed_vs_length.png"):
        by_length += ["![Decode speed vs context length](speed_vs_length.png)", ""]
    return lines + (by_length if len(by_length) > 2 else [])


Series = dict[str, dict[Any, float]]


def _length_series(tasks: list[Row], bench: list[Row]) -> tuple[Series, Series, str]:
    """(KV MB, decode tok/s) per spec and length; memory falls back to eval peaks when nothing was benchmarked."""
    memory: Series = defaultdict(dict)
    speed: Series = defaultdict(dict)
    if bench:
        for (spec, length), stats in _bench_summary(bench).items():
            if length is not None and stats["kv_bytes"] is not None:
                memory[spec][length] = stats["kv_bytes"] / 1e6
            if length is not None and stats["decode_tok_s"] is not None:
                speed[spec][length] = stats["decode_tok_s"]
        return memory, speed, "bench.jsonl, median over repeats"
    for (spec, length), rows in _group(tasks, lambda r: (_spec(r), r.get("length"))).items():
        peaks = [float(r["kv_bytes_peak"]) for r in rows if r.get("kv_bytes_peak") is not None]
        if length is not None and peaks:
            memory[spec][length] = statistics.fmean(peaks) / 1e6
    return memory, speed, "eval.jsonl task rows, mean peak"


# --------------------------------------------------------------------------- entry point


def write_report(results_dir: Path, out_dir: Path, title: str | None = None) -> Path:
    """Write ``out_dir/REPORT.md`` and its PNGs from ``results_dir``; returns the REPORT.md path."""
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if not results_dir.is_dir():
        raise KVOptError(f"results folder {results_dir} does not exist; pass the folder holding eval.jsonl")
    report = writable_file(out_dir / "REPORT.md", "--out")
    eval_rows = load_rows(results_dir / "eval.jsonl", EVAL_ROW_KEYS)
    bench = load_rows(results_dir / "bench.jsonl", BENCH_ROW_KEYS)
    tasks = [r for r in eval_rows if r.get("score") is not None and r.get("task") != "ppl"]
    ppl_rows = [r for r in eval_rows if r.get("ppl") is not None]
    methods = _methods(eval_rows + bench)

    lines = _header(title or "kvopt evaluation report", results_dir, eval_rows, tasks, bench)
    if not eval_rows:
        state = "is empty" if (results_dir / "eval.jsonl").is_file() else "is missing"
        lines += [f"**{results_dir / 'eval.jsonl'} {state}: no accuracy or perplexity results.**", ""]
    lines += _accuracy_section(tasks, methods) if eval_rows else []
    lines += _retention_section(tasks, methods)
    lines += _ppl_section(ppl_rows, methods)
    lines += _bench_section(bench, methods)
    lines += _plots_section(tasks, bench, methods, out_dir)
    report.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return report


KEPT_NOTE = (
    "> Kept from an earlier run: this run had no results for this section (its results folder lacked them); "
    "rerun its step to refresh it."
)


def _sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``(preamble, [(key, section text)])``, split at level-2 headings (``## ``).

    The key is the heading without a trailing parenthesis, so a section measured with other
    settings (``(8192-token prefill)``) replaces its earlier version instead of joining it.
    """
    parts = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    preamble, sections = ("", parts) if text.startswith("## ") else (parts[0], parts[1:])
    return preamble, [(re.sub(r"\s*\(.*\)$", "", section.splitlines()[0]), section) for section in sections]


def _has_results(section: str) -> bool:
    return not any(placeholder in section for placeholder in PLACEHOLDERS)


def keep_sections(new: str, old: str) -> tuple[str, list[str]]:
    """``new`` plus the sections of ``old`` it lacks, each in its old place, marked as kept.

    A report regenerated from a partial results folder (a step re-run alone) would otherwise drop
    every section it has no results for (or say only that: :data:`PLACEHOLDERS`). Returns the
    merged text and the headings kept.
    """
    preamble, merged = _sections(new)
    merged = [(key, text) for key, text in merged if _has_results(text)]
    present = {key for key, _ in merged}
    old_sections = [(key, text) for key, text in _sections(old)[1] if _has_results(text)]
    kept = []
    for index, (key, text) in enumerate(old_sections):
        if key in present:
            continue
        earlier = {k for k, _ in old_sections[:index]}
        position = max((i + 1 for i, (k, _) in enumerate(merged) if k in earlier), default=0)
        if KEPT_NOTE not in text:
            first, _, rest = text.partition("\n")
            text = f"{first}\n\n{KEPT_NOTE}\n\n{rest.lstrip(chr(10))}"
        merged.insert(position, (key, text))
        kept.append(key)
    return preamble + "".join(text.rstrip("\n") + "\n\n" for _, text in merged), kept  # a blank line between sections
