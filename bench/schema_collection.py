"""A collection of real-world JSON schemas answered by the model through the whole stack: how many
replies are valid, invalid, cut by max_tokens, refused, and what it costs a token; JSON Schema's
own reading (objects open, every schema strict: what Storyteller did before 2026-12-03) against
the defaults (objects closed, lenient where strict was not asked), in one run.

    python -m bench.schema_collection --out docs/results/schema-collection
    python -m bench.schema_collection --only now --limit 20         # a quick look

The collection is tests/data/real_world_schemas.json: 121 schemas written for this project in
the shapes people send (function signatures, configuration files, API payloads, Kubernetes
objects, analytics events, a game's), 53 of them hard ($ref trees, oneOf, patterns,
formats, uniqueItems, if/then). Each is asked once, greedy, with its own one-line request, as
`response_format: json_schema`, `--concurrency` at a time. A reply is:

- valid: it parses and meets the whole schema (jsonschema; formats as far as its FormatChecker
  checks them without optional packages: date, email, idn-email, ipv4, uuid, not date-time or uri);
- relaxed: it breaks only keywords the answer named as `unenforced` (the lenient mode's promise);
- invalid: it breaks a keyword the grammar was to enforce (must stay 0);
- cut: max_tokens ended it (finish_reason "length");
- refused: a 400 naming what cannot be enforced; error: anything else.

Prints a table, writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema

from bench.report import pyplot, save_figure, write_json
from bench.stack import stack

COLLECTION = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_world_schemas.json"
KINDS = ("valid", "relaxed", "invalid", "cut", "refused", "error")
# The two ways of reading a schema compared: the env the API runs with, and strict on every schema.
MODES = {"before": ({"OPEN_OBJECTS": "1"}, True), "now": ({}, False)}


def load_collection(path: Path = COLLECTION) -> list[dict]:
    return json.loads(path.read_text())["schemas"]


def judge(entry: dict, text: str, finish_reason: str, unenforced: list) -> tuple[str, str]:
    """(kind, why) of one whole reply to `entry`'s schema."""
    if finish_reason == "length":
        return "cut", ""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return "invalid", f"not JSON: {exc}"
    validator = jsonschema.Draft202012Validator(entry["schema"], format_checker=jsonschema.FormatChecker())
    errors = list(validator.iter_errors(value))
    if not errors:
        return "valid", ""
    named = {word.split(":")[0].split(" ")[0] for word in unenforced}  # "format: url" -> format
    # A break is relaxed as named when a named keyword is on its way down the schema: a `then`'s
    # `required` fails as "required" under "then" (schema path ["then", "required"]).
    broken = sorted({error.validator for error in errors})
    if all(named & {str(part) for part in error.schema_path} for error in errors):
        return "relaxed", ", ".join(broken)
    return "invalid", ", ".join(broken)


def ask(client, model: str, entry: dict, strict: bool, max_tokens: int) -> dict:
    """One schema asked once through the openai client: its outcome."""
    import openai
    start = time.monotonic()
    try:
        done = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": entry["ask"]}], temperature=0, max_tokens=max_tokens,
            response_format={"type": "json_schema", "json_schema": {"name": entry["name"][:64], "schema": entry["schema"],
                                                                    "strict": strict}})
    except openai.BadRequestError as exc:
        return {"kind": "refused", "why": str(exc.body.get("message", exc))[:200], "tokens": 0}
    except openai.OpenAIError as exc:
        return {"kind": "error", "why": str(exc)[:200], "tokens": 0}
    seconds = time.monotonic() - start
    choice = done.choices[0]
    unenforced = (done.model_extra or {}).get("unenforced", [])
    kind, why = judge(entry, choice.message.content or "", choice.finish_reason, unenforced)
    tokens = done.usage.completion_tokens
    return {"kind": kind, "why": why, "tokens": tokens, "unenforced": unenforced,
            "ms_per_token": 1000 * seconds / tokens if tokens else None}


