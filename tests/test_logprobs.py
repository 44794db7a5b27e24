"""Log-probabilities, echo and usage.cached_tokens, from the worker's logits to the openai client.

A sequence keeps each token's entry with its text (held back with it, cut with a stop string, none
for end-of-text); a job asking for logprobs is written again from the start when its worker dies,
and the client hears each entry once. On the packaged SmolLM2 (its default dtype and kernels),
each logprob is the model's own float32 log-softmax at its position, recomputed through the
engine's runner as prompt rows; the prompt's logprobs are the reply's numbers for the same
positions; logprobs never change the tokens written. Through the openai client on a real stack
(tiny Llama, real redis-server): completions' logprobs and echo, chat's logprobs and top_logprobs,
whole and streamed, and usage.prompt_tokens_details.cached_tokens.
"""
from __future__ import annotations

import math

import pytest
import torch

from api.streaming import unsent
from api.logprobs import Rendering, StreamState, token_text
from api.tokenizers import Tokenizer
from shared.protocol import Final, Job, SamplingParams, TextDelta
from shared.settings import Settings
from tests.engines import SETTINGS, make_engine, write
from tests.live_stack import client, stack  # noqa: F401 (fixtures: a real stack)
from tests.processes import MODEL
from tests.queue_jobs import MODEL as QUEUE_MODEL, die_holding, messages_heard, push_job, subscribe_to
from tests.tiny_models import tiny_tokenizer
from worker import job_queue
from worker.continuous import engine as continuous
from worker.continuous.request import Request
from worker.job_queue import JobQueue
from worker.logprobs import text_offsets
from worker.model_loader import PACKAGED, load
from worker.sequence import Sequence

TOKENIZER = tiny_tokenizer()
TEXT = "Once upon a time a brave knight walked to the café gate. The end!"


def _seq(stream: bool = True, written=None, **params) -> Sequence:
    job = Job(id="j", model="m", prompt_ids=TOKENIZER("Tell me").input_ids, timeout_s=60, stream=stream,
              params=SamplingParams(**{"max_tokens": 100, "logprobs": 2, **params}))
    return Sequence(job, TOKENIZER, frozenset({TOKENIZER.eos_token_id}), written)


def _entry(token: int) -> tuple[float, list]:
    """A made-up entry, told apart by its token: logprob -token/1000, top [[token, that]]."""
    return -token / 1000, [[token, -token / 1000]]


def _feed(seq: Sequence, ids: list[int]) -> list[TextDelta]:
    deltas = []
    for token in ids:
        seq.append(token, _entry(token))
        delta = seq.delta()
        if delta:
            seq.sent(delta)
            deltas.append(delta)
        if seq.finished:
            break
    return deltas


def _check_aligned(seq: Sequence, deltas: list[TextDelta]) -> None:
    """Each delta carries exactly the entries of the tokens whose text starts in its text, in order
    and once; together they are the final answer's."""
    streamed = [e for d in deltas for e in d.logprobs]
    assert streamed == seq.final().logprobs
    for delta in deltas:
        assert delta.logprobs_start == sum(len(d.logprobs) for d in deltas[:deltas.index(delta)])
        for token, logprob, offset, top in delta.logprobs:
            assert delta.offset <= offset < delta.offset + len(delta.text)
            assert (logprob, top) == _entry(token)


# A sequence's entries, aligned with its text

def test_each_token_has_its_entry_at_the_offset_its_text_starts():
    ids = TOKENIZER(TEXT).input_ids
    seq = _seq(max_tokens=len(ids))
    deltas = _feed(seq, ids)
    final = seq.final()
    assert final.text == TEXT and final.finish_reason == "length"
    assert [e[0] for e in final.logprobs] == ids and len(final.logprobs) == final.completion_tokens
    for (_, _, offset, _), (_, _, after, _), token in zip(final.logprobs, final.logprobs[1:] + [[0, 0, len(TEXT), 0]], ids):
        piece, alone = TEXT[offset:after], TOKENIZER.decode([token])
        # A token's own text; one that holds part of a character ("é": two tokens) holds it whole,
        # if it has its last byte, or nothing of it.
        assert piece == alone or ("\ufffd" in alone and alone.replace("\ufffd", "") in (piece, piece[:-1]))
    _check_aligned(seq, deltas)


