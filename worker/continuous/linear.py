"""A linear layer that holds its weight twice: dense for big steps, quantized for small ones.

At a few tokens per step a decode is bound by memory bandwidth, and the GGUF's own quantized
blocks (Q4_1 layers, the Q8_0 head) stream far fewer bytes than a dense copy. At many tokens per
step it is bound by arithmetic, and the dense product wins. The choice is made per call, by the
number of rows: up to `small_rows` take the quantized path (--int4-rows, lowered at start to where
the dense product gets faster on this CPU, timed).

Three quantized kernels exist, and which is faster depends on the CPU, by a lot: torch's int4
kernel (the Q4_1 blocks repacked without changing a value: scale = d, zero = m + 8 d) is fast with
AVX-512 and was 60x slower than float32 on an AVX2-only CPU here; this engine's float kernel
(csrc/quantized.h: the file's nibbles and bytes, AVX2) runs anywhere; its integer kernel
(csrc/int8.h: the activations rounded to 8 bits per group, as llama.cpp does, and the file's bytes
multiplied in int8, with AVX-512 VNNI or else AVX2) was the fastest on both kinds of CPU here.
`small_kernel` times them once per process on layers of SmolLM2's shape and keeps the fastest, or
none if none beats the dense product, and up to how many rows it keeps winning.

On the CPU in bf16 the dense weight is stored pre-packed in oneDNN's blocked layout, the same
kernel that torch.compile's freezing pass uses: measured 1.1-2x faster than F.linear on the same
weight, with no compile step. Float32 keeps F.linear, so the exactness tests compare like with like.
"""
from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Optional, Union

import torch
import torch.nn.functional as F

from worker.continuous.weights import Q41, Q80, Quantized

log = logging.getLogger(__name__)

GROUP = 32  # Q4_1 and Q8_0 blocks: one scale (and minimum) per 32 weights of a row
PACK_ROWS_HINT = 64  # oneDNN blocks the packed weight for steps of about this many rows


