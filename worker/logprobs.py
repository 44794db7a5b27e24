"""Log-probabilities of tokens, from the model's own logits: what a request's `logprobs` reports.

The model's own log-softmax, in float32, before the temperature, penalties, biases and masks that
the pick sees (vLLM's default, "raw_logprobs"): computed beside the pick, from the logits it was
made from, so it never changes which token is written. Only the rows that ask are computed, and
each row is reduced at once to its entry: the chosen token's logprob and the k likeliest tokens'
[id, logprob], k its own (params.logprobs, or params.prompt_logprobs for a prompt's rows).

Prompt logprobs (completions' echo with logprobs): the logits at a prompt position p score the
prompt's token p + 1. A request that asks for them computes every prompt position (the scheduler
skips its prefix-cache lookup), and the runner hands each prompt chunk's rows here
(`prompt_rows`, `score_prompts`), reduced to entries within the step.
"""
from __future__ import annotations

from os.path import commonprefix

import torch

Entry = tuple[float, list]  # (the chosen token's logprob, [[id, logprob], ...the k likeliest])


def entries(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[Entry]:
    """logits: [rows, vocab], the model's own; `chosen`: each row's token; `ks`: how many of the
    likeliest each row wants beside it. torch's log_softmax over the rows in float32, then the
    chosen token's and the k likeliest's, in one move of each to Python."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    picked = rows.gather(1, torch.tensor(chosen, device=rows.device)[:, None])[:, 0].tolist()
    most = min(max(ks), rows.shape[-1])
    if not most:
        return [(lp, []) for lp in picked]
    values, ids = top_k(rows, most)
    values, ids = values.tolist(), ids.tolist()
    return [(lp, [[i, v] for i, v in zip(row_ids[:k], row_values[:k])])
            for lp, row_ids, row_values, k in zip(picked, ids, values, ks)]


def top_k(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, largest first: torch.topk's values, found faster on the CPU over a
    large vocabulary (docs/serving.md): the k largest lie in the k blocks of the row with the
    largest maxima, so topk runs on those blocks only, after one pass of amax."""
    count, vocab = rows.shape
    width = next((w for w in (1024, 512, 256, 128) if vocab % w == 0 and vocab // w >= 2 * k), 0)
    if not width:  # a vocabulary no block width divides, or too small to gain
        return rows.topk(k, dim=-1)
    blocks = rows.view(count, vocab // width, width)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k]: the blocks that hold the top k
    within = blocks.gather(1, best[:, :, None].expand(count, k, width)).view(count, k * width).topk(k, dim=-1)
    block = best.gather(1, within.indices // width)
    return within.values, block * width + within.indices % width


def prompt_rows(plan) -> list[tuple[int, object, int]]:
    """The rows of this step's flat batch whose logits score a prompt token of a request that asks
    for prompt logprobs: (row, its sequence, the position it sits at). The runner lays the plan
    out in order, each request's `count` tokens from its `computed` on; a position p scores the
    prompt's token p + 1, so the prompt's last position (which scores the first written token, on
    the sampled path) and a preempted request's written tokens are left out."""
    rows, start = [], 0
    for req, count in plan:
        seq = req.seq
        if seq.prompt_scores is not None:
            first, last = req.computed, min(req.computed + count, len(seq.prompt_ids) - 1)
            rows += [(start + p - first, seq, p) for p in range(first, last)]
        start += count
    return rows


def score_prompts(model, hidden: torch.Tensor, rows: list[tuple[int, object, int]]) -> None:
    """Each row's logits (the model's head on its hidden state), reduced at once to the entry of
    the prompt token it scores, kept by the sequence (Sequence.prompt_scores). A head call of its
    own, so the sampled rows' logits are computed exactly as without it."""
    index = torch.tensor([row for row, _, _ in rows], device=hidden.device)
    logits = model.logits(hidden.index_select(0, index))
    scored = entries(logits, [seq.prompt_ids[p + 1] for _, seq, p in rows],
                     [seq.params.prompt_logprobs for _, seq, _ in rows])
    for (_, seq, p), entry in zip(rows, scored):
        seq.prompt_scores[p] = entry


def text_offsets(decode, ids: list[int]) -> list[int]:
    """Where each token's text starts in the text of `ids` (`decode`: ids -> text), decoded as a
    sequence decodes its reply (worker/sequence.py): a short window at a time, tokens that end
    inside a character waiting for the rest, then placed by `split_offsets`."""
    offsets, length, prefix, read = [], 0, 0, 0
    for end in range(1, len(ids) + 1):
        offsets.append(length)
        before, after = decode(ids[prefix:read]), decode(ids[prefix:end])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before):]
            if end - read > 1:
                offsets[read + 1:end] = split_offsets(decode, ids[prefix:end], read - prefix, length, new)
            length += len(new)
            prefix, read = read, end
    return offsets


def split_offsets(decode, window: list[int], read: int, base: int, new: str) -> list[int]:
    """window[read:] (2 tokens or more) came out as one piece of text, `new`, at `base` of the text
    (window[:read] is context, already out): where the text of each but the first starts. A token
    starts after what the tokens before it decode to for good: the tokens of a character split
    over them all start where it does, and a byte that never makes a character is its U+FFFD."""
    before = decode(window[:read])
    whole = before + new
    return [base + max(0, len(commonprefix([decode(window[:end]), whole])) - len(before))
            for end in range(read + 1, len(window))]
