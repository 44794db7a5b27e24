"""A request's own changes to its next-token logits, before any pick: penalties, bias, masks.

Applied per row, each row from its own tokens and parameters, so a row's result does not depend on
what shares its step (every operation here is elementwise on the row, in float32). The order is
vLLM's: min_tokens' mask of the tokens that would end the reply, logit_bias, repetition, frequency
and presence penalties, then the grammar's mask, then min_p (which needs the others' result). The
pick that follows (worker/sampling.py: greedy, torch's top-k/top-p or the C++ sampler) then sees
only allowed tokens whichever path it takes, and divides by the temperature itself.

The formulas, for a token t with logit l, written c(t) times in this reply so far:
  repetition_penalty r (CTRL's, as HF and vLLM): if t is in the prompt or the reply,
      l / r where l > 0, l * r otherwise;
  frequency_penalty f, presence_penalty p (OpenAI's): l - f * c(t) - p * (c(t) > 0);
  logit_bias b(t): l + b(t);
  min_p m: tokens whose probability after temperature T is below m times the likeliest's are
      dropped, that is those with l < max(l) + T * ln(m) (greedy ignores it: the likeliest stays).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from shared.protocol import SamplingParams

NEG_INF = float("-inf")


def changes_logits(params: SamplingParams) -> bool:
    """Whether `adjust` has anything to do for a request of these parameters (a grammar aside)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.min_tokens or (params.min_p and not params.greedy))


def adjust(logits: torch.Tensor, seqs: list, bitmask: Optional[torch.Tensor] = None, kernel=None) -> torch.Tensor:
    """logits: [rows, width], a row per sequence in `seqs` (worker.sequence.Sequence). Returns the
    logits to pick from: `logits` itself where no row changes; a float32 copy with each row's
    changes where a penalty or bias computes; with masks alone, `logits` masked in place (-inf is
    exact in any dtype) unless a row asks for logprobs, which need the model's own (then a copy). `bitmask`: the grammar masks of the rows (worker/constraint.py), or None;
    `kernel`: the C++ kernels, whose mask_rows applies it."""
    rows = [i for i, seq in enumerate(seqs) if seq.adjusts]
    if not rows and bitmask is None:
        return logits
    if rows:
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    elif any(seq.logprobs is not None for seq in seqs):
        out = logits.clone()  # the model's own logits stay for the logprobs (worker/logprobs.py)
    else:
        out = logits  # a mask alone, and nobody needs the raw logits: in place, not copied
    for i in rows:
        _penalise(out[i], seqs[i])
    if bitmask is not None:
        from worker.constraint import apply_mask  # llguidance: only workers that serve grammars
        apply_mask(out, bitmask.to(out.device), kernel)
    for i in rows:
        params = seqs[i].params
        if params.min_p and not params.greedy:
            row = out[i]
            row.masked_fill_(row < row.max() + params.temperature * math.log(params.min_p), NEG_INF)
    return out


def _penalise(row: torch.Tensor, seq) -> None:
    params: SamplingParams = seq.params
    output = seq.output_ids
    if params.min_tokens and len(output) < params.min_tokens and seq.stop_ids:
        row[torch.tensor(sorted(seq.stop_ids), device=row.device)] = NEG_INF
    if params.logit_bias:
        ids = torch.tensor([int(t) for t in params.logit_bias], device=row.device)
        keep = ids < row.numel()
        row[ids[keep]] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)[keep]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(output)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
