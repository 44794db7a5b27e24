"""Per-row sampling: greedy rows, top-k and top-p cuts, and seeds that repeat."""
from __future__ import annotations

import torch

from shared.protocol import SamplingParams
from worker.sampling import _top_k, _top_p, new_generator, sample


def test_greedy_rows_take_the_largest_logit():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1)]
    assert sample(logits, params, [new_generator(0), new_generator(0)]) == [1, 0]


def test_top_k_keeps_each_rows_own_k_largest():
    rows = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    kept = torch.isfinite(_top_k(rows, [1, 3, 0]))
    assert kept.tolist() == [[False, True, False, False], [False, True, True, True], [True] * 4]


def test_top_p_keeps_the_smallest_set_holding_p_of_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(_top_p(probs.log(), [0.7]))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    kept = torch.isfinite(_top_p(probs.log(), [0.4]))
    assert kept.tolist() == [[True, False, False, False]]  # the first token always stays


def test_sampled_tokens_stay_inside_the_cut():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    gen = new_generator(7)
    picks = {sample(logits, [SamplingParams(top_k=5, temperature=2.0)], [gen])[0] for _ in range(200)}
    assert picks <= allowed and len(picks) > 1


def test_same_seed_same_tokens_whatever_the_rows_around_it():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 3

    def draw(seeds, row):
        gens = [new_generator(s) for s in seeds]
        return [sample(logits, params, gens)[row] for _ in range(20)]

    assert draw([42, 1, 2], 0) == draw([42, 9, 8], 0)
    assert draw([42, 1, 2], 0) != draw([43, 1, 2], 0)


def test_tokens_are_drawn_with_the_softmax_probabilities():
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    logits = probs.log()[None].repeat(4000, 1)  # 4000 rows: one draw each, all at once
    gens = [new_generator(i) for i in range(4000)]
    picks = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * 4000, gens))
    freq = torch.bincount(picks, minlength=4).float() / 4000
    assert freq[2] == 0  # a token with no probability is never drawn
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_any_integer_seeds_a_generator():
    # Jobs are JSON anyone can write: a seed torch would refuse must not take a worker down.
    for seed in (-1, 2**64 + 5, -(2**70)):
        assert sample(torch.randn(1, 10), [SamplingParams(temperature=1.0)], [new_generator(seed)])[0] in range(10)


# --- the C++ sampler (worker/continuous/csrc/sampling.h), for rows with a temperature alone ------

def test_the_kernels_draws_follow_softmax_of_logits_over_temperature(kernel):
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    for temperature, dtype in ((1.0, torch.float32), (2.0, torch.float32), (0.5, torch.bfloat16)):
        logits = probs.log()[None].repeat(4000, 1).to(dtype)
        gens = [new_generator(i) for i in range(4000)]
        picks = torch.tensor(sample(logits, [SamplingParams(temperature=temperature)] * 4000, gens, kernel))
        freq = torch.bincount(picks, minlength=4).float() / 4000
        expected = torch.softmax(logits.float()[0] / temperature, dim=-1)
        assert freq[2] == 0
        assert torch.allclose(freq, expected, atol=0.03), (temperature, freq, expected)


def test_the_kernel_draws_what_the_torch_path_draws_from_the_same_numbers(kernel):
    """A vocabulary of 49,152 (SmolLM2's), 300 rows, each seeded: the same uniform number lands on
    the same token but where float32 sums in another order move a boundary (rare)."""
    logits = torch.randn(300, 49152, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=0.8)] * 300
    ours = sample(logits, params, [new_generator(i) for i in range(300)], kernel)
    torch_path = sample(logits, params, [new_generator(i) for i in range(300)])
    agree = sum(a == b for a, b in zip(ours, torch_path))
    assert agree >= 297, agree
    assert len(set(ours)) > 100  # drawn, not the largest each time


def test_rows_with_cuts_or_greedy_keep_their_own_paths_beside_the_kernel(kernel):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3, temperature=1.0),
              SamplingParams(temperature=1.0), SamplingParams(top_p=0.5, temperature=1.0)]
    picks = sample(logits, params, [new_generator(i) for i in range(4)], kernel)
    assert picks[0] == int(logits[0].argmax())
    assert picks[1] in set(torch.topk(logits[1], 3).indices.tolist())
    # each row's draw is its own: the same seeds give the same picks without the kernel, where the
    # kernel is not used (the cut rows) and for the greedy row
    alone = sample(logits, params, [new_generator(i) for i in range(4)])
    assert [picks[0], picks[1], picks[3]] == [alone[0], alone[1], alone[3]]
