"""Who runs each step: each policy's order, the token budget, chunked prefill and preemption."""
from __future__ import annotations

import pytest

from tests.schedulers import decoding, request, run, scheduler
from worker.continuous.request import Status
from worker.continuous.scheduler import FILL_ATTENTION, MIN_PROMPT_SHARE, PROMPT_TOKENS_PER_DECODE


def test_fifo_runs_decodes_then_prompts_shortest_rest_first_the_oldest_keeping_half():
    s = scheduler("fifo", budget=16)
    decoding, long_prompt = request(3), request(40)
    s.add(decoding)
    run(s, s.schedule())  # prefilled, now decoding
    s.add(long_prompt)
    run(s, s.schedule())  # decode + first chunk of the long prompt (15 tokens)
    short, longer = request(5), request(60)
    s.add(short)
    s.add(longer)
    plan = s.schedule()
    # 15 for prompts: the long one keeps 7 (half), the short one all its 5, the long one the 3 left
    assert plan == [(decoding, 1), (long_prompt, 10), (short, 5)]
    assert longer.status is Status.PENDING, "a longer rest than the prompt under way's waits behind it"


def test_new_requests_keep_the_queues_order_among_themselves():
    s = scheduler("fifo", budget=17)  # 16 prompt tokens beside one decode
    decoding(s, 1)
    under_way = request(26, first=1000)
    s.add(under_way)
    run(s, s.schedule())  # 16 computed, 10 left
    first, second = request(30), request(2, first=2000)
    s.add(first)
    s.add(second)
    plan = dict(s.schedule())
    # The prompt under way keeps 8, and has 2 left, shorter than `first`; then `first` starts.
    assert plan[under_way] == 10 and plan[first] == 6
    assert second not in plan, "shorter, but behind `first` in line"


def test_short_prompts_arriving_every_step_never_stop_the_oldest():
    s = scheduler("fifo", budget=40, blocks=400)  # prompts get 16 a step beside up to 24 decodes
    decoding(s, 1)
    oldest = request(100, first=1000)
    s.add(oldest)
    steps = 0
    while oldest.status is not Status.DECODING:
        s.add(request(12))  # more than the 8 a step leaves them: they queue up
        plan = dict(s.schedule())
        assert plan[oldest] >= min(8, oldest.to_compute), "half of the 16 prompt tokens, or its rest"
        run(s, list(plan.items()))
        steps += 1
    assert steps <= 100 // 8 + 1
    assert sum(1 for r in s.running if r.status is Status.DECODING) > 3, "the short ones ran too"


def test_a_turn_whose_history_is_cached_goes_before_a_history_read_from_the_start():
    """The case the order is for: an NPC conversation's next turn is its history (in this worker's
    prefix cache) and a few new tokens; another conversation's history read from the start (its
    worker stopped) would have held it for every step of its read."""
    s = scheduler("fifo", budget=17, block_size=4, prefix_caching=True)
    decoding(s, 1)
    turn = request(64, max_tokens=1, first=100)
    s.add(turn)
    while not turn.finished:
        run(s, s.schedule())
    read_again = request(64, first=5000)
    s.add(read_again)
    run(s, s.schedule())  # under way
    next_turn = request(70, first=100)  # the turn's prompt and 6 new tokens: 64 of them cached
    s.add(next_turn)
    plan = dict(s.schedule())
    assert next_turn.seq.cached_tokens == 64 and plan[next_turn] == 6, "its whole rest in one step"
    assert plan[read_again] == 16 - 6, "the read goes on with the rest of the budget"


def test_prefill_first_gives_the_budget_to_prompts_before_decodes():
    s = scheduler("prefill-first", budget=8)
    decoding = request(3)
    s.add(decoding)
    run(s, s.schedule())
    long_prompt = request(20)
    s.add(long_prompt)
    plan = s.schedule()
    assert plan == [(long_prompt, 8)], "the whole budget went to the prompt"
    run(s, plan)
    plan = s.schedule()
    assert plan == [(long_prompt, 8)]
    run(s, plan)
    plan = s.schedule()
    assert plan == [(decoding, 1), (long_prompt, 4)], "decodes first in the list, with what is left"


def test_a_long_prompt_is_chunked_and_the_others_keep_decoding():
    s = scheduler("fifo", budget=10)
    players = [request(2) for _ in range(4)]
    for p in players:
        s.add(p)
    run(s, s.schedule())
    long_prompt = request(30)
    s.add(long_prompt)
    chunks = []
    while long_prompt.status is not Status.DECODING:
        plan = s.schedule()
        assert [r for r, _ in plan[:4]] == players, "every player decodes every step"
        chunks += [n for r, n in plan if r is long_prompt]
        run(s, plan)
    assert chunks == [6, 6, 6, 6, 6]


def test_admission_waits_for_room_plus_margin():
    s = scheduler(blocks=5, block_size=4, margin=2)
    first, second = request(8), request(8)  # 2 blocks each
    s.add(first)
    s.add(second)
    plan = s.schedule()
    assert [r for r, _ in plan] == [first], "2 + 2 blocks + a margin of 2 do not fit in 5"
    assert second.status is Status.PENDING
    roomy = scheduler(blocks=6, block_size=4, margin=2)
    roomy.add(request(8))
    roomy.add(request(8))
    assert len(roomy.schedule()) == 2


