"""The continuous engine: requests join and leave the running batch at every step.

Each step the scheduler picks who runs (decodes, prefill chunks, new arrivals) under a token
budget and the paged cache's room; the model runner computes them in one forward pass; requests
that reach their end get a token, and those that finish give their blocks back at once.
"""
from __future__ import annotations

import logging
import math
import os
import time

import torch

from shared.protocol import FEATURES, Job
from shared.settings import Settings
from worker.continuous import kernels, linear, models
from worker.continuous.attention import KVCache
from worker.continuous.block_manager import BlockManager
from worker.continuous.config import EngineConfig
from worker.continuous.model_runner import ModelRunner
from worker.continuous.pacer import Pacer
from worker.continuous.request import Request
from worker.continuous.scheduler import Scheduler
from worker.model_loader import LoadedModel
from worker.sequence import Sequence
from worker.engine_protocol import check_prompt, resumable

log = logging.getLogger(__name__)
STEP_SMOOTHING = 0.2  # each step's weight in step_s: the last ten or so count

MIB = 1 << 20


class ContinuousEngine:
    name = "continuous"
    features = FEATURES  # penalties, logprobs, prompt logprobs, grammars (WorkerInfo.features)

    def __init__(self, loaded: LoadedModel, model, config: EngineConfig, kernel=None):
        """`model`: compact model code (worker.continuous.models) holding the loaded weights;
        `kernel`: the C++ kernels (worker.continuous.kernels), or None."""
        self.loaded = loaded
        size = config.block_size
        kv_dtype = cache_dtype(config, loaded)
        blocks = config.kv_blocks or max(1, config.kv_memory * MIB // (size * KVCache.bytes_per_token(
            model.layers, model.kv_heads, model.head_dim, kv_dtype)))
        self.blocks = BlockManager(blocks, size, config.prefix_caching)
        # Each running request holds a block at least, and each decode costs a token of the budget:
        # beyond either, requests would be held without being computed, also with a larger --batch.
        self.capacity = min(config.batch or blocks, blocks, config.max_batch_tokens)
        if config.batch > self.capacity:
            log.warning("--batch %d: at most %d requests run at once (one KV block and one token of "
                        "--max-batch-tokens each)", config.batch, self.capacity)
        # Room kept free at admission so that running requests can grow: 1% of the pool, as vLLM does.
        margin = max(1, blocks // 100)
        self.scheduler = Scheduler(self.blocks, config, self.capacity, margin,
                                   Pacer(config.max_stretch, config.step_fill))
        cache = KVCache(model.layers, model.kv_heads, model.head_dim, blocks, size, kv_dtype, loaded.device)
        self.runner = ModelRunner(model, cache, size, loaded.device, kernel)
        self.numerics = ""  # the fingerprint, set by build()
        self.last_batch = 0  # sequences computed by the last step
        self.generated = 0  # tokens written, since start
        self.step_s = 0.0  # a step's recent time, smoothed: how long the API offers a job for (api/routing.py)
        # What a new request has cost its first step lately, in prompt tokens computed (prefix-cache
        # hits left out): free_slots' guess for jobs still in Redis, whose prompts it cannot see.
        self._start_cost = 0.0  # 0: nothing admitted yet
        self._hit_share = 0.0  # of their prompts, what recent requests found in the prefix cache
        self._margin = margin
        self._admitted: set[Request] = set()  # the running requests already counted
        self._hits = 0  # the block manager's prefix hits when last counted
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB, %s); up to %d requests, %d tokens a step, "
                 "%s scheduler, prefix caching %s", blocks, size, cache.k.nbytes * 2 / MIB,
                 str(kv_dtype).removeprefix("torch."), self.capacity,
                 config.max_batch_tokens, config.scheduler, "on" if config.prefix_caching else "off")

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def free_slots(self) -> int:
        """How many more jobs to take now: as many as the next step will start (give a first chunk
        of their prompt), by its token budget and the cache's room, less what is held unstarted.

        A job taken beyond that would wait inside this worker, a step or many, while another worker
        might be idle: it stays in Redis instead, for whichever worker can start it first. Every
        step is preceded by a take, so nothing is lost by not looking further ahead. A guess, as
        the jobs' prompts are still in Redis: the worker asks again after adding what it took.
        """
        s = self.scheduler
        self._learn_start_cost()
        live, waiting = self._unfinished()
        room = s.max_running - len(live) - len(waiting)
        budget, blocks = s.start_budget(), self.blocks.free - self._margin
        # Held, not started: the next step starts them first. Their share of the prompt found in the
        # prefix cache is known only at their admission: as much as recent requests found.
        for req in waiting:
            budget -= req.to_compute * (1 - self._hit_share)
            blocks -= self.blocks.blocks_for(math.ceil(len(req.tokens) * (1 - self._hit_share)))
        if room <= 0 or budget <= 0 or blocks <= 0:
            return 0
        # A new job's cost: what recent ones cost, or else what the held ones would; with neither,
        # one job, and the worker asks again once it holds that one and knows its prompt.
        cost = self._start_cost or (sum(r.to_compute for r in waiting) / len(waiting) if waiting else 0)
        if not cost:
            return 1
        # The last one taken may get only part of its prompt computed: it has started all the same.
        fit = min(math.ceil(budget / cost), blocks // self.blocks.blocks_for(math.ceil(cost)))
        return max(0, min(room, fit))

    def held_slots(self) -> int:
        """How many jobs offered to this worker to take beyond free_slots: 1 while the next step has
        prompt tokens for one that is shorter than every prompt under way, nothing it took is still
        unstarted, and the cache and the batch have room. The API offers a job here because this
        worker's prefix cache holds its conversation (api/routing.py), so what it costs is its new
        turn, and the scheduler starts it before longer prompts (shortest rest first); by
        free_slots' count it would wait in Redis for all of them. One a take is enough: a take
        precedes every step, and turns come far slower than steps."""
        live, waiting = self._unfinished()
        if waiting or len(live) >= self.scheduler.max_running:
            return 0
        return int(self.scheduler.short_budget() > 0 and self.blocks.free - self._margin > 0)

    def _unfinished(self) -> tuple[list[Request], list[Request]]:
        """The scheduler's running and waiting requests, less those finished or cancelled."""
        s = self.scheduler
        return [r for r in s.running if not r.finished], [r for r in s.waiting if not r.finished]

    def _learn_start_cost(self) -> None:
        """What the requests admitted since the last call computed of their prompts: their length
        (a resumed job's written tokens included: they are prefilled with its prompt), less the
        prefix-cache hits their admission found."""
        running = self.scheduler.running
        new = [r for r in running if r not in self._admitted and not r.preemptions]
        self._admitted = set(running)
        hits, self._hits = self.blocks.hits - self._hits, self.blocks.hits
        if new:
            prompts = sum(len(r.seq.prompt_ids) + r.seq.resumed for r in new)
            hits = min(hits, prompts - len(new))  # the last token of each is always computed
            cost, share = (prompts - hits) / len(new), hits / prompts
            if self._start_cost:  # lately weighs as much as all before: prompts change with the game
                cost, share = (self._start_cost + cost) / 2, (self._hit_share + share) / 2
            self._start_cost, self._hit_share = cost, share

    def add(self, job: Job, written: list[int] | None = None, constraint=None) -> Sequence:
        check_prompt(job.prompt_ids, self.loaded)
        most = len(job.prompt_ids) + job.params.max_tokens
        if self.blocks.blocks_for(most) > self.blocks.num_blocks:
            raise ValueError(f"{most} tokens (prompt and max_tokens) do not fit in this worker's KV "
                             f"cache of {self.blocks.num_blocks * self.blocks.block_size} tokens")
        seq = Sequence(job, self.loaded.tokenizer, self.loaded.eos_ids, resumable(written, job, self.loaded),
                       constraint)
        if not seq.finished:  # else its record completed it: nothing to compute
            self.scheduler.add(Request(seq))
        return seq

    def sequences(self) -> list[Sequence]:
        return [r.seq for r in self.scheduler.requests()]

    def step(self) -> list[Sequence]:
        """Schedule, run, postprocess: the scheduler's bookkeeping on both sides of the forward pass."""
        plan = self.scheduler.schedule()
        self.last_batch = len(plan)
        if not plan:
            return []
        start, forced = time.perf_counter(), self.scheduler.forced
        produced = self.runner.run(plan)
        self.generated += len(produced) + self.scheduler.forced - forced
        elapsed = time.perf_counter() - start
        self.step_s += (elapsed - self.step_s) * (STEP_SMOOTHING if self.step_s else 1.0)
        return self.scheduler.postprocess(plan, produced, elapsed)

    def reset(self) -> list[Sequence]:
        return [r.seq for r in self.scheduler.reset()]

    def stats(self) -> dict:
        """For the heartbeat: how full the cache is and what the scheduler holds."""
        return {"kv_blocks": self.blocks.num_blocks, "kv_usage": round(self.blocks.usage(), 4),
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "prefix_hit_tokens": self.blocks.hits, "prefix_hit_blocks": self.blocks.hits // self.blocks.block_size,
                "preempted": self.scheduler.preempted, "generated": self.generated, "step_s": round(self.step_s, 4),
                "forced": self.scheduler.forced}


def build(loaded: LoadedModel, settings: Settings, tensors: dict, model_config):
    """The continuous engine for this model (`model_config`: transformers'), or None (with the reason
    logged) if it cannot run it. The engine's settings are read here, once (EngineConfig)."""
    reason = models.unsupported(model_config)
    if reason:
        log.warning("the continuous engine cannot run this model (%s): using the static engine on "
                    "transformers' classes instead", reason)
        return None
    cpu = loaded.device.type == "cpu"
    config = EngineConfig.from_settings(settings, cpu)
    kernel = kernels.build(os.path.join(config.cache_dir, "kernels"), config.kernel_isa) \
        if cpu and config.cache_dir else None
    linear.check_small_kernel(config.small_kernel, kernel)
    model = models.build(model_config, tensors, loaded.dtype, loaded.device, config, kernel)
    for note in getattr(model, "notes", ()):  # how this model's attention runs here (sliding windows, longrope)
        log.info("%s", note)
    context = getattr(model, "context", loaded.context_window)  # the positions its rotary tables cover
    if context < loaded.context_window:  # the worker advertises this one (WorkerInfo.context_window)
        log.info("context window: %d tokens (the model's config says %d)", context, loaded.context_window)
        loaded.context_window = context
    engine = ContinuousEngine(loaded, model, config, kernel)
    engine.numerics = numerics(model, loaded, kernel, config.kernel_isa, engine.runner.cache.k.dtype)
    log.info("numerics: %s", engine.numerics)
    if not engine.numerics.endswith("+invariant"):
        log.warning("a request's text may depend on the other requests in its step here (%s): seeds "
                    "reproduce only on an idle worker; see the README for the settings that keep it",
                    "no C++ kernels" if kernel is None else "these settings or this model's weights")
    return engine


KV_DTYPES = ("auto", "model", "float16", "bfloat16")


def cache_dtype(config: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """The KV cache's element type (Settings.kv_dtype). auto: float16 where a CPU computes in
    float32 because --dtype auto found no bf16 arithmetic there (the steps' products stay float32;
    keys and values are rounded to float16 as they are stored, as llama.cpp stores them: half the
    bytes a token, so twice the players in the same memory); else the model's dtype. A half cache
    is only kept beside float32 (the C++ decoder's with_cache_type)."""
    name = config.kv_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype {name!r}: expected one of {', '.join(KV_DTYPES)}")
    if name == "auto":
        half = loaded.device.type == "cpu" and loaded.dtype == torch.float32 and config.dtype == "auto"
        return torch.float16 if half else loaded.dtype
    dtype = loaded.dtype if name == "model" else getattr(torch, name)
    if dtype != loaded.dtype and loaded.dtype != torch.float32:
        raise ValueError(f"kv_dtype {name}: a {name} cache is kept beside float32 steps only (this model "
                         f"computes in {str(loaded.dtype).removeprefix('torch.')}); use auto or model")
    return dtype


def numerics(model, loaded: LoadedModel, kernel, isa: str = "native", kv_dtype: torch.dtype = None) -> str:
    """The worker's numerics fingerprint (WorkerInfo.numerics): how its products run, the dtype, the
    kernels' build, and "+invariant" where each row's numbers are its own whatever shares its step:
    an invariant kernel at every step for every layer (linear.INVARIANT), inside the C++ decoder
    (every token a row of it: its norms, rotary and attention)."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    if kv_dtype not in (None, loaded.dtype):  # the keys' and values' rounding changes the text
        dtype += "+kv-" + str(kv_dtype).removeprefix("torch.")
    if loaded.device.type != "cpu" or kernel is None:
        return f"torch-{loaded.device.type}/{dtype}"
    layers = model.linears()
    paths = "+".join(sorted(set().union(*(layer.paths for layer in layers))))
    invariant = model.rows_decoder(kernel) and all(layer.invariant for layer in layers)
    return f"{paths}/{dtype}/kernels-{kernels.build_id(isa)}" + ("+invariant" if invariant else "")