def ask_all(client, model: str, entries: list[dict], strict: bool, max_tokens: int, concurrency: int,
            label: str = "") -> list[dict]:
    """Every entry asked, `concurrency` at a time; with a `label`, a line of progress every 10."""
    done = iter(range(1, len(entries) + 1))

    def one(entry: dict) -> dict:
        outcome = ask(client, model, entry, strict, max_tokens)
        count = next(done)  # one step of an iterator: atomic under the GIL
        if label and (count % 10 == 0 or count == len(entries)):
            print(f"{label}: {count}/{len(entries)} answered", flush=True)
        return outcome

    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(one, entries))
    return [{"name": e["name"], "collection": e["collection"], "hard": e["hard"], **o} for e, o in zip(entries, outcomes)]


def summary(outcomes: list[dict]) -> dict:
    counts = Counter(o["kind"] for o in outcomes)
    times = [o["ms_per_token"] for o in outcomes if o.get("ms_per_token")]
    return {**{kind: counts.get(kind, 0) for kind in KINDS},
            "median_ms_per_token": round(statistics.median(times), 1) if times else None}


def main(argv=None) -> int:
    import openai
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--limit", type=int, default=0, help="the first N schemas only (0: all)")
    parser.add_argument("--only", choices=("both", *MODES), default="both")
    parser.add_argument("--out", default="bench/results/schema-collection")
    args = parser.parse_args(argv)
    entries = load_collection()[:args.limit or None]
    results = {}
    for mode, (env, strict) in MODES.items():
        if args.only not in ("both", mode):
            continue
        with stack(env, "smollm2", label=f"schemas-{mode}") as running:
            client = openai.OpenAI(base_url=running.url, api_key="-", timeout=600, max_retries=0)
            started = time.monotonic()
            outcomes = ask_all(client, running.model, entries, strict, args.max_tokens, args.concurrency, mode)
            results[mode] = {"seconds": round(time.monotonic() - started, 1), "outcomes": outcomes,
                             "all": summary(outcomes),
                             "by_collection": {c: summary([o for o in outcomes if o["collection"] == c])
                                               for c in sorted({e["collection"] for e in entries})},
                             "hard": summary([o for o in outcomes if o["hard"]])}
    print(f"{len(entries)} schemas, greedy, max_tokens {args.max_tokens}, {args.concurrency} at a time")
    print(f"{'mode':<8} {'part':<14}" + "".join(f"{k:>9}" for k in KINDS) + f"{'ms/token':>10}")
    for mode, result in results.items():
        for part, counts in [("all", result["all"]), ("hard", result["hard"]), *result["by_collection"].items()]:
            print(f"{mode:<8} {part:<14}" + "".join(f"{counts[k]:>9}" for k in KINDS)
                  + f"{counts['median_ms_per_token'] or 0:>10.1f}")
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"schemas": len(entries), "max_tokens": args.max_tokens,
                                          "concurrency": args.concurrency, "modes": {
                                              m: {"env": MODES[m][0], "strict": MODES[m][1]} for m in results},
                                          "results": results})
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def _plot(results: dict, path: Path) -> None:
    """A stacked bar per mode and collection: where the replies went."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    colours = {"valid": "#2a9d8f", "relaxed": "#8ab17d", "invalid": "#e63946", "cut": "#f4a261",
               "refused": "#8d99ae", "error": "#000000"}
    labels, ticks, x = [], [], 0.0
    for mode, result in results.items():
        for part, counts in [("all", result["all"]), *result["by_collection"].items()]:
            bottom = 0
            for kind in KINDS:
                ax.bar(x, counts[kind], bottom=bottom, color=colours[kind], label=kind if not ticks else None)
                bottom += counts[kind]
            labels.append(f"{mode}\n{part.replace('_', chr(10))}")
            ticks.append(x)
            x += 1
        x += 0.5  # a gap between the modes
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("replies")
    ax.set_title("Real-world schemas, SmolLM2 greedy: where the replies went")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
