"""What the faster kernels cost in text and buy in speed: the same greedy stories written by engines
that differ in one setting, in-process, against a reference that computes with the file's weights
exactly (float32, dense products).

For each variant and prompt: how many of the first N tokens it writes alike with the reference
before they part, and the share of stories that stay identical; then one player's decode step time.
The variants (name=SETTING=VALUE,...; DTYPE picks the weights' type):

    python -m bench.kernel_text --prompts 16 --tokens 100 --out docs/results/kernel_text
    python -m bench.kernel_text --variants "bf16=DTYPE=bfloat16" "int4 head=DTYPE=bfloat16,INT4_HEAD=1"
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from bench.prompts import make_prompt
from bench.report import write_json
from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.continuous import engine as continuous
from worker.model_loader import load

REFERENCE = "float32, dense=DTYPE=float32,SMALL_KERNEL=dense"
VARIANTS = ["bf16, int8 kernel=DTYPE=bfloat16,SMALL_KERNEL=int8",
            "bf16, int4 kernel=DTYPE=bfloat16,SMALL_KERNEL=int4",
            "bf16, dense=DTYPE=bfloat16,SMALL_KERNEL=dense",
            "float32, int8 kernel=DTYPE=float32,SMALL_KERNEL=int8",
            "bf16, int8 kernel, int4 head=DTYPE=bfloat16,SMALL_KERNEL=int8,INT4_HEAD=1"]


def write(engine, prompts, tokens: int) -> list[list[int]]:
    """Each story alone, as a lone player's: steps of one row, where the quantized kernels run."""
    texts = []
    for i, prompt in enumerate(prompts):
        seq = engine.add(Job(id=f"h{i}", model="m", prompt_ids=prompt, timeout_s=3600,
                             params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)))
        while engine.busy:
            engine.step()
        texts.append(seq.output_ids)
    return texts


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


def parse_variant(text: str) -> tuple[str, Settings]:
    """"name=KEY=VALUE,KEY=VALUE" (the worker's environment variables) -> (name, its settings)."""
    name, _, assignments = text.partition("=")
    environ = dict(a.split("=", 1) for a in assignments.split(",") if a)
    return name, Settings.from_env({"KV_MEMORY": "256", **environ})


def build(loaded_by_dtype: dict, settings: Settings):
    if settings.dtype not in loaded_by_dtype:
        loaded_by_dtype[settings.dtype] = load("smollm2", dtype=settings.dtype, transformers_model=False,
                                               cache_dir=Settings.cache_dir)
    loaded = loaded_by_dtype[settings.dtype]
    return continuous.build(loaded, settings, loaded.weights(), loaded.config)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--reference", default=REFERENCE)
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--out", default="bench/results/kernel_text")
    args = parser.parse_args(argv)
    loaded: dict = {}
    rng = random.Random(1)
    name, settings = parse_variant(args.reference)
    reference = build(loaded, settings)
    tokenizer = loaded[settings.dtype].tokenizer
    prompts = [tokenizer.encode(make_prompt(rng)) for _ in range(args.prompts)]
    expected = write(reference, prompts, args.tokens)
    results = {name: {"lone_step_ms": lone_step_ms(reference, prompts[0])}}
    print(f"{args.prompts} greedy stories of {args.tokens} tokens against {name}:")
    for variant in args.variants:
        label, settings = parse_variant(variant)
        try:
            engine = build(loaded, settings)
        except ValueError as exc:  # a kernel this CPU lacks
            print(f"  {label}: skipped ({exc})")
            continue
        texts = write(engine, prompts, args.tokens)
        alike = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(texts, expected)]
        results[label] = {"alike_before_parting": alike, "identical_stories": sum(n == args.tokens for n in alike),
                          "median_alike": statistics.median(alike), "lone_step_ms": lone_step_ms(engine, prompts[0])}
        r = results[label]
        print(f"  {label}: identical {r['identical_stories']} of {args.prompts}; alike before parting: "
              f"median {r['median_alike']}, min {min(alike)}; one player {r['lone_step_ms']:.1f} ms per step")
    print(f"  {name}: one player {results[name]['lone_step_ms']:.1f} ms per step")
    out = Path(args.out).with_suffix(".json")
    write_json(out, {"prompts": args.prompts, "tokens": args.tokens, "reference": name, "results": results},
               indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
