"""Structured output's cost: a crowd whose every request carries a JSON schema against the same
crowd unconstrained, through the whole stack, in one run; and what a schema's first use costs.

    python -m bench.structured --out docs/results/structured-output
    python -m bench.structured --players 8 --repeats 1 --requests 1      # a quick check

Each constrained request takes one of SCHEMAS (eight shapes a game asks an NPC for: enums,
integer ranges, bounded strings) through `response_format`; the unconstrained crowd is its twin:
the same prompts and seeds with no schema, each asked for exactly as many tokens as its
constrained reply had (learnt before the runs: the engine writes a request's text whatever shares
its step), so both crowds do the same work but for the constraint. Both sample at 0.8. The lone player's time per token is the median gap between its
streamed chunks. The compile cost is measured in this process on the packaged SmolLM2's
tokenizer: what the API does to check a schema (api/grammars.py) and what a worker does at the
schema's first use (worker/constraint.py: the matcher and its first mask), and the same again
from the worker's cache. Prints a table, writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.client import complete
from bench.load import run_crowd
from bench.report import pyplot, save_figure, write_json
from bench.stack import stack
from bench.stats import ratio

WORDS = ("the old well", "the dragon", "a cursed crown", "the harbour", "the goblin king", "a lost map",
         "the frozen tower", "the bard's song")
_TEXT = {"type": "string", "minLength": 1}
SCHEMAS = {
    "npc_line": {"type": "object", "properties": {
        "line": {**_TEXT, "maxLength": 80}, "mood": {"enum": ["grumpy", "cheerful", "wary", "sly"]},
        "gold_offered": {"type": "integer", "minimum": 0, "maximum": 500}},
        "required": ["line", "mood", "gold_offered"], "additionalProperties": False},
    "quest": {"type": "object", "properties": {
        "title": {**_TEXT, "maxLength": 40}, "goal": {**_TEXT, "maxLength": 80},
        "reward": {"type": "integer", "minimum": 10, "maximum": 1000},
        "difficulty": {"enum": ["easy", "hard", "deadly"]}},
        "required": ["title", "goal", "reward", "difficulty"], "additionalProperties": False},
    "shop_offer": {"type": "object", "properties": {
        "item": {**_TEXT, "maxLength": 30}, "price": {"type": "integer", "minimum": 1, "maximum": 999},
        "haggle": {"type": "boolean"}},
        "required": ["item", "price", "haggle"], "additionalProperties": False},
    "combat_move": {"type": "object", "properties": {
        "action": {"enum": ["strike", "parry", "flee", "cast"]}, "target": {**_TEXT, "maxLength": 30},
        "damage": {"type": "integer", "minimum": 0, "maximum": 50}, "taunt": {**_TEXT, "maxLength": 60}},
        "required": ["action", "target", "damage", "taunt"], "additionalProperties": False},
    "choice": {"type": "object", "properties": {
        "option": {"enum": ["help", "refuse", "bargain"]}, "reason": {**_TEXT, "maxLength": 100}},
        "required": ["option", "reason"], "additionalProperties": False},
    "item": {"type": "object", "properties": {
        "name": {**_TEXT, "maxLength": 30}, "rarity": {"enum": ["common", "rare", "legendary"]},
        "weight": {"type": "integer", "minimum": 1, "maximum": 100}, "lore": {**_TEXT, "maxLength": 80}},
        "required": ["name", "rarity", "weight", "lore"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "sky": {"enum": ["clear", "storm", "fog", "snow"]},
        "wind": {"type": "integer", "minimum": 0, "maximum": 12}, "omen": {**_TEXT, "maxLength": 80}},
        "required": ["sky", "wind", "omen"], "additionalProperties": False},
    "rumour": {"type": "object", "properties": {
        "about": {**_TEXT, "maxLength": 40}, "truth": {"type": "integer", "minimum": 0, "maximum": 100},
        "whisper": {**_TEXT, "maxLength": 100}, "tags": {"type": "array", "items": {"enum": ["war", "gold", "magic"]},
                                                        "maxItems": 3}},
        "required": ["about", "truth", "whisper"], "additionalProperties": False},
}


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


class NpcAsk:
    """The crowd's prompts: a player's question to the innkeeper (bench.load's RequestShape's role)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def draw(self, rng: random.Random) -> tuple[str, int]:
        return f"A player asks the innkeeper about {rng.choice(WORDS)}. Answer as JSON.\n", self.tokens


