"""Charts of a bench.engines run: one PNG per scenario, every configuration side by side."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    # Imported late so the benchmark pays for matplotlib only when it draws, and never needs a
    # display: Agg renders straight to files.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _label(value) -> str:
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
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    PLOTTERS[name](axes, results)
    fig.suptitle(f"{name}: {description}", fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
