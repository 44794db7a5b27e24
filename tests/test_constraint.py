"""Structured output on the worker (worker/constraint.py): a grammar's mask on every pick of the
continuous engine, on a tiny random model whose free text is noise, so only the mask makes it JSON."""
from __future__ import annotations

import hashlib
import json

import jsonschema
import llguidance
import pytest
import torch

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from worker.constraint import Grammars
from tests.engines import make_engine, run_until_idle

SCHEMA = {"type": "object",
          "properties": {"mood": {"enum": ["grumpy", "happy", "sly"]},
                         "gold": {"type": "integer", "minimum": 0, "maximum": 40},
                         "line": {"type": "string", "maxLength": 12}},
          "required": ["mood", "gold", "line"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, Settings(block_size=4, kv_blocks=512, max_batch_tokens=64, batch=0))


def stored(*grammars: str) -> dict[str, str]:
    """Grammar texts by their hash, as the API stores them in Redis."""
    return {hashlib.sha256(g.encode()).hexdigest(): g for g in grammars}


# Compact JSON, as the API asks (api/grammars.py): with free whitespace a random model writes newlines.
JSON = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
CHOICE = llguidance.LLMatcher.grammar_from_regex("(north|south|east|west)")
STORE = stored(JSON, CHOICE)
JSON_ID, CHOICE_ID = list(STORE)


@pytest.fixture(scope="module")
def grammars(tiny_llama):
    return Grammars(tiny_llama.tokenizer, tiny_llama.vocab_size, STORE.get)


def job(i: int, grammar: str, **params) -> Job:
    params = {"max_tokens": 120, "temperature": 1.0, "seed": i, "grammar": grammar, **params}
    return Job(id=f"j{i}", model="m", prompt_ids=[5 + i % 7, 9, 11], params=SamplingParams(**params), timeout_s=60)


STEPS = 2000  # more than any request here needs: past it a test fails rather than hangs


def test_sampled_replies_in_a_crowd_all_match_their_schema(engine, grammars):
    seqs = [engine.add(job(i, JSON_ID if i % 2 else CHOICE_ID, top_p=0.95 if i % 3 else 1.0),
                       constraint=grammars.constraint(JSON_ID if i % 2 else CHOICE_ID)) for i in range(24)]
    run_until_idle(engine, STEPS)
    for seq in seqs:
        assert seq.finish_reason == "stop", seq.text
        if seq.params.grammar == JSON_ID:
            jsonschema.validate(json.loads(seq.text), SCHEMA)
        else:
            assert seq.text in ("north", "south", "east", "west")
    assert len({s.text for s in seqs if s.params.grammar == JSON_ID}) > 1  # sampled, not one fixed reply


def test_greedy_replies_are_constrained_too(engine, grammars):
    seq = engine.add(job(1, JSON_ID, temperature=0), constraint=grammars.constraint(JSON_ID))
    run_until_idle(engine, STEPS)
    jsonschema.validate(json.loads(seq.text), SCHEMA)


def test_a_reply_cut_by_max_tokens_ends_with_length(engine, grammars):
    seq = engine.add(job(2, JSON_ID, max_tokens=3), constraint=grammars.constraint(JSON_ID))
    run_until_idle(engine, STEPS)
    assert seq.finish_reason == "length" and len(seq.output_ids) == 3 and seq.text.startswith("{")


def test_a_resumed_job_replays_its_record_through_the_matcher_and_goes_on_constrained(engine, grammars):
    whole = engine.add(job(3, JSON_ID), constraint=grammars.constraint(JSON_ID))
    run_until_idle(engine, STEPS)
    written = whole.output_ids[:len(whole.output_ids) // 2]
    resumed = engine.add(job(3, JSON_ID), written, constraint=grammars.constraint(JSON_ID))
    assert resumed.resumed == len(written)
    run_until_idle(engine, STEPS)
    assert resumed.output_ids == whole.output_ids and resumed.text == whole.text  # same seed, same draws
    jsonschema.validate(json.loads(resumed.text), SCHEMA)


def test_grammars_are_compiled_once_and_copied_per_request(tiny_llama):
    fetched = []
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.vocab_size, lambda d: fetched.append(d) or STORE.get(d))
    first, second = grammars.constraint(JSON_ID), grammars.constraint(JSON_ID)
    assert fetched == [JSON_ID] and first.matcher is not second.matcher


def test_a_grammar_missing_from_redis_is_a_clear_error(tiny_llama):
    grammars = Grammars(tiny_llama.tokenizer, tiny_llama.vocab_size, lambda d: None)
    with pytest.raises(ValueError, match="not in Redis"):
        grammars.constraint("ab" * 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_plus_plus_mask_is_llguidances_own(kernel, dtype):
    """kernel.mask_rows against llguidance.torch's: random bitmasks, a width that is not a multiple
    of 32, and words short of the width (tokens past them are never allowed)."""
    import llguidance.torch

    g = torch.Generator().manual_seed(0)
    for width, words in ((49152, 1536), (1000, 32), (1000, 30)):
        logits = torch.randn(5, width, generator=g).to(dtype)
        bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
        bitmask[1] = 0  # nothing allowed
        bitmask[2] = -1  # everything the words cover
        ours, theirs = logits.clone(), logits.float()
        kernel.mask_rows(ours, bitmask)
        llguidance.torch.apply_token_bitmask_inplace(theirs, bitmask)
        assert torch.equal(ours.float(), theirs), (width, words)


def test_a_masked_row_samples_in_the_c_plus_plus_sampler_as_before(kernel):
    """The sampler skips exp() for -inf (a masked token): the same picks as torch's inverse CDF."""
    from worker.sampling import new_generator, sample

    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(1))
    logits[:, 50:] = float("-inf")
    params = [SamplingParams(temperature=0.9)] * 16
    ours = sample(logits, params, [new_generator(i) for i in range(16)], kernel)
    torchs = sample(logits, params, [new_generator(i) for i in range(16)])
    assert ours == torchs and max(ours) < 50
