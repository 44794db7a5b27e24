"""The same prompts through transformers' own continuous batching, in this process, for reference.

`model.generate_batch(...)` (transformers.generation.continuous_batching) runs a paged KV cache and
a scheduler of its own on the model's own classes. Timing it on the prompts bench.engines'
uniform crowd sends (player i's first prompt, for i < N) gives a bar to hold the worker's
numbers against: no HTTP, no Redis, no API, only the engine and the model. It is greedy by
default (the worker benchmark samples at temperature 0.8; decoding cost is the same).

    python -m bench.hf_generate_batch                      # 64 prompts x 100 tokens, EOS ignored
    python -m bench.hf_generate_batch --prompts 16 --tokens 50 --num-blocks 256
"""
from __future__ import annotations

import argparse
import logging
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bench.prompts import RequestShape
from bench.report import write_json
from bench.stats import p95, rounded

CB_LOGGER = "ContinuousBatchingLogger"  # transformers' logger for continuous batching


class Collect(logging.Handler):
    """Keeps transformers' continuous-batching log lines: how it sized the cache, which
    attention it fell back to; they go into the JSON as the run's own account of itself."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def make_prompts(count: int, tokens: int, seed: int, prompt_tokens=None) -> list[str]:
    """Player i's first prompt of bench.load, for i < count: the crowd's own prompts."""
    shape = RequestShape(max_tokens=(tokens, tokens), prompt_tokens=prompt_tokens)
    return [shape.draw(random.Random(seed + i))[0] for i in range(count)]


def summarize(outputs: dict, seconds: float) -> dict:
    """Tokens/s, and each request's latency and TTFT, from transformers' own timestamps
    (perf_counter: created_time, lifespan end, each token's timestamp).

    tokens_per_s counts from the first request's creation to the last one's end: generate_batch
    also builds and warms a fresh manager inside the call (seconds on a CPU), which the worker
    did once at start-up, so that is left out; call_tokens_per_s keeps it in."""
    done = [o for o in outputs.values() if o.error is None]
    tokens = sum(len(o.generated_tokens) for o in done)
    ends = [o.lifespan[1] for o in done if o.lifespan[1] > 0]
    span = max(ends) - min(o.created_time for o in done) if ends else 0.0
    latencies = [o.lifespan[1] - o.created_time for o in done if o.lifespan[1] > 0]
    ttfts = [o.timestamps[0] - o.created_time for o in done if o.timestamps]
    return {"requests": len(done), "errors": len(outputs) - len(done),
            "seconds": round(span, 3), "call_seconds": round(seconds, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / span, 2) if span > 0 else None,
            "call_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
            "median_s": rounded(statistics.median, latencies, 4), "p95_s": rounded(p95, latencies, 4),
            "ttft_median_s": rounded(statistics.median, ttfts, 4),
            "ttft_p95_s": rounded(p95, ttfts, 4),
            "generated_min": min((len(o.generated_tokens) for o in done), default=None),
            "generated_max": max((len(o.generated_tokens) for o in done), default=None),
            "error_samples": list(dict.fromkeys(str(o.error) for o in outputs.values()
                                                if o.error is not None))[:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="requests, all submitted at once")
    ap.add_argument("--tokens", type=int, default=100, help="max_new_tokens of each")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="prompts of ~MIN-MAX tokens (default: the crowd's one-line prompts)")
    ap.add_argument("--honor-eos", action="store_true",
                    help="stop at end-of-text (default: ignored, every request writes --tokens)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attn", default=None,
                    help="attn_implementation to load with (default: the model's, sdpa on CPU)")
    ap.add_argument("--page-size", type=int, help="KV cache tokens per page (transformers: 256)")
    ap.add_argument("--num-blocks", type=int, help="KV cache blocks (default: sized from memory)")
    ap.add_argument("--max-batch-tokens", type=int, help="tokens per step (default: from memory)")
    ap.add_argument("--max-requests-per-batch", type=int)
    ap.add_argument("--scheduler", default="fifo", choices=["fifo", "prefill_first"])
    ap.add_argument("--no-prefix-sharing", action="store_true",
                    help="allow_block_sharing=False (no prefix caching)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/hf_generate_batch", help="writes <out>.json")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from worker import model_loader

    collect = Collect()
    cb_log = logging.getLogger(CB_LOGGER)
    cb_log.addHandler(collect)
    cb_log.setLevel(logging.INFO)

    loaded = model_loader.load(args.model, dtype=args.dtype, device=args.device)
    model = loaded.model
    if args.attn:
        model.set_attn_implementation(args.attn)
    tokenizer = loaded.tokenizer
    prompts = make_prompts(args.prompts, args.tokens, args.seed,
                           tuple(args.prompt_tokens) if args.prompt_tokens else None)
    inputs = [tokenizer(p)["input_ids"] for p in prompts]
    # eos_token_id=-1 is transformers' own "no end-of-text" for continuous batching: each
    # request then writes exactly max_new_tokens, like the worker's ignore_eos.
    eos = sorted(loaded.eos_ids) if args.honor_eos else -1
    generation = GenerationConfig(max_new_tokens=args.tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=loaded.pad_id)
    cb_settings = {k: v for k, v in {"page_size": args.page_size, "num_blocks": args.num_blocks,
                                     "max_batch_tokens": args.max_batch_tokens,
                                     "max_requests_per_batch": args.max_requests_per_batch}.items()
                   if v is not None}
    cb_settings.update(scheduler_type=args.scheduler, allow_block_sharing=not args.no_prefix_sharing)

    def run(batch):
        # A fresh manager each call (generate_batch's default), sized for this call's requests.
        return model.generate_batch(batch, generation_config=generation,
                                    continuous_batching_config=ContinuousBatchingConfig(**cb_settings),
                                    record_timestamps=True, progress_bar=True)

    print(f"# transformers {transformers.__version__} generate_batch: {loaded.name} "
          f"({loaded.device}, {str(loaded.dtype).removeprefix('torch.')}, "
          f"attention {model.config._attn_implementation}), {len(inputs)} prompts of "
          f"{min(map(len, inputs))}-{max(map(len, inputs))} tokens x {args.tokens} tokens, "
          f"EOS {'honoured' if args.honor_eos else 'ignored'}, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    run(inputs[:2])  # warm-up, untimed: first-call allocations, as the worker benchmark warms up
    collect.lines.clear()
    start = time.perf_counter()
    outputs = run(inputs)
    row = summarize(outputs, time.perf_counter() - start)
    row["prompt_tokens_median"] = statistics.median(map(len, inputs))

    print(f"{'requests':>9} {'errors':>7} {'wall s':>8} {'tok/s':>8} {'median s':>9} "
          f"{'p95 s':>8} {'TTFT med':>9} {'TTFT p95':>9} {'call s':>8} {'call tok/s':>10}")
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    print(f"{row['requests']:>9} {row['errors']:>7} {row['seconds']:>8.2f} "
          f"{num(row['tokens_per_s'], '.1f'):>8} {num(row['median_s'], '.3f'):>9} "
          f"{num(row['p95_s'], '.3f'):>8} {num(row['ttft_median_s'], '.3f'):>9} "
          f"{num(row['ttft_p95_s'], '.3f'):>9} {row['call_seconds']:>8.2f} "
          f"{num(row['call_tokens_per_s'], '.1f'):>10}")
    print("(wall s and tok/s: first request in to last out; call: the whole generate_batch "
          "call, with its cache set-up and warm-up)")
    for message in row["error_samples"]:
        print(f"    error: {message}")
    result = {"engine": "transformers generate_batch", "transformers": transformers.__version__,
              "torch": torch.__version__, "model": loaded.name, "device": str(loaded.device),
              "dtype": str(loaded.dtype).removeprefix("torch."),
              "attention": model.config._attn_implementation, "threads": torch.get_num_threads(),
              "host": platform.processor() or platform.machine(), "prompts": len(inputs),
              "max_new_tokens": args.tokens, "ignore_eos": not args.honor_eos, "do_sample": False,
              "prompt_tokens": args.prompt_tokens, "seed": args.seed,
              "continuous_batching_config": cb_settings, "log": collect.lines, **row}
    path = Path(args.out + ".json")
    write_json(path, result)
    print(f"wrote {path}")
    return 1 if row["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