class Linear:
    def __init__(self, weight: Union[torch.Tensor, Quantized], bias: Optional[torch.Tensor], dtype,
                 device, small_rows: int = 0, kernel=None, dense: Optional[torch.Tensor] = None,
                 small: str = "auto"):
        """`kernel`: the engine's C++ module (kernels.build), or None. `dense`: the weight already
        dequantized in `dtype` on `device` (a tied embedding's table), shared instead of made again.
        `small`: the quantized kernel of small steps (SMALL_KERNELS; "auto": `small_kernel`'s pick)."""
        quantized = isinstance(weight, (Q41, Q80))
        self.weight = dense if dense is not None else \
            (weight.dequantize() if quantized else weight).to(device=device, dtype=dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.out_features = self.weight.shape[0]
        self.onednn = device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
        if self.onednn:  # the plain copy is not kept: the packed one is all the products need
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
            except RuntimeError:  # oneDNN's bf16 packing needs AVX-512 (or AVX-NE-CONVERT)
                self.onednn = False
        self.small, most = None, 0
        if quantized and small_rows and device.type == "cpu" and small != "dense":
            # Past some rows the dense product is faster: where, depends on the CPU (timed once).
            self.small, most = small_kernel(kernel, dtype, small)
        if self.small == "int4" and not isinstance(weight, Q41):
            self.small = None  # torch's int4 kernel takes 4-bit values only
        self.small_rows = min(small_rows, most) if self.small else 0
        self.q4_1 = isinstance(weight, Q41)
        self.kernel = kernel
        self.packed = self.scales_zeros = None  # torch's int4 layout, or the file's bytes for "int8"
        self.q = self.d = self.m = None  # the file's own: a byte per weight, a scale and minimum per group
        if self.small == "int4":
            self.packed, self.scales_zeros = weight.pack_int4(dtype)
        elif self.small == "int8":
            self.packed = weight.int8_packed()
        elif self.small == "bytes":  # Q4_1 two weights to a byte, Q8_0 one
            self.q = weight.nibbles() if isinstance(weight, Q41) else weight.q.contiguous()
            self.d, self.m = weight.d.contiguous(), weight.m

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_rows:
            if self.small == "int4":
                out = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
            elif self.small == "int8":
                out = self.kernel.int8_linear(x, self.packed, self.q4_1)
            else:
                out = self.kernel.quantized_linear(x, self.q, self.d, self.m)
            return out if self.bias is None else out + self.bias
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def for_kernel(self):
        """This layer as the C++ decoder holds it (sharing these tensors, not copying them)."""
        small = {"int4": (1, self.packed, self.scales_zeros, None),
                 "bytes": (2, self.q, self.d, self.m),
                 "int8": (3 if self.q4_1 else 4, self.packed, None, None)}.get(self.small, (0, None, None, None))
        return self.kernel.Linear(self.weight, self.onednn, small[0], *small[1:], self.small_rows)


SMALL_KERNELS = ("auto", "int8", "int4", "bytes", "dense")


def check_small_kernel(name: str, kernel) -> None:
    """Refuses a kernel this process cannot run (--small-kernel), with the reason."""
    if name not in SMALL_KERNELS:
        raise ValueError(f"--small-kernel {name!r}: one of {', '.join(SMALL_KERNELS)}")
    needs = {"int8": "int8_linear", "bytes": "quantized_linear"}.get(name)
    if needs and not hasattr(kernel, needs):
        why = "the C++ kernels were not built" if kernel is None else "this CPU has neither AVX-512 VNNI nor AVX2"
        raise ValueError(f"--small-kernel {name}: unavailable here ({why})")
    if name == "int4" and not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        raise ValueError("--small-kernel int4: this torch has no int4 kernel for the CPU")


# Rows at which the quantized kernel is timed against the dense product.
CROSSOVER_ROWS = (2, 4, 8, 16, 32, 64, 128, 256)


def _timing_layers(dtype):
    """16 layers of SmolLM2's MLP shape, ~56 MB dense in float32: more than a CPU's cache, so the
    weights stream from memory as a real step's do (a single layer that stays in cache makes the
    dense product look as fast as the quantized ones). Quantized, and dense as Linear runs them."""
    gen = torch.Generator().manual_seed(0)
    layers = [quantize_q4_1(torch.randn(1536, 576, generator=gen)) for _ in range(16)]
    return layers, [Linear(w, None, dtype, torch.device("cpu")) for w in layers]  # as the model's dense path


def _ways(kernel, dtype, names) -> dict:
    """name -> a function of x that runs the 16 timing layers that way (None: dense)."""
    layers, dense = _timing_layers(dtype)
    ways = {None: lambda x: [layer(x) for layer in dense]}
    if "int4" in names and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        packed = [w.pack_int4(dtype) for w in layers]
        ways["int4"] = lambda x: [torch._weight_int4pack_mm_for_cpu(x, p, GROUP, sz) for p, sz in packed]
    if "bytes" in names and kernel is not None and hasattr(kernel, "quantized_linear"):
        packed_q = [w.nibbles() for w in layers]
        ways["bytes"] = lambda x: [kernel.quantized_linear(x, q, w.d, w.m) for q, w in zip(packed_q, layers)]
    if "int8" in names and kernel is not None and hasattr(kernel, "int8_linear"):
        packed_8 = [w.int8_packed() for w in layers]
        ways["int8"] = lambda x: [kernel.int8_linear(x, p, True) for p in packed_8]
    return ways


def _fastest(ways: dict, x: torch.Tensor, repeats: int = 5, threads: int = 1) -> dict:
    """Each way's least disturbed time on x, in seconds, on `threads` threads.

    The quantized kernels are timed against each other on one thread: a multithreaded kernel
    timed while other processes hold the cores waits for its slowest thread (once measured 120 ms
    where it takes 1.6), and they scale alike with threads, being memory-bound."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = {}
        for name, run in ways.items():
            run(x)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(x)
                samples.append(time.perf_counter() - start)
            times[name] = min(samples)
        return times
    finally:
        torch.set_num_threads(before)


@lru_cache(maxsize=None)
def small_kernel(kernel, dtype, choice: str = "auto") -> tuple[Optional[str], int]:
    """The quantized kernel of small steps and the most rows a step may have for it, timed once per
    process (the timing layers are let go after): `choice`, or for "auto" the fastest at one row:
    "int4" (torch's), "bytes" or "int8" (ours), or None (dense is fastest, and no rows)."""
    ways = _ways(kernel, dtype, ("int4", "bytes", "int8") if choice == "auto" else (choice,))
    name = choice
    if choice == "auto":
        times = _fastest(ways, torch.randn(1, 576, dtype=dtype))
        name = min(times, key=times.get)
        log.info("small steps' products: %s (16 layers at one row, one thread: %s)", name or "dense",
                 ", ".join(f"{way or 'dense'} {t * 1e3:.1f} ms" for way, t in times.items()))
        if name is None:
            return None, 0
    return name, _crossover_rows({None: ways[None], name: ways[name]}, name, dtype)


def _crossover_rows(ways: dict, name: str, dtype) -> int:
    """The most rows a step may have for the quantized kernel `name` still to beat the dense product
    here (timed at CROSSOVER_ROWS; at least 1). Where the dense product is fast (bf16 on AMX) that
    is a few rows; where it is float32 on AVX2, the integer kernel won up to 128.
    On the process's threads: there the dense product gained little from a second thread (64 rows:
    35 ms on one, 33 on two) and the integer kernel twice (40, 23 ms)."""
    rows, seen = 1, []
    for n in CROSSOVER_ROWS:
        times = _fastest(ways, torch.randn(n, 576, dtype=dtype), repeats=3, threads=torch.get_num_threads())
        seen.append(f"{n}: {times[name] * 1e3:.1f} / {times[None] * 1e3:.1f} ms")
        if times[name] >= times[None]:
            break
        rows = n
    log.info("%s products up to %d rows a step (16 layers, %s against dense: %s)", name, rows, name,
             ", ".join(seen))
    return rows


def fuse(parts: list) -> Union[torch.Tensor, Q41]:
    """Weights stacked by output rows (QKV, gate and up): one matrix product instead of several."""
    if all(isinstance(p, Q41) for p in parts):
        return Q41.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, (Q41, Q80)) else p for p in parts])


def dense_float(weight: Union[torch.Tensor, Quantized]) -> torch.Tensor:
    """A weight as a float32 matrix, dequantized if the file keeps it quantized."""
    return weight.dequantize() if isinstance(weight, (Q41, Q80)) else weight.float()


def quantize_q4_1(weight: torch.Tensor) -> Q41:
    """Round a float matrix to Q4_1 (per 32 weights: a scale and a minimum), for the --int4-head flag."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q41(q=q.view(rows, cols), d=scale, m=low)
