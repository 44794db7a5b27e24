"""Pick each row's next token under its own temperature, top-k, top-p and random generator."""
from __future__ import annotations

import torch

from shared.protocol import SamplingParams


def new_generator(seed) -> torch.Generator:
    """A generator per request, so a seeded request writes the same text whatever shares its batch."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any integer: torch takes 64 bits
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           kernel=None) -> list[int]:
    """logits: [rows, vocab]. Returns one token id per row. `kernel`: the continuous engine's C++
    module, whose `sample_rows` draws the rows that have a temperature and no top-k or top-p cut
    (the same draw, without torch's [rows, vocab] temporaries, a real share of a crowd's step)."""
    picks = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        # max().indices, not argmax(): the same token, found faster over a large vocabulary
        # (docs/serving.md).
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, rows.max(dim=-1).indices.tolist()):
            picks[i] = token
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return picks
    # One uniform number per row from the row's own generator, then inverse-CDF sampling for all
    # rows at once: the same distribution as torch.multinomial, without a call per row.
    uniform = torch.stack([torch.rand((), generator=generators[i]) for i in sampled])
    plain = [k for k, i in enumerate(sampled) if params[i].top_k <= 0 and params[i].top_p >= 1.0]
    if kernel is not None and hasattr(kernel, "sample_rows") and logits.device.type == "cpu" and plain:
        rows = [sampled[k] for k in plain]
        temperature = torch.tensor([params[i].temperature for i in rows])
        every = len(rows) == logits.shape[0]  # all of them, in order: no copy of the logits
        for i, token in zip(rows, kernel.sample_rows(logits if every else logits[rows], temperature,
                                                     uniform[plain]).tolist()):
            picks[i] = token
        cut = sorted(set(range(len(sampled))) - set(plain))
        sampled, uniform = [sampled[k] for k in cut], uniform[cut]
        if not sampled:
            return picks

    rows = logits[sampled].float()
    temperature = torch.tensor([params[i].temperature for i in sampled], device=rows.device)
    rows = rows / temperature[:, None]
    rows = _top_k(rows, [params[i].top_k for i in sampled])
    rows = _top_p(rows, [params[i].top_p for i in sampled])
    cdf = torch.softmax(rows, dim=-1).cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, (uniform.to(rows.device) * cdf[:, -1])[:, None], right=True)
    for row, i in enumerate(sampled):
        picks[i] = min(int(chosen[row]), rows.shape[-1] - 1)
    return picks


def _top_k(rows: torch.Tensor, ks: list[int]) -> torch.Tensor:
    if not any(k > 0 for k in ks):
        return rows
    vocab = rows.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=rows.device)
    # Each row keeps its own k-th largest logit, taken from the largest k of the batch.
    largest = torch.topk(rows, int(ks.max()), dim=-1).values
    kth = largest.gather(-1, (ks - 1)[:, None])
    return rows.masked_fill(rows < kth, float("-inf"))


def _top_p(rows: torch.Tensor, ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in ps):
        return rows
    top_p = torch.tensor(ps, device=rows.device)[:, None]
    sorted_logits, order = torch.sort(rows, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Drop a token once the tokens before it already hold top_p of the mass; the first always stays.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return rows.masked_fill(drop, float("-inf"))
