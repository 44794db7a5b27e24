"""The soak's results: what became of every request, and latency around each fault.

Windows around a fault that started at t:
  before   requests that ended in [t - 10 s, t): the service as it was
  during   requests in flight at any moment of [t, t + 20 s): those the fault could touch
  rest     requests in flight during no fault's 20 s: the service between faults
Latency percentiles are over the answered requests of a window (nearest rank: a latency some
request really had), from sending to the last byte.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Optional

from bench.report import cell, pyplot, save_figure, write_json
from bench.soak_client import ANSWERED, FAILED, HUNG_UP, LOST, Attempt
from bench.stats import percentile

BEFORE_S, DURING_S = 10.0, 20.0
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
FAULT_COLOURS = {"kill": "tab:red", "term": "tab:orange", "redis": "tab:purple"}


def window_row(name: str, attempts: list[Attempt]) -> dict:
    answered = [a.latency for a in attempts if a.outcome == ANSWERED]
    ttfts = [a.ttft for a in attempts if a.outcome == ANSWERED and a.ttft is not None]

    def pct(values, q):
        return round(percentile(values, q), 3) if values else None

    outcomes = Counter(a.outcome for a in attempts)
    return {"window": name, "requests": len(attempts), "answered": outcomes[ANSWERED],
            "hung_up": outcomes[HUNG_UP], "failed": outcomes[FAILED], "lost": outcomes[LOST],
            "p50_s": pct(answered, 50), "p95_s": pct(answered, 95), "p99_s": pct(answered, 99),
            "ttft_p50_s": pct(ttfts, 50), "ttft_p95_s": pct(ttfts, 95)}


def windows(attempts: list[Attempt], faults: list[dict]) -> list[dict]:
    rows, touched = [], set()
    for fault in faults:
        t = fault["started"]
        if t is None:
            continue
        before = [a for a in attempts if t - BEFORE_S <= a.done < t]
        during = [a for a in attempts if a.sent < t + DURING_S and a.done >= t]
        touched.update(id(a) for a in during)
        label = f"{fault['label']} at {t:.0f} s"
        rows += [window_row(f"{label}: 10 s before", before), window_row(f"{label}: 20 s after", during)]
    rows.append(window_row("rest (no fault within 20 s)", [a for a in attempts if id(a) not in touched]))
    rows.append(window_row("all", attempts))
    return rows


def summarize(attempts: list[Attempt], faults: list[dict], config: dict, extra: dict) -> dict:
    outcomes = Counter(a.outcome for a in attempts)
    streamed = [a for a in attempts if a.stream and a.outcome in (ANSWERED, HUNG_UP)]
    whole = [a for a in attempts if not a.stream and a.outcome == ANSWERED]
    counts = {
        "sent": len(attempts),
        "answered": outcomes[ANSWERED],
        "answered_streamed": sum(a.stream for a in attempts if a.outcome == ANSWERED),
        "hung_up": outcomes[HUNG_UP],
        "failed": outcomes[FAILED],
        "failed_by": dict(Counter(a.detail for a in attempts if a.outcome == FAILED).most_common()),
        "lost": outcomes[LOST],
        "lost_by": dict(Counter(a.detail for a in attempts if a.outcome == LOST).most_common()),
        "stream_text_mismatch": sum(bool(a.verdict) for a in streamed),
        "stream_mismatch_by": dict(Counter(a.verdict for a in streamed if a.verdict)),
        "whole_text_mismatch": sum(bool(a.verdict) for a in whole),
    }
    return {"config": config, "counts": counts, "faults": faults, "windows": windows(attempts, faults),
            **extra, "requests": [a.to_dict() for a in attempts]}


def passed(summary: dict) -> bool:
    counts = summary["counts"]
    return counts["lost"] == 0 and counts["stream_text_mismatch"] == 0


def _num(value: Optional[float]) -> str:
    return cell(value, ".2f")


def markdown(summary: dict, chart_name: Optional[str]) -> str:
    c, cfg = summary["counts"], summary["config"]
    lines = [f"### Soak: {cfg['players']} players, {cfg['duration']:g} s, {cfg['workers']} workers of "
             f"{cfg['model']} ({cfg['started']})", "",
             f"{cfg['distinct']} distinct requests (prompts of {cfg['prompts']}, max_tokens "
             f"{cfg['max_tokens']}), greedy, dtype {cfg['dtype']}; {cfg['stream_share']:.0%} streamed, "
             f"{cfg['hang_up_share']:.0%} of those hung up after 1-{cfg['hang_up_chunks']} chunks; "
             f"client timeout {cfg['client_timeout']:g} s, request timeout {cfg['request_timeout']:g} s; "
             f"a worker SIGKILLed every {cfg['fault_every']:g} s. Verdict: "
             f"**{'PASS' if passed(summary) else 'FAIL'}** (lost and duplicated stream text must be 0).", "",
             "| requests | count |", "|---|---:|",
             f"| sent | {c['sent']} |",
             f"| answered in full | {c['answered']} ({c['answered_streamed']} streamed) |",
             f"| hung up on purpose (prefix checked) | {c['hung_up']} |",
             f"| failed with a clear error | {c['failed']} |"]
    lines += [f"| &nbsp;&nbsp;{label} | {n} |" for label, n in c["failed_by"].items()]
    lines.append(f"| **lost** (no answer, no clear error) | **{c['lost']}** |")
    lines += [f"| &nbsp;&nbsp;{label} | {n} |" for label, n in c["lost_by"].items()]
    lines.append(f"| **streamed text unlike its reference** (duplicated or different) | "
                 f"**{c['stream_text_mismatch']}** |")
    lines += [f"| &nbsp;&nbsp;{label} | {n} |" for label, n in c["stream_mismatch_by"].items()]
    lines += [f"| whole answers unlike their reference | {c['whole_text_mismatch']} |", "",
              "| at (s) | fault | what happened | new worker serving after (s) |", "|---:|---|---|---:|"]
    for f in summary["faults"]:
        at = "-" if f["started"] is None else f"{f['started']:.1f}"
        lines.append(f"| {at} | {f['label']} | {f['detail']} | {_num(f['recovered_s'])} |")
    lines += ["", "| window | requests | answered | hung up | failed | lost | p50 s | p95 s | p99 s | "
              "TTFT p50 s | TTFT p95 s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in summary["windows"]:
        lines.append(f"| {w['window']} | {w['requests']} | {w['answered']} | {w['hung_up']} | {w['failed']} | "
                     f"{w['lost']} | {_num(w['p50_s'])} | {_num(w['p95_s'])} | {_num(w['p99_s'])} | "
                     f"{_num(w['ttft_p50_s'])} | {_num(w['ttft_p95_s'])} |")
    if chart_name:
        lines += ["", f"![latency over time, faults marked]({chart_name})"]
    return "\n".join(lines) + "\n"


def write(summary: dict, prefix: Path, page: Optional[Path] = None) -> str:
    """<prefix>.json, <prefix>.png, and the soak's section of page (<prefix>.md unless given; the
    rest of that file is left as it is), its chart linked relative to the page. Returns the
    Markdown section."""
    write_json(prefix.with_suffix(".json"), summary, indent=1)
    chart = prefix.with_suffix(".png")
    plot(summary, chart)
    page = page or prefix.with_suffix(".md")
    section = markdown(summary, Path(os.path.relpath(chart, page.parent)).as_posix())
    text = page.read_text() if page.exists() else "# Reliability\n"
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    page.write_text(text)
    return section


def plot(summary: dict, path: Path) -> None:
    rows = summary["requests"]
    fig, ax = pyplot().subplots(figsize=(13, 5.5), layout="constrained")
    for outcome, stream, style, label in [(ANSWERED, False, dict(c="tab:blue", marker="."), "answered, whole"),
                                          (ANSWERED, True, dict(c="tab:green", marker="."), "answered, streamed"),
                                          (FAILED, None, dict(c="tab:red", marker="x"), "failed (clear error)"),
                                          (LOST, None, dict(c="black", marker="X", s=60), "lost")]:
        chosen = [r for r in rows if r["outcome"] == outcome and (stream is None or r["stream"] == stream)]
        if chosen:
            ax.scatter([r["done"] for r in chosen], [r["done"] - r["sent"] for r in chosen],
                       label=f"{label} ({len(chosen)})", alpha=0.5, s=style.pop("s", 12), **style)
    top = max([r["done"] - r["sent"] for r in rows], default=1.0)
    for f in summary["faults"]:
        if f["started"] is not None:
            ax.axvline(f["started"], color=FAULT_COLOURS[f["kind"]], ls="--", lw=1)
            ax.text(f["started"], top, f" {f['kind']}", color=FAULT_COLOURS[f["kind"]], rotation=90,
                    va="top", fontsize=8)
    cfg = summary["config"]
    ax.set(xlabel="seconds since the players started (when the request ended)",
           ylabel="seconds from sending to the end", ylim=(0, top * 1.05),
           title=f"Soak: {cfg['players']} players, {cfg['workers']} workers of {cfg['model']}; "
                 f"faults: kill = worker SIGKILL + restart, term = worker SIGTERM + new one, "
                 f"redis = Redis restart")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)
