"""What the benches print and write: tables, JSON files and charts, in one place.

A bench measures and hands its rows here; this module turns them into the text a terminal shows
and the files docs/results/ keeps. Keeping the two apart means a table column or a JSON field
is spelled once (docs link the JSON files, so their field names do not change), and every chart
is drawn the same way: matplotlib's Agg backend, imported only when something is drawn, so a
bench that only measures never pays for it and never needs a display.

    the crowd table and chart   bench.load, bench.compare: a row per crowd size, runs as lines
    side-by-side tables/charts  bench.engines: a column per configuration, ratios to the first
    cells, JSON, figures        every bench (soak_report, scale_workers, structured, redis_cost...)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from bench.stats import ratio

COLUMNS = ("players", "ok", "errors", "wall s", "tok/s", "median s", "p95 s", "ms/tok")
STREAM_COLUMNS = ("TTFT med", "TTFT p95", "gap med", "gap p95", "gap max")


# --- cells, JSON, figures --------------------------------------------------------------------

def cell(value, fmt: str) -> str:
    """A table cell: '-' for nothing (a crowd where every request failed); a median of whole
    numbers may be x.5, so a "d" format falls back to a general one."""
    if value is None:
        return "-"
    try:
        return format(value, fmt)
    except (ValueError, TypeError):
        return format(value, "g")


def write_json(path: str | Path, data, indent: int = 2) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


def pyplot():
    """matplotlib.pyplot on the Agg backend, which renders straight to files."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# --- the crowd table and chart (bench.load, bench.compare) ------------------------------------

def format_row(row: Optional[dict], stream: bool = False) -> str:
    """A table line for a crowd's `row`, or the header when row is None; a streamed crowd's line
    (and the header with stream=True) also has TTFT in seconds and the gaps between chunks in ms."""
    if row is None:  # the header
        cells = COLUMNS + (STREAM_COLUMNS if stream else ())
    else:
        ms_tok = row["median_s_per_token"] and row["median_s_per_token"] * 1000
        cells = (row["players"], row["requests"], row["errors"], cell(row["seconds"], ".2f"),
                 cell(row["tokens_per_s"], ".1f"), cell(row["median_s"], ".3f"),
                 cell(row["p95_s"], ".3f"), cell(ms_tok, ".1f"))
        if row.get("stream"):
            cells += (cell(row["ttft_median_s"], ".3f"), cell(row["ttft_p95_s"], ".3f"),
                      cell(row["gap_median_ms"], ".1f"), cell(row["gap_p95_ms"], ".1f"),
                      cell(row["gap_max_ms"], ".1f"))
    return "  ".join(f"{c:>9}" for c in cells)


def load_runs(path: str | Path) -> list[dict]:
    path = Path(path)
    return json.loads(path.read_text())["runs"] if path.exists() else []


def merge_run(runs: list[dict], run: dict) -> list[dict]:
    """Replace any run with the same label, so re-running a config updates it."""
    return [r for r in runs if r["label"] != run["label"]] + [run]


def write_runs(runs: list[dict], path: str | Path) -> None:
    write_json(path, {"runs": runs})


