"""A request's own changes to its logits (worker/logits.py), against a hand computation of each
formula, and their place before every pick path (greedy, torch's cut, the C++ sampler)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from shared.protocol import SamplingParams
from worker.logits import adjust, changes_logits
from worker.sampling import new_generator, sample


def row(params: SamplingParams, prompt=(), output=(), stop_ids=frozenset({0})):
    return SimpleNamespace(params=params, prompt_ids=list(prompt), output_ids=list(output), stop_ids=stop_ids,
                           adjusts=changes_logits(params), constraint=None)


LOGITS = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]])


def test_no_change_gives_the_logits_back_untouched():
    seq = row(SamplingParams(temperature=0))
    assert not seq.adjusts
    assert adjust(LOGITS, [seq]) is LOGITS


def test_frequency_and_presence_penalties_follow_openais_formula():
    # Token 1 written twice, token 4 once: l - f * count - p * (count > 0).
    seq = row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output=[1, 4, 1])
    out = adjust(LOGITS, [seq])[0].tolist()
    expected = LOGITS[0].tolist()
    expected[1] -= 0.5 * 2 + 0.25
    expected[4] -= 0.5 * 1 + 0.25
    assert out == pytest.approx(expected)


def test_negative_penalties_favour_repeats():
    seq = row(SamplingParams(presence_penalty=-2.0), output=[2])
    assert adjust(LOGITS, [seq])[0, 2].item() == pytest.approx(-1.0 + 2.0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Seen: 1 and 2 in the prompt, 4 in the output; 0, 3, 5 unseen and unchanged.
    seq = row(SamplingParams(repetition_penalty=2.0), prompt=[1, 2], output=[4])
    out = adjust(LOGITS, [seq])[0].tolist()
    assert out == pytest.approx([1.0, 1.0, -2.0, 0.5, 1.5, -2.0])


def test_logit_bias_adds_per_token_and_ignores_ids_past_the_logits():
    seq = row(SamplingParams(logit_bias={"3": 100.0, "0": -100.0, "999": 5.0}))
    out = adjust(LOGITS, [seq])[0].tolist()
    assert out == pytest.approx([-99.0, 2.0, -1.0, 100.5, 3.0, -2.0])
    assert sample(adjust(LOGITS, [seq]), [seq.params], [new_generator(1)]) == [3]


def test_min_tokens_masks_the_tokens_that_would_end_the_reply_until_it_is_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    early = row(params, output=[1], stop_ids=frozenset({0, 2}))
    assert adjust(logits, [early])[0].tolist() == [-math.inf, 1.0, -math.inf, 0.0]
    late = row(params, output=[1, 1], stop_ids=frozenset({0, 2}))
    assert adjust(logits, [late])[0].tolist() == logits[0].tolist()


def test_min_p_drops_tokens_below_a_share_of_the_likeliest_after_temperature():
    logits = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    for temperature in (0.5, 1.0, 2.0):
        params = SamplingParams(min_p=0.2, temperature=temperature)
        probs = torch.softmax(logits[0] / temperature, -1)
        kept_by_hand = (probs >= 0.2 * probs.max()).tolist()
        kept = torch.isfinite(adjust(logits, [row(params)])[0]).tolist()
        assert kept == kept_by_hand
    assert not changes_logits(SamplingParams(min_p=0.5, temperature=0))  # greedy: the likeliest stays


def test_each_row_changes_alone_and_the_others_keep_their_numbers():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    plain, biased = row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0, logit_bias={"7": 50.0}))
    out = adjust(logits, [plain, biased, plain])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    alone = adjust(logits[1:2], [biased])
    assert torch.equal(out[1], alone[0])  # the same bits whatever shares the step


def test_a_bfloat16_step_is_adjusted_in_float32():
    logits = LOGITS.to(torch.bfloat16)
    out = adjust(logits, [row(SamplingParams(presence_penalty=0.1), output=[4])])
    assert out.dtype == torch.float32 and out[0, 4].item() == pytest.approx(3.0 - 0.1)


@pytest.mark.parametrize("cut", [dict(), dict(top_k=3), dict(top_p=0.9)], ids=["c++ or plain", "top-k", "top-p"])
def test_a_masked_token_is_never_picked_on_any_path(cut, kernel):
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    banned = int(logits[0].argmax())
    params = SamplingParams(temperature=1.5, logit_bias={str(banned): -100.0}, **cut)
    seq, gen = row(params), new_generator(5)
    picks = {sample(adjust(logits, [seq]), [params], [gen], kernel)[0] for _ in range(300)}
    assert banned not in picks and len(picks) > 1
