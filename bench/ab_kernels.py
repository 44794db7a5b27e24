"""Two builds of the C++ kernels against each other in one process: the checkout's and a variant's.

A change to csrc/ that should only make the kernels faster (a prefetch, a loop's shape) is judged
by a ratio from one run. These machines are shared and their memory's speed changes from minute to
minute, so two runs minutes apart compare the minutes, not the builds. This builds the variant (a
copy of csrc/ with the change) as a module of its own name beside the checkout's, loads the model
once and times the two in turns, alternating which goes first:

  products  every layer's products at each `--rows` (bench.profile_step's part_calls), with the
            variant's module swapped into every layer and part; their outputs are checked equal bit
            for bit before the timing
  steps     whole engine steps, an engine per build from the one load, holding `--rows` requests
            each; their tokens are checked equal after the timing

    cp -r worker/continuous/csrc /tmp/variant && $EDITOR /tmp/variant/kquants.h
    python -m bench.ab_kernels /tmp/variant --model <a GGUF file> --rows 1 4 --rounds 8

Prints each round's times and, per row count, the variant's speed over the checkout's (the median
of the rounds' ratios and their range); writes <out>.json and <out>.png (every round's ratio).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.profile_step import filled_engine, part_calls
from bench.report import pyplot, save_figure, write_json
from shared.settings import Settings
from worker.continuous import kernels
from worker.model_loader import load


def build_variant(csrc: Path, isa: str):
    """The variant's module, built (once per content) under the cache with a name of its own, so that
    it loads beside the checkout's."""
    digest = hashlib.sha256(isa.encode())
    for path in sorted(csrc.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    key = digest.hexdigest()[:12]
    build_dir = Path(Settings.cache_dir).expanduser() / "ab-kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    print(f"building the variant {csrc} in {build_dir} (once per content)...", flush=True)
    return kernels.compile_units(f"{kernels.NAME}_ab_{key}", str(csrc), str(build_dir), isa)


def with_module(layers: list, module) -> None:
    """Every layer's products, and every part's of a stack, through `module`."""
    for layer in layers:
        layer.kernel = module
        with_module(layer.parts, module)


def median_seconds(prepare, call, repeats: int) -> float:
    prepare()
    call()  # the first after a switch finds the other build's lines in the caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def products_calls(loaded, settings: Settings, modules: dict, rows: int) -> dict:
    """Per build, what makes it the one in use and a call: every layer's products at `rows` rows."""
    engine = filled_engine(loaded, settings, 1, 8, 2)
    layers = [layer for layer in engine.runner.model.linears() if layer is not engine.runner.model.head]
    products = part_calls(engine, rows)["products"]
    inputs = {width: torch.randn(rows, width).to(loaded.dtype) for width in {l.in_features for l in layers}}
    outputs = {}
    for name, module in modules.items():
        with_module(layers, module)
        outputs[name] = [layer(inputs[layer.in_features]) for layer in layers]
    if not all(torch.equal(a, b) for a, b in zip(*outputs.values())):
        raise SystemExit(f"the builds' products differ at {rows} rows: not the same numeric path")
    return {name: (functools.partial(with_module, layers, module), products) for name, module in modules.items()}


def step_calls(loaded, settings: Settings, modules: dict, rows: int, steps: int,
               context: int) -> tuple[dict, dict]:
    """Per build, nothing to make it the one in use (each has an engine of its own, made from the one
    load) and a call: a step of its engine, which holds `rows` requests."""
    engines, build = {}, kernels.build
    try:
        for name, module in modules.items():
            kernels.build = lambda *args, _module=module, **kwargs: _module
            engines[name] = filled_engine(loaded, settings, rows, context, steps)
    finally:
        kernels.build = build
    return {name: (lambda: None, engine.step) for name, engine in engines.items()}, engines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", type=Path, help="a copy of worker/continuous/csrc with the change")
    parser.add_argument("--model", required=True, help="a GGUF file or a model directory")
    parser.add_argument("--what", choices=("products", "steps"), default="products")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a build a round (the median counts)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=32,
                        help="tokens each request holds when its steps are timed (steps; attention grows with it)")
    parser.add_argument("--kernel-isa", choices=sorted(kernels.ISAS), default="native")
    parser.add_argument("--out", default="bench/results/ab-kernels")
    args = parser.parse_args(argv)
    if not (args.variant / kernels.UNITS[0]).is_file():
        parser.error(f"{args.variant} holds no {kernels.UNITS[0]}: give a copy of worker/continuous/csrc")
    torch.set_num_threads(args.threads)
    modules = {"checkout": kernels.build(os.path.join(Settings.cache_dir, "kernels"), args.kernel_isa),
               "variant": build_variant(args.variant, args.kernel_isa)}
    loaded = load(args.model, dtype="auto", transformers_model=False, cache_dir=Settings.cache_dir)
    settings = Settings(kernel_isa=args.kernel_isa)
    results = []
    for rows in args.rows:
        engines = None
        if args.what == "products":
            calls = products_calls(loaded, settings, modules, rows)
        else:
            calls, engines = step_calls(loaded, settings, modules, rows, args.rounds * (args.repeats + 1) + 4,
                                          args.context)
        seconds = {name: [] for name in calls}
        for r in range(args.rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                seconds[name].append(median_seconds(*calls[name], args.repeats))
            print(f"{rows} rows, round {r}: checkout {seconds['checkout'][-1] * 1000:.2f} ms, variant "
                  f"{seconds['variant'][-1] * 1000:.2f} ms", flush=True)
        if engines and [list(q.tokens) for q in engines["checkout"].scheduler.running] != \
                [list(q.tokens) for q in engines["variant"].scheduler.running]:
            raise SystemExit(f"the builds' engines wrote different tokens at {rows} rows")
        ratios = [a / b for a, b in zip(seconds["checkout"], seconds["variant"])]
        results.append({"rows": rows, "checkout_ms": [round(s * 1000, 3) for s in seconds["checkout"]],
                        "variant_ms": [round(s * 1000, 3) for s in seconds["variant"]],
                        "speed": round(statistics.median(ratios), 4), "speeds": [round(x, 4) for x in ratios]})
    print(f"\n{args.what}: the variant's speed over the checkout's, {args.rounds} rounds")
    print(f"| rows | checkout ms | variant ms | speed (range) |\n|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['rows']} | {statistics.median(r['checkout_ms']):.2f} | {statistics.median(r['variant_ms']):.2f} | "
              f"{r['speed']:.3f} ({min(r['speeds']):.3f}-{max(r['speeds']):.3f}) |")
    write_json(f"{args.out}.json", {"variant": str(args.variant), "model": args.model, "what": args.what,
                                    "context": args.context,
                                    "threads": args.threads, "kernel_isa": args.kernel_isa, "results": results})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    for i, r in enumerate(results):
        ax.scatter([i] * len(r["speeds"]), r["speeds"], color="#2a7", alpha=0.6)
        ax.hlines(r["speed"], i - 0.25, i + 0.25, color="#222")
    ax.axhline(1.0, color="#999", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(results)), [f"{r['rows']} rows" for r in results])
    ax.set_ylabel("variant / checkout speed")
    ax.set_title(f"{args.what}: each round's ratio, and the median")
    fig.tight_layout()
    save_figure(fig, f"{args.out}.png")
    print(f"\nwrote {args.out}.json and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
