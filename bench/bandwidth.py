"""This machine's memory read bandwidth: the bound a lone player's decoding is held against.

One player's step reads every weight once and does little else with it, so its fastest possible
time is the weights' bytes over the rate the cores can read memory. That rate is measured here as
the fastest of a few plain reductions over a buffer far larger than the caches (1 GiB by default,
in 2 MiB pages where Linux gives them, as the engine's weights are: worker/continuous/huge_pages.py;
on 4 KiB pages the same reductions read 10-20% slower on a Zen 4, which would flatter the engine),
on the engine's thread count, each run `--repeats` times (the median counts): torch's float32 sum,
its float32 amax and an int64 sum. A reduction reads each byte once and writes nothing, as the
kernels' weight stream does. Give `--bytes-per-token` (a model's packed weights, head included) to
get the bound in tokens/s as well.

    python -m bench.bandwidth --threads 2
    python -m bench.bandwidth --threads 2 --bytes-per-token 1.075e9 --out docs/results/bandwidth

Prints a table, writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch

from bench.report import pyplot, save_figure, write_json
from worker.continuous.huge_pages import HugePages

WAYS = {
    "float32 sum": (torch.float32, torch.sum),
    "float32 amax": (torch.float32, torch.amax),
    "int64 sum": (torch.int64, torch.sum),
}


def measure(gib: float, repeats: int) -> dict[str, float]:
    """GB/s (10^9 bytes) each way reads at, the median of `repeats` passes."""
    rates = {}
    for name, (dtype, reduce) in WAYS.items():
        elements = int(gib * 2 ** 30) // torch.empty((), dtype=dtype).element_size()
        buffer = HugePages().empty((elements,), dtype).fill_(1)  # written once: every page is resident
        reduce(buffer)  # a first pass, unmeasured
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            reduce(buffer)
            seconds.append(time.perf_counter() - start)
        rates[name] = buffer.numel() * buffer.element_size() / statistics.median(seconds) / 1e9
        del buffer
    return rates


def weight_bytes_per_token(path: str) -> int:
    """The bytes of a GGUF file's tensors one decoding step reads: all of them, but for the token
    embedding where the file has an output (head) tensor of its own (a step reads one row of it)."""
    import gguf
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def bound(path: str, threads: int, gib: float = 1.0, repeats: int = 7) -> dict:
    """A lone player's bound on a GGUF file on `threads` threads, measured now: the fastest way's
    GB/s and the tokens/s it allows at the file's own weight bytes a token."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = max(measure(gib, repeats).values())
    finally:
        torch.set_num_threads(before)
    per_token = weight_bytes_per_token(path)
    return {"bandwidth_gb_s": round(best, 2), "bytes_per_token": per_token,
            "bound_tokens_per_s": round(best * 1e9 / per_token, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the worker's TORCH_THREADS)")
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size, GiB")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bytes-per-token", type=float, default=0.0,
                    help="a model's weight bytes read per token: also print the bound in tokens/s")
    ap.add_argument("--out", default="bench/results/bandwidth")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rates = measure(args.gib, args.repeats)
    best = max(rates.values())
    print(f"\nread bandwidth, {args.threads} threads, {args.gib:g} GiB buffer, median of {args.repeats}\n")
    print("| way | GB/s |\n|---|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    summary = {"bandwidth_gb_s": round(best, 2)}
    if args.bytes_per_token:
        bound = best * 1e9 / args.bytes_per_token
        summary.update(bytes_per_token=args.bytes_per_token, bound_tokens_per_s=round(bound, 2),
                       bound_ms_per_token=round(1000 / bound, 2))
        print(f"\nthe fastest, {best:.1f} GB/s, reads {args.bytes_per_token / 1e9:.3f} GB a token in "
              f"{1000 / bound:.1f} ms: at most {bound:.1f} tokens/s for one player")
    out = args.out
    write_json(f"{out}.json", {"when": datetime.datetime.now().isoformat(timespec="seconds"),
                               "machine": platform.processor() or platform.machine(), "args": vars(args),
                               "gb_s": {k: round(v, 2) for k, v in rates.items()}, "summary": summary})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(rates), list(rates.values()), color="#2a7")
    ax.set_xlabel("GB/s read")
    ax.set_title(f"memory read bandwidth, {args.threads} threads")
    fig.tight_layout()
    save_figure(fig, f"{out}.png", dpi=110)
    print(f"\nwrote {out}.json and {out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