def plot_crowds(runs: list[dict], path: str | Path) -> None:
    """Throughput and latency (and TTFT, when streamed) by crowd size, a line per run."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    streamed = any(r.get("stream") for run in runs for r in run["rows"])
    fig, axes = plt.subplots(1, 3 if streamed else 2, figsize=(19 if streamed else 13, 5.2),
                             layout="constrained")
    ax_tps, ax_lat = axes[0], axes[1]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        rows = [r for r in run["rows"] if r["median_s"] is not None]
        xs = [r["players"] for r in rows]
        ax_tps.plot(xs, [r["tokens_per_s"] for r in rows], "o-", color=colour, label=run["label"])
        for r in rows:  # a crowd measured in several rounds: the line is their median, each a dot
            rounds = r.get("tokens_per_s_rounds") or []
            ax_tps.plot([r["players"]] * len(rounds), rounds, ".", color=colour, alpha=0.35)
        ax_lat.plot(xs, [r["median_s"] for r in rows], "o-", color=colour, label=run["label"])
        ax_lat.plot(xs, [r["p95_s"] for r in rows], "s--", color=colour, alpha=0.7)
        if streamed:
            rows = [r for r in rows if r.get("ttft_median_s") is not None]
            xs = [r["players"] for r in rows]
            axes[2].plot(xs, [r["ttft_median_s"] for r in rows], "o-", color=colour,
                         label=run["label"])
            axes[2].plot(xs, [r["ttft_p95_s"] for r in rows], "s--", color=colour, alpha=0.7)

    ticks = sorted({r["players"] for run in runs for r in run["rows"]})
    panels = [(ax_tps, "Throughput", "output tokens / s (all players)"),
              (ax_lat, "Request latency", "seconds per request")]
    if streamed:
        panels.append((axes[2], "Time to first token", "seconds"))
    for ax, title, ylabel in panels:
        ax.set(title=title, ylabel=ylabel, xlabel="players (concurrent clients)")
        ax.set_xscale("log", base=2)
        # Label exactly the crowd sizes measured, not powers of two matplotlib picks.
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
    ax_tps.set_ylim(bottom=0)
    # Waits range from seconds to minutes between configurations: a log scale shows both.
    ax_lat.set_yscale("log")
    ax_tps.legend(title="run")
    # Colour says which run, line style says which statistic; say so once in the legend.
    for ax in axes[1:]:
        handles, _ = ax.get_legend_handles_labels()
        handles += [Line2D([], [], color="grey", ls="-", label="median"),
                    Line2D([], [], color="grey", ls="--", label="p95")]
        ax.legend(handles=handles)
    if runs:
        desc = {f"{r['tokens']} tokens x {r['requests']} requests per player" for r in runs}
        fig.suptitle("Storyteller crowd load: " + "; ".join(sorted(desc)))
    save_figure(fig, path, dpi=120)


# --- side by side: a column per configuration (bench.engines) ---------------------------------

def format_table(name: str, description: str, metrics, results: dict[str, list[dict]],
                 columns: list[str]) -> str:
    """A scenario's table: a line per (case, metric), a column per configuration, then each
    configuration's value as a multiple of the first configuration's."""
    present = [c for c in columns if results.get(c)]
    if not present:
        return f"== {name}: no results"
    base = present[0]
    notes = {"higher": " (higher better)", "lower": " (lower better)"}
    cases = [row["case"] for row in results[base]]
    lines = []
    for index, case in enumerate(cases):
        for metric in metrics:
            values = {c: (results[c][index] if index < len(results[c]) else {}).get(metric.key)
                      for c in present}
            if all(v is None for v in values.values()):
                continue  # a metric this case does not have
            cells = [case, metric.label + notes.get(metric.better, "")]
            cells += [cell(v, metric.fmt) for v in values.values()]
            cells += ["-" if (r := ratio(values[c], values[base])) is None else f"{r:.2f}x"
                      for c in present[1:]]
            lines.append(cells)
    header = ["case", "metric"] + present + [f"{c} / {base}" for c in present[1:]]
    widths = [max(len(str(row[i])) for row in [header] + lines) for i in range(len(header))]

    def line(cells):  # the case and the metric to the left, numbers to the right
        return "  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}"
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([f"== {name}: {description}", line(header)] + [line(c) for c in lines])


def _label(value) -> str:  # a bar's number
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _bars(ax, groups: list[str], series: dict[str, list], title: str, ylabel: str) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series (a configuration)."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [0 if v is None else v for v in values]
        bars = ax.bar(xs, heights, width, label=label)
        ax.bar_label(bars, labels=[_label(v) for v in values],
                     fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _series(results: dict[str, list[dict]], key: str) -> dict[str, list]:
    return {label: [row.get(key) for row in rows] for label, rows in results.items()}


def _cases(results: dict[str, list[dict]]) -> list[str]:
    first = next(iter(results.values()), [])
    return [row["case"] for row in first]


def plot_uniform(ax_pair, results):
    cases = _cases(results)
    _bars(ax_pair[0], cases, _series(results, "tokens_per_s"), "Throughput", "output tokens / s")
    _bars(ax_pair[1], cases, _series(results, "median_s"), "Median request latency", "seconds")


def plot_mixed(ax_pair, results):
    labels = list(results)
    one = {k: [results[k][0].get("tokens_per_s") if results[k] else None] for k in labels}
    _bars(ax_pair[0], ["mixed crowd"], one, "Throughput (tokens really written)",
          "output tokens / s")
    waits = {k: [rows[0].get(m) if rows else None for m in ("median_s", "p95_s")]
             for k, rows in results.items()}
    _bars(ax_pair[1], ["median", "p95"], waits, "Request latency", "seconds")


def plot_prefix(ax_pair, results):
    ttft = {k: [rows[0].get(m) if rows else None for m in ("ttft_median_s", "ttft_p95_s")]
            for k, rows in results.items()}
    _bars(ax_pair[0], ["median", "p95"], ttft, "Time to first token", "seconds")
    tps = {k: [rows[0].get("tokens_per_s") if rows else None] for k, rows in results.items()}
    _bars(ax_pair[1], ["shared prefix"], tps, "Throughput", "output tokens / s")


def plot_interference(ax_pair, results):
    def period_rows(rows):
        return [r for r in rows if r["case"].startswith("gaps ")]
    periods = [r["case"].removeprefix("gaps ") for r in period_rows(next(iter(results.values())))]
    _bars(ax_pair[0], periods, {k: [r.get("gap_max_ms") for r in period_rows(rows)]
                                for k, rows in results.items()},
          "Longest gap between chunks", "ms")
    _bars(ax_pair[1], periods, {k: [r.get("gap_median_ms") for r in period_rows(rows)]
                                for k, rows in results.items()},
          "Median gap between chunks", "ms")


PLOTTERS = {"uniform": plot_uniform, "mixed": plot_mixed, "prefix": plot_prefix,
            "interference": plot_interference}


def plot_scenario(name: str, description: str, results: dict[str, list[dict]],
                  path: str | Path) -> bool:
    """Draw one scenario's results (configuration label -> rows); False if nothing to draw."""
    results = {label: rows for label, rows in results.items() if rows}
    if not results or name not in PLOTTERS:
        return False
    fig, axes = pyplot().subplots(1, 2, figsize=(13, 5), layout="constrained")
    PLOTTERS[name](axes, results)
    fig.suptitle(f"{name}: {description}", fontsize=10)
    save_figure(fig, path)
    return True