def test_a_token_that_ends_inside_a_character_waits_with_its_text():
    first, second = TOKENIZER.convert_tokens_to_ids(["\u00c3", "\u00a9"])  # "é": C3 A9, a byte each
    seq = _seq()
    caf = TOKENIZER("caf").input_ids
    _feed(seq, caf)
    assert _feed(seq, [first]) == []  # half a character: neither its text nor its entry is sent
    [delta] = _feed(seq, [second])
    assert delta.text == "é" and [e[0] for e in delta.logprobs] == [first, second]
    assert [e[2] for e in delta.logprobs] == [3, 3]  # both start where the character does
    assert delta.logprobs_start == len(caf)


def test_a_stop_string_cuts_the_entries_of_the_tokens_past_it():
    seq = _seq(stop=["knight"])
    deltas = _feed(seq, TOKENIZER(TEXT).input_ids)
    final = seq.final()
    assert final.text == "Once upon a time a brave " and final.finish_reason == "stop"
    assert all(offset < len(final.text) for _, _, offset, _ in final.logprobs)
    # The token that holds the stop string's start (" knight" or " kn...") begins in the text: kept.
    assert TOKENIZER.decode([e[0] for e in final.logprobs]).startswith(final.text)
    assert len(final.logprobs) < final.completion_tokens  # the stop string's tokens were written
    _check_aligned(seq, deltas)


def test_text_that_may_start_a_stop_string_holds_its_entries_back_too():
    seq = _seq(stop=[" brave dragon"])
    ids = TOKENIZER(TEXT).input_ids
    deltas, fed = [], 0
    while not seq.text.endswith(" brave"):
        deltas += _feed(seq, ids[fed:fed + 1])
        fed += 1
    sent = deltas[-1].offset + len(deltas[-1].text)
    assert seq.text[sent:] == " brave"  # it may be the stop string's start: held back...
    assert [e[0] for d in deltas for e in d.logprobs] == [e[0] for e in seq.logprobs if e[2] < sent]
    assert any(e[2] >= sent for e in seq.logprobs)  # ...and so are its tokens' entries
    deltas += _feed(seq, ids[fed:])
    _check_aligned(seq, deltas)
    assert "".join(d.text for d in deltas) == TEXT


def test_end_of_text_gets_no_entry_and_the_last_delta_carries_what_is_left():
    ids = TOKENIZER("The end").input_ids
    seq = _seq()
    deltas = _feed(seq, ids + [TOKENIZER.eos_token_id])
    assert seq.finish_reason == "stop" and [e[0] for e in seq.final().logprobs] == ids
    _check_aligned(seq, deltas)


def test_without_logprobs_nothing_is_kept():
    seq = _seq(stream=False, logprobs=None)
    for token in TOKENIZER("The end").input_ids:
        seq.append(token)
    seq.cancel("length")
    assert seq.logprobs is None and seq.final().logprobs is None and seq.final().prompt_logprobs is None
    assert not seq._incremental  # a whole answer is still decoded once, at the end


def test_a_job_asking_for_logprobs_is_written_again_from_the_start_not_resumed():
    written = TOKENIZER(" brave knight").input_ids
    assert _seq(written=written, logprobs=None).resumed == len(written)  # without: resumed
    from worker.static_engine import resumable

    class Loaded:
        vocab_size = len(TOKENIZER)
    job = _seq().job
    assert resumable(written, job, Loaded()) is None


def test_prompt_text_offsets_are_where_each_prompt_token_starts():
    ids = TOKENIZER("Hello world! a café.").input_ids
    offsets = text_offsets(lambda x: TOKENIZER.decode(x, skip_special_tokens=True), ids)
    text = TOKENIZER.decode(ids)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    pieces = [text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]
    assert "".join(pieces) == text
    for token, piece in zip(ids, pieces):  # each token's own text, or "" for half a character
        assert piece in (TOKENIZER.decode([token]), "") or "\ufffd" in TOKENIZER.decode([token])


# The API's side: rendering and the stream's alignment

