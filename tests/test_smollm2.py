"""The real thing: the packaged SmolLM2-135M-Instruct loads offline and writes an English story."""
from __future__ import annotations

import re
import time

import pytest

from shared.protocol import Job, SamplingParams
from worker.model_loader import PACKAGED, PACKAGED_NAME, load
from worker.static_engine import StaticEngine

pytestmark = pytest.mark.slow

COMMON_WORDS = {"the", "a", "and", "was", "of", "to", "in", "he", "she", "his", "her", "there"}


@pytest.fixture(scope="module")
def smollm2():
    # float32: token-for-token comparisons are exact in float32 (bfloat16 may differ at ~2% of steps).
    return load(PACKAGED, dtype="float32", device="cpu")


def _chat_job(loaded, job_id: str, request: str, max_tokens: int) -> Job:
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                                add_generation_prompt=True)
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
    return Job(id=job_id, model=loaded.name, prompt_ids=ids,
               params=SamplingParams(max_tokens=max_tokens, temperature=0), deadline=time.time() + 300)


def _run(loaded, jobs):
    engine = StaticEngine(loaded, capacity=len(jobs))
    seqs = [engine.add(job) for job in jobs]
    while engine.busy:
        engine.step()
    return seqs


def test_smollm2_writes_an_english_story(smollm2):
    assert smollm2.name == PACKAGED_NAME and smollm2.context_window == 8192
    [story] = _run(smollm2, [_chat_job(smollm2, "s", "Tell a short story about a brave dragon.", 60)])
    words = re.findall(r"[a-z']+", story.text.lower())
    assert len(words) >= 30, story.text
    assert len(COMMON_WORDS & set(words)) >= 4, story.text
    assert "dragon" in words, story.text
    assert sum(c.isascii() for c in story.text) / len(story.text) > 0.95


def test_smollm2_batch_writes_what_each_request_writes_alone(smollm2):
    requests = ["Tell a story about a castle.", "Write two sentences about a skeleton guarding a gate at night."]
    jobs = [_chat_job(smollm2, f"j{i}", r, 20) for i, r in enumerate(requests)]
    together = [s.output_ids for s in _run(smollm2, jobs)]
    alone = [_run(smollm2, [job])[0].output_ids for job in jobs]
    assert together == alone
