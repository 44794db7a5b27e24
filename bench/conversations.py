"""NPC conversations across a pool of two workers, with routing to the worker that holds each
conversation (docs/scaling.md, routing) and without it, in one run.

    python -m bench.conversations --out docs/results/conversations
    python -m bench.conversations --players 8 --turns 4 --out /tmp/conversations   # a quick look
    python -m bench.conversations --pause-s 20   # and both again, one worker stopped for 20 s
    python -m bench.conversations --model path/to/model.Q4_K_M.gguf --players 8   # a larger model

Each mode starts its own stack (redis-server, the API, two workers of the packaged SmolLM2, or of
`--model`, with TORCH_THREADS=1 each, on this 2-core machine); `AFFINITY_WAIT` 0.05 s turns routing on, 0 off. Every player
holds one conversation: a shared ~300-token system prompt, then `--turns` turns, each a line of 10-40
words, a streamed reply of up to 80 tokens (sampled, seeded per player and turn), then 1-3 s before
the next line; its `user` field is the player's. Each turn's time to first token, its tokens and
`usage.prompt_tokens_details.cached_tokens` are recorded. Reported per mode: the median time to
first token from the third turn on, tokens/s over the whole run, the share of those turns'
prompts found cached, and what Redis did per turn (INFO read around the mode, less what the idle
stack does in as long: commands, scripts' included, bytes in and out, Redis' CPU). Prints a table,
writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import redis

from bench.probes import delta, info_reply_bytes, less_background, snapshot
from bench.prompts import make_lore, system_prompt
from bench.report import pyplot, save_figure, write_json
from bench.stack import stack
from bench.stats import ratio
from serve import free_port
from shared import metrics as names
from tests.prometheus_text import scrape, value

MODES = {"routing": {"AFFINITY_WAIT": "0.05"}, "no routing": {"AFFINITY_WAIT": "0"}}
# --pause-s: both again, one worker stopped (SIGSTOP) mid-run
PAUSED = {"routing, a worker paused": "routing", "no routing, a worker paused": "no routing"}
REPLY_TOKENS = 80
REDIS_COST = {"commands": "commands", "mget": "MGET", "bytes_in": "bytes in", "bytes_out": "bytes out",
              "cpu_us": "CPU µs"}
IDLE_S = 5.0  # the stack's background in Redis (heartbeats, idle polls), taken off each mode's cost


def conversation(client, model: str, player: int, turns: int, system: str) -> list[dict]:
    """One player's conversation: a row per turn."""
    import openai
    rng = random.Random(player)
    messages, rows = [{"role": "system", "content": system}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": make_lore(rng, rng.randint(10, 40))})
        start, first, text, usage = time.monotonic(), None, [], None
        try:
            stream = client.chat.completions.create(
                model=model, messages=messages, max_tokens=REPLY_TOKENS, temperature=0.8,
                seed=player * 100 + turn, stream=True, stream_options={"include_usage": True},
                user=f"player-{player}")
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first if first is not None else time.monotonic() - start
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    usage = chunk.usage
        except openai.OpenAIError as exc:
            rows.append({"player": player, "turn": turn, "error": str(exc)[:200]})
            return rows
        details = usage.prompt_tokens_details if usage else None
        rows.append({"player": player, "turn": turn, "ttft_s": first, "seconds": time.monotonic() - start,
                     "started": start,
                     "tokens": usage.completion_tokens if usage else 0,
                     "prompt_tokens": usage.prompt_tokens if usage else 0,
                     "cached_tokens": (details.cached_tokens or 0) if details else 0})
        messages.append({"role": "assistant", "content": "".join(text)})
        time.sleep(rng.uniform(1.0, 3.0))
    return rows


def offer_waits(samples: list[dict]) -> dict:
    """The workers' offered jobs (taken by their own worker, or by the other once the offer lapsed)
    and quantiles of each kind's wait (storyteller_offer_wait_seconds: the upper bound of the bucket
    each quantile falls in; p100, the longest's), summed over the workers' /metrics, and the jobs
    they put back after a worker's heartbeat expired."""
    def quantiles(taken_by: str) -> dict:
        by_bound = Counter()  # a bucket's `le` label -> its count, summed over the workers
        for s in samples:
            for (name, labels), count in s.items():
                if name == names.OFFER_WAIT + "_bucket" and dict(labels).get("taken_by") == taken_by:
                    by_bound[dict(labels)["le"]] += count
        bounds = sorted(by_bound, key=float)  # float("+Inf") sorts last
        total = by_bound[bounds[-1]] if bounds else 0
        quantile = lambda q: next(float(b) for b in bounds if by_bound[b] >= q * total) if total else None  # noqa: E731
        return {f"p{round(q * 100)}": quantile(q) for q in (0.5, 0.9, 0.99, 1.0)}

    return {"offered_own": sum(value(s, names.OFFERED_JOBS, taken_by="own") for s in samples),
            "offered_taken_over": sum(value(s, names.OFFERED_JOBS, taken_by="other") for s in samples),
            # a stopped worker's jobs, put back once its heartbeat expired: in neither count above
            "requeued": sum(value(s, names.REQUEUED_JOBS) for s in samples),
            "own_wait_s": quantiles("own"), "taken_over_wait_s": quantiles("other")}


def pause_worker(process, after_s: float, pause_s: float, window: dict) -> None:
    """Stop `process` (SIGSTOP: its heartbeat stops too) `after_s` into the run, for `pause_s`."""
    time.sleep(after_s)
    window["from"] = time.monotonic()
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(pause_s)
    os.kill(process.pid, signal.SIGCONT)
    window["to"] = time.monotonic()


def run_mode(env: dict, label: str, players: int, turns: int, system: str, pause_s: float = 0,
             model: str = "smollm2") -> dict:
    import openai
    ports = [free_port(), free_port()]
    with stack(env, model, label=f"conversations-{label}", workers=2,
               worker_env=[{"TORCH_THREADS": "1", "METRICS_PORT": port} for port in ports]) as running:
        client = openai.OpenAI(base_url=running.url, api_key="-", timeout=600, max_retries=0)
        server = redis.Redis(port=running.redis_port)
        info_bytes = info_reply_bytes(server)
        idle = snapshot(server)
        time.sleep(IDLE_S)
        idle, before = delta(idle, snapshot(server), info_bytes), snapshot(server)
        started, window = time.monotonic(), {}
        with ThreadPoolExecutor(players + 1) as pool:
            if pause_s:  # a third of the way into a run of ~turns x 8 s
                pool.submit(pause_worker, running.worker_processes[1], turns * 8 / 3, pause_s, window)
            rows = [row for rows in pool.map(lambda p: conversation(client, running.model, p, turns, system),
                                             range(players)) for row in rows]
        seconds = time.monotonic() - started
        used = less_background(delta(before, snapshot(server), info_bytes), idle)
        offers = offer_waits([scrape(f"http://127.0.0.1:{port}/metrics") for port in ports])
    done = [r for r in rows if "error" not in r]
    # What Redis did for a turn (commands run inside scripts counted, as Redis counts them).
    redis_per_turn = {"commands": round(sum(used["calls"].values()) / len(done), 1),
                      "mget": round(used["calls"].get("mget", 0) / len(done), 2),
                      "bytes_in": round(used["net_in"] / len(done)), "bytes_out": round(used["net_out"] / len(done)),
                      "cpu_us": round(used["cpu_s"] * 1e6 / len(done))} if done else None
    later = [r for r in done if r["turn"] >= 2 and r["ttft_s"] is not None]
    by_turn = {t: statistics.median([r["ttft_s"] for r in done if r["turn"] == t and r["ttft_s"] is not None] or [0])
               for t in range(turns)}
    return {"seconds": round(seconds, 1), "errors": len(rows) - len(done), "turns": len(done),
            "tokens_per_s": round(sum(r["tokens"] for r in done) / seconds, 2),
            "ttft_from_turn_3_median_s": round(statistics.median(r["ttft_s"] for r in later), 3) if later else None,
            "cached_share_from_turn_3": round(sum(r["cached_tokens"] for r in later)
                                              / max(1, sum(r["prompt_tokens"] for r in later)), 3),
            "ttft_median_by_turn_s": by_turn, "offers": offers, "paused": during(done, window),
            "redis_per_turn": redis_per_turn,
            "rows": [{k: v for k, v in r.items() if k != "started"} for r in rows]}


def during(rows: list[dict], window: dict) -> Optional[dict]:
    """The turns begun while a worker was paused: how many, and their times to first token; and
    apart, of the later turns: those whose worker held the history (most of the prompt found
    cached) and wrote their first token in the pause (the running worker's own conversations);
    those that found it held but wrote it only after the pause (the paused worker's, which it
    answered once back, or the running worker's that waited as long); and those read again (the
    paused worker's, taken over or put back). So what the paused worker's turns waited is seen
    beside the running worker's own line in the same seconds."""
    if not window:
        return None
    inside = [r for r in rows if window["from"] <= r["started"] < window["to"] and r["ttft_s"] is not None]

    def times(some: list[dict]) -> dict:
        ttfts = [r["ttft_s"] for r in some]
        return {"turns": len(ttfts), "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
                "ttft_max_s": round(max(ttfts), 3) if ttfts else None}

    later = [r for r in inside if r["turn"] >= 1]
    held = [r for r in later if r["cached_tokens"] >= r["prompt_tokens"] / 2]
    waited = [r for r in held if r["started"] + r["ttft_s"] >= window["to"]]
    return {"seconds": round(window["to"] - window["from"], 1), **times(inside),
            "held": times([r for r in held if r not in waited]), "held_after_the_pause": times(waited),
            "read_again": times([r for r in later if r not in held])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--players", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--pause-s", type=float, default=0,
                        help="also run routing with one worker stopped this long a third of the way in")
    parser.add_argument("--model", default="smollm2", help="the workers' --model (default: the packaged SmolLM2)")
    parser.add_argument("--kv-memory", type=int, default=0,
                        help="the workers' KV cache, MiB (0: their default): smaller than the conversations "
                             "need, a worker keeps only some histories, as a busy pool does")
    parser.add_argument("--out", default="bench/results/conversations")
    args = parser.parse_args(argv)
    system = system_prompt(args.system_tokens)
    results = {}
    modes = {**MODES, **({label: MODES[mode] for label, mode in PAUSED.items()} if args.pause_s else {})}
    for label, env in modes.items():
        env = {**env, **({"KV_MEMORY": str(args.kv_memory)} if args.kv_memory else {})}
        results[label] = run_mode(env, label, args.players, args.turns, system,
                                  args.pause_s if label in PAUSED else 0, args.model)
        print(f"{label}: done in {results[label]['seconds']} s", file=sys.stderr)
    on, off = results["routing"], results["no routing"]
    summary = {"ttft_ratio": ratio(on["ttft_from_turn_3_median_s"], off["ttft_from_turn_3_median_s"]),
               "tokens_per_s_ratio": ratio(on["tokens_per_s"], off["tokens_per_s"])}
    print(f"\n{args.players} conversations x {args.turns} turns, 2 workers of {Path(args.model).name} (TORCH_THREADS=1 each), "
          f"~{args.system_tokens}-token system prompt, replies up to {REPLY_TOKENS} tokens\n")
    print("| | routing | no routing | ratio | bar |\n|---|---:|---:|---:|---|")
    print(f"| time to first token from turn 3, median s | {on['ttft_from_turn_3_median_s']} | "
          f"{off['ttft_from_turn_3_median_s']} | {_r(summary['ttft_ratio'])} | <= 0.4 |")
    print(f"| tokens/s | {on['tokens_per_s']} | {off['tokens_per_s']} | {_r(summary['tokens_per_s_ratio'])} | >= 1.2 |")
    print(f"| prompt tokens found cached, turns 3+ | {on['cached_share_from_turn_3']:.0%} | "
          f"{off['cached_share_from_turn_3']:.0%} | | |")
    print(f"| errors | {on['errors']} | {off['errors']} | | |")
    def cost(mode: dict) -> str:
        per_turn = mode["redis_per_turn"]
        return " / ".join(str(per_turn[k]) for k in REDIS_COST) if per_turn else "-"

    print(f"| Redis per turn: {' / '.join(REDIS_COST.values())} | {cost(on)} | {cost(off)} | | |")
    if args.pause_s:
        print_paused([results[label] for label in PAUSED])
    offers = on["offers"]
    print(f"\nrouting: {offers['offered_own']:.0f} offered jobs taken by their own worker, "
          f"{offers['offered_taken_over']:.0f} by the other; their wait (bucket bounds, s): own "
          f"{offers['own_wait_s']}, taken over {offers['taken_over_wait_s']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), {"when": datetime.datetime.now().isoformat(timespec="seconds"),
                                          "machine": platform.processor() or platform.machine(),
                                          "args": vars(args), "summary": summary, "modes": results}, indent=1)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, color in (("routing", "#2a7"), ("no routing", "#999"), *zip(PAUSED, ("#d62", "#c9a"))):
        if label not in results:
            continue
        by_turn = results[label]["ttft_median_by_turn_s"]
        ax.plot([t + 1 for t in by_turn], list(by_turn.values()), "o-", color=color, label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, median (s)")
    ax.set_title(f"{args.players} NPC conversations on two workers of {Path(args.model).stem}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), dpi=110)
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def print_paused(modes: list[dict]) -> None:
    """Routing and no routing with a worker paused, side by side: the turns begun in the pause."""
    spans = [m["paused"] for m in modes]
    times = lambda t: f"{t['turns']}: {t['ttft_median_s']} / {t['ttft_max_s']}"  # noqa: E731
    print(f"\n| a worker paused {spans[0]['seconds']} s: turns begun in the pause | routing | no routing |"
          "\n|---|---:|---:|")
    for name, cells in (
            ("turns", [p["turns"] for p in spans]),
            ("time to first token, median / max s", [f"{p['ttft_median_s']} / {p['ttft_max_s']}" for p in spans]),
            ("from turn 2, the history held, first token in the pause: turns: median / max s",
             [times(p["held"]) for p in spans]),
            ("from turn 2, the history held, first token after it: turns: median / max s",
             [times(p["held_after_the_pause"]) for p in spans]),
            ("from turn 2, read again (the paused worker's): turns: median / max s",
             [times(p["read_again"]) for p in spans]),
            ("jobs put back after the paused worker's heartbeat expired",
             [f"{m['offers']['requeued']:.0f}" for m in modes]),
            ("errors", [m["errors"] for m in modes])):
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    offers = modes[0]["offers"]
    print(f"\nrouting, paused: {offers['offered_taken_over']:.0f} offered jobs taken over, their wait before it "
          f"(bucket bounds, s) {offers['taken_over_wait_s']}; the own worker's {offers['own_wait_s']}")


def _r(value):
    return None if value is None else round(value, 2)


if __name__ == "__main__":
    sys.exit(main())
