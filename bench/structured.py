"""Structured output's cost: a crowd whose every request carries a JSON schema against the same
crowd unconstrained, through the whole stack, in one run; and what a schema's first use costs.

    python -m bench.structured --out docs/results/structured-output
    python -m bench.structured --players 8 --repeats 1 --requests 1 --hard 8   # a quick check

Each constrained request takes one of SCHEMAS (eight shapes a game asks an NPC for: enums,
integer ranges, bounded strings) through `response_format`; the unconstrained crowd is its twin:
the same prompts and seeds with no schema, each asked for exactly as many tokens as its
constrained reply had (learnt before the runs: the engine writes a request's text whatever shares
its step), so both crowds do the same work but for the constraint. Both sample at 0.8. The lone
player's time per token is the median of its requests' time over their tokens (not the gap between
streamed chunks, which forced tokens fill several at a time). The compile cost is measured in this process on the packaged SmolLM2's
tokenizer: what the API does to check a schema (api/grammars.py) and what a worker does at the
schema's first use (worker/constraint.py: the matcher and its first mask), and the same again
from the worker's cache.

Two more crowds, in the same run: the hardest schemas of the real-world collection
(tests/data/real_world_schemas.json, `hard`: $ref trees, oneOf, patterns, formats), `--hard-players`
at a time through the chat route, greedy, against their free twin (the same messages, each asked for
as many tokens as its constrained reply wrote); and, on a second stack with `JUMP_FORWARD=0`, the
NPC crowd and the hard crowd again, so what forced tokens save is a ratio of this run too. Prints
a table, writes <out>.json and <out>.png.
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
from typing import Optional

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


def compile_costs(schemas: dict) -> list[dict]:
    """Per schema (name -> JSON schema), in ms: the API's check, a worker's first compile and mask,
    and a cached start."""
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
    for name, schema in schemas.items():
        start = time.perf_counter()
        req = parse_completion({"model": "m", "prompt": "p", "response_format": {
            "type": "json_schema", "json_schema": {"name": name[:64], "schema": schema}}})
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


HARD_TOKENS = 128  # as tests/test_structured_output.py's collection test: most hard replies finish


def hard_entries(limit: int) -> list[dict]:
    from bench.schema_collection import load_collection
    return [e for e in load_collection() if e["hard"]][:limit or None]


def hard_crowd(client, model: str, entries: list[dict], players: int, lengths: Optional[dict] = None) -> dict:
    """Each hard schema asked once, `players` at a time, greedy, as `response_format` (strict not
    asked); with `lengths` (name -> tokens), their free twin instead: the same messages, no schema,
    each asked for exactly as many tokens as its constrained reply wrote (refused ones left out).
    Returns the tokens written by name, the wall time and its ms per token."""
    import openai

    def one(entry: dict) -> tuple[str, int]:
        fields = {"model": model, "messages": [{"role": "user", "content": entry["ask"]}], "temperature": 0}
        if lengths is None:
            fields.update(max_tokens=HARD_TOKENS, response_format={
                "type": "json_schema", "json_schema": {"name": entry["name"][:64], "schema": entry["schema"]}})
        else:
            fields.update(max_tokens=lengths[entry["name"]], extra_body={"ignore_eos": True})
        try:
            return entry["name"], client.chat.completions.create(**fields).usage.completion_tokens
        except openai.BadRequestError:
            return entry["name"], 0
    asked = entries if lengths is None else [e for e in entries if lengths.get(e["name"])]
    start = time.monotonic()
    with ThreadPoolExecutor(players) as pool:
        tokens = dict(pool.map(one, asked))
    seconds = time.monotonic() - start
    total = sum(tokens.values())
    return {"tokens": tokens, "seconds": round(seconds, 2),
            "ms_per_token": round(1000 * seconds / total, 2) if total else None}


STACKS = {"jump": {}, "no-jump": {"JUMP_FORWARD": "0"}}  # forced tokens on (the default) and off


def main(argv=None) -> int:
    import openai
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--players", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per player in the crowd")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each crowd; medians reported")
    parser.add_argument("--hard", type=int, default=0, help="the first N hard schemas of the collection (0: all)")
    parser.add_argument("--hard-players", type=int, default=8, help="hard schemas asked at once")
    parser.add_argument("--out", default="bench/results/structured-output")
    args = parser.parse_args(argv)

    entries = hard_entries(args.hard)
    costs = compile_costs({**SCHEMAS, **{e["name"]: e["schema"] for e in entries}})
    runs: dict[str, list[dict]] = {}
    lengths: dict[int, int] = {}
    hard_lengths: dict[str, int] = {}
    for label, env in STACKS.items():
        with stack(env, label=f"structured-{label}") as running:
            model, client = running.model, openai.OpenAI(base_url=running.url, api_key="-", timeout=600, max_retries=0)
            for name in SCHEMAS:  # every schema once, so the crowds measure cached grammars
                complete(running.url, model, "Say hello as JSON.\n", 8, 0.8, False, 600,
                         {"response_format": response_format(name)})
            first = hard_crowd(client, model, entries, args.hard_players)  # compiles, and learns the lengths
            if not hard_lengths:  # forced tokens or not, the same text (tests/test_jump_forward.py): once
                hard_lengths.update(first["tokens"])
                for repeat in range(args.repeats):
                    learn_lengths(running.url, model, 1, 4, args.tokens, 7 + repeat, lengths)
                    learn_lengths(running.url, model, args.players, args.requests, args.tokens, 100 * repeat, lengths)
            for repeat in range(args.repeats):
                order = (False, True) if repeat % 2 == 0 else (True, False)  # neither always goes first
                for constrained in order:
                    kind = f"{label} {'json' if constrained else 'plain'}"
                    runs.setdefault(f"lone {kind}", []).append(
                        crowd(running.url, model, 1, 4, args.tokens, constrained, True, 7 + repeat, lengths))
                    runs.setdefault(f"crowd {kind}", []).append(crowd(
                        running.url, model, args.players, args.requests, args.tokens, constrained, False,
                        100 * repeat, lengths))
                    runs.setdefault(f"hard {kind}", []).append(hard_crowd(
                        client, model, entries, args.hard_players, None if constrained else hard_lengths))
                    print(f"{label}, repeat {repeat + 1}: {kind} done", file=sys.stderr)

    def med(key, field):
        values = [r[field] for r in runs[key] if r.get(field) is not None]
        return statistics.median(values) if values else None

    summary = {"errors": {k: sum(r.get("errors", 0) for r in v) for k, v in runs.items()},
               "hard_schemas": len(entries), "hard_tokens": sum(hard_lengths.values())}
    for label in STACKS:
        crowd_tps = {kind: med(f"crowd {label} {kind}", "tokens_per_s") for kind in ("plain", "json")}
        # A request's time over its tokens, not the gap between streamed chunks: forced tokens
        # arrive several to a chunk, so the gaps grow while the reply comes sooner.
        lone = {kind: _rounded(1000 * (med(f"lone {label} {kind}", "median_s_per_token") or 0)) or None
                for kind in ("plain", "json")}
        hard = {kind: med(f"hard {label} {kind}", "ms_per_token") for kind in ("plain", "json")}
        summary[label] = {"crowd_tokens_per_s": crowd_tps, "lone_ms_per_token": lone, "hard_ms_per_token": hard,
                          "crowd_tokens": {kind: med(f"crowd {label} {kind}", "tokens") for kind in ("plain", "json")},
                          "crowd_ratio": _rounded(ratio(crowd_tps["json"], crowd_tps["plain"])),
                          "lone_ratio": _rounded(ratio(lone["json"], lone["plain"])),
                          "hard_ratio": _rounded(ratio(hard["json"], hard["plain"]))}

    print(f"\n{args.players} players x {args.requests} requests, max_tokens {args.tokens}; {len(entries)} hard "
          f"schemas, {args.hard_players} at a time, max_tokens {HARD_TOKENS}; medians of {args.repeats} runs\n")
    print("| | forced tokens | unconstrained | JSON schemas | ratio | bar |\n|---|---|---:|---:|---:|---|")
    for label in STACKS:
        row = summary[label]
        print(f"| NPC crowd, tokens/s | {label} | {_rounded(row['crowd_tokens_per_s']['plain'])} | "
              f"{_rounded(row['crowd_tokens_per_s']['json'])} | {row['crowd_ratio']} | >= 1.1 |")
        print(f"| lone player, ms a token | {label} | {row['lone_ms_per_token']['plain']} | "
              f"{row['lone_ms_per_token']['json']} | {row['lone_ratio']} | <= 1.15 |")
        print(f"| hard schemas' crowd, ms a token | {label} | {_rounded(row['hard_ms_per_token']['plain'])} | "
              f"{_rounded(row['hard_ms_per_token']['json'])} | {row['hard_ratio']} | <= 1.5 |")
    print(f"| errors | | {sum(v for k, v in summary['errors'].items() if 'plain' in k)} | "
          f"{sum(v for k, v in summary['errors'].items() if 'json' in k)} | | |")
    print("\n| schema | API check ms | worker first use ms | worker cached ms |\n|---|---:|---:|---:|")
    for row in costs:
        print(f"| {row['schema']} | {row['api_check_ms']} | {row['worker_first_ms']} | {row['worker_cached_ms'] or ''} |")
    firsts = [row["worker_first_ms"] for row in costs[1:]]
    summary["first_use_ms"] = {"median": _rounded(statistics.median(firsts)), "max": max(firsts)}
    print(f"\nworker first use, every schema: median {summary['first_use_ms']['median']} ms, "
          f"most {summary['first_use_ms']['max']} ms (bar: < 50)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor() or
              platform.machine(), "args": vars(args), "summary": summary, "compile_ms": costs, "runs": runs,
              "schemas_sha256": hashlib.sha256(json.dumps(SCHEMAS, sort_keys=True).encode()).hexdigest()[:16]}
    write_json(out.with_suffix(".json"), record, indent=1)
    _plot(summary, costs, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def _rounded(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 2)


def _plot(summary: dict, costs: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    metrics = [("crowd_ratio", "NPC crowd tokens/s\n(bar: >= 1.1)", 1.1),
               ("lone_ratio", "lone player ms/token\n(bar: <= 1.15)", 1.15),
               ("hard_ratio", "hard schemas' crowd ms/token\n(bar: <= 1.5)", 1.5)]
    for i, (key, _, bar) in enumerate(metrics):
        for offset, label, color in ((-0.2, "jump", "#2a7"), (0.2, "no-jump", "#aaa")):
            value = summary[label][key] or 0
            left.bar([i + offset], [value], 0.4, color=color, label=f"forced tokens: {label}" if i == 0 else None)
            left.text(i + offset, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
        left.plot([i - 0.45, i + 0.45], [bar, bar], color="#c33", ls=":", lw=1.2)
    left.axhline(1.0, color="#555", lw=0.6)
    left.set_xticks(range(len(metrics)), [m[1] for m in metrics], fontsize=8)
    left.set_ylabel("JSON schemas / unconstrained twin")
    left.set_title("Constrained against unconstrained, same run (red: each bar)")
    left.legend(fontsize=8)
    rows = sorted(costs[1:], key=lambda c: c["worker_first_ms"])
    right.plot(range(len(rows)), [c["worker_first_ms"] for c in rows], "o", color="#2a7", ms=3, label="worker, first use")
    right.plot(range(len(rows)), [c["api_check_ms"] for c in rows], "o", color="#58c", ms=3, label="API check")
    right.axhline(50, color="#c33", ls=":", lw=1)
    right.set_yscale("log")
    right.set_xlabel(f"schema ({len(rows)}: the 8 NPC ones and the hard real-world ones), by first use")
    right.set_ylabel("ms (log scale)")
    right.set_title("A schema's first compile and mask (bar at 50 ms)")
    right.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
