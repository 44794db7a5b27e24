"""A linear layer: the GGUF's quantized blocks on one kernel for every step size, or a dense weight.

One numeric path whatever the step holds is what makes a request's text its own (docs/serving.md,
"Same request, same text"): a row's product must not change with how many rows share its step.
So the quantized kernel picked here runs every step, from a lone decode to a 512-token prompt chunk;
it is chosen by what this CPU has, never by a timing (two workers of one pool, or one worker
started twice, compute the same bits). On AVX-512 VNNI CPUs that kernel (csrc/panels.h: the file's
Q4_1 and Q8_0 bytes against 8-bit activations, 16 output features a vector) also measured the
fastest at every row count, ahead of oneDNN's bf16 product (bench/row_kernels.py; docs/serving.md,
"Measurements behind the engine's choices").

The other kernels stay as settings (--small-kernel): "int8" on AVX2 (csrc/int8.h, the same
rounding, a weight row's groups along the lanes), "bytes" (csrc/quantized.h, the weights turned to
floats, any CPU), "int4" (torch's), and "dense" (the weights dequantized: torch's product, whose
reduction order may change with the number of rows, so not batch-invariant). --int4-rows N limits
the quantized kernel to steps of up to N tokens, with the dense product beyond: faster on a CPU
whose dense product wins at many rows (AMX), at the cost of invariance; logged at start.

On the CPU in bf16 a dense weight is stored pre-packed in oneDNN's blocked layout, the same
kernel that torch.compile's freezing pass uses: faster than F.linear on the same weight, with no
compile step. Float32 keeps F.linear.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from worker.continuous.weights import GROUP, Q41, QUANTIZED, KQuant, Quantized, dense_float

PACK_ROWS_HINT = 64  # oneDNN blocks the packed weight for steps of about this many rows
EVERY_STEP = -1  # --int4-rows: the quantized kernel at every step size (the default)
SMALL_KERNELS = ("auto", "int8", "int4", "bytes", "dense")


EVERY_ROW = 1 << 62  # small_rows of a layer whose one kernel runs every step
# The kernels whose product gives a row the same bits whatever shares its step (each output summed
# in one order by the same instructions at any number of rows: tests/test_invariance.py).
# csrc/kquants.h, by the instruction set it was built for (one of the two is in a build).
KQUANT_PATHS = ("int8-vnni-kquants", "int8-avx2-kquants")
INVARIANT = ("int8-vnni-panels", "int8-avx2", "dense-panels") + KQUANT_PATHS


class Linear:
    def __init__(self, weight: Union[torch.Tensor, Quantized, list], bias: Optional[torch.Tensor], dtype,
                 device, small_rows: int = 0, kernel=None, dense: Optional[torch.Tensor] = None,
                 small: str = "auto"):
        """`kernel`: the engine's C++ module (kernels.build), or None. `dense`: the weight already
        dequantized in `dtype` on `device` (a tied embedding's table), shared instead of made again.
        `small_rows`: steps of up to this many rows take the kernel `small` (SMALL_KERNELS; "auto":
        `pick_kernel`'s; for a dense weight, "auto" at every step is csrc/dense_panels.h where this
        CPU runs it), EVERY_STEP all of them, 0 none: the dense product. A list of quantized
        matrices of different types (weights.fuse) is a stack: each part on its own type's kernel,
        the outputs side by side."""
        self.parts = []
        if isinstance(weight, list):
            self.parts = [Linear(part, None, dtype, device, small_rows, kernel, small=small) for part in weight]
            if all(part.weight is None for part in self.parts):  # every part has a kernel at every step
                self._stack(bias, device, dtype, kernel)
                return
            self.parts = []
            weight = torch.cat([dense_float(part) for part in weight])  # some part needs a dense product anyway
        quantized = isinstance(weight, QUANTIZED)
        cpu = device.type == "cpu" and kernel is not None
        self.small = None  # the kernel of steps up to small_rows (a name of INVARIANT, "bytes", "int4")
        if quantized and small_rows and (cpu or small == "int4"):
            self.small = pick_kernel(small, kernel)
            if self.small == "int8":
                self.small = _int8_path(kernel, isinstance(weight, KQuant))
            elif isinstance(weight, KQuant):
                self.small = None  # the float ("bytes") and torch's int4 kernels take Q4_1 and Q8_0 only
            if self.small == "int4" and not isinstance(weight, Q41):
                self.small = None  # torch's int4 kernel takes 4-bit values only
        elif not quantized and small_rows == EVERY_STEP and small == "auto" and cpu and \
                _dense_panels_take(kernel, dtype, weight.shape):
            self.small = "dense-panels"
        self.small_rows = (EVERY_ROW if small_rows == EVERY_STEP else small_rows) if self.small else 0
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.onednn = False
        self.weight = None  # the dense weight, only where some step needs it
        if self.small_rows < EVERY_ROW:
            self.weight = dense if dense is not None else \
                (weight.dequantize() if quantized else weight).to(device=device, dtype=dtype)
            self.onednn = device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            if self.onednn:  # the plain copy is not kept: the packed one is all the products need
                try:
                    self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
                except RuntimeError:  # oneDNN's bf16 packing needs AVX-512 (or AVX-NE-CONVERT)
                    self.onednn = False
        self.out_features, self.in_features = weight.shape
        self.q4_1 = isinstance(weight, Q41)
        self.code = weight.code if isinstance(weight, KQuant) else -1  # csrc/kquants.h's type code
        self.kernel = kernel
        self.packed = self.scales_zeros = None  # the weight as the small steps' kernel reads it
        self.q = self.d = self.m = None  # the file's own: a byte per weight, a scale and minimum per group
        if self.small == "int4":
            self.packed, self.scales_zeros = weight.pack_int4(dtype)
        elif self.small in KQUANT_PATHS or self.small == "int8-vnni-panels":
            self.packed = weight.panel_packed()
        elif self.small == "int8-avx2":
            self.packed = weight.int8_packed()
        elif self.small == "bytes":  # Q4_1 two weights to a byte, Q8_0 one
            self.q = weight.nibbles() if isinstance(weight, Q41) else weight.q.contiguous()
            self.d, self.m = weight.d.contiguous(), weight.m
        elif self.small == "dense-panels":
            self.packed = pack_dense_panels((dense if dense is not None else weight).to(device=device, dtype=dtype))

    def place_weights(self, pages) -> None:
        """Moves what the kernel reads at every step into `pages` (huge_pages.HugePages): the same bytes."""
        if self.parts:  # a stack holds its parts' weights
            for part in self.parts:
                part.place_weights(pages)
        else:
            self.packed, self.q = pages.place(self.packed), pages.place(self.q)

    def _stack(self, bias, device, dtype, kernel) -> None:
        """This layer as the stack of its parts (each already made), outputs side by side."""
        self.small = "+".join(sorted({part.path for part in self.parts}))
        self.small_rows = EVERY_ROW
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.weight = None
        self.out_features = sum(part.out_features for part in self.parts)
        self.in_features = self.parts[0].in_features
        self.kernel = kernel

    @property
    def path(self) -> str:
        """How this layer's products run (the worker's numerics fingerprint is made of these)."""
        if not self.small:
            return "dense"
        return self.small if self.small_rows >= EVERY_ROW else f"{self.small}-to-{self.small_rows}-rows+dense"

    @property
    def paths(self) -> set:
        """Every path this layer's products take (a stack's parts each have theirs)."""
        return set().union(*(part.paths for part in self.parts)) if self.parts else {self.path}

    @property
    def invariant(self) -> bool:
        """Whether a row's product is the same whatever else its step holds."""
        if self.parts:
            return all(part.invariant for part in self.parts)
        return self.small in INVARIANT and self.small_rows >= EVERY_ROW

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts:
            if all(part.small in KQUANT_PATHS and x.shape[0] <= part.small_rows for part in self.parts):
                out = self.kernel.kquant_stack(x, [part.packed for part in self.parts], [part.code for part in self.parts])
            else:
                out = torch.cat([part(x) for part in self.parts], dim=1)
            return out if self.bias is None else out + self.bias
        if x.shape[0] <= self.small_rows:
            if self.small == "int4":
                out = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
            elif self.small == "int8-vnni-panels":
                out = self.kernel.panel_linear(x, self.packed, self.q4_1)
            elif self.small == "int8-avx2":
                out = self.kernel.int8_linear(x, self.packed, self.q4_1)
            elif self.small in KQUANT_PATHS:
                out = self.kernel.kquant_linear(x, self.packed, self.code)
            elif self.small == "dense-panels":
                out = self.kernel.dense_panel_linear(x, self.packed)
            else:
                out = self.kernel.quantized_linear(x, self.q, self.d, self.m)
            return out if self.bias is None else out + self.bias
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def for_kernel(self):
        """This layer as the C++ decoder holds it (sharing these tensors, not copying them). Its path
        goes by the code the C++ table gives its name (csrc/linear.h: the module's PATHS)."""
        if self.parts:
            return self.kernel.Linear.stack([part.for_kernel() for part in self.parts])
        a, b, c = {"int4": (self.packed, self.scales_zeros, None),
                   "bytes": (self.q, self.d, self.m)}.get(self.small, (self.packed, None, None))
        weight = self.weight if self.weight is not None else torch.empty(0)
        return self.kernel.Linear(weight, self.onednn, self.kernel.PATHS[self.small or "dense"], self.q4_1,
                                  a, b, c, self.small_rows, self.code)


