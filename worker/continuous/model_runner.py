"""One step on the model: the scheduler's plan in, tensors built, forward pass, a token per row out.

The plan is a list of (request, tokens to compute), decodes first. Its tokens become one flat
batch; each token's cache slot comes from its request's block table. Only requests whose chunk
reaches the end of what they have to compute get logits, and a token.
"""
from __future__ import annotations

import torch

from worker.continuous.attention import Chunk, KVCache, StepLayout
from worker.continuous.request import Request
from worker.continuous.scheduler import is_decode
from worker import logprobs
from worker.logits import adjust
from worker.sampling import sample


class ModelRunner:
    def __init__(self, model, cache: KVCache, block_size: int, device: torch.device, kernel=None):
        self.model = model
        self.kernel = kernel  # the C++ decode attention, where it was built
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self._masks = None  # worker.constraint.MaskFiller, made at the first constrained row

    @torch.inference_mode()
    def run(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int, object]]:
        """Compute the plan; returns (request, new token, its logprobs entry or None) for each
        request that reached its end.

        The grammar masks of the rows that get a token are computed in llguidance's threads while
        the forward pass runs (both release Python's lock), and applied with the rows' own
        penalties and biases before the pick (worker/logits.py). Logprobs, where asked, come from
        the model's own logits beside the pick (worker/logprobs.py), and never change it."""
        ids, positions, step, last_rows, sampled = self._layout(plan)
        masks = self._start_masks(sampled)
        hidden = self.model.forward(ids, positions, self.cache, step)
        scored = logprobs.prompt_rows(plan)  # prompt positions of requests that want their logprobs
        if scored:
            logprobs.score_prompts(self.model, hidden, scored)
        if not sampled:
            return []
        logits = self.model.logits(hidden[last_rows])
        seqs = [r.seq for r in sampled]
        chosen_from = adjust(logits, seqs, masks.result() if masks is not None else None, self.kernel)
        tokens = sample(chosen_from, [s.params for s in seqs], [s.generator for s in seqs], self.kernel)
        entries = [None] * len(seqs)
        asking = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if asking:
            rows = logits if len(asking) == len(seqs) else logits[asking]
            for i, entry in zip(asking, logprobs.entries(rows, [tokens[i] for i in asking],
                                                         [seqs[i].params.logprobs for i in asking])):
                entries[i] = entry
        return list(zip(sampled, tokens, entries))

    @torch.inference_mode()
    def logits(self, plan: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        """The forward pass: next-token logits of the requests that reached their end, and who they
        are (the model's own, before any request's changes)."""
        ids, positions, step, last_rows, sampled = self._layout(plan)
        hidden = self.model.forward(ids, positions, self.cache, step)
        return (self.model.logits(hidden[last_rows]) if sampled else None), sampled

    def _start_masks(self, sampled: list[Request]):
        constraints = [r.seq.constraint for r in sampled]
        if not any(c is not None for c in constraints):
            return None
        if self._masks is None:
            from worker.constraint import MaskFiller  # llguidance: only once a grammar is served
            self._masks = MaskFiller()
        return self._masks.start(constraints)

    def _layout(self, plan):
        size = self.block_size
        ids, positions, slots, last_rows, sampled, chunks = [], [], [], [], [], []
        decodes = [req for req, count in plan if is_decode(req, count)]  # first in the plan
        for req, count in plan:
            start, first = len(ids), req.computed
            span = range(first, first + count)
            ids += req.tokens[first:first + count]
            positions += span
            table = req.table.blocks
            slots += [table[p // size] * size + p % size for p in span]
            if first + count == len(req.tokens):
                last_rows.append(len(ids) - 1)
                sampled.append(req)
            if start >= len(decodes):
                chunks.append((start, len(ids), req, first + count))
        dev = self.device
        # Each row's blocks and how many tokens it attends to: the decodes', and where the kernel
        # is built every prompt token's too (its own position + 1). Then the whole step runs as
        # rows, through one attention kernel that reduces each row over its blocks in order, in
        # the C++ decoder for the families that have one: a token's keys, values and logits are
        # the same bits whether it came in a prompt chunk of any size or as a decode (the same
        # text whatever the crowd, docs/serving.md). Without the kernel, chunks go through torch.
        rows = [(r.table.blocks, r.computed + 1) for r in decodes]
        if chunks and self.kernel is not None:
            rows += [(req.table.blocks, p + 1) for start, end, req, known in chunks
                     for p in range(known - (end - start), known)]
            chunks = []
        step = StepLayout(slots=torch.tensor(slots, device=dev), decodes=len(rows))
        if rows:
            step.decode_tables, step.decode_lengths = self._row_context(rows)
            step.kernel = self.kernel
        for start, end, req, known in chunks:
            context = self._slots(req.table.blocks, known)
            # Query i of the chunk sits at position (known - (end - start) + i) and sees keys up to it.
            query_pos = torch.arange(known - (end - start), known, device=dev)
            mask = torch.arange(known, device=dev)[None, :] <= query_pos[:, None]
            step.chunks.append(Chunk(start, end, context, mask, first=known - (end - start)))
        return (torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), step,
                torch.tensor(last_rows, device=dev), sampled)

    def _slots(self, blocks: list[int], count: int) -> torch.Tensor:
        table = torch.tensor(blocks, device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        return (table[:, None] * self.block_size + offsets).flatten()[:count]

    def _row_context(self, rows: list[tuple[list[int], int]]):
        """Each row's blocks, padded to the widest with its own first block (real data, masked off
        by length), and how many tokens each attends to."""
        width = -(-max(length for _, length in rows) // self.block_size)
        padded = [table + table[:1] * (width - len(table)) for table in (blocks[:width] for blocks, _ in rows)]
        tables = torch.tensor(padded, device=self.device)
        return tables, torch.tensor([length for _, length in rows], device=self.device)
