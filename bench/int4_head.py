"""What --int4-head costs in text and buys in speed: the same greedy stories with the output head in
bf16 and requantized to 4 bits, in-process.

For each prompt, how many of the first N tokens the two write alike before they part, and the
share of stories that stay identical; then one player's decode step time both ways.

    python -m bench.int4_head --prompts 16 --tokens 100
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.prompts import make_prompt
from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.continuous import engine as continuous
from worker.model_loader import load


def write(engine, prompts, tokens: int) -> list[list[int]]:
    seqs = [engine.add(Job(id=f"h{i}", model="m", prompt_ids=p, timeout_s=3600,
                           params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)))
            for i, p in enumerate(prompts)]
    while engine.busy:
        engine.step()
    return [s.output_ids for s in seqs]


def lone_step_ms(engine, prompt, steps: int = 40) -> float:
    engine.add(Job(id="lone", model="m", prompt_ids=prompt, timeout_s=3600,
                   params=SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True)))
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.busy:
        engine.step()
    return statistics.median(times) * 1000


def main(argv=None) -> None:
    import random
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--out", default="bench/results/int4_head")
    args = parser.parse_args(argv)
    loaded = load("smollm2", transformers_model=False, cache_dir=Settings.cache_dir)
    rng = random.Random(1)
    prompts = [loaded.tokenizer.encode(make_prompt(rng)) for _ in range(args.prompts)]
    base = Settings(kv_memory=256)
    engines = {"bf16 head": continuous.build(loaded, base, loaded.weights(), loaded.config),
               "int4 head": continuous.build(loaded, replace(base, int4_head=True), loaded.weights(),
                                             loaded.config)}
    texts = {name: write(engine, prompts, args.tokens) for name, engine in engines.items()}
    alike = []
    for a, b in zip(*texts.values()):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        alike.append(same)
    ms = {name: lone_step_ms(engine, prompts[0]) for name, engine in engines.items()}
    result = {"prompts": args.prompts, "tokens": args.tokens, "alike_before_parting": alike,
              "identical_stories": sum(n == args.tokens for n in alike),
              "median_alike": statistics.median(alike), "lone_step_ms": ms}
    print(f"{args.prompts} greedy stories of {args.tokens} tokens, bf16 head against int4 head:")
    print(f"  identical: {result['identical_stories']} of {args.prompts}; tokens alike before they "
          f"part: median {result['median_alike']}, min {min(alike)}")
    for name, value in ms.items():
        print(f"  one player, {name}: {value:.1f} ms per step ({1000 / value:.0f} tokens/s)")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
