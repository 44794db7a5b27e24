"""The continuous engine: requests join and leave the running batch at every step.

Each step the scheduler picks who runs (decodes, prefill chunks, new arrivals) under a token
budget and the paged cache's room; the model runner computes them in one forward pass; requests
that reach their end get a token, and those that finish give their blocks back at once.
"""
from __future__ import annotations

import logging
import os

from shared.protocol import Job
from shared.settings import Settings
from worker.continuous import kernels, models
from worker.continuous.attention import KVCache
from worker.continuous.block_manager import BlockManager
from worker.continuous.model_runner import ModelRunner
from worker.continuous.request import Request, Status
from worker.continuous.scheduler import Scheduler
from worker.model_loader import LoadedModel
from worker.sequence import Sequence
from worker.static_engine import check_prompt

log = logging.getLogger(__name__)

MIB = 1 << 20


class ContinuousEngine:
    name = "continuous"

    def __init__(self, loaded: LoadedModel, model, settings: Settings):
        """`model`: compact model code (worker.continuous.models) holding the loaded weights."""
        self.loaded = loaded
        size = settings.block_size
        blocks = settings.kv_blocks or max(1, settings.kv_memory * MIB // (size * KVCache.bytes_per_token(
            model.layers, model.kv_heads, model.head_dim, loaded.dtype)))
        self.blocks = BlockManager(blocks, size, settings.prefix_caching)
        # Each running request holds a block at least, and each decode costs a token of the budget.
        self.capacity = settings.batch or min(blocks, settings.max_batch_tokens)
        # Room kept free at admission so that running requests can grow: 1% of the pool, as vLLM does.
        margin = max(1, blocks // 100)
        self.scheduler = Scheduler(self.blocks, settings.max_batch_tokens, self.capacity,
                                   settings.scheduler, margin, settings.prefill_chunk)
        cache = KVCache(model.layers, model.kv_heads, model.head_dim, blocks, size, loaded.dtype,
                        loaded.device)
        kernel = kernels.paged_decode(os.path.join(settings.cache_dir, "kernels")) \
            if loaded.device.type == "cpu" and settings.cache_dir else None
        self.runner = ModelRunner(model, cache, size, loaded.device, kernel)
        self.last_batch = 0  # sequences computed by the last step
        self.generated = 0  # tokens written, since start
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB); up to %d requests, %d tokens a step, "
                 "%s scheduler, prefix caching %s", blocks, size, cache.k.nbytes * 2 / MIB, self.capacity,
                 settings.max_batch_tokens, settings.scheduler, "on" if settings.prefix_caching else "off")

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def free_slots(self) -> int:
        # Jobs that could not be admitted stay in Redis, where another worker may take them.
        if self.scheduler.waiting:
            return 0
        return max(0, self.capacity - len(self.scheduler.running))

    def add(self, job: Job) -> Sequence:
        check_prompt(job.prompt_ids, self.loaded)
        most = len(job.prompt_ids) + job.params.max_tokens
        if self.blocks.blocks_for(most) > self.blocks.num_blocks:
            raise ValueError(f"{most} tokens (prompt and max_tokens) do not fit in this worker's KV "
                             f"cache of {self.blocks.num_blocks * self.blocks.block_size} tokens")
        seq = Sequence(job, self.loaded.tokenizer, self.loaded.eos_ids)
        self.scheduler.add(Request(seq))
        return seq

    def sequences(self) -> list[Sequence]:
        return [r.seq for r in self.scheduler.requests()]

    def step(self) -> list[Sequence]:
        plan = self.scheduler.schedule()
        self.last_batch = len(plan)
        if not plan:
            return []
        produced = self.runner.run(plan)
        self.generated += len(produced)
        for req, count in plan:
            req.computed += count
            self.blocks.computed(req.table, req.tokens, req.computed)
        changed = []
        for req, token in produced:
            if not req.finished:  # cancelled while this step ran
                req.append(token)
                req.status = Status.DECODING
            changed.append(req.seq)
            if req.finished:  # its blocks go back now, not at the next step
                self.scheduler.retire(req)
        return changed

    def reset(self) -> list[Sequence]:
        dropped = self.scheduler.requests()
        for req in dropped:
            self.scheduler.finish(req)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        return [r.seq for r in dropped]

    def stats(self) -> dict:
        """For the heartbeat: how full the cache is and what the scheduler holds."""
        return {"kv_blocks": self.blocks.num_blocks, "kv_usage": round(self.blocks.usage(), 4),
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "prefix_hit_tokens": self.blocks.hits, "prefix_hit_blocks": self.blocks.hits // self.blocks.block_size,
                "preempted": self.scheduler.preempted, "generated": self.generated}


def build(loaded: LoadedModel, settings: Settings, tensors: dict, config):
    """The continuous engine for this model, or None (with the reason logged) if it cannot run it."""
    reason = models.unsupported(config)
    if reason:
        log.warning("the continuous engine cannot run this model (%s): using the static engine on "
                    "transformers' classes instead", reason)
        return None
    model = models.build(config, tensors, loaded.dtype, loaded.device,
                         settings.int4_rows if loaded.device.type == "cpu" else 0, settings.int4_head)
    return ContinuousEngine(loaded, model, settings)
