"""What rounding the activations to 8 bits costs in KL divergence, by how they are grouped.

The K-quant kernels (worker/continuous/csrc/kquants.h) round a product's activations to 8 bits per
group of 32. With a float step per group (as they did until 2026-12-06) each group and row then
costs a float multiply and two multiply-adds after the integer sums, and at 64 rows on a Zen 4
that is what holds the products (docs/serving.md); with the row's step halved per group ("pow2row",
what they do now) a multiply less. A coarser or cheaper grouping frees some of that work, at a
price in quality, and issue 23 bounds the price: the engine's KL divergence from the file's float
reference no worse than llama.cpp's own. This measures the price without a kernel for it:

- the float reference: the file's weights dequantized, products in float32 (the torch path, no
  C++ kernels: every product is a dense one, so rounding can be put in front of it), on the same
  text and chunks as `bench.kl_divergence` reads (README.md, chunks of 512, the second half of each
  scored, the first token BOS);
- each scheme: the same, with every product's input rounded as the scheme says (the products
  themselves exact in float32), so only the activations' rounding differs from the reference.
  A product whose K is a multiple of 256 (a K-quant tensor in llama.cpp's files) takes the scheme;
  the others (Q5_0/Q5_1/Q8_0 tensors, whose activations both engines round per 32) keep per 32,
  unless --all-layers, which asks what a model whose every product is a K-quant would pay.

The schemes (a step is what one integer unit of q is worth; a group's largest |x| is never clipped):

    per32       a float step per 32 (what the kernels did until 2026-12-06)
    per64       a float step per 64
    per256      a float step per 256 (llama.cpp's Q8_K for the K-quants)
    pow2        per 32, the step the block of 256's step times 2^-e (e >= 0, the smallest step that
                fits): the integer sums of a block's groups meet one float scale after a shift
    pow2row     the same with the row's step instead of its block's (e up to 13): the kernels' own
    quarters    as pow2, with steps of 1, 7/8, 3/4 or 5/8 times 2^-e

    python -m bench.activation_grouping                        # SmolLM2-135M Q4_K_M, every scheme
    python -m bench.activation_grouping --all-layers --schemes per32 pow2row

Prints a table, writes <out>.json and <out>.png. The measure is float32's; the engine's defaults
(bf16 activations, cache and hidden states) add their own share on top (docs/serving.md).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from bench.report import cell, pyplot, save_figure, write_json

OUT = Path("docs/results/activation-grouping")
LARGEST = 127.0
CAP = 13  # the most halvings of a block's step (csrc/kquants.h's SHIFTS: a shifted sum stays in int32)


def _groups(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1] // n, n)


def _rounded(groups: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """groups [rows, G, n] rounded to integers of `step` [rows, G, 1] (ties to even, as the kernels)."""
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    return torch.clamp(torch.round(groups * inverse), -LARGEST, LARGEST) * step


def per(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [rows, K] rounded with a float step per n values: max|x| / 127, as the kernels round per 32
    (q = round(x * (127 / max)), then q * (max / 127))."""
    g = _groups(x, n)
    largest = g.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, LARGEST / largest, torch.zeros_like(largest))
    return (torch.round(g * inverse) * (largest / LARGEST)).reshape(x.shape)