def test_when_the_pool_runs_out_the_newest_is_set_back_and_resumes_with_its_tokens():
    s = scheduler(blocks=5, block_size=4, budget=64)
    old, new = request(4, max_tokens=12), request(4, max_tokens=8)  # 4 and 3 blocks at most
    s.add(old)
    run(s, s.schedule())
    s.add(new)
    preempted_with = None
    while not (old.finished and new.finished):
        run(s, s.schedule())
        if new.preemptions and preempted_with is None:
            preempted_with = list(new.tokens)
    assert new.preemptions >= 1 and old.preemptions == 0, "the newest one was set back"
    assert len(preempted_with) > 4 and preempted_with[:4] == list(range(10, 14)), \
        "what it had written stays, as prompt"
    assert len(old.seq.output_ids) == 12 and len(new.seq.output_ids) == 8, "both finished all"
    s.schedule()
    assert s.blocks.free == 5


def test_the_last_running_request_is_never_preempted():
    s = scheduler(blocks=2, block_size=4, budget=64)
    only = request(4, max_tokens=4)  # 8 tokens: exactly the pool
    s.add(only)
    while not only.finished:
        plan = s.schedule()
        assert plan == [(only, plan[0][1])]
        run(s, plan)
    assert only.preemptions == 0


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        scheduler("random")


def test_beside_decodes_a_prompt_gets_only_the_prefill_chunk():
    s = scheduler(budget=32, prefill_chunk=5)
    assert MIN_PROMPT_SHARE > 5, "the chunk is the cap here"
    alone = request(40)
    s.add(alone)
    plan = s.schedule()
    assert plan == [(alone, 32)], "nobody decodes: the whole budget"
    run(s, plan)
    plan = s.schedule()
    assert plan == [(alone, 8)]
    run(s, plan)  # now decoding
    newcomer = request(40)
    s.add(newcomer)
    plan = s.schedule()
    assert plan == [(alone, 1), (newcomer, 5)], "a decode is running: 5 prompt tokens a step"


def test_the_prompt_share_grows_with_the_decodes_it_rides_with():
    s = scheduler(blocks=400, budget=512, prefill_chunk=256)
    decoding(s, 20)
    newcomer = request(1000)
    s.add(newcomer)
    plan = s.schedule()
    assert plan[-1] == (newcomer, PROMPT_TOKENS_PER_DECODE * 20)


def test_beside_few_decodes_a_prompt_fills_the_step_to_step_fill():
    """A step costs about the same up to ~64 tokens: 5 decodes leave a prompt 59 tokens, not 16;
    30 decodes still leave it 34 (the fill), and 60 leave it one a decode."""
    for decodes, share in ((5, 59), (30, 34), (60, 60)):
        s = scheduler(blocks=800, budget=512, prefill_chunk=256, step_fill=64)
        decoding(s, decodes)
        newcomer = request(1000)
        s.add(newcomer)
        assert s.schedule()[-1] == (newcomer, share)


def test_a_prompt_deep_into_a_long_context_fills_the_step_with_smaller_chunks():
    """A chunk's attention grows with the context it reads: its fill shrinks as FILL_ATTENTION / context."""
    s = scheduler(blocks=2000, budget=512, prefill_chunk=256, step_fill=64)
    decoding(s, 5, max_tokens=1000)  # decoding all along
    long_prompt = request(3000)
    s.add(long_prompt)
    seen = []
    while long_prompt.status is not Status.DECODING:
        context = long_prompt.computed
        plan = s.schedule()
        seen.append((context, dict(plan).get(long_prompt, 0)))
        run(s, plan)
    for context, share in seen[1:-1]:  # the first is its admission; the last what was left
        assert share == max(MIN_PROMPT_SHARE, min(59, FILL_ATTENTION // max(context, 1))), (context, share)
    assert seen[1][1] == 59 and seen[-2][1] == MIN_PROMPT_SHARE


@pytest.mark.parametrize("policy, prompt", [("fifo", 30), ("prefill-first", 60)])
def test_start_budget_is_what_the_next_step_gives_a_newcomer(policy, prompt):
    """The engine's free_slots trusts start_budget() to foretell schedule(): a newcomer's first chunk."""
    s = scheduler(policy, budget=40, step_fill=24)
    players = decoding(s, 3)
    ongoing = request(prompt)  # not done in its first step, under either order
    s.add(ongoing)
    run(s, s.schedule())  # its first chunk: it is prefilling now
    assert ongoing.status is Status.PREFILLING and all(p.status is Status.DECODING for p in players)
    budget = s.start_budget()
    assert 0 < budget < 40  # the ongoing prompt's rest (fifo: and the decodes' share) taken out
    newcomer = request(200)
    s.add(newcomer)
    plan = dict(s.schedule())
    assert plan[newcomer] == budget


def test_reset_drops_everything_and_gives_the_blocks_back():
    s = scheduler(blocks=20, block_size=4)
    decoding(s, 2)
    s.add(request(6))
    free_before = s.blocks.free
    dropped = s.reset()
    assert len(dropped) == 3 and not s.busy and s.blocks.free > free_before
    assert all(r.status is Status.FINISHED for r in dropped)
