"""A sequence's text: incremental decoding, stop strings held back and cut, end-of-text, max_tokens."""
from __future__ import annotations


import pytest

from shared.protocol import Job, SamplingParams
from tests.tiny_models import tiny_tokenizer
from worker.sequence import Sequence

TEXT = "Once upon a time a brave knight walked to the café gate. The end!"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _seq(tokenizer, stream: bool = True, **params) -> Sequence:
    job = Job(id="j", model="m", prompt_ids=tokenizer("Tell me").input_ids,
              params=SamplingParams(**{"max_tokens": 100, **params}), timeout_s=60,
              stream=stream)
    return Sequence(job, tokenizer, frozenset({tokenizer.eos_token_id}))


def _feed(seq: Sequence, ids: list[int]) -> list[str]:
    deltas = []
    for token in ids:
        seq.append(token)
        delta = seq.delta()
        if delta:
            assert seq.text[delta.offset:].startswith(delta.text)  # the offset says where it goes
            seq.sent(delta)
            deltas.append(delta.text)
        if seq.finished:
            break
    return deltas


def test_deltas_add_up_to_the_whole_decode(tokenizer):
    ids = tokenizer(TEXT).input_ids
    seq = _seq(tokenizer)
    deltas = _feed(seq, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert len(deltas) > 5  # written piece by piece, not at the end


def test_a_character_split_across_tokens_is_never_sent_half_written(tokenizer):
    # "é" is two bytes, C3 A9; byte-level BPE can write it as two tokens, one byte each.
    first, second = tokenizer.convert_tokens_to_ids(["\u00c3", "\u00a9"])
    seq = _seq(tokenizer)
    assert "".join(_feed(seq, tokenizer("caf").input_ids)) == "caf"
    assert _feed(seq, [first]) == []  # half a character: nothing to send yet
    assert _feed(seq, [second]) == ["é"]


def test_half_a_character_at_the_end_is_written_as_it_decodes(tokenizer):
    # The answer ends inside a character: the streamed text still equals the whole decode.
    first = tokenizer.convert_tokens_to_ids("\u00c3")
    ids = tokenizer("caf").input_ids + [first]
    seq = _seq(tokenizer, max_tokens=len(ids))
    streamed = "".join(_feed(seq, ids))
    assert seq.finish_reason == "length"
    assert streamed == seq.final().text == tokenizer.decode(ids) == "caf\ufffd"


def test_stop_string_cuts_the_text_and_is_never_sent(tokenizer):
    seq = _seq(tokenizer, stop=["knight"])
    deltas = _feed(seq, tokenizer(TEXT).input_ids)
    assert seq.finish_reason == "stop"
    assert seq.text == "Once upon a time a brave "
    assert "".join(deltas) == seq.text
    assert seq.final().text == seq.text


def test_text_that_may_start_a_stop_string_waits_until_it_does_not(tokenizer):
    seq = _seq(tokenizer, stop=["brave dragon"])
    deltas = _feed(seq, tokenizer(TEXT).input_ids)
    assert seq.finish_reason is None  # "brave knight" is not the stop string...
    assert "".join(deltas) == TEXT  # ...so all of it is sent in the end


def test_end_of_text_stops_unless_ignored(tokenizer):
    ids = tokenizer("Once upon").input_ids + [tokenizer.eos_token_id] + tokenizer(" a time").input_ids
    stopped = _seq(tokenizer)
    _feed(stopped, ids)
    assert (stopped.finish_reason, stopped.text) == ("stop", "Once upon")

    ignoring = _seq(tokenizer, ignore_eos=True)
    _feed(ignoring, ids)
    assert ignoring.finish_reason is None
    assert ignoring.text == "Once upon a time"


def test_max_tokens_ends_with_length(tokenizer):
    seq = _seq(tokenizer, max_tokens=3)
    _feed(seq, tokenizer(TEXT).input_ids)
    final = seq.final()
    assert (final.finish_reason, final.completion_tokens) == ("length", 3)
    assert final.prompt_tokens == len(tokenizer("Tell me").input_ids)


def test_text_not_marked_sent_comes_again_with_what_follows(tokenizer):
    # As when Redis could not be reached: nothing was published, so the next delta repeats it.
    seq = _seq(tokenizer)
    ids = tokenizer(TEXT).input_ids
    seq.append(ids[0])
    unsent = seq.delta()
    seq.append(ids[1])
    again = seq.delta()
    assert (again.offset, again.text) == (0, tokenizer.decode(ids[:2]))
    assert again.text.startswith(unsent.text)


def test_without_streaming_or_stop_strings_the_text_is_decoded_once_at_the_end(tokenizer):
    seq = _seq(tokenizer, stream=False, max_tokens=5)
    ids = tokenizer(TEXT).input_ids
    assert _feed(seq, ids[:4]) == []  # nothing to send: nobody listens to the pieces
    assert seq.text == ""
    _feed(seq, ids[4:])
    assert seq.final().text == tokenizer.decode(ids[:5]) and seq.finish_reason == "length"
