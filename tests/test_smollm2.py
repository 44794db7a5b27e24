"""The real thing: the packaged SmolLM2-135M-Instruct loads offline and writes an English story;
so does that file requantized by llama.cpp's quantizer to what users download (Q4_K_M, Q5_K_M, Q8_0, Q4_0),
each served by a worker started with MODEL=<the file>."""
from __future__ import annotations

import re

import pytest
import torch

from shared.protocol import Job, SamplingParams
from pathlib import Path

from tests.engines import write
from tests.gguf_files import SMOLLM2_TYPES
from tests.processes import default_worker, make_client, models_served, start_api, stop, wait_until
from shared.settings import Settings
from worker.continuous import engine as continuous
from worker.model_loader import PACKAGED, PACKAGED_NAME, load
from worker.static_engine import StaticEngine

pytestmark = pytest.mark.slow

COMMON_WORDS = {"the", "a", "and", "was", "of", "to", "in", "he", "she", "his", "her", "there"}


@pytest.fixture(scope="module")
def smollm2(smollm2_dense):
    # float32: token-for-token comparisons are exact in float32 (bfloat16 may differ at ~2% of steps).
    return smollm2_dense


def _chat_job(loaded, job_id: str, request: str, max_tokens: int) -> Job:
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                                add_generation_prompt=True)
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
    return Job(id=job_id, model=loaded.name, prompt_ids=ids,
               params=SamplingParams(max_tokens=max_tokens, temperature=0), timeout_s=300)


def _run(loaded, jobs):
    return write(StaticEngine(loaded, capacity=len(jobs)), jobs)


def _assert_english_story(text: str, about: str) -> None:
    words = re.findall(r"[a-z']+", text.lower())
    assert len(words) >= 30, text
    assert len(COMMON_WORDS & set(words)) >= 4, text
    assert about in words, text
    assert sum(c.isascii() for c in text) / len(text) > 0.95, text


def test_smollm2_writes_an_english_story(smollm2):
    assert smollm2.name == PACKAGED_NAME and smollm2.context_window == 8192
    [story] = _run(smollm2, [_chat_job(smollm2, "s", "Tell a short story about a brave dragon.", 60)])
    _assert_english_story(story.text, "dragon")


def test_the_default_service_tells_stories_to_the_openai_client(redis_server, tmp_path):
    # What a new user gets: the default worker (no --model) and the API, driven by OpenAI's client.
    worker = default_worker(redis_server.url, tmp_path, "worker", OMP_NUM_THREADS="2")
    port, api = start_api(redis_server, tmp_path, "api")
    try:
        wait_until(lambda: PACKAGED_NAME in models_served(port), [worker, api], "SmolLM2 to load", timeout=240)
        client = make_client(port)
        chat = client.chat.completions.create(
            model=PACKAGED_NAME, max_tokens=80, temperature=0,
            messages=[{"role": "user", "content": "Tell a short story about a knight and a castle."}])
        _assert_english_story(chat.choices[0].message.content, "knight")
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=PACKAGED_NAME, prompt="Once upon a time, a dragon", max_tokens=60, temperature=0.7, seed=1,
            stream=True, extra_body={"ignore_eos": True}) if chunk.choices)
        _assert_english_story("Once upon a time, a dragon" + streamed, "dragon")
    finally:
        stop(api), stop(worker)


