"""The workloads bench.engines runs against each worker configuration.

    uniform       1, 16, 64 players x 4 requests x 100 tokens, EOS ignored: raw batching
    mixed         64 players, prompts ~20-1500 tokens, max_tokens 10-300, EOS honoured: a real
                  crowd, where static batching pads to the longest prompt and waits for the
                  longest answer
    prefix        16 players streaming, every prompt opening with the same ~300-token system
                  text: what a prefix cache saves, seen in time to first token
    interference  a ~2,000-token prompt arrives while 16 players stream (bench.interference)

Each scenario returns rows: dicts with a "case" (what the row is, e.g. "16 players") and the
numbers bench.load or bench.interference measured. Sizes holds every knob, so one flag can
shrink them all for a smoke run.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable

from bench.interference import PERIODS, run_interference
from bench.load import run_crowd
from bench.prompts import RequestShape


@dataclass(frozen=True)
class Sizes:
    players: tuple[int, ...] = (1, 16, 64)  # uniform crowds
    requests: int = 4  # per player, in every crowd
    tokens: int = 100  # max_tokens where it is fixed (uniform, prefix, interference players)
    crowd: int = 64  # players of the mixed crowd
    prompt_tokens: tuple[int, int] = (20, 1500)  # mixed
    max_tokens: tuple[int, int] = (10, 300)  # mixed
    stream_players: int = 16  # prefix and interference
    system_prompt_tokens: int = 300  # prefix
    long_prompt_tokens: int = 2000  # interference
    delay: float = 2.0  # interference: seconds of calm before the long prompt


# Small enough that all four scenarios take about a minute per configuration on 2 CPU cores.
SMOKE = Sizes(players=(1, 4), requests=1, tokens=8, crowd=4, prompt_tokens=(20, 200),
              max_tokens=(4, 16), stream_players=4, system_prompt_tokens=300,
              long_prompt_tokens=500, delay=2.0)


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    fmt: str
    better: str = "higher"  # or "lower": said in the table, so a ratio reads the right way


@dataclass(frozen=True)
class Scenario:
    name: str
    describe: Callable[[Sizes], str]
    run: Callable[..., list[dict]]  # (url, model, sizes, seed, log) -> rows
    metrics: tuple[Metric, ...] = field(default=())


TPS = Metric("tokens_per_s", "tok/s", ".1f")
MEDIAN = Metric("median_s", "median s", ".2f", "lower")
P95 = Metric("p95_s", "p95 s", ".2f", "lower")
ERRORS = Metric("errors", "errors", "d", "-")
TTFT_MEDIAN = Metric("ttft_median_s", "TTFT med s", ".3f", "lower")
TTFT_P95 = Metric("ttft_p95_s", "TTFT p95 s", ".3f", "lower")
GAP_MEDIAN = Metric("gap_median_ms", "gap med ms", ".1f", "lower")
GAP_P95 = Metric("gap_p95_ms", "gap p95 ms", ".1f", "lower")
GAP_MAX = Metric("gap_max_ms", "gap max ms", ".1f", "lower")
# Counted by the worker itself (bench.engines reads them from its heartbeat), where it can.
PREFIX_HITS = Metric("worker_prefix_hit_tokens", "prefix-cache hits (tokens)", "d", "-")
PREEMPTED = Metric("worker_preempted", "preempted", "d", "-")


def _uniform(url, model, sizes: Sizes, seed: int, log) -> list[dict]:
    rows = []
    for players in sizes.players:
        row = run_crowd(url, model, players, sizes.requests, sizes.tokens, seed=seed)
        rows.append({"case": f"{players} players", **row})
    return rows


def _mixed(url, model, sizes: Sizes, seed: int, log) -> list[dict]:
    shape = RequestShape(max_tokens=sizes.max_tokens, prompt_tokens=sizes.prompt_tokens)
    row = run_crowd(url, model, sizes.crowd, sizes.requests, seed=seed, shape=shape,
                    ignore_eos=False)
    return [{"case": f"{sizes.crowd} players", **row}]


def _prefix(url, model, sizes: Sizes, seed: int, log) -> list[dict]:
    shape = replace(RequestShape.fixed(sizes.tokens), system_tokens=sizes.system_prompt_tokens)
    row = run_crowd(url, model, sizes.stream_players, sizes.requests, seed=seed, shape=shape,
                    stream=True)
    return [{"case": f"{sizes.stream_players} players", **row}]


def _interference(url, model, sizes: Sizes, seed: int, log) -> list[dict]:
    result = run_interference(url, model, sizes.stream_players, sizes.tokens,
                              long_prompt_tokens=sizes.long_prompt_tokens, delay=sizes.delay,
                              seed=seed, log=log)
    rows = [{"case": f"gaps {name}", **result["periods"][name]} for name in PERIODS]
    long_failed = [f"long prompt: {result['long_error']}"] if result["long_error"] else []
    rows.append({"case": "long prompt", "detail": result,
                 **{k: result[k] for k in ("long_ttft_s", "long_seconds", "stall_ratio",
                                           "player_ttft_while_max_s")},
                 "errors": result["errors"] + len(long_failed),
                 "error_samples": long_failed + result["error_samples"]})
    return rows


SCENARIOS = {s.name: s for s in (
    Scenario("uniform",
             lambda z: f"{'/'.join(map(str, z.players))} players x {z.requests} requests x "
                       f"{z.tokens} tokens, EOS ignored",
             _uniform, (TPS, MEDIAN, P95, ERRORS)),
    Scenario("mixed",
             lambda z: f"{z.crowd} players x {z.requests} requests, prompts ~"
                       f"{z.prompt_tokens[0]}-{z.prompt_tokens[1]} tokens, max_tokens "
                       f"{z.max_tokens[0]}-{z.max_tokens[1]}, EOS honoured",
             _mixed, (TPS, MEDIAN, P95, Metric("median_s_per_token", "s/token", ".4f", "lower"),
                      Metric("tokens", "tokens written", "d", "-"),
                      Metric("prompt_tokens_median", "prompt med", ".0f", "-"), PREFIX_HITS,
                      PREEMPTED, ERRORS)),
    Scenario("prefix",
             lambda z: f"{z.stream_players} players x {z.requests} requests x {z.tokens} tokens, "
                       f"streamed, each prompt opening with the same ~{z.system_prompt_tokens}"
                       "-token system text",
             _prefix, (TTFT_MEDIAN, TTFT_P95, TPS, MEDIAN, GAP_MEDIAN, GAP_P95, PREFIX_HITS,
                       ERRORS)),
    Scenario("interference",
             lambda z: f"a ~{z.long_prompt_tokens}-token prompt arrives {z.delay:g} s into "
                       f"{z.stream_players} players streaming {z.tokens}-token stories",
             _interference,
             (GAP_MEDIAN, GAP_P95, GAP_MAX,
              Metric("max_over_median", "max/median", ".1f", "lower"),
              Metric("long_ttft_s", "long TTFT s", ".2f", "lower"),
              Metric("stall_ratio", "stall x", ".1f", "lower"),
              Metric("player_ttft_while_max_s", "players TTFT max s", ".2f", "lower"), ERRORS)),
)}


def combine_repeats(repeats: list[list[dict]]) -> list[dict]:
    """One list of rows from several runs of a scenario: each number is the median over the
    runs (errors are summed: one is one too many), matched by case; each row keeps every run's
    own numbers under "repeats"."""
    if len(repeats) == 1:
        return repeats[0]
    combined = []
    for i, first in enumerate(repeats[0]):
        runs = [rows[i] for rows in repeats if i < len(rows) and rows[i]["case"] == first["case"]]
        row = {}
        for key, value in first.items():
            values = [r.get(key) for r in runs]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if key == "errors":
                row[key] = sum(numbers)
            elif numbers and len(numbers) == len([v for v in values if v is not None]):
                row[key] = statistics.median(numbers)
            else:
                row[key] = value
        row["repeats"] = runs
        combined.append(row)
    return combined
