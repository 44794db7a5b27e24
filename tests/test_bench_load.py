"""The benchmark's pure helpers: prompt sizes, percentiles, stream gaps, plans and tables.

No server, no model: these run in well under a second.
"""
import random

import pytest

from bench import engines, interference, prompts, report, scenarios, stats
from bench.client import Outcome, chunk_text, sse_events
from bench.load import summarize
from bench.report import format_row

# --- prompts ---------------------------------------------------------------------------------

def test_default_shape_draws_the_classic_prompt_as_before():
    # The same rng draws as the original benchmark: old seeds give the same prompts.
    prompt, tokens = prompts.RequestShape.fixed(100).draw(random.Random(3))
    assert prompt == prompts.make_prompt(random.Random(3))
    assert tokens == 100


@pytest.mark.parametrize("target", [20, 100, 300, 1500, 2000])
def test_sized_prompt_is_about_the_asked_length(target):
    prompt = prompts.sized_prompt(random.Random(target), target)
    assert abs(prompts.approx_tokens(prompt) - target) <= max(3, 0.02 * target)
    assert prompt.endswith(".\n") and "Write a short story about" in prompt


def test_drawn_lengths_spread_over_the_range():
    shape = prompts.RequestShape(max_tokens=(10, 300), prompt_tokens=(20, 1500))
    rng = random.Random(0)
    draws = [shape.draw(rng) for _ in range(200)]
    lengths = [prompts.approx_tokens(p) for p, _ in draws]
    tokens = [t for _, t in draws]
    assert 15 <= min(lengths) < 200 and 1300 < max(lengths) <= 1510
    assert all(10 <= t <= 300 for t in tokens) and len(set(tokens)) > 50


def test_same_seed_same_prompts():
    shape = prompts.RequestShape(max_tokens=(10, 300), prompt_tokens=(20, 1500))
    a = [shape.draw(random.Random(7)) for _ in range(3)]
    b = [shape.draw(random.Random(7)) for _ in range(3)]
    assert a == b and shape.draw(random.Random(8)) != a[0]


def test_system_prompt_is_shared_and_about_n_tokens():
    shape = prompts.RequestShape(system_tokens=300)
    system = prompts.system_prompt(300)
    p1, _ = shape.draw(random.Random(1))
    p2, _ = shape.draw(random.Random(2))
    assert p1.startswith(system) and p2.startswith(system) and p1 != p2
    assert abs(prompts.approx_tokens(system) - 300) <= 6
    assert prompts.system_prompt(0) == ""


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError):
        prompts.RequestShape(max_tokens=(10, 5))
    with pytest.raises(ValueError):
        prompts.RequestShape(prompt_tokens=(0, 5))


# --- statistics ------------------------------------------------------------------------------

def test_nearest_rank_percentile():
    values = list(range(1, 101))
    assert stats.percentile(values, 95) == 95
    assert stats.percentile(values, 50) == 50
    assert stats.percentile(values, 100) == 100
    assert stats.p95([3.0, 1.0, 2.0]) == 3.0  # few samples: the maximum
    assert stats.percentile([7], 1) == 7
    with pytest.raises(ValueError):
        stats.percentile([], 50)


def test_gaps_and_their_summary():
    assert stats.gaps([1.0, 1.1, 1.3, 2.3]) == pytest.approx([0.1, 0.2, 1.0])
    summary = stats.gap_summary([0.1, 0.2, 1.0])
    assert summary == {"gap_count": 3, "gap_median_ms": 200.0, "gap_p95_ms": 1000.0,
                       "gap_max_ms": 1000.0}
    assert stats.gap_summary([])["gap_median_ms"] is None
    assert stats.ratio(3, 0) is None and stats.ratio(None, 2) is None and stats.ratio(3, 2) == 1.5


def test_summarize_counts_reported_tokens_and_stream_gaps():
    outcomes = [Outcome(0.0, 2.0, 10, 40, [0.5, 0.6, 0.8]),
                Outcome(0.0, 4.0, 30, 60, [1.0, 1.1])]
    row = summarize(2, outcomes, ["HTTP 500: boom"], seconds=4.0, stream=True)
    assert row["tokens"] == 40 and row["tokens_per_s"] == 10.0
    assert row["ttft_median_s"] == 0.75 and row["ttft_p95_s"] == 1.0
    assert row["gap_count"] == 3 and row["gap_max_ms"] == 200.0
    assert row["prompt_tokens_median"] == 50 and row["errors"] == 1
    assert len(format_row(row)) == len(format_row(None, stream=True)) > len(format_row(None))


