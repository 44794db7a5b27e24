"""The matrix-product candidates for one numeric path, at 1-512 rows, in one run.

A row's product must be the same bits at every step size for a request's text to be its own, so
one kernel has to serve every step: the lone player's decode and the 512-token prompt chunk. This
times each candidate on SmolLM2's own 30 layers (its GGUF weights: the QKV, output, gate-up and
down products, as the model runs them) at 1 to 512 rows, on the process's threads, and prints a
table (median ms for all 120 products, and each against oneDNN's bf16 product), writes JSON and a
chart. Candidates that are not row-invariant are timed too, as the baseline they replace.

    python -m bench.row_kernels --threads 2 --out docs/results/row-kernels
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.report import pyplot, save_figure, write_json
from worker.continuous import kernels
from worker.continuous.linear import PACK_ROWS_HINT, pack_dense_panels
from worker.continuous.weights import fuse, read_gguf
from worker.model_loader import PACKAGED_FILE, packaged_model_dir

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
NAMES = ("qkv", "o", "gate_up", "down")


def smollm2_layers() -> list:
    """The model's 120 quantized products (Q41), as the engine fuses them."""
    _, tensors = read_gguf(os.path.join(packaged_model_dir(), PACKAGED_FILE))
    layers, i = [], 0
    while f"model.layers.{i}.self_attn.q_proj.weight" in tensors:
        p = f"model.layers.{i}."
        layers += [fuse([tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
                   fuse([tensors[p + "self_attn.o_proj.weight"]]),
                   fuse([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]),
                   fuse([tensors[p + "mlp.down_proj.weight"]])]
        i += 1
    return layers


def candidates(layers: list, kernel) -> dict:
    """name -> (invariant?, a function of {K: x} running every layer once)."""
    def over(packed, product):
        return lambda xs: [product(xs[w.shape[1]], p) for w, p in zip(layers, packed)]
    ways = {}
    dense_bf16 = [w.dequantize().bfloat16() for w in layers]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in dense_bf16]
    ways["dense bf16 (oneDNN)"] = (False, over(onednn, lambda x, w: torch.ops.mkldnn._linear_pointwise(
        x, w, None, "none", [], "")))
    if hasattr(kernel, "int8_linear"):
        ways["int8, groups along lanes (int8.h)"] = (True, over([w.int8_packed() for w in layers],
                                                               lambda x, p: kernel.int8_linear(x, p, True)))
    if hasattr(kernel, "panel_linear"):
        ways["int8, features along lanes (panels.h)"] = (True, over([w.panel_packed() for w in layers],
                                                                   lambda x, p: kernel.panel_linear(x, p, True)))
    if hasattr(kernel, "dense_panel_linear") and "bfloat16" in kernel.dense_panel_dtypes():
        ways["dense bf16 in panels (dense_panels.h)"] = (True, over([pack_dense_panels(w) for w in dense_bf16],
                                                                    kernel.dense_panel_linear))
    del dense_bf16
    return ways


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def time_ms(run, xs, repeats: int) -> float:
    run(xs)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(xs)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def plot(results: dict, out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, row in results["ms"].items():
        ax.plot(results["rows"], [results["rows"][i] / ms * 1000 for i, ms in enumerate(row)], marker="o",
                label=name + ("" if results["invariant"][name] else " (not row-invariant)"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the step")
    ax.set_ylabel("rows per second through SmolLM2's 120 products")
    ax.set_title(f"One step's products, {results['threads']} threads, {results['cpu']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/row-kernels")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = kernels.build(str(Path("~/.cache/storyteller/kernels").expanduser()))
    ways = candidates(smollm2_layers(), kernel)
    gen = torch.Generator().manual_seed(0)
    results = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
               "rows": args.rows, "ms": {name: [] for name in ways},
               "invariant": {name: invariant for name, (invariant, _) in ways.items()}}
    print(f"{'rows':>5} " + " ".join(f"{name[:22]:>24}" for name in ways))
    for n in args.rows:
        xs = {k: torch.randn(n, k, generator=gen).bfloat16() for k in (576, 1536)}
        line = []
        for name, (_, run) in ways.items():
            results["ms"][name].append(time_ms(run, xs, args.repeats))
        base = results["ms"]["dense bf16 (oneDNN)"][-1]
        for name in ways:
            ms = results["ms"][name][-1]
            line.append(f"{ms:8.2f} ms ({base / ms:4.2f}x)")
        print(f"{n:>5} " + " ".join(f"{cell:>24}" for cell in line), flush=True)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), results, indent=1)
    plot(results, out)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')} "
          "(x: speed against oneDNN's bf16 product, higher is faster)")


if __name__ == "__main__":
    main()
