"""The activation roundings bench.activation_grouping prices (per 32 is held to the kernel's own in
tests/test_kquants.py): no scheme clips a group, each keeps its steps where it says, and a coarser
grouping rounds an outlier's neighbours worse."""
from __future__ import annotations

import torch

from bench.activation_grouping import CAP, SCHEMES, per, shared_steps, takes_scheme


def _activations(rows: int = 6, K: int = 1536, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g) * torch.rand(rows, K // 32, 1, generator=g).pow(4).repeat_interleave(32, 1).view(rows, K)
    x[:, 100] *= 40  # an outlier, as LLM activations have
    return x


def test_every_scheme_moves_a_value_by_at_most_half_its_step_and_clips_none():
    x = _activations()
    groups = x.view(x.shape[0], -1, 32)
    for name, (round_x, _) in SCHEMES.items():
        if name.startswith("per"):
            n = int(name[3:])
            step = x.view(x.shape[0], -1, n).abs().amax(-1, keepdim=True).repeat_interleave(n // 32, 1) / 127
        else:
            step = shared_steps(x, None if name == "pow2row" else 256, (1.0, 0.875, 0.75, 0.625) if name == "quarters" else (1.0,))
        error = (round_x(x).view_as(groups) - groups).abs()
        assert (error <= step / 2 * (1 + 1e-5)).all(), name


def test_shared_steps_are_the_blocks_step_halved_and_the_smallest_that_fit():
    x = _activations()
    group_max = x.view(x.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    for block in (256, None):
        steps = shared_steps(x, block)
        n = x.shape[1] if block is None else block
        base = x.view(x.shape[0], -1, n).abs().amax(-1, keepdim=True).repeat_interleave(n // 32, 1) / 127
        halvings = torch.log2(base / steps)
        assert torch.allclose(halvings, halvings.round(), atol=1e-5) and (halvings >= -1e-5).all()
        assert (steps * 127 >= group_max * (1 - 1e-5)).all()  # holds the group's largest
        below_cap = halvings.round() < CAP
        assert ((steps / 2 * 127 < group_max) | ~below_cap).all()  # half of it would not
    quarters = shared_steps(x, 256, (1.0, 0.875, 0.75, 0.625))
    assert (quarters <= shared_steps(x, 256) * (1 + 1e-6)).all() and (quarters * 127 >= group_max * (1 - 1e-5)).all()


def test_a_coarser_grouping_rounds_worse_and_only_k_quant_products_take_it():
    x = _activations()
    error = {name: (SCHEMES[name][0](x) - x).pow(2).sum().item() for name in ("per32", "per64", "per256", "pow2")}
    assert error["per32"] < error["per64"] < error["per256"]
    assert error["per32"] < error["pow2"] < error["per256"]
    assert torch.equal(per(x, 32), SCHEMES["per32"][0](x))
    assert takes_scheme("per256", 1536, False) and not takes_scheme("per256", 576, False)
    assert takes_scheme("pow2row", 576, True) and not takes_scheme("pow2row", 576, False)
    assert not takes_scheme("pow2", 576, True)  # no block of 256 to share a step in