def test_completions_and_chat_shapes_with_partial_characters():
    tok = Tokenizer(TOKENIZER)
    first, second = TOKENIZER.convert_tokens_to_ids(["\u00c3", "\u00a9"])
    entries = [[first, -0.5, 3, [[first, -0.5], [second, -1.0]]], [second, -0.25, 3, []]]
    completion = Rendering(tok, chat=False, asked=True, echo=["caf"]).piece(0, entries)
    assert completion == {"tokens": ["bytes:\\xc3", "bytes:\\xa9"], "token_logprobs": [-0.5, -0.25],
                          "top_logprobs": [{"bytes:\\xc3": -0.5, "bytes:\\xa9": -1.0}, {}],
                          "text_offset": [6, 6]}  # after the echoed prompt's 3 characters
    chat = Rendering(tok, chat=True, asked=True).piece(0, entries)
    assert chat["refusal"] is None
    assert [c["bytes"] for c in chat["content"]] == [[0xC3], [0xA9]]
    assert bytes(sum((c["bytes"] for c in chat["content"]), [])).decode() == "é"
    assert chat["content"][0]["top_logprobs"][1] == {"token": "bytes:\\xa9", "logprob": -1.0, "bytes": [0xA9]}
    assert token_text(" gate".encode()) == " gate"
    assert Rendering(tok, chat=True, asked=False).piece(0, entries) is None


def test_a_stream_skips_the_entries_a_written_again_job_repeats():
    state = StreamState(1)
    state.take(0, [[1, -1.0, 0, []], [2, -2.0, 1, []]], 0)
    assert [e[0] for e in state.flush(0)] == [1, 2]
    state.take(0, [[1, -1.0, 0, []], [2, -2.0, 1, []], [3, -3.0, 2, []]], 0)  # the same job, again
    assert [e[0] for e in state.flush(0)] == [3]
    state.take(0, [[9, -9.0, 9, []]], 5)  # past a missed message: left to the final answer
    assert state.flush(0) == []
    state.take(0, [[4, -4.0, 3, []]], 3)
    assert [e[0] for e in state.flush(0)] == [4]


def test_a_dead_workers_logprobs_job_is_heard_once_written_again(fake_redis, monkeypatch, tiny_llama):
    """Killed after 5 tokens of a stream: the next worker writes it from the start (its entries died
    with the first), and through the API's rules the client hears the text and each entry once,
    equal to the undisturbed job's."""
    monkeypatch.setattr(job_queue, "RECORD_INTERVAL_S", 0)
    job = Job(id="job-0", model=QUEUE_MODEL, prompt_ids=[21, 45, 33, 190, 7], timeout_s=60, stream=True,
              params=SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3, logprobs=2))
    [undisturbed] = write(make_engine(tiny_llama), [job])
    push_job(fake_redis, job)
    pubsub = subscribe_to(fake_redis, job.id)
    first = JobQueue(fake_redis, "first", QUEUE_MODEL)
    [taken] = first.take(limit=1, wait_s=0, block_s=1)
    engine = make_engine(tiny_llama)
    seq = engine.add(taken)
    while len(seq.output_ids) < 5:
        first.publish(engine.step())
    die_holding(first, fake_redis)
    second = JobQueue(fake_redis, "second", QUEUE_MODEL)
    assert second.requeue_dead_workers() == 1
    [again] = second.take(limit=1, wait_s=0, block_s=1)
    assert len(second.written[again.id]) == 5
    fresh = make_engine(tiny_llama)
    rewritten = fresh.add(again, second.written.pop(again.id))
    assert rewritten.resumed == 0
    while fresh.busy:
        second.publish(fresh.step())
    heard, state, final = "", StreamState(1), None
    for _, message in messages_heard(pubsub):
        new = unsent(heard, message.offset if isinstance(message, TextDelta) else 0, message.text)
        assert new is not None
        heard += new
        state.take(0, message.logprobs, message.logprobs_start if isinstance(message, TextDelta) else 0)
        final = message if isinstance(message, Final) else final
    assert heard == final.text == undisturbed.text
    assert state.flush(0) == final.logprobs == undisturbed.final().logprobs
    assert len(final.logprobs) == 12


