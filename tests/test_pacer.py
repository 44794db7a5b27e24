"""The pacer: prompt tokens beside decodes follow how far, as timed, they stretch the decodes' step."""
import pytest

from tests.schedulers import decoding, request, scheduler
from worker.continuous.pacer import Pacer
from worker.continuous.scheduler import MIN_PROMPT_SHARE


def machine(alone: float, per_token: float):
    """A step's seconds on a made-up machine: `alone` for the decodes, `per_token` a prompt token."""
    return lambda prompt_tokens: alone * (1 + per_token * prompt_tokens)


def pace(pacer: Pacer, decodes: int, step, steps: int = 20) -> list[int]:
    """Decode-only steps first (the streams' own pace), then steps with as many prompt tokens as allowed."""
    for _ in range(3):
        pacer.observe(decodes, 0, step(0))
    seen = []
    for _ in range(steps):
        tokens = pacer.allowed(decodes)
        seen.append(tokens)
        pacer.observe(decodes, tokens, step(tokens))
    return seen


def test_where_prompt_tokens_cost_little_the_step_stays_full():
    pacer = Pacer(max_stretch=2.0, most=48)
    assert pace(pacer, 16, machine(0.030, 0.005)) == [48] * 20  # 48 tokens: 1.24x


def test_where_they_cost_much_the_allowance_settles_where_the_step_takes_max_stretch():
    pacer = Pacer(max_stretch=2.0, most=48)
    seen = pace(pacer, 16, machine(0.030, 0.05))  # 48 tokens: 3.4x; 20 tokens: 2x
    assert seen[0] == 48 and seen[1] == 20
    assert all(18 <= tokens <= 20 for tokens in seen[1:])


def test_a_step_over_the_stretch_cuts_at_once_and_room_grows_back_by_halves():
    pacer = Pacer(max_stretch=2.0, most=64)
    for _ in range(3):
        pacer.observe(8, 0, 0.010)
    pacer.observe(8, 64, 0.050)  # 5x: 64 tokens would take 2x at 16
    assert pacer.allowed(8) == 16
    pacer.observe(8, 16, 0.011)  # 1.1x: 16 tokens could be ~178, at most 64: halfway is 40
    assert pacer.allowed(8) == 40
    pacer.observe(8, 40, 0.013)  # 1.3x: toward 64 again
    assert pacer.allowed(8) == 52


def test_each_number_of_decodes_has_its_own_pace_and_unknown_pace_leaves_the_most():
    pacer = Pacer(max_stretch=2.0, most=48)
    pace(pacer, 16, machine(0.030, 0.05))
    assert pacer.allowed(16) < 48 and pacer.allowed(31) == pacer.allowed(16)  # one power of two
    assert pacer.allowed(2) == 48
    pacer.observe(2, 48, 1.0)  # no decode-only step at 2 decodes yet: nothing to compare with
    assert pacer.allowed(2) == 48
    pacer.observe(2, 48, 100.0)  # nor did that step become their pace: one 100x it would cut the share
    assert pacer.allowed(2) == 48


@pytest.mark.parametrize("bad", [dict(decodes=0), dict(seconds=0.0)])
def test_steps_without_decodes_or_time_teach_nothing(bad):
    pacer = Pacer(max_stretch=2.0, most=48)
    step = dict(decodes=4, prompt_tokens=0, seconds=0.01)
    pacer.observe(**step)
    pacer.observe(**{**step, "prompt_tokens": 48, "seconds": 0.05, **bad})
    assert pacer.allowed(4) == 48


def test_untimed_pacer_always_allows_the_most():
    pacer = Pacer(max_stretch=0, most=48)
    assert pace(pacer, 16, machine(0.030, 0.5)) == [48] * 20


def test_the_scheduler_trims_a_prompts_fill_to_the_pacers_allowance_but_never_below_the_floor():
    s = scheduler(blocks=800, budget=512, prefill_chunk=256, step_fill=64)
    s.pacer = Pacer(max_stretch=2.0, most=64)
    decoding(s, 5)
    for _ in range(3):
        s.pacer.observe(5, 0, 0.010)
    s.pacer.observe(5, 59, 0.010 * (1 + 59 / 30))  # 59 tokens made it 2.97x: 30 would take 2x
    newcomer = request(1000)
    s.add(newcomer)
    assert s.schedule()[-1] == (newcomer, 30)
    s.pacer.observe(5, 30, 1.0)  # a step 100x: the allowance drops to nothing, the floor remains
    assert s.pacer.allowed(5) == 0 and s.prompt_share(5) == MIN_PROMPT_SHARE
