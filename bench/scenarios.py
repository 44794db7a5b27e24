"""The workloads bench.engines runs against each worker configuration.

    uniform       1, 16, 64 players x 4 requests x 100 tokens, EOS ignored: raw batching
    mixed         64 players, prompts ~20-1500 tokens, max_tokens 10-300, EOS honoured: a real
                  crowd, where static batching pads to the longest prompt and waits for the
                  longest answer
    prefix        16 players streaming, every prompt opening with the same ~300-token system
                  text: what a prefix cache saves, seen in time to first token
    interference  a ~2,000-token prompt arrives while 16 players stream (bench.interference)

Each is data (a Scenario): which sizes its crowd takes, streamed or not, EOS honoured or not;
Scenario.run reads it and returns rows: dicts with a "case" (what the row is, e.g. "16
players") and the numbers bench.load or bench.interference measured. Sizes holds every knob, so
one flag can shrink them all for a smoke run.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Optional

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


@dataclass(frozen=True)
class Scenario:
    """A workload, declared: which of the Sizes each part of it takes, and how it is asked.

    `players`, `max_tokens`, `prompt_tokens` and `system_tokens` name fields of Sizes, so one
    --smoke (or one flag) resizes every scenario that uses a knob. A crowd scenario is run by
    bench.load.run_crowd, once per crowd size when `players` names several, each a row; an
    interference one by bench.interference, a row per period and one for the long prompt.
    `description` is filled in from the sizes (describe).
    """
    name: str
    description: str
    metrics: tuple[Metric, ...]
    players: str = "players"  # Sizes field: a crowd size, or several (a row each)
    max_tokens: str = "tokens"  # Sizes field: a fixed max_tokens, or a (min, max) span
    prompt_tokens: Optional[str] = None  # Sizes field: a span of prompt lengths (None: one line)
    system_tokens: Optional[str] = None  # Sizes field: the shared system text's length
    stream: bool = False
    ignore_eos: bool = True
    interference: bool = False  # the players stream while a long prompt arrives

    def describe(self, sizes: Sizes) -> str:
        return self.description.format(**{f.name: _shown(f.name, getattr(sizes, f.name))
                                          for f in fields(Sizes)})

    def shape(self, sizes: Sizes) -> RequestShape:
        tokens = getattr(sizes, self.max_tokens)
        return RequestShape(max_tokens=tuple(tokens) if isinstance(tokens, tuple) else (tokens, tokens),
                            prompt_tokens=getattr(sizes, self.prompt_tokens) if self.prompt_tokens else None,
                            system_tokens=getattr(sizes, self.system_tokens) if self.system_tokens else 0)

    def run(self, url: str, model: str, sizes: Sizes, seed: int, log) -> list[dict]:
        """The scenario's rows, each a dict with its "case" and the numbers measured."""
        if self.interference:
            return _interference(url, model, sizes, seed, log)
        crowds = getattr(sizes, self.players)
        return [{"case": f"{players} players",
                 **run_crowd(url, model, players, sizes.requests, seed=seed, shape=self.shape(sizes),
                             ignore_eos=self.ignore_eos, stream=self.stream)}
                for players in (crowds if isinstance(crowds, tuple) else (crowds,))]


def _shown(name: str, value) -> str:
    """A size as a description says it: crowds 1/16/64, spans 20-1500, seconds 2."""
    if isinstance(value, tuple):
        return ("/" if name == "players" else "-").join(map(str, value))
    return format(value, "g") if isinstance(value, float) else str(value)


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
    Scenario("uniform", "{players} players x {requests} requests x {tokens} tokens, EOS ignored",
             (TPS, MEDIAN, P95, ERRORS)),
    Scenario("mixed", "{crowd} players x {requests} requests, prompts ~{prompt_tokens} tokens, "
                      "max_tokens {max_tokens}, EOS honoured",
             (TPS, MEDIAN, P95, Metric("median_s_per_token", "s/token", ".4f", "lower"),
              Metric("tokens", "tokens written", "d", "-"),
              Metric("prompt_tokens_median", "prompt med", ".0f", "-"), PREFIX_HITS, PREEMPTED, ERRORS),
             players="crowd", max_tokens="max_tokens", prompt_tokens="prompt_tokens", ignore_eos=False),
    Scenario("prefix", "{stream_players} players x {requests} requests x {tokens} tokens, streamed, "
                       "each prompt opening with the same ~{system_prompt_tokens}-token system text",
             (TTFT_MEDIAN, TTFT_P95, TPS, MEDIAN, GAP_MEDIAN, GAP_P95, PREFIX_HITS, ERRORS),
             players="stream_players", system_tokens="system_prompt_tokens", stream=True),
    Scenario("interference", "a ~{long_prompt_tokens}-token prompt arrives {delay} s into "
                             "{stream_players} players streaming {tokens}-token stories",
             (GAP_MEDIAN, GAP_P95, GAP_MAX, Metric("max_over_median", "max/median", ".1f", "lower"),
              Metric("long_ttft_s", "long TTFT s", ".2f", "lower"),
              Metric("stall_ratio", "stall x", ".1f", "lower"),
              Metric("player_ttft_while_max_s", "players TTFT max s", ".2f", "lower"), ERRORS),
             players="stream_players", stream=True, interference=True),
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