def test_sse_parsing():
    raw = [b'data: {"choices": [{"text": "Once"}]}\n', b"\n", b": comment\n",
           b'data: {"choices": [], "usage": {"completion_tokens": 3}}\r\n', b"\r\n",
           b"data: [DONE]\n", b"\n"]
    events = list(sse_events(raw))
    assert events[-1] == "[DONE]" and len(events) == 3
    assert chunk_text({"choices": [{"text": "Once"}]}) == "Once"
    assert chunk_text({"choices": [{"delta": {"content": "up"}}]}) == "up"
    assert chunk_text({"choices": [], "usage": {}}) == ""


# --- interference ----------------------------------------------------------------------------

def test_gaps_are_sorted_into_periods():
    windows = interference.period_windows(ready=0.0, sent=10.0, first=12.0, stop=20.0)
    stream = [1.0, 1.1, 9.9, 10.5, 11.9, 12.1, 12.2]
    got = interference.classify_gaps([stream], windows)
    assert got["before"] == pytest.approx([0.1, 8.8])
    # 9.9-10.5 straddles the send: it counts as a stall of the prefill.
    assert got["while"] == pytest.approx([0.6, 1.4, 0.2])
    assert got["after"] == pytest.approx([0.1])


# --- engines ---------------------------------------------------------------------------------

def test_parse_config():
    assert engines.parse_config("static") == ("static", {"ENGINE": "static", "BATCH": "64"})
    assert engines.parse_config("cb32:ENGINE=continuous,BATCH=32") == (
        "cb32", {"ENGINE": "continuous", "BATCH": "32"})
    for bad in ("nope", "x:ENGINE", ":A=1"):
        with pytest.raises(ValueError):
            engines.parse_config(bad)


def test_plan_adds_prefix_caching_twins_once():
    configs = [engines.parse_config(c) for c in ("static", "continuous")]
    steps = engines.plan(configs, ["uniform", "prefix"])
    assert [(s.label, s.scenarios) for s in steps] == [
        ("static", ("uniform", "prefix")), ("continuous", ("uniform",)),
        ("continuous+prefix", ("prefix",)), ("continuous-noprefix", ("prefix",))]
    assert steps[3].env == {"ENGINE": "continuous", "PREFIX_CACHING": "0"}
    # A twin already in the list is not started twice.
    configs.append(engines.parse_config("continuous-noprefix"))
    labels = [s.label for s in engines.plan(configs, ["prefix"])]
    assert labels == ["static", "continuous+prefix", "continuous-noprefix"]
    assert [s.label for s in engines.plan(configs[:2], ["prefix"], prefix_variants=False)] == [
        "static", "continuous"]


def test_table_shows_ratio_to_first_config():
    results = {"a": [{"case": "1 players", "tokens_per_s": 10.0, "errors": 0}],
               "b": [{"case": "1 players", "tokens_per_s": 25.0, "errors": 0}]}
    table = report.format_table("uniform", "desc", scenarios.SCENARIOS["uniform"].metrics,
                                 results, ["a", "b"])
    line = next(x for x in table.splitlines() if "tok/s" in x)
    assert "10.0" in line and "25.0" in line and line.endswith("2.50x")


def test_scenarios_are_read_from_their_sizes():
    mixed = scenarios.SCENARIOS["mixed"]
    assert mixed.shape(scenarios.SMOKE) == prompts.RequestShape(max_tokens=(4, 16),
                                                                prompt_tokens=(20, 200))
    assert scenarios.SCENARIOS["prefix"].shape(scenarios.Sizes()) == prompts.RequestShape(
        max_tokens=(100, 100), system_tokens=300)
    assert scenarios.SCENARIOS["uniform"].describe(scenarios.Sizes()) == (
        "1/16/64 players x 4 requests x 100 tokens, EOS ignored")
    assert scenarios.SCENARIOS["interference"].describe(scenarios.SMOKE).startswith(
        "a ~500-token prompt arrives 2 s into 4 players")