def halvings(x: torch.Tensor, block: int | None, cap: int = CAP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 32 [rows, G, 1]: e, the times the block's step (its max|x| / 127; block None: the
    row's) is halved, at most `cap`, the most that still holds the group's largest |x| within 127
    steps; and the block's 127 / max|x|. Reckoned in float32 as csrc/kquants.h's Activations does."""
    group_max = _groups(x, 32).abs().amax(-1, keepdim=True)
    n = x.shape[1] if block is None else block
    block_max = _groups(x, n).abs().amax(-1, keepdim=True).repeat_interleave(n // 32, dim=1)
    inverse = torch.where(block_max > 0, LARGEST / block_max, torch.zeros_like(block_max))
    at_block_step = group_max * inverse
    e = sum((at_block_step * 2.0 ** j <= LARGEST).float() for j in range(1, cap + 1))
    return e, inverse


def shared_steps(x: torch.Tensor, block: int | None, fractions: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    """Each group of 32's step [rows, G, 1]: the block's step times f 2^-e, f one of `fractions` (in
    (1/2, 1]): the smallest that holds the group (with fractions (1,): the block's halved e times)."""
    e, inverse = halvings(x, block)
    base = torch.where(inverse > 0, 1.0 / inverse, torch.zeros_like(inverse))
    group_max = _groups(x, 32).abs().amax(-1, keepdim=True)
    best = base * torch.pow(2.0, -e)
    for f in fractions:
        for extra in (0, 1):  # f 2^-(e+1) may hold the group where 2^-(e+1) did not
            candidate = base * f * torch.pow(2.0, -torch.clamp(e + extra, max=CAP))
            best = torch.where((candidate * LARGEST >= group_max) & (candidate < best), candidate, best)
    return best


def shared(x: torch.Tensor, block: int | None, fractions: tuple[float, ...] = (1.0,)) -> torch.Tensor:
    """x rounded with per-32 steps shared from the block's. With fractions (1,) exactly as the
    kernels round (block None): q = round(x (127 / max|x| of the row) 2^e), q times the step."""
    g = _groups(x, 32)
    if fractions != (1.0,):
        return _rounded(g, shared_steps(x, block, fractions)).reshape(x.shape)
    e, inverse = halvings(x, block)
    step = torch.where(inverse > 0, 1.0 / inverse, torch.zeros_like(inverse))
    q = torch.round(g * (inverse * torch.pow(2.0, e)))
    return (q * (step * torch.pow(2.0, -e))).reshape(x.shape)


# A scheme: how it rounds x [rows, K], and what K must be a multiple of for it.
SCHEMES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "per32": (lambda x: per(x, 32), 32),
    "per64": (lambda x: per(x, 64), 64),
    "per256": (lambda x: per(x, 256), 256),
    "pow2": (lambda x: shared(x, 256), 256),
    "pow2row": (lambda x: shared(x, None), 32),
    "quarters": (lambda x: shared(x, 256, (1.0, 0.875, 0.75, 0.625)), 256),
}


def takes_scheme(scheme: str, K: int, all_layers: bool) -> bool:
    """Whether a product of K inputs is rounded by the scheme (else per 32): a K-quant's K is a
    multiple of 256; --all-layers: every product whose K the scheme's groups divide."""
    return K % SCHEMES[scheme][1] == 0 and (K % 256 == 0 or all_layers)


def rounding(scheme: str, all_layers: bool):
    """The Linear.__call__ there was, and one that rounds its input as `scheme` says before the
    dense float32 product."""
    from worker.continuous import linear
    original, round_x = linear.Linear.__call__, SCHEMES[scheme][0]

    def call(self, x):
        K = x.shape[-1]
        return original(self, round_x(x) if takes_scheme(scheme, K, all_layers) else per(x, 32))
    return original, call


def measure(path: Path, schemes: list[str], chunks: int, all_layers: bool) -> list[dict]:
    os.environ["STORYTELLER_NO_KERNELS"] = "1"  # the torch path: every product a dense Linear call
    from bench import kl_divergence as kl
    from worker.continuous import linear
    built = kl.engine(path, "float32", "dense")
    if built.runner.kernel is not None:
        raise RuntimeError("the C++ kernels loaded: the products would not pass through Linear.__call__")
    tokenizer = built.loaded.tokenizer
    ids = tokenizer.encode(kl.TEXT.read_text(), add_special_tokens=False)
    per_chunk = kl.CONTEXT - 1
    texts = [[tokenizer.bos_token_id, *ids[i * per_chunk:(i + 1) * per_chunk]]
             for i in range(min(chunks, len(ids) // per_chunk))]
    reference = [kl.chunk_log_probs(built, t) for t in texts]
    rows = []
    for scheme in schemes:
        original, call = rounding(scheme, all_layers)
        linear.Linear.__call__ = call
        try:
            log_probs = [kl.chunk_log_probs(built, t) for t in texts]
        finally:
            linear.Linear.__call__ = original
        rows.append({"scheme": scheme, "kld": kl.mean_kld(reference, log_probs),
                     "ppl": kl.perplexity(log_probs, texts), "ppl_ref": kl.perplexity(reference, texts)})
        print(f"{scheme:>9}: KL {rows[-1]['kld']:.6f}, perplexity {rows[-1]['ppl']:.4f} "
              f"(reference {rows[-1]['ppl_ref']:.4f})", flush=True)
    base = next((r["kld"] for r in rows if r["scheme"] == "per32"), None)
    for r in rows:
        r["kld_over_per32"] = None if base is None else r["kld"] - base
    return rows


def plot(rows: list[dict], title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar([r["scheme"] for r in rows], [r["kld"] for r in rows], color="#4C72B0")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['kld']:.5f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KL from the float reference (nats)")
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="smollm2-135m",
                    help="a GGUF file, or a shape of bench.llama_cpp (its Q4_K_M file; default: SmolLM2-135M's)")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--chunks", type=int, default=7, help="chunks of 512 tokens of README.md")
    ap.add_argument("--all-layers", action="store_true", help="every product takes the scheme, not only K-quants'")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    from bench import kl_divergence
    path = kl_divergence.resolve(args.file)
    print(f"== {path.name}: activations rounded per scheme, against float32 on the same weights", flush=True)
    rows = measure(path, args.schemes, args.chunks, args.all_layers)
    print(f"\n{'scheme':>9} {'KL':>9} {'over per32':>11} {'perplexity':>11}")
    for r in rows:
        print(f"{r['scheme']:>9} {r['kld']:>9.6f} {cell(r['kld_over_per32'], '+.6f'):>11} {r['ppl']:>11.4f}")
    which = "every product" if args.all_layers else "K-quant products (K a multiple of 256)"
    write_json(args.out.with_suffix(".json"), {"file": path.name, "chunks": args.chunks, "rounded": which, "rows": rows})
    plot(rows, f"{path.name}: activations rounded per scheme in {which}", args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