@pytest.mark.parametrize("qtype", SMOLLM2_TYPES)
def test_a_requantized_file_tells_stories_to_the_openai_client(qtype, smollm2_gguf, smollm2_tokenizer, redis_alone,
                                                                 tmp_path):
    """A worker on the file (MODEL=<path>): it serves the file's stem, and its chat and completion
    answers are English with the right finish_reason and token counts."""
    path = Path(smollm2_gguf(qtype))
    name = path.stem  # SmolLM2-135M-Instruct.Q4_K_M: the model's name is the file's stem
    worker = default_worker(redis_alone.url, tmp_path, "worker", MODEL=str(path), OMP_NUM_THREADS="2")
    port, api = start_api(redis_alone, tmp_path, "api")
    try:
        wait_until(lambda: name in models_served(port), [worker, api], f"{name} to load", timeout=240)
        assert models_served(port) == {name}
        client = make_client(port)
        assert [m.id for m in client.models.list().data] == [name]
        messages = [{"role": "user", "content": "Tell a short story about a knight and a castle."}]
        chat = client.chat.completions.create(model=name, max_tokens=80, temperature=0, messages=messages)
        story, usage = chat.choices[0].message.content, chat.usage
        _assert_english_story(story, "knight")
        prompt_ids = smollm2_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        prompt_ids = getattr(prompt_ids, "input_ids", prompt_ids)  # a BatchEncoding in newer transformers
        assert chat.model == name and usage.prompt_tokens == len(prompt_ids)
        assert 0 < usage.completion_tokens <= 80 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert chat.choices[0].finish_reason == ("length" if usage.completion_tokens == 80 else "stop"), usage
        if chat.choices[0].finish_reason == "length":
            # cut at max_tokens: all 80 tokens are in the text (SmolLM2's words tokenize back alike)
            assert abs(len(smollm2_tokenizer(story, add_special_tokens=False).input_ids) - 80) <= 2, story

        prompt = "Once upon a time, a dragon"
        text = client.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0.7, seed=1,
                                         extra_body={"ignore_eos": True})
        _assert_english_story(prompt + text.choices[0].text, "dragon")
        assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 40
        assert text.usage.prompt_tokens == len(smollm2_tokenizer(prompt).input_ids)
    finally:
        stop(api), stop(worker)


def test_smollm2_batch_writes_what_each_request_writes_alone(smollm2):
    requests = ["Tell a story about a castle.", "Write two sentences about a skeleton guarding a gate at night."]
    jobs = [_chat_job(smollm2, f"j{i}", r, 20) for i, r in enumerate(requests)]
    together = [s.output_ids for s in _run(smollm2, jobs)]
    alone = [_run(smollm2, [job])[0].output_ids for job in jobs]
    assert together == alone


# The cache in the model's dtype: these hold the engine's model code to transformers' numbers (a
# float16 cache beside float32, --kv-dtype auto on a CPU without bf16, rounds keys and values).
EXACT = Settings(int4_rows=0, kv_dtype="model")


def _continuous(loaded, settings=EXACT):
    return continuous.build(loaded, settings, loaded.model.state_dict(), loaded.config)


def test_the_compact_runner_matches_transformers_logits_and_text(smollm2):
    """The continuous engine's own Llama code on SmolLM2's weights, against transformers' model."""
    job = _chat_job(smollm2, "c", "Tell a short story about a brave dragon.", 40)
    engine = _continuous(smollm2)
    with torch.inference_mode():
        expected = smollm2.model(input_ids=torch.tensor(job.prompt_ids)[None]).logits[0, -1]
    engine.add(job)
    logits, _ = engine.runner.logits(engine.scheduler.schedule())
    assert torch.allclose(logits[0], expected, atol=1e-3, rtol=0), (logits[0] - expected).abs().max()
    [story] = write(_continuous(smollm2), [job])
    [reference] = _run(smollm2, [job])
    assert story.output_ids == reference.output_ids


def test_the_continuous_engine_writes_what_the_static_one_writes_for_a_crowd(smollm2):
    requests = ["Tell a story about a castle.", "Write two sentences about a skeleton guarding a gate at night.",
                "Describe a tavern.", "Tell a short story about a brave dragon."]
    jobs = [_chat_job(smollm2, f"j{i}", r, 24) for i, r in enumerate(requests)]
    together = [s.output_ids for s in write(_continuous(smollm2), jobs)]
    alone = [_run(smollm2, [job])[0].output_ids for job in jobs]
    assert together == alone


def test_the_gguf_read_straight_runs_like_transformers_load(smollm2):
    """The fast path (GGUF blocks read by our reader, no transformers model) writes the same text."""
    direct = load(PACKAGED, dtype="float32", device="cpu", transformers_model=False, cache_dir=Settings().cache_dir)
    assert direct.model is None and direct.eos_ids == smollm2.eos_ids
    job = _chat_job(smollm2, "d", "Tell a short story about a knight.", 30)
    engine = continuous.build(direct, EXACT, direct.weights(), direct.config)
    assert write(engine, [job])[0].output_ids == _run(smollm2, [job])[0].output_ids