def test_repeats_are_combined_by_median():
    runs = [[{"case": "x", "tokens_per_s": v, "errors": e, "label": "k"}]
            for v, e in ((1.0, 0), (5.0, 1), (2.0, 0))]
    row = scenarios.combine_repeats(runs)[0]
    assert row["tokens_per_s"] == 2.0 and row["errors"] == 1 and row["label"] == "k"
    assert len(row["repeats"]) == 3


def test_worker_counter_deltas_and_cells():
    before = [{"stats": {"prefix_hit_tokens": 100, "preempted": 1, "kv_usage": 0.5}}]
    after = [{"stats": {"prefix_hit_tokens": 350, "preempted": 1, "kv_usage": 0.1}}]
    assert engines.counter_deltas(before, after) == {"worker_prefix_hit_tokens": 250,
                                                     "worker_preempted": 0}
    assert engines.counter_deltas([{}], [{"stats": None}]) == {}
    assert report.cell(None, "d") == "-" and report.cell(2.5, "d") == "2.5"


def test_interference_rows_count_a_failed_long_prompt(monkeypatch):
    period = {"gap_count": 0, "gap_median_ms": None, "gap_p95_ms": None, "gap_max_ms": None}
    result = {"periods": {name: dict(period) for name in interference.PERIODS},
              "long_ttft_s": None, "long_seconds": None, "stall_ratio": None,
              "player_ttft_while_max_s": None, "errors": 1, "error_samples": ["HTTP 503: x"],
              "long_error": "timed out"}
    monkeypatch.setattr(scenarios, "run_interference", lambda *a, **k: result)
    rows = scenarios.SCENARIOS["interference"].run("url", "m", scenarios.SMOKE, 0, None)
    assert [r["case"] for r in rows] == ["gaps before", "gaps while", "gaps after", "long prompt"]
    assert rows[-1]["errors"] == 2 and rows[-1]["error_samples"][0] == "long prompt: timed out"


def test_side_by_side_quotes_the_median_of_each_rounds_ratio():
    from bench import vs_llama_server as vs

    def crowd(players, turn, tokens_per_s, share=None, errors=0):
        row = {"players": players, "round": turn, "tokens_per_s": tokens_per_s, "errors": errors, "rss_mb": turn}
        return {**row, "bound": {"share": share, "bandwidth_gb_s": 30.0 + turn}} if share else row

    # Round 2's llama-server ran in a slow minute: its ratio is high, the median's is not.
    llama = [crowd(1, 1, 30.0, 0.50), crowd(1, 2, 15.0, 0.25), crowd(1, 3, 32.0, 0.53), crowd(16, 1, 10.0)]
    ours = [crowd(1, 1, 33.0, 0.55), crowd(1, 2, 36.0, 0.60), crowd(1, 3, 32.0, 0.53), crowd(16, 1, 40.0, errors=1)]
    runs = [{"label": label, "rounds": rows, "rows": [vs.median_row([r for r in rows if r["players"] == p])
                                                       for p in (1, 16)]}
            for label, rows in (("llama-server", llama), ("storyteller", ours))]
    lone = runs[0]["rows"][0]
    assert lone["round"] == 1 and lone["tokens_per_s"] == 30.0 and lone["rss_mb"] == 1  # a round's own row
    assert lone["tokens_per_s_rounds"] == [30.0, 15.0, 32.0] and lone["bound"]["share"] == 0.50
    assert lone["bound"]["bandwidth_gb_s"] == 31.0 and lone["bound"]["share_rounds"] == [0.50, 0.25, 0.53]
    rows = vs.side_by_side(runs)
    assert [r["players"] for r in rows] == [1, 16]
    assert rows[0]["ratio_rounds"] == [1.1, 2.4, 1.0] and rows[0]["ratio"] == 1.1
    assert rows[0]["llama_tokens_per_s"] == 30.0 and rows[0]["storyteller_tokens_per_s"] == 33.0
    assert rows[1]["ratio"] == 4.0 and rows[1]["errors"] == 1 and rows[1]["storyteller_of_bound"] is None
    one = vs.side_by_side(runs[1:])  # --only storyteller: no ratio to quote
    assert one[0]["ratio"] is None and one[0]["ratio_rounds"] == [] and one[0]["storyteller_tokens_per_s"] == 33.0
