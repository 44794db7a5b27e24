"""Engines side by side, in one run: the same scenarios against a worker per configuration.

A configuration is a named set of worker environment variables (ENGINE, BATCH, PREFIX_CACHING,
SCHEDULER, MAX_BATCH_TOKENS...). For each, this starts a private stack (redis-server, API, one
worker; bench.stack), runs the chosen scenarios (bench.scenarios) and stops it. Then it prints a
table per scenario, every configuration side by side with its ratio to the first, and writes
<out>.json and <out>-<scenario>.png. Machines are noisy: compare ratios from one run, not
numbers from different runs; --repeats N reports each number as the median of N runs.

    python -m bench.engines --out docs/results/engines
    python -m bench.engines --configs static continuous "cb32:ENGINE=continuous,BATCH=32"
    python -m bench.engines --configs static --scenarios uniform --smoke     # a quick check

The prefix scenario compares prefix caching on and off: a continuous configuration that does
not set PREFIX_CACHING runs it twice, on two extra stacks, as <name>+prefix and <name>-noprefix.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from tqdm import tqdm

from bench.load import run_crowd
from bench.report import format_table, plot_scenario, write_json
from bench.scenarios import SCENARIOS, SMOKE, Sizes, combine_repeats
from bench.stack import StackError, stack

# Named worker configurations. Anything not set is the worker's own default.
CONFIGS = {
    "static": {"ENGINE": "static", "BATCH": "64"},
    "static16": {"ENGINE": "static", "BATCH": "16"},
    "continuous": {"ENGINE": "continuous"},
    "continuous-prefix": {"ENGINE": "continuous", "PREFIX_CACHING": "1"},
    "continuous-noprefix": {"ENGINE": "continuous", "PREFIX_CACHING": "0"},
    "continuous-prefill-first": {"ENGINE": "continuous", "SCHEDULER": "prefill-first"},
}
DEFAULT_CONFIGS = ("static", "continuous")
# Counters a worker may keep in its heartbeat's "stats" (the continuous engine does): each
# scenario reports how much they grew while it ran.
WORKER_COUNTERS = ("prefix_hit_tokens", "preempted")


@dataclass(frozen=True)
class Step:
    """One stack to start: its label, its worker environment, the scenarios to run on it."""
    label: str
    env: dict
    scenarios: tuple[str, ...]


def parse_config(spec: str, known: dict = CONFIGS) -> tuple[str, dict]:
    """'static' (a name from CONFIGS) or 'label:KEY=VALUE,KEY=VALUE' (a configuration of one's
    own) -> (label, env)."""
    if ":" not in spec:
        if spec not in known:
            raise ValueError(f"unknown configuration {spec!r}: known are {', '.join(known)}, "
                             "or write LABEL:KEY=VALUE,KEY=VALUE")
        return spec, dict(known[spec])
    label, _, assignments = spec.partition(":")
    env = {}
    for item in filter(None, assignments.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{spec!r}: {item!r} is not KEY=VALUE")
        env[key.strip()] = value.strip()
    if not label:
        raise ValueError(f"{spec!r}: the label before ':' is empty")
    return label, env


def is_continuous(env: dict) -> bool:
    return env.get("ENGINE", "").lower() == "continuous"


def plan(configs: list[tuple[str, dict]], scenarios: list[str],
         prefix_variants: bool = True) -> list[Step]:
    """The stacks to start, in order. A continuous configuration that leaves PREFIX_CACHING to
    the worker runs the prefix scenario on two stacks of its own, with caching on and off,
    unless a configuration with that very environment is already in the list."""
    steps: list[Step] = []
    for label, env in configs:
        wanted = tuple(scenarios)
        variants = []
        if (prefix_variants and "prefix" in wanted and is_continuous(env)
                and "PREFIX_CACHING" not in env):
            wanted = tuple(s for s in wanted if s != "prefix")
            for suffix, value in (("+prefix", "1"), ("-noprefix", "0")):
                twin = {**env, "PREFIX_CACHING": value}
                if not any(other == twin for _, other in configs):
                    variants.append(Step(label + suffix, twin, ("prefix",)))
        if wanted:
            steps.append(Step(label, env, wanted))
        steps += variants
    return steps


def columns_for(steps: list[Step], scenario: str) -> list[str]:
    return [s.label for s in steps if scenario in s.scenarios]


def sizes_from_args(args) -> Sizes:
    """--smoke's small sizes or the full ones, with every size flag given overriding either."""
    sizes = SMOKE if args.smoke else Sizes()
    given = {f.name: getattr(args, f.name) for f in fields(Sizes)
             if getattr(args, f.name, None) is not None}
    return replace(sizes, **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


def counter_deltas(before: list[dict], after: list[dict]) -> dict:
    """How much the workers' own counters (heartbeat "stats": prefix-cache hits, preemptions)
    grew during a scenario, as worker_<name>; nothing for a worker that keeps no counters."""
    def totals(workers):
        sums: dict[str, int] = {}
        for worker in workers:
            for key, value in (worker.get("stats") or {}).items():
                if key in WORKER_COUNTERS and isinstance(value, int):
                    sums[key] = sums.get(key, 0) + value
        return sums
    start, end = totals(before), totals(after)
    return {f"worker_{key}": value - start.get(key, 0) for key, value in end.items()}


def announced_engine_note(env: dict, workers: list[dict]) -> str | None:
    """A warning when the worker says it runs another engine than the one asked for (a worker
    that predates ENGINE ignores it and runs the static engine)."""
    asked = env.get("ENGINE")
    said = sorted({str(w.get("engine")) for w in workers})
    if asked and said and not any(asked.lower() in s.lower() for s in said):
        return f"asked for ENGINE={asked} but the worker announces engine {', '.join(said)}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="configurations: " + "; ".join(
                                     f"{k} = {' '.join(f'{a}={b}' for a, b in v.items())}"
                                     for k, v in CONFIGS.items()))
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                    help="names from the list below, or LABEL:KEY=VALUE,KEY=VALUE")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="worker/API environment added to every configuration (e.g. DTYPE=float32)")
    ap.add_argument("--prefix-variants", action=argparse.BooleanOptionalAction, default=True,
                    help="run the prefix scenario with PREFIX_CACHING=1 and =0 for continuous "
                         "configurations that do not set it")
    ap.add_argument("--smoke", action="store_true", help="shrink every scenario for a quick check")
    size = ap.add_argument_group("scenario sizes (default: the full benchmark, or --smoke's)")
    size.add_argument("--players", type=int, nargs="+", help="uniform: crowd sizes (1 16 64)")
    size.add_argument("--requests", type=int, help="requests per player, every scenario (4)")
    size.add_argument("--tokens", type=int, help="max_tokens where fixed (100)")
    size.add_argument("--crowd", type=int, help="mixed: players (64)")
    size.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                      help="mixed: prompt lengths (20 1500)")
    size.add_argument("--max-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                      help="mixed: max_tokens (10 300)")
    size.add_argument("--stream-players", type=int, help="prefix, interference: players (16)")
    size.add_argument("--system-prompt-tokens", type=int, help="prefix: shared text (300)")
    size.add_argument("--long-prompt-tokens", type=int, help="interference: long prompt (2000)")
    size.add_argument("--delay", type=float, help="interference: seconds before it (2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each scenario; medians shown")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/engines",
                    help="writes <out>.json and <out>-<scenario>.png")
    ap.add_argument("--logs", default="bench/results/logs", help="the stacks' logs")
    args = ap.parse_args(argv)
    try:
        configs = [parse_config(spec) for spec in args.configs]
        common = dict(parse_config("all:" + ",".join(args.set))[1]) if args.set else {}
    except ValueError as exc:
        ap.error(str(exc))
    if len({label for label, _ in configs}) != len(configs):
        ap.error("two configurations have the same label")
    configs = [(label, {**common, **env}) for label, env in configs]
    sizes = sizes_from_args(args)
    steps = plan(configs, args.scenarios, args.prefix_variants)
    out = Path(args.out)

    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": {"machine": platform.machine(), "processor": platform.processor(),
                       "python": platform.python_version()},
              "model": args.model, "seed": args.seed, "repeats": args.repeats,
              "sizes": {f.name: getattr(sizes, f.name) for f in fields(Sizes)},
              "configs": {s.label: {"env": s.env, "scenarios": list(s.scenarios)} for s in steps},
              "scenarios": {name: {"description": SCENARIOS[name].describe(sizes),
                                   "columns": columns_for(steps, name), "results": {}}
                            for name in args.scenarios}}

    def save() -> None:
        write_json(f"{out}.json", report)

    total = sum(len(s.scenarios) for s in steps) * args.repeats
    progress = tqdm(total=total, desc="scenarios", unit="run", file=sys.stderr)
    say = progress.write
    interrupted = False
    try:
        for step in steps:
            config = report["configs"][step.label]
            say(f"# {step.label}: {' '.join(f'{k}={v}' for k, v in step.env.items()) or 'defaults'}"
                f" -> {', '.join(step.scenarios)}")
            try:
                with stack(step.env, args.model, Path(args.logs), step.label) as running:
                    config["workers"] = running.workers()
                    note = announced_engine_note(step.env, config["workers"])
                    if note:
                        config["warning"] = note
                        say(f"  WARNING: {note}")
                    run_crowd(running.url, running.model, 1, 1, 8, progress=False)  # warm-up
                    for name in step.scenarios:
                        scenario = SCENARIOS[name]
                        before, repeats = running.workers(), []
                        # A seed of its own per repeat: the same prompts again would be found in the
                        # prefix cache (a repeated 2,000-token prompt's first token came in 0.4 s, not 26).
                        for repeat in range(args.repeats):
                            repeats.append(scenario.run(running.url, running.model, sizes,
                                                        args.seed + 1000 * repeat, lambda line: say(line)))
                            progress.update()
                        rows = combine_repeats(repeats)
                        after = running.workers()
                        counters = counter_deltas(before, after)  # over all repeats
                        report["scenarios"][name].setdefault("worker_counters", {})[
                            step.label] = counters
                        if len(rows) == 1:  # a one-case scenario: they are that case's
                            rows[0].update(counters)
                        report["scenarios"][name]["results"][step.label] = rows
                        config.setdefault("stats_after", {})[name] = [w.get("stats")
                                                                      for w in after]
                        save()
                        errors = sum(r.get("errors") or 0 for r in rows)
                        say(f"  {name}: done" + (f", {errors} errors" if errors else ""))
            except StackError as exc:
                config["error"] = str(exc)
                say(f"  FAILED to start: {exc}")
                progress.update(len(step.scenarios) * args.repeats)
                save()
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted; reporting what finished")
    finally:
        progress.close()

    print()
    errors = 0
    for name in args.scenarios:
        entry = report["scenarios"][name]
        print(format_table(name, entry["description"], SCENARIOS[name].metrics, entry["results"],
                           entry["columns"]))
        print()
        errors += sum(r.get("errors") or 0 for rows in entry["results"].values() for r in rows)
        for label, rows in entry["results"].items():
            for row in rows:
                for message in row.get("error_samples") or []:
                    print(f"    {label} error: {message}")
    failed = [label for label, c in report["configs"].items() if c.get("error")]
    warned = [f"{label}: {c['warning']}" for label, c in report["configs"].items()
              if c.get("warning")]
    for line in warned:
        print(f"WARNING {line}")
    print(f"errors: {errors}" + (f"; stacks that did not start: {', '.join(failed)}" if failed else ""))
    save()
    charts = [f"{out}-{name}.png" for name in args.scenarios
              if plot_scenario(name, report["scenarios"][name]["description"],
                               report["scenarios"][name]["results"], f"{out}-{name}.png")]
    print(f"wrote {out}.json" + "".join(f", {c}" for c in charts))
    if interrupted:
        return 130
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