def _int8_path(kernel, kquant: bool) -> str:
    """The integer kernel this build runs for a matrix: the K-quant one for a KQuant, else the VNNI
    panels where built, else int8.h's (AVX2)."""
    if kquant:
        return next(name for name in KQUANT_PATHS if name in kernel.PATHS)
    return "int8-vnni-panels" if hasattr(kernel, "panel_linear") else "int8-avx2"


def _dense_panels_take(kernel, dtype, shape) -> bool:
    """Whether csrc/dense_panels.h runs this dense weight here (its dtype on this CPU; 16 features a panel)."""
    if not hasattr(kernel, "dense_panel_linear"):
        return False
    name = str(dtype).removeprefix("torch.")
    return name in kernel.dense_panel_dtypes() and shape[0] % 16 == 0 and (name == "float32" or shape[1] % 2 == 0)


def pack_dense_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] as csrc/dense_panels.h reads it: per panel of 16 output features, k by k (bfloat16:
    pairs of k) across the 16: [N // 16, K * 16]."""
    rows, cols = weight.shape
    if weight.dtype == torch.bfloat16:
        panels = weight.reshape(rows // 16, 16, cols // 2, 2).permute(0, 2, 1, 3)
    else:
        panels = weight.reshape(rows // 16, 16, cols).permute(0, 2, 1)
    return panels.reshape(rows // 16, cols * 16).contiguous()


def pick_kernel(name: str, kernel) -> Optional[str]:
    """The quantized kernel `name` stands for here ("auto": the integer kernel where this CPU has
    one, else the float one; neither without the C++ kernels), or None for the dense product."""
    if name == "auto":
        if kernel is None:
            return None
        return "int8" if hasattr(kernel, "int8_linear") or hasattr(kernel, "panel_linear") else "bytes"
    return None if name == "dense" else name


def check_small_kernel_name(name: str) -> None:
    """Refuses a --small-kernel that names no kernel (the worker asks at start, before loading anything)."""
    if name not in SMALL_KERNELS:
        raise ValueError(f"--small-kernel {name!r}: expected one of {', '.join(SMALL_KERNELS)}")


def check_small_kernel(name: str, kernel) -> None:
    """Refuses a kernel this process cannot run (--small-kernel), with the reason."""
    check_small_kernel_name(name)
    needs = {"int8": ("int8_linear", "panel_linear"), "bytes": ("quantized_linear",)}.get(name, ())
    if needs and not any(hasattr(kernel, n) for n in needs):
        why = "the C++ kernels were not built" if kernel is None else "this CPU has neither AVX-512 VNNI nor AVX2"
        raise ValueError(f"--small-kernel {name}: unavailable here ({why})")
    if name == "int4" and not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        raise ValueError("--small-kernel int4: this torch has no int4 kernel for the CPU")