def test_prompt_logprobs_of_a_chunked_prompt_beside_decodes(tiny_llama):
    """A 60-token prompt computed 16 tokens a step beside a decoding request (each chunk's rows
    scored in its step) scores each prompt token as one 512-token step does, and as the reply path
    scores the same tokens written."""
    from dataclasses import replace

    prompt = [(7 * i) % 300 + 4 for i in range(60)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=3, prompt_logprobs=3)
    chunked = make_engine(tiny_llama, replace(SETTINGS, max_batch_tokens=16, prefill_chunk=16, step_fill=16))
    beside = chunked.add(Job(id="beside", model="m", prompt_ids=[5, 6, 7], timeout_s=60,
                             params=SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
    chunked.step()
    seq = chunked.add(Job(id="long", model="m", prompt_ids=prompt, timeout_s=60, params=params))
    steps = 0
    while not seq.finished:
        chunked.step()
        steps += 1
    assert steps >= 4 and not beside.finished  # in chunks, beside the decodes
    whole = make_engine(tiny_llama, replace(SETTINGS, max_batch_tokens=512, kv_blocks=256))
    [alone] = write(whole, [Job(id="long", model="m", prompt_ids=prompt, timeout_s=60, params=params)])
    entries, expected = seq.final().prompt_logprobs, alone.final().prompt_logprobs
    assert [e[0] for e in entries] == prompt and entries[0][1] is None
    for mine, theirs in zip(entries[1:], expected[1:]):
        assert mine[1] == pytest.approx(theirs[1], abs=1e-5)
        assert [lp for _, lp in mine[3]] == pytest.approx([lp for _, lp in theirs[3]], abs=1e-5)
    # The prompt's 10 first tokens written as a reply (forced by logit_bias) score the same.
    forced = make_engine(tiny_llama)
    for i in range(1, 11):
        [reply] = write(forced, [Job(id=f"w{i}", model="m", prompt_ids=prompt[:i], timeout_s=60,
                                     params=SamplingParams(max_tokens=1, logprobs=3, temperature=0,
                                                           logit_bias={str(prompt[i]): 100.0}))])
        assert reply.output_ids == [prompt[i]]
        assert reply.logprobs[0][1] == pytest.approx(entries[i][1], abs=1e-5)


# The packaged SmolLM2, in process

@pytest.fixture(scope="module")
def smollm2():
    return load(PACKAGED, dtype="auto", device="cpu", transformers_model=False,  # the worker's defaults
                cache_dir=Settings().cache_dir)


def _reference_logprobs(engine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The model's float32 log-softmax after prompt + output[:i], for each i: every prefix a request
    of its own in one step, computed as a prompt chunk by the engine's runner (runner.logits: the
    model's own logits), not through the decodes that wrote them."""
    plan = []
    for i in range(len(output)):
        req = Request(Sequence(Job(id=f"ref-{i}", model="m", prompt_ids=prompt + output[:i],
                                   params=SamplingParams(), timeout_s=60), engine.loaded.tokenizer, frozenset()))
        assert engine.blocks.allocate(req.table, req.tokens, cached=False) == 0
        plan.append((req, len(req.tokens)))
    logits, _ = engine.runner.logits(plan)
    for req, _ in plan:
        engine.blocks.release(req.table)
    return torch.log_softmax(logits.float(), dim=-1)


PROMPT = "Once upon a time, in a land of dragons and gold,"


@pytest.mark.slow
def test_smollm2_logprobs_are_the_models_own_log_softmax(smollm2):
    engine = continuous.build(smollm2, Settings(), smollm2.weights(), smollm2.config)
    prompt = smollm2.tokenizer(PROMPT).input_ids
    plain, greedy, sampled = write(engine, [
        Job(id="plain", model="m", prompt_ids=prompt, params=SamplingParams(max_tokens=10, temperature=0),
            timeout_s=60),
        Job(id="greedy", model="m", prompt_ids=prompt, timeout_s=60,
            params=SamplingParams(max_tokens=10, temperature=0, logprobs=5)),
        # Penalties and temperature change the pick, not the logprobs (the model's own numbers).
        Job(id="sampled", model="m", prompt_ids=prompt, timeout_s=60,
            params=SamplingParams(max_tokens=10, temperature=1.3, seed=5, logprobs=3, presence_penalty=1.5))])
    assert greedy.output_ids == plain.output_ids and greedy.text == plain.text  # beside the pick only
    for seq in (greedy, sampled):
        final = seq.final()
        assert len(final.logprobs) == final.completion_tokens == len(seq.output_ids)
        reference = _reference_logprobs(engine, prompt, seq.output_ids)
        k = seq.params.logprobs
        for i, (token, logprob, offset, top) in enumerate(final.logprobs):
            assert token == seq.output_ids[i]
            # The same bits here (the runner's rows are row-invariant); 1e-6 allowed elsewhere.
            assert abs(logprob - reference[i, token].item()) <= 1e-6, (seq.id, i)
            expected = reference[i].topk(k)
            assert [lp for _, lp in top] == pytest.approx(expected.values.tolist(), abs=1e-6)
            assert all(reference[i, t].item() == pytest.approx(lp, abs=1e-6) for t, lp in top)  # ties aside
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True) and len(top) == k
            if seq is greedy:  # the likeliest: first among the top (or tied with it)
                assert token in [t for t, _ in top] and logprob == top[0][1]
    assert any(logprob < -1e-3 for _, logprob, _, _ in sampled.final().logprobs)


@pytest.mark.slow
def test_smollm2_prompt_logprobs_are_the_replys_numbers_and_skip_the_prefix_cache(smollm2):
    engine = continuous.build(smollm2, Settings(), smollm2.weights(), smollm2.config)
    prompt = smollm2.tokenizer(PROMPT + " there lived a bard who sang of storms and ships").input_ids
    [reply] = write(engine, [Job(id="reply", model="m", prompt_ids=prompt, timeout_s=60,
                                 params=SamplingParams(max_tokens=8, temperature=0, logprobs=4))])
    whole = prompt + reply.output_ids
    # Echo with logprobs of the prompt and its reply: its prompt's blocks are in the cache, unused.
    [echo] = write(engine, [Job(id="echo", model="m", prompt_ids=whole, timeout_s=60,
                                params=SamplingParams(max_tokens=1, temperature=0, logprobs=4, prompt_logprobs=4))])
    [again] = write(engine, [Job(id="again", model="m", prompt_ids=whole, timeout_s=60,
                                 params=SamplingParams(max_tokens=1, temperature=0))])
    assert echo.cached_tokens == 0 and echo.final().cached_tokens == 0
    assert again.final().cached_tokens >= 16 and again.cached_tokens % 16 == 0  # whole blocks of it
    entries = echo.final().prompt_logprobs
    assert [e[0] for e in entries] == whole
    assert entries[0][1] is None and entries[0][3] is None  # nothing scores the first token
    assert all(e[1] is not None and len(e[3]) == 4 for e in entries[1:])
    # The reply's tokens as prompt: the same numbers as when they were written (same bits here).
    for (token, logprob, _, top), mine in zip(entries[len(prompt):], reply.final().logprobs):
        assert (token, logprob, top) == (mine[0], mine[1], mine[3])
    # Text offsets count in the prompt's own text.
    text = smollm2.tokenizer.decode(whole, skip_special_tokens=True)
    offsets = [e[2] for e in entries]
    assert "".join(text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])) == text
    assert offsets[len(prompt)] == len(smollm2.tokenizer.decode(prompt))


