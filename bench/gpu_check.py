"""The continuous engine on a GPU: does it write what transformers writes, and how fast. One short
script for a lent GPU machine (it runs on the CPU too, with --device cpu, to check the script).

1. Text: greedy stories from the continuous engine against transformers' own `generate` on the same
   device, weights and dtype: tokens alike before they part, per prompt (in float32 they should
   not part; in bf16 rounding may part them late).
2. Speed, in process: decode steps at 1, 16 and 64 rows (median ms per step, tokens/s), the static
   engine beside it.

    python -m bench.gpu_check --device cuda --out "$OUT/gpu_check"
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from bench.prompts import make_prompt
from bench.profile_step import filled_engine
from bench.report import write_json
from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.continuous import engine as continuous
from worker.model_loader import load
from worker.static_engine import StaticEngine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def alike(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def text_check(dtype: str, device: str, prompts: list[str], tokens: int) -> dict:
    loaded = load("smollm2", dtype=dtype, device=device)
    engine = continuous.build(loaded, Settings(kv_memory=256), loaded.model.state_dict(), loaded.config)
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    seqs = [engine.add(Job(id=f"t{i}", model="m", prompt_ids=p, timeout_s=3600,
                           params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)))
            for i, p in enumerate(ids)]
    while engine.busy:
        engine.step()
    parted = []
    for prompt, seq in zip(ids, seqs):
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([prompt], device=loaded.device), max_new_tokens=tokens,
                                        min_new_tokens=tokens, do_sample=False)
        parted.append(alike(seq.output_ids, out[0, len(prompt):].tolist()))
    return {"dtype": str(loaded.dtype), "alike_before_parting": parted, "tokens": tokens}


def step_ms(engine, device: torch.device, steps: int) -> float:
    """Median wall time of `steps` engine steps, the device's queue drained around each."""
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def speed(device: str, batches: list[int], steps: int) -> list[dict]:
    loaded = load("smollm2", device=device)
    rows = []
    for batch in batches:
        ms = step_ms(filled_engine(loaded, Settings(kv_memory=1024), batch, 64), loaded.device, steps)
        static = StaticEngine(loaded, capacity=batch)
        prompt = loaded.tokenizer.encode("Write a short story about a dragon.\n")
        for i in range(batch):
            static.add(Job(id=f"s{i}", model="m", prompt_ids=prompt, timeout_s=3600,
                           params=SamplingParams(max_tokens=steps + 20, temperature=0, ignore_eos=True)))
        static.step()  # the prefill
        static_ms = step_ms(static, loaded.device, steps)
        rows.append({"batch": batch, "continuous_ms": ms, "continuous_tokens_per_s": batch / ms * 1e3,
                     "static_ms": static_ms, "static_tokens_per_s": batch / static_ms * 1e3})
        print(f"  batch {batch:3d}: continuous {ms:7.2f} ms/step ({batch / ms * 1e3:7.0f} tok/s), "
              f"static {static_ms:7.2f} ms/step ({batch / static_ms * 1e3:7.0f} tok/s)", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--out", default="bench/results/gpu_check")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (torch.cuda.is_available() is False)")
    rng = random.Random(2)
    prompts = [make_prompt(rng) for _ in range(args.prompts)]
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
              "torch": torch.__version__, "text": []}
    for dtype in ("float32", "auto"):
        check = text_check(dtype, args.device, prompts, args.tokens)
        result["text"].append(check)
        print(f"{check['dtype']}: tokens alike with transformers' generate before parting "
              f"{check['alike_before_parting']} of {args.tokens}", flush=True)
    print("decode steps in process (default dtype):")
    result["speed"] = speed(args.device, args.batches, args.steps)
    out = Path(args.out).with_suffix(".json")
    write_json(out, result, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