def compile_costs() -> list[dict]:
    """Per schema, in ms: the API's check, a worker's first compile and mask, and a cached start."""
    import llguidance.torch
    import torch

    from api import grammars as api_grammars  # the API's own path, from the request's field
    from api.tokenizers import Tokenizer
    from api.validation import parse_completion
    from worker import model_loader
    from worker.constraint import Grammars

    tokenizer = model_loader.load(model_loader.PACKAGED, transformers_model=False).tokenizer
    width = len(tokenizer)
    rows, stored = [], {}
    grammars, api_tokenizer = Grammars(tokenizer, width, stored.get), Tokenizer(tokenizer)
    start = time.perf_counter()
    api_tokenizer.llguidance()  # once per API process, at its first constrained request
    built = time.perf_counter()
    grammars.warm()  # once per worker, on a thread at its start
    rows.append({"schema": "(llguidance's tokenizer, once per process)", "api_check_ms": round((built - start) * 1e3, 1),
                 "worker_first_ms": round((time.perf_counter() - built) * 1e3, 1), "worker_cached_ms": None})
    for name in SCHEMAS:
        start = time.perf_counter()
        req = parse_completion({"model": "m", "prompt": "p", "response_format": response_format(name)})
        grammar = api_grammars.for_request(req, api_tokenizer, None)
        checked = time.perf_counter()
        digest = grammar.digest
        stored[digest] = grammar.text
        first = grammars.constraint(digest)
        bitmask = torch.full(llguidance.torch.get_bitmask_shape(1, width), -1, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(first.matcher, bitmask, 0)
        compiled = time.perf_counter()
        again = grammars.constraint(digest)
        llguidance.torch.fill_next_token_bitmask(again.matcher, bitmask, 0)
        cached = time.perf_counter()
        rows.append({"schema": name, "api_check_ms": round((checked - start) * 1e3, 2),
                     "worker_first_ms": round((compiled - checked) * 1e3, 2),
                     "worker_cached_ms": round((cached - compiled) * 1e3, 3)})
    return rows


def _extra(constrained: bool, lengths: dict):
    """A request's fields beyond the prompt: its schema and seed (drawn from the player's rng in
    the same order either way, so both crowds ask the same), and for the unconstrained twin the
    length its constrained reply had."""
    names = list(SCHEMAS)

    def draw(rng: random.Random) -> dict:
        name, seed = rng.choice(names), rng.getrandbits(31)
        if constrained:
            return {"response_format": response_format(name), "seed": seed}
        return {"seed": seed, "max_tokens": max(1, lengths[seed])}
    return draw


def requests_of(players: int, requests: int, tokens: int, seed: int) -> list[tuple[str, dict]]:
    """The (prompt, constrained fields) a crowd will send, drawn as bench.load.run_crowd draws them."""
    shape, extra, out = NpcAsk(tokens), _extra(True, {}), []
    for player in range(players):
        rng = random.Random(seed + player)
        for _ in range(requests):
            prompt, _ = shape.draw(rng)
            out.append((prompt, extra(rng)))
    return out


def learn_lengths(url: str, model: str, players: int, requests: int, tokens: int, seed: int,
                  lengths: dict) -> None:
    """Each constrained request's reply length, by its seed: asked once, 16 at a time. The engine
    writes a request's text whatever shares its step (batch invariance), so the crowd's replies
    will have these lengths too, and the unconstrained twin is asked for exactly as many tokens."""
    todo = requests_of(players, requests, tokens, seed)
    with ThreadPoolExecutor(16) as pool:
        outcomes = pool.map(lambda item: complete(url, model, item[0], tokens, 0.8, False, 600, item[1]), todo)
        for (_, fields), outcome in zip(todo, outcomes):
            lengths[fields["seed"]] = outcome.completion_tokens


def crowd(url: str, model: str, players: int, requests: int, tokens: int, constrained: bool,
          stream: bool, seed: int, lengths: dict) -> dict:
    return run_crowd(url, model, players, requests, tokens, temperature=0.8, ignore_eos=not constrained,
                     seed=seed, shape=NpcAsk(tokens), stream=stream, extra=_extra(constrained, lengths),
                     progress=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--players", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per player in the crowd")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each crowd; medians reported")
    parser.add_argument("--out", default="bench/results/structured-output")
    args = parser.parse_args(argv)

    costs = compile_costs()
    runs: dict[str, list[dict]] = {k: [] for k in ("crowd plain", "crowd json", "lone plain", "lone json")}
    with stack({}, label="structured") as running:
        model = running.model
        for name in SCHEMAS:  # every schema once, so the crowds measure cached grammars
            complete(running.url, model, "Say hello as JSON.\n", 8, 0.8, False, 600,
                     {"response_format": response_format(name)})
        lengths: dict[int, int] = {}
        for repeat in range(args.repeats):
            learn_lengths(running.url, model, 1, 4, args.tokens, 7 + repeat, lengths)
            learn_lengths(running.url, model, args.players, args.requests, args.tokens, 100 * repeat, lengths)
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)  # neither always goes first
            for constrained in order:
                kind = "json" if constrained else "plain"
                runs[f"lone {kind}"].append(crowd(running.url, model, 1, 4, args.tokens, constrained, True,
                                                  7 + repeat, lengths))
                runs[f"crowd {kind}"].append(crowd(running.url, model, args.players, args.requests, args.tokens,
                                                   constrained, False, 100 * repeat, lengths))
                print(f"repeat {repeat + 1}: {kind} done", file=sys.stderr)

    def med(key, field):
        values = [r[field] for r in runs[key] if r.get(field) is not None]
        return statistics.median(values) if values else None

    summary = {
        "crowd_tokens_per_s": {"plain": med("crowd plain", "tokens_per_s"), "json": med("crowd json", "tokens_per_s")},
        "lone_gap_ms": {"plain": med("lone plain", "gap_median_ms"), "json": med("lone json", "gap_median_ms")},
        "lone_s_per_token": {"plain": med("lone plain", "median_s_per_token"),
                             "json": med("lone json", "median_s_per_token")},
        "errors": {k: sum(r["errors"] for r in v) for k, v in runs.items()},
        "crowd_tokens": {"plain": med("crowd plain", "tokens"), "json": med("crowd json", "tokens")},
    }
    summary["crowd_ratio"] = ratio(summary["crowd_tokens_per_s"]["json"], summary["crowd_tokens_per_s"]["plain"])
    summary["lone_gap_ratio"] = ratio(summary["lone_gap_ms"]["json"], summary["lone_gap_ms"]["plain"])

    print(f"\n{args.players} players x {args.requests} requests, max_tokens {args.tokens}, "
          f"medians of {args.repeats} runs\n")
    print("| | unconstrained | 8 JSON schemas | ratio | bar |\n|---|---:|---:|---:|---|")
    print(f"| crowd tokens/s | {summary['crowd_tokens_per_s']['plain']} | {summary['crowd_tokens_per_s']['json']} "
          f"| {summary['crowd_ratio']} | >= 0.85 |")
    print(f"| lone player, ms between tokens | {summary['lone_gap_ms']['plain']} | {summary['lone_gap_ms']['json']} "
          f"| {summary['lone_gap_ratio']} | <= 1.15 |")
    print(f"| crowd tokens written (the twins: equal) | {summary['crowd_tokens']['plain']} | "
          f"{summary['crowd_tokens']['json']} | | |")
    print(f"| errors | {summary['errors']['crowd plain'] + summary['errors']['lone plain']} | "
          f"{summary['errors']['crowd json'] + summary['errors']['lone json']} | | |")
    print("\n| schema | API check ms | worker first use ms | worker cached ms |\n|---|---:|---:|---:|")
    for row in costs:
        print(f"| {row['schema']} | {row['api_check_ms']} | {row['worker_first_ms']} | {row['worker_cached_ms'] or ''} |")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor() or
              platform.machine(), "args": vars(args), "summary": summary, "compile_ms": costs, "runs": runs,
              "schemas_sha256": hashlib.sha256(json.dumps(SCHEMAS, sort_keys=True).encode()).hexdigest()[:16]}
    write_json(out.with_suffix(".json"), record, indent=1)
    _plot(summary, costs, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def _plot(summary: dict, costs: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["crowd tokens/s", "lone player ms/token"]
    plain = [summary["crowd_tokens_per_s"]["plain"] or 0, summary["lone_gap_ms"]["plain"] or 0]
    json_ = [summary["crowd_tokens_per_s"]["json"] or 0, summary["lone_gap_ms"]["json"] or 0]
    for i, (a, b) in enumerate(zip(plain, json_)):
        left.bar([i - 0.2], [1.0], 0.4, color="#888", label="unconstrained" if i == 0 else None)
        left.bar([i + 0.2], [b / a if a else 0], 0.4, color="#2a7", label="8 JSON schemas" if i == 0 else None)
    left.axhline(0.85, color="#c33", ls=":", lw=1)
    left.axhline(1.15, color="#c33", ls=":", lw=1)
    left.set_xticks(range(2), labels)
    left.set_ylabel("relative to unconstrained")
    left.set_title("Constrained against unconstrained (bars at 0.85 and 1.15)")
    left.legend()
    names = [c["schema"].replace("(llguidance's tokenizer, once per process)", "tokenizer, once") for c in costs]
    at = range(len(costs))
    right.barh([y + 0.2 for y in at], [c["worker_first_ms"] for c in costs], 0.4, color="#2a7", label="worker, first use")
    right.barh([y - 0.2 for y in at], [c["api_check_ms"] for c in costs], 0.4, color="#58c", label="API check")
    right.set_yticks(list(at), names)
    right.set_xscale("log")
    right.axvline(50, color="#c33", ls=":", lw=1)
    right.set_xlabel("ms (log scale)")
    right.set_title("A schema's first compile (bar at 50 ms)")
    right.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
