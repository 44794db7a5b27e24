"""Who runs this step, and how many of their tokens: the continuous engine's admission rule.

Every step has a budget of `max_batch_tokens`. A decoding request costs one token; a prompt
costs its length, so a long one is split into chunks across steps and the others keep decoding
between them. While anyone is decoding, prompts get a share of the step that grows with the
number of decodes (a prompt token per decode, at least 16, and enough to fill the step to
`step_fill` tokens as far as the pacer's timing allows, at most `prefill_chunk`; fifo): past a
point a step's time grows with its tokens (below it, reading the weights costs the same whatever
the rows), so a whole prompt in one step would hold every stream beside it, and a chunk's attention
over a long context is most of that cost (measured: docs/serving.md, "Measurements behind the
engine's choices"). New requests are admitted only when the cache has room for their prompt plus a
margin, so that running requests can still grow. When it has not (the pool ran out while
decoding), the newest running request is set back: its blocks are freed and it waits, first in
line, to be prefilled again with what it wrote so far. The last running request is never set back.

Two orders: `fifo` serves decodes first, then prompts; `prefill-first` serves prompts first and
decodes with what budget is left. Under both, the prompts' budget goes to the prompts under way and
the new requests by the rest each has to compute (what the prefix cache does not hold), shortest
first, new requests in their order: an NPC conversation's next turn, whose history this worker
holds, is a few dozen tokens, and waited behind another conversation read from its start (a
thousand and more) when prompts went by arrival (docs/scaling.md, a paused worker). The oldest
prompt under way keeps half the budget (all of it that it needs, up to half), so short ones
arriving step after step never stop it.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from worker.continuous.block_manager import BlockManager
from worker.continuous.config import EngineConfig
from worker.continuous.pacer import Pacer
from worker.continuous.request import Request, Status
from worker.sequence import Sequence

POLICIES = ("fifo", "prefill-first")
PROMPT_TOKENS_PER_DECODE = 1
MIN_PROMPT_SHARE = 16


# A prompt fills the step (step_fill) with chunks of at most FILL_ATTENTION / (the context they
# read) tokens: a chunk's attention grows with that context, so a long prompt's late chunks, kept
# as large as its early ones, made the streams beside them wait far longer than small ones did
# (measured: docs/serving.md). 32,768: 64 tokens up to a context of 512, 16 at 2,048.
FILL_ATTENTION = 32768


def _kept(oldest: Request, budget: int) -> int:
    """What the oldest prompt under way keeps of the prompts' `budget`: up to half (none of a spent
    budget)."""
    return max(0, min(oldest.to_compute, budget // 2))


def is_decode(req: Request, count: int) -> bool:
    """A plan's item that is one decoding token (the model runner's decode rows), not a chunk."""
    return count == 1 and req.status is Status.DECODING


class Scheduler:
    def __init__(self, blocks: BlockManager, config: EngineConfig, max_running: int, margin_blocks: int = 1,
                 pacer: Optional[Pacer] = None):
        """`config`: its budget, chunk, fill and policy; `max_running` and `margin_blocks` follow from
        the cache's size (the engine's)."""
        if config.scheduler not in POLICIES:
            raise ValueError(f"scheduler {config.scheduler!r}: expected one of {', '.join(POLICIES)}")
        self.blocks = blocks
        self.max_batch_tokens = config.max_batch_tokens
        self.prefill_chunk = config.prefill_chunk or config.max_batch_tokens  # prompt tokens a step beside decodes
        self.step_fill = config.step_fill  # prompts fill a step with decodes up to this many tokens
        self.pacer = pacer  # and no further than the streams' gaps allow, as timed
        self.max_running = max_running
        self.policy = config.scheduler
        self.jump_forward = config.jump_forward  # a grammar's forced tokens, appended after each pick
        self.margin_blocks = margin_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # by arrival
        self.preempted = 0  # since start
        self.forced = 0  # tokens a grammar forced, appended without a step of their own, since start
        self._preempted_now = False

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requests(self) -> list[Request]:
        return self.running + list(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (request, tokens to compute), decodes first in the list."""
        self._drop_finished()
        budget, plan = self.max_batch_tokens, []
        self._preempted_now = False
        if self.policy == "fifo":
            budget = self._decodes(plan, budget)
            if plan:  # others are decoding: prompts get a share that keeps their streams flowing
                budget = min(budget, self.prompt_share(len(plan)))
            self._prompts(plan, budget)
        else:
            budget = self._prompts(plan, budget)
            self._decodes(plan, budget)
        plan.sort(key=lambda item: not is_decode(*item))  # stable: one-token decodes first
        return plan

    def postprocess(self, plan: list[tuple[Request, int]], produced: list, elapsed_s: float) -> list[Sequence]:
        """After the model ran `plan` (in `elapsed_s`): count each request's computed tokens, give
        those that reached their end the token `produced` holds for them ((request, token, logprobs
        entry)), and retire the finished at once (their blocks back now, not at the next step).
        Returns the sequences that changed."""
        decodes = sum(1 for item in plan if is_decode(*item))
        if self.pacer:
            self.pacer.observe(decodes, sum(count for _, count in plan) - decodes, elapsed_s)
        for req, count in plan:
            req.computed += count
            self.blocks.computed(req.table, req.tokens, req.computed)
        changed = []
        for req, token, entry in produced:
            if not req.finished:  # cancelled while this step ran
                self.forced += req.append(token, entry, self.jump_forward)
                req.status = Status.DECODING
            changed.append(req.seq)
            if req.finished:
                self.retire(req)
        return changed

    def reset(self) -> list[Request]:
        """Drop everything held (the worker lost its jobs): their blocks back; the requests dropped."""
        dropped = self.requests()
        for req in dropped:
            self.finish(req)
        self.running.clear()
        self.waiting.clear()
        return dropped

    def start_budget(self) -> int:
        """Prompt tokens the next step has for a request that starts in it and has at least as much
        to compute as every prompt under way, by schedule()'s own rule: the prompts' budget (fifo:
        what decodes leave, and their share beside them) less what those prompts have left."""
        prefills = sum(r.to_compute for r in self.running if r.status is Status.PREFILLING and not r.finished)
        return self._prompt_budget() - prefills

    def short_budget(self) -> int:
        """Prompt tokens the next step has for a request that starts in it with less to compute than
        every prompt under way: the prompts' budget less what the oldest of them keeps."""
        budget = self._prompt_budget()
        oldest = next((r for r in self.running if r.status is Status.PREFILLING and not r.finished), None)
        return budget - (_kept(oldest, budget) if oldest else 0)

    def _prompt_budget(self) -> int:
        decodes = sum(1 for r in self.running if r.status is Status.DECODING and not r.finished)
        budget = self.max_batch_tokens
        if self.policy == "fifo":  # decodes go first, and leave prompts a share beside them
            budget -= decodes
            if decodes:
                budget = min(budget, self.prompt_share(decodes))
        return budget

    def finish(self, req: Request) -> None:
        """A request left (finished or cancelled): its blocks go back at once."""
        req.status = Status.FINISHED
        self.blocks.release(req.table)

    def retire(self, req: Request) -> None:
        """A running request is done: out of the batch, its blocks back."""
        self.running.remove(req)
        self.finish(req)

    def prompt_share(self, decodes: int) -> int:
        """Prompt tokens a step computes beside `decodes` decoding requests (fifo)."""
        context = max((r.computed for r in self.running if r.status is Status.PREFILLING), default=0)
        fill = min(self.step_fill - decodes, FILL_ATTENTION // max(context, 1))
        if self.pacer:
            fill = min(fill, self.pacer.allowed(decodes))
        return min(self.prefill_chunk, max(MIN_PROMPT_SHARE, PROMPT_TOKENS_PER_DECODE * decodes, fill))

    def _decodes(self, out: list, budget: int) -> int:
        for req in [r for r in self.running if r.status is Status.DECODING]:
            if budget <= 0:
                break
            if req.status is not Status.DECODING:  # set back while making room for an older one
                continue
            while not self.blocks.grow(req.table, len(req.tokens)):
                victim = max(self.running, key=lambda r: r.arrival)
                if victim is req and len(self.running) == 1:
                    raise RuntimeError("the KV cache cannot hold one request")  # refused at add()
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is Status.DECODING:
                # Its new token, and the tokens a grammar forced after it (Request.append): one
                # chunk, as much of it as the budget holds (at least the one token).
                count = max(1, min(req.to_compute, budget))
                out.append((req, count))
                budget -= count
        return budget

    def _prompts(self, out: list, budget: int) -> int:
        """The prompts' `budget`. The oldest prompt under way (or else the first in line, which
        starts) keeps up to half; the rest goes to whichever has least left to compute: the prompt
        under way with the shortest rest, or the first in line (its rest found by looking its
        prompt up in the prefix cache). New requests keep their order among themselves, as the
        queue gave them, and start only while the cache has room (_start). Returns what is left."""
        chunks: dict[Request, int] = {}  # the plan's prompt chunks, in the order given
        self._drop_cancelled()
        ongoing = [r for r in self.running if r.status is Status.PREFILLING]
        line = deque(self.waiting)
        starting = True  # until a new request finds no room: those behind it wait too
        if line and budget > 0 and not ongoing:
            starting = self._start(line.popleft())
            ongoing += self.running[-1:] if starting else []
        if ongoing:
            chunks[ongoing[0]] = _kept(ongoing[0], budget)
            budget -= chunks[ongoing[0]]
        rests = {r: r.to_compute - chunks.get(r, 0) for r in ongoing}  # by arrival: ties go to the older
        head_rest = None  # the first in line's, looked up once
        while budget > 0:
            shortest = min(rests, key=rests.get, default=None)
            head = line[0] if line and starting else None
            if head is not None and head_rest is None:
                head_rest = len(head.tokens) - self._cached(head)
            if head is not None and (shortest is None or head_rest < rests[shortest]):
                line.popleft()
                head_rest = None
                starting = self._start(head)
                if not starting:
                    continue
                req, rest = head, head.to_compute
            elif shortest is not None:
                req, rest = shortest, rests.pop(shortest)
            else:
                break
            chunk = min(rest, budget)
            chunks[req] = chunks.get(req, 0) + chunk
            budget -= chunk
        out += [(req, n) for req, n in chunks.items() if n > 0]
        return budget

    def _cached(self, req: Request) -> int:
        return self.blocks.cached(req.tokens) if req.prefix_cache else 0

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.finished]:  # cancelled while they waited
            self.waiting.remove(req)
            req.status = Status.FINISHED

    def _start(self, req: Request) -> bool:
        """Admit a waiting request, if the cache has room for it (plus a margin while others run) and
        the batch for one more: it is prefilling from the step on."""
        # Right after a preemption the pool is short: admitting now would only preempt again.
        if len(self.running) >= self.max_running or self._preempted_now:
            return False
        cached = self.blocks.allocate(req.table, req.tokens, self.margin_blocks if self.running else 0,
                                      req.prefix_cache)
        if cached is None:
            return False
        self.waiting.remove(req)
        req.computed = cached
        if not req.preemptions:  # what its answer reports (usage.prompt_tokens_details)
            req.seq.cached_tokens = min(cached, len(req.seq.prompt_ids))
        req.status = Status.PREFILLING
        self.running.append(req)
        return True

    def _preempt(self, req: Request, scheduled: list) -> None:
        """Soft reset: free its blocks; it is prefilled again, its written tokens now prompt."""
        self.running.remove(req)
        self.blocks.release(req.table)
        req.computed = 0
        req.status = Status.PENDING
        req.preemptions += 1
        self.preempted += 1
        self._preempted_now = True
        self.waiting.appendleft(req)
        scheduled[:] = [(r, n) for r, n in scheduled if r is not req]

    def _drop_finished(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.retire(req)
