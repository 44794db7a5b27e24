"""Static batching, as in the seed: the batch is formed once, then decoded until its last row ends.

Prompts of different lengths share one tensor: left padding puts every prompt's end in the last
column, the attention mask hides the pads, and each row's position ids count its own tokens only.
A finished row leaves the batch at once (its cache rows are dropped), but no new row joins until
the whole batch is done; that is what a continuous engine adds.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache

from shared.protocol import PARAM_FEATURES, Job, params_json
from worker.engine_protocol import check_prompt, resumable
from worker.model_loader import LoadedModel
from worker.sampling import sample
from worker.sequence import Sequence


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, each [rows, longest prompt], pads on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position among its row's real tokens; pads get 0 (they are masked anyway)."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def unsupported_params(params) -> list[str]:
    """The parameters a job sets that only the continuous engine honours: the static engine honours
    plain sampling only (no field of shared/protocol.PARAM_FEATURES)."""
    return [name for name in params_json(params) if name in PARAM_FEATURES]


class StaticEngine:
    name = "static"
    features = ()  # plain sampling only (WorkerInfo.features)

    # transformers' model on padded batches: a row's numbers depend on the batch's padding and size.
    numerics = "static-transformers"

    def __init__(self, loaded: LoadedModel, capacity: int):
        self.loaded = loaded
        self.capacity = capacity
        self._waiting: list[Sequence] = []   # added, not yet prefilled
        self._running: list[Sequence] = []   # one per row of the cache, in row order
        self._cache: Optional[DynamicCache] = None
        self._mask: Optional[torch.Tensor] = None
        self._last: Optional[torch.Tensor] = None  # each row's newest token, [rows, 1]
        self.last_batch = 0  # sequences computed by the last step
        self.generated = 0  # tokens written, since start

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    def free_slots(self) -> int:
        return 0 if self._running else self.capacity - len(self._waiting)

    def held_slots(self) -> int:
        return 0  # it starts nothing while a batch runs

    def add(self, job: Job, written: Optional[list[int]] = None, constraint=None) -> Sequence:
        # It announces no features (WorkerInfo.features), so the API sends it no such job; one that
        # comes all the same (an API of another version) is refused, not written unconstrained.
        unsupported = unsupported_params(job.params)
        if unsupported or constraint is not None:
            raise ValueError(f"the static engine does not support {', '.join(unsupported) or 'grammar'}: "
                             f"serve this model on the continuous engine")
        if self.free_slots() <= 0:
            raise RuntimeError("static engine: no room until the running batch ends")
        check_prompt(job.prompt_ids, self.loaded)
        seq = Sequence(job, self.loaded.tokenizer, self.loaded.eos_ids, resumable(written, job, self.loaded))
        if not seq.finished:  # else its record completed it: nothing to compute
            self._waiting.append(seq)
        return seq

    def sequences(self) -> list[Sequence]:
        return self._waiting + self._running

    def stats(self) -> dict:
        return {"running": len(self._running), "waiting": len(self._waiting), "generated": self.generated}

    def reset(self) -> list[Sequence]:
        dropped = self.sequences()
        self._waiting = []
        self._clear_running()
        return dropped

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        self._drop_finished()
        logits = self._decode() if self._running else self._prefill() if self._waiting else None
        if logits is None:
            self.last_batch = 0
            return []
        seqs = self._running
        self.last_batch = len(seqs)
        self.generated += len(seqs)
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq, token in zip(seqs, tokens):
            if not seq.finished:  # cancelled while this step ran
                seq.append(token)
        self._last = torch.tensor(tokens, device=self.loaded.device)[:, None]
        changed = list(seqs)
        self._drop_finished()
        return changed

    def _prefill(self) -> Optional[torch.Tensor]:
        self._running, self._waiting = [s for s in self._waiting if not s.finished], []
        if not self._running:
            return None
        # A resumed job's written tokens are prefilled with its prompt (a prefill, not a decode each).
        ids, mask = left_pad([s.prompt_ids + s.output_ids for s in self._running], self.loaded.pad_id)
        dev = self.loaded.device
        self._cache = DynamicCache()
        self._mask = mask.to(dev)
        out = self.loaded.model(input_ids=ids.to(dev), attention_mask=self._mask,
                                position_ids=positions_from_mask(self._mask),
                                past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _decode(self) -> torch.Tensor:
        ones = torch.ones((self._mask.shape[0], 1), dtype=self._mask.dtype, device=self._mask.device)
        self._mask = torch.cat([self._mask, ones], dim=-1)
        out = self.loaded.model(input_ids=self._last, attention_mask=self._mask,
                                position_ids=positions_from_mask(self._mask)[:, -1:],
                                past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _drop_finished(self) -> None:
        """Remove finished rows from the batch, its cache and its mask, so they cost nothing more."""
        keep = [i for i, s in enumerate(self._running) if not s.finished]
        if len(keep) == len(self._running):
            return
        if not keep:
            self._clear_running()
            return
        index = torch.tensor(keep, device=self.loaded.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        self._last = self._last[index]
        self._running = [self._running[i] for i in keep]

    def _clear_running(self) -> None:
        self._running = []
        self._cache = self._mask = self._last = None