# Through the openai client, on a real stack (tiny Llama, real redis-server)

# The tiny model writes random tokens: its special tokens (ids 0-3, left out of the text) are kept
# out of the reply, so that the tokens' text adds up to the reply's. End-of-text is id 0.
NO_SPECIALS = {"logit_bias": {str(i): -100 for i in range(4)}, "ignore_eos": True}


def _whole_and_streamed(client, chat: bool, **request):
    """The same greedy request, whole and streamed (with usage): (whole, [chunks])."""
    create = client.chat.completions.create if chat else client.completions.create
    whole = create(model=MODEL, temperature=0, extra_body=NO_SPECIALS, **request)
    chunks = list(create(model=MODEL, temperature=0, extra_body=NO_SPECIALS, stream=True,
                         stream_options={"include_usage": True}, **request))
    return whole, chunks


def _joined(parts: list) -> dict:
    """Streamed completions logprobs, joined as one."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for name in joined:
            joined[name] += getattr(part, name)
    return joined


@pytest.mark.timeout(180)
@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_completions_logprobs_whole_and_streamed(client, echo):  # noqa: F811 (a fixture)
    prompt = "Once upon a time a brave knight"
    whole, chunks = _whole_and_streamed(client, chat=False, prompt=prompt, max_tokens=12, logprobs=3, echo=echo)
    choice, usage = whole.choices[0], whole.usage
    lp = choice.logprobs
    count = usage.completion_tokens + (usage.prompt_tokens if echo else 0)
    assert usage.completion_tokens == 12 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == count
    assert choice.text.startswith(prompt) if echo else not choice.text.startswith(prompt)
    if echo:
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert lp.text_offset[usage.prompt_tokens] == len(prompt)  # the reply after the prompt's text
    scored = [i for i, value in enumerate(lp.token_logprobs) if value is not None]
    assert len(scored) == count - (1 if echo else 0)
    for i in scored:
        top = lp.top_logprobs[i]
        assert len(top) <= 3 and lp.token_logprobs[i] <= 0 and all(v <= 0 for v in top.values())
        # The likeliest 3, likeliest first (a JSON object in the API's key order, not sorted by
        # name). Greedy: the chosen is likeliest unless that is a special token, kept out by the bias.
        assert max(top.values()) >= lp.token_logprobs[i] - 1e-6 and len(top) == 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
        if lp.tokens[i] in top:
            assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
    assert lp.text_offset == sorted(lp.text_offset)
    # Each token's text is where its offset says (its bytes may be part of a character).
    for i, token in enumerate(lp.tokens):
        if not token.startswith("bytes:"):
            assert choice.text[lp.text_offset[i]:].startswith(token), (i, token)
    # Streamed: the same text and logprobs, each chunk's tokens starting in its own text.
    text, parts, at = "", [], 0
    for chunk in chunks:
        for c in chunk.choices:
            if c.logprobs is not None:
                parts.append(c.logprobs)
                assert all(at <= offset < at + len(c.text) or (not c.text and offset == at)
                           for offset in c.logprobs.text_offset), (at, c.text, c.logprobs.text_offset)
            text += c.text
            at += len(c.text)
    assert text == choice.text
    assert _joined(parts) == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                              "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}
    assert chunks[-1].usage.completion_tokens == 12


@pytest.mark.timeout(120)
def test_echo_without_logprobs_only_prepends_the_prompt(client):  # noqa: F811
    plain = client.completions.create(model=MODEL, prompt="The dragon slept", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="The dragon slept", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The dragon slept" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None and plain.choices[0].logprobs is None
    tokens = Tokenizer(TOKENIZER).encode("The dragon slept")  # the stack's tokenizer is this one
    by_ids = client.completions.create(model=MODEL, prompt=tokens, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == echoed.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The dragon slept", max_tokens=6,
                                            temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    assert chunks[0].choices[0].text == "The dragon slept"


@pytest.mark.timeout(180)
def test_chat_logprobs_and_top_logprobs_whole_and_streamed(client):  # noqa: F811
    messages = [{"role": "user", "content": "Tell me of the dragon."}]
    whole, chunks = _whole_and_streamed(client, chat=True, messages=messages, max_tokens=10, logprobs=True,
                                        top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10 and whole.choices[0].logprobs.refusal is None
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == whole.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.logprob <= 0
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.token == token_text(bytes(c.bytes))
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    assert "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    # top_logprobs 0: the chosen token's logprob alone; none asked: null.
    alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True,
                                           extra_body=NO_SPECIALS)
    assert [c.top_logprobs for c in alone.choices[0].logprobs.content] == [[], [], []]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.timeout(120)
def test_a_repeated_long_prompt_reports_its_cached_tokens(client):  # noqa: F811
    prompt = " ".join(["the knight walked to the castle gate with a sword"] * 6)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    # n choices of one prompt count its cached tokens once; chat reports them too.
    three = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3)
    assert three.usage.prompt_tokens_details.cached_tokens == cached
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # Echo with logprobs computes every prompt position: nothing is taken from the cache.
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=1, echo=True)
    assert echo.usage.prompt_tokens_details.cached_tokens == 0
    assert math.isfinite(echo.choices[0].logprobs.token_logprobs[1])


@pytest.mark.parametrize("vocab, k", [(49152, 5), (49152, 20), (32000, 3), (400, 2), (4096, 1), (4096, 0)])
def test_the_block_top_k_finds_torchs_values(vocab, k):
    from worker.logprobs import top_k
    g = torch.Generator().manual_seed(vocab + k)
    rows = (torch.randn(7, vocab, generator=g) * 4).bfloat16().float()  # bf16: many ties
    rows[3, 5] = rows[3].max() + 1  # one clear winner in a row's first block
    values, ids = top_k(rows, k)
    expected = rows.topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(rows.gather(1, ids), values)  # each id holds its value (a tie may be another)
    assert all(len(set(row)) == k for row in ids.tolist())
