"""The seed's test: greedy decoding in a padded batch writes exactly what each prompt writes alone."""
from __future__ import annotations


import pytest
import torch

from shared.protocol import Job, SamplingParams
from worker import static_engine
from worker.model_loader import load
from tests.engines import write
from worker.static_engine import StaticEngine

PROMPT_LENGTHS = (3, 9, 5, 14)  # different lengths, so the batch pads most rows
NEW_TOKENS = 12


def _jobs(vocab: int) -> list[Job]:
    gen = torch.Generator().manual_seed(1)
    # Avoid the special tokens at the start of the vocabulary (eos, pad).
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    # ignore_eos: every row writes all its tokens, so a difference anywhere is seen.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [Job(id=f"j{i}", model="m", prompt_ids=p, params=params, timeout_s=60)
            for i, p in enumerate(prompts)]


def _write(loaded, jobs: list[Job]) -> dict[str, list[int]]:
    return {s.id: s.output_ids for s in write(StaticEngine(loaded, capacity=len(jobs)), jobs)}


def _alone(loaded, jobs):
    alone = {}
    for job in jobs:
        alone.update(_write(loaded, [job]))
    return alone


def test_batch_writes_what_each_prompt_writes_alone(loaded):
    jobs = _jobs(len(loaded.tokenizer))
    together = _write(loaded, jobs)
    assert all(len(tokens) == NEW_TOKENS for tokens in together.values())
    assert together == _alone(loaded, jobs)


def test_without_the_mask_the_padded_rows_change(loaded, monkeypatch):
    jobs = _jobs(len(loaded.tokenizer))
    alone = _alone(loaded, jobs)
    real_left_pad = static_engine.left_pad

    def pad_without_mask(prompts, pad_id):
        ids, mask = real_left_pad(prompts, pad_id)
        return ids, torch.ones_like(mask)  # pads attended to as if they were words

    monkeypatch.setattr(static_engine, "left_pad", pad_without_mask)
    assert _write(loaded, jobs) != alone


def test_without_per_row_positions_the_padded_rows_change(tiny_model_dirs, monkeypatch):
    # GPT-2 learns an embedding per absolute position, so a padded prompt that counts its pads
    # reads as if it started later. (Llama's rotary positions are relative: shifting every position
    # of a row by its padding changes nothing, so only GPT-2 can show this mistake.)
    loaded = load(tiny_model_dirs["gpt2"], dtype="float32", device="cpu")
    jobs = _jobs(len(loaded.tokenizer))
    alone = _alone(loaded, jobs)
    monkeypatch.setattr(static_engine, "positions_from_mask",
                        lambda mask: torch.arange(mask.shape[1]).expand_as(mask))
    assert _write(loaded, jobs) != alone


def test_a_finished_row_leaves_the_batch_without_changing_the_others(loaded):
    jobs = _jobs(len(loaded.tokenizer))
    jobs[1].params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    together = _write(loaded, jobs)
    alone = _alone(loaded, jobs)
    assert len(together["j1"]) == 2
    assert together == alone


@pytest.mark.parametrize("prompt", [[], [10**6], [-1], list(range(10, 138))])
def test_a_prompt_the_model_cannot_run_is_refused_before_it_joins_a_batch(loaded, prompt):
    engine = StaticEngine(loaded, capacity=2)
    job = _jobs(len(loaded.tokenizer))[0]
    job.prompt_ids = prompt  # empty, outside the vocabulary, or as long as the context window (128)
    with pytest.raises(ValueError):
        engine.add(job)
    assert not engine.busy
