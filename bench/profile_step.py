"""Where one decode step of the continuous engine spends its time, in-process (no Redis, no API).

Fills the engine with B requests, lets them decode a few steps, then times steps (median of N)
and profiles a few with torch.profiler. Prints a table per batch size: step time, tokens/s, and
the operators that took the most time; writes JSON.

    python -m bench.profile_step --batches 1 16 64 --threads 2 --out docs/results/profile

Where the whole step is one C++ call (the decoder), the operator table says little; so each step
is also split by timing its parts alone on the same shapes: the layers' products (a pass over
every Linear of the model on `batch` rows), the head, the sampler (a row of the vocabulary per request), and the
rest (attention, norms, rotary, the engine's Python) as what the step takes beyond them. On a CPU
with AMX tiles, the K-quant products of many rows take them (the same bits), a product's threads
with no piece left fetch the next product's first bytes (the same bits), and on an Intel CPU a
K-quant pass of 1-4 rows prefetches its weights further ahead (the same bits); each timed step and
the products are then also timed with each of these off, in turn, and the table says both.

    python -m bench.profile_step --model path/to/model.Q4_K_M.gguf --batches 1 64 --threads 2 --out docs/results/profile-big

`--kernel-isa avx2` times the kernels' AVX2 build, as a CPU without AVX-512 runs it, on one with it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.report import write_json
from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.continuous import engine as continuous
from worker.continuous import kernels
from worker.model_loader import load


# The kernels' switches a step is also timed without (their module's function: on/off, or the state).
SWITCHES = {"AMX tiles": "kquant_tiles", "AVX2 columns": "kquant_columns", "fetch ahead": "fetch_ahead",
            "few rows' prefetch": "kquant_few_rows_fetch"}
# Steps an engine takes after it is filled and timed: the profiled ones.
PROFILED_STEPS = 3


def filled_engine(loaded, settings: Settings, batch: int, context: int, steps: int):
    """An engine whose `batch` requests all hold `context` tokens, with a KV cache that keeps all of
    them running for `steps` more (and the profiled ones): a cache sized by --kv-memory alone holds
    fewer of a large model's requests (in float32 half as many as in bf16), and a step would then
    compute fewer rows than it is said to."""
    prompt = loaded.tokenizer.encode("Write a short story about a dragon, a gate and a skeleton.\n")
    # None finishes before the profile does: a step per timed turn and one per switch turned off.
    max_tokens = context + (1 + len(SWITCHES)) * steps + PROFILED_STEPS + 2
    tokens = len(prompt) + 1 + max_tokens
    blocks = batch * -(-tokens // settings.block_size) + batch // 16 + 2  # and the 1% admission margin
    engine = continuous.build(loaded, replace(settings, kv_blocks=blocks), loaded.weights(), loaded.config)
    for i in range(batch):
        engine.add(Job(id=f"p{i}", model="m", prompt_ids=[*prompt, i % 1000 + 100],
                       params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                       timeout_s=3600))
    while min((r.computed for r in engine.scheduler.running), default=0) < context:
        engine.step()
    return engine


def profile_batch(loaded, settings: Settings, batch: int, steps: int, context: int) -> dict:
    engine = filled_engine(loaded, settings, batch, context, steps)
    parts = part_calls(engine, batch)
    for call in parts.values():
        call()  # warm: the first call allocates
    # Each step, then each part once, in turn: a slow minute of a shared machine slows them alike.
    # The kernels' switches that change no bits (AMX tiles where the CPU has them, fetching the
    # next product ahead): a step and the products are also timed with each off, in the same
    # turns, so each A/B is a ratio from one run.
    switches = {name: getattr(engine.runner.kernel, attr, None) for name, attr in SWITCHES.items()}
    switches = {name: turn for name, turn in switches.items() if turn is not None and turn()}
    times, part_times = [], {name: [] for name in parts}
    without = {name: {"step": [], "products": []} for name in switches}

    def timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    for _ in range(steps):
        times.append(timed(engine.step))
        if engine.last_batch != batch:
            raise RuntimeError(f"a timed step computed {engine.last_batch} rows, not {batch}")
        for name, call in parts.items():
            part_times[name].append(timed(call))
        for name, turn in switches.items():
            turn(False)
            try:
                without[name]["step"].append(timed(engine.step))
                without[name]["products"].append(timed(parts["products"]))
            finally:
                turn(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:16]
    step_ms = statistics.median(times) * 1000
    parts = {f"{name}_ms": statistics.median(t) * 1000 for name, t in part_times.items()}
    parts["rest_ms"] = step_ms - sum(parts.values())
    switched_off = {switch: {f"{name}_ms": statistics.median(t) * 1000 for name, t in timed_parts.items()}
                    for switch, timed_parts in without.items()}
    return {"batch": batch, "step_ms": step_ms, "tokens_per_s": batch / step_ms * 1000, "numerics": engine.numerics,
            "parts": parts, "switched_off": switched_off,
            "ops": [{"name": e.key, "share": e.self_cpu_time_total / total,
                     "ms_per_step": e.self_cpu_time_total / (1000 * PROFILED_STEPS),
                     "calls_per_step": e.count / PROFILED_STEPS}
                    for e in ops]}


def part_calls(engine, batch: int) -> dict:
    """A `batch`-row step's parts, each a call that does it alone on its own shapes: the layers'
    products (one pass over every layer in order, as a step makes it: a layer timed on its own again
    and again would find its weights in the L3 cache, which the whole model's do not fit), the head,
    and the sampler (temperature 0.8, no cut: the C++ loop)."""
    model = engine.runner.model
    dtype = engine.loaded.dtype
    head = model.head
    layers = [layer for layer in model.linears() if layer is not head]
    inputs = {}
    for layer in layers + [head]:
        inputs.setdefault(layer.in_features, torch.randn(batch, layer.in_features).to(dtype))
    calls = {"products": lambda: [layer(inputs[layer.in_features]) for layer in layers],
             "head": lambda: head(inputs[head.in_features])}
    kernel = engine.runner.kernel
    if kernel is not None and hasattr(kernel, "sample_rows"):
        logits = torch.randn(batch, head.out_features)
        calls["sampling"] = lambda: kernel.sample_rows(logits, torch.full((batch,), 0.8),
                                                       torch.rand(batch, dtype=torch.float64))
    return calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=20, help="steps timed per batch size")
    parser.add_argument("--context", type=int, default=64, help="tokens each request holds when timed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--int4-rows", type=int, default=Settings.int4_rows)
    parser.add_argument("--small-kernel", default=Settings.small_kernel)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtype", default=Settings.kv_dtype, help="the KV cache's element type (Settings.kv_dtype)")
    parser.add_argument("--model", default="smollm2", help="the packaged SmolLM2, a GGUF file or a directory")
    parser.add_argument("--kernel-isa", choices=sorted(kernels.ISAS), default=Settings.kernel_isa,
                        help="the kernels' instruction sets (Settings.kernel_isa): avx2 times the AVX2 build here")
    parser.add_argument("--out", default="bench/results/profile")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load(args.model, dtype=args.dtype, transformers_model=False,
                  cache_dir=Settings.cache_dir)
    settings = Settings(int4_rows=args.int4_rows, small_kernel=args.small_kernel, dtype=args.dtype,
                        kv_dtype=args.kv_dtype, kernel_isa=args.kernel_isa)
    results = []
    for batch in args.batches:
        r = profile_batch(loaded, settings, batch, args.steps, args.context)
        results.append(r)
        print(f"\nbatch {batch}: {r['step_ms']:.1f} ms per step, {r['tokens_per_s']:.0f} tokens/s "
              f"({torch.get_num_threads()} threads, {r['numerics']})")
        print("  " + ", ".join(f"{name.removesuffix('_ms')} {ms:.1f} ms" for name, ms in r["parts"].items()))
        for switch, off in r["switched_off"].items():
            print(f"  {switch} off: step {off['step_ms']:.1f} ms ({off['step_ms'] / r['step_ms']:.2f}x the time with it), "
                  f"products {off['products_ms']:.1f} ms ({off['products_ms'] / r['parts']['products_ms']:.2f}x)")
        print(f"  {'operator':<36} {'share':>6} {'ms/step':>8} {'calls':>6}")
        for op in r["ops"]:
            print(f"  {op['name']:<36} {op['share']:>6.1%} {op['ms_per_step']:>8.2f} {op['calls_per_step']:>6.0f}")
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"threads": torch.get_num_threads(), "int4_rows": args.int4_rows,
                                          "small_kernel": args.small_kernel, "context": args.context,
                                          "kernel_isa": args.kernel_isa,
                                          "results": results}, indent=1)
    print(f"\nwrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
