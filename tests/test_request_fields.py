"""No request field silently ignored: each one honoured, accepted as metadata, or a 400 naming it.

On fakeredis with a stand-in worker (tests/test_api_errors.py's): unknown fields, fields this server
cannot honour and wrong values are each a 400 with `param`; no-op values and metadata are accepted
and change nothing in the job; --lenient logs and ignores unknown fields; batch lines follow the
same rules; a field whose feature the model's workers do not all announce is refused. Then through
the official openai client against a real stack (tests/test_integration.py's).
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
from dataclasses import replace

import openai
import pytest

from api import validation
from api.app import create_app
from api.batch_input import parse_file
from api.errors import ApiError
from api.checks import check_features, required_features
from api.openapi import document
from api.validation import CHAT_FIELDS, COMPLETION_FIELDS, parse_chat, parse_completion
from shared import keys
from shared.protocol import (FEATURE_GRAMMAR, FEATURE_LOGPROBS, FEATURE_PENALTIES, FEATURE_PROMPT_LOGPROBS, FEATURES,
                             PARAM_FEATURES, SamplingParams, WorkerInfo, features_needed, params_json)
from shared.settings import Settings
from tests.fake_workers import MODEL, answer_in_background, openai_error, register_worker, seen_jobs
from tests.live_stack import client, stack  # noqa: F401 (a real stack's fixtures, reused)
from tests.processes import models_served, start, stop, wait_until
from worker.static_engine import unsupported_params

CHAT = [{"role": "user", "content": "A dragon?"}]
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"


def _body(path: str, **fields) -> dict:
    base = {"prompt": "Once upon a time"} if path == COMPLETIONS else {"messages": CHAT}
    return {"model": MODEL, **base, **fields}


def _announce(fake_redis, queue, features) -> None:
    """The registered stand-in worker's heartbeat again, announcing `features`."""
    info = WorkerInfo.from_json(fake_redis.get(keys.heartbeat(MODEL, queue.worker_id)))
    queue.heartbeat(replace(info, features=list(features)), ttl_s=60)


@pytest.fixture
def served(fake_redis):
    """The API with one stand-in worker that announces every feature."""
    queue = register_worker(fake_redis)
    _announce(fake_redis, queue, FEATURES)
    return create_app(Settings(request_timeout=5), client=fake_redis).test_client(), queue


def _nothing_queued(fake_redis) -> None:
    assert not any(fake_redis.llen(name) for name in keys.queues(MODEL))


# Unknown fields

@pytest.mark.parametrize("path, name", [
    (COMPLETIONS, "foo"), (CHATS, "foo"), (COMPLETIONS, "guided_json"), (CHATS, "use_beam_search"),
    # each route's own fields are unknown to the other
    (CHATS, "prompt"), (CHATS, "echo"), (CHATS, "suffix"), (CHATS, "best_of"),
    (COMPLETIONS, "messages"), (COMPLETIONS, "tools"), (COMPLETIONS, "tool_choice"), (COMPLETIONS, "top_logprobs"),
    (COMPLETIONS, "max_completion_tokens"), (COMPLETIONS, "audio"),
])
def test_an_unknown_field_is_a_400_naming_it(served, fake_redis, path, name):
    api, _ = served
    error = openai_error(api.post(path, json=_body(path, **{name: 1})), 400, param=name, code="unknown_parameter")
    assert error["message"] == f"Unrecognized request argument supplied: {name}"
    _nothing_queued(fake_redis)


def test_an_unknown_field_with_null_is_still_unknown(served):
    api, _ = served
    openai_error(api.post(COMPLETIONS, json=_body(COMPLETIONS, foo=None)), 400, param="foo", code="unknown_parameter")


def test_lenient_logs_each_unknown_field_once_and_ignores_it(fake_redis, caplog):
    queue = register_worker(fake_redis)
    api = create_app(Settings(request_timeout=5, lenient=True), client=fake_redis).test_client()
    validation._warned_unknown.discard("lenient_extra")
    with caplog.at_level(logging.WARNING, logger="api.validation"):
        for _ in range(2):
            answer_in_background(fake_redis, queue)
            response = api.post(COMPLETIONS, json=_body(COMPLETIONS, lenient_extra={"x": 1}, max_tokens=2))
            assert response.status_code == 200, response.get_data(as_text=True)
    warnings = [r for r in caplog.records if "lenient_extra" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert params_json(seen_jobs[0].params) == {"max_tokens": 2, "seed": seen_jobs[0].params.seed}
    # Lenient is about unknown fields only: a known field this server cannot honour is still refused.
    openai_error(api.post(COMPLETIONS, json=_body(COMPLETIONS, suffix="The end.")), 400, param="suffix",
                 code="unsupported_parameter")
    openai_error(api.post(CHATS, json=_body(CHATS, lenient_extra=1, presence_penalty=9)), 400,
                 param="presence_penalty")


def test_parse_takes_lenient_as_an_argument():
    with pytest.raises(ApiError) as refused:
        parse_chat(_body(CHATS, foo=1))
    assert refused.value.param == "foo"
    assert parse_chat(_body(CHATS, foo=1), lenient=True).messages == CHAT


# Fields this server cannot honour: refused unless at their no-op value

@pytest.mark.parametrize("path, name, value", [
    (COMPLETIONS, "suffix", "The end."),
    (COMPLETIONS, "best_of", 2),
    (CHATS, "modalities", ["text", "audio"]),
    (CHATS, "audio", {"voice": "alloy", "format": "wav"}),
    (CHATS, "prediction", {"type": "content", "content": "old text"}),
    (CHATS, "web_search_options", {}),
    (CHATS, "reasoning_effort", "low"),
    (CHATS, "verbosity", "low"),
    (CHATS, "functions", [{"name": "f", "parameters": {}}]),
    (CHATS, "function_call", "auto"),
])
def test_an_unsupported_field_is_a_400_naming_it(served, fake_redis, path, name, value):
    api, _ = served
    error = openai_error(api.post(path, json=_body(path, **{name: value})), 400, param=name,
                         code="unsupported_parameter")
    assert "not supported" in error["message"]
    _nothing_queued(fake_redis)


def test_the_deprecated_functions_say_to_use_tools(served):
    api, _ = served
    error = openai_error(api.post(CHATS, json=_body(CHATS, functions=[{"name": "f"}])), 400, param="functions")
    assert "'tools'" in error["message"]
    error = openai_error(api.post(CHATS, json=_body(CHATS, function_call={"name": "f"})), 400, param="function_call")
    assert "'tool_choice'" in error["message"]


# Wrong values

@pytest.mark.parametrize("path, fields, param", [
    (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty"),
    (CHATS, {"presence_penalty": -2.01}, "presence_penalty"),
    (CHATS, {"presence_penalty": "high"}, "presence_penalty"),
    (COMPLETIONS, {"frequency_penalty": 3}, "frequency_penalty"),
    (CHATS, {"frequency_penalty": True}, "frequency_penalty"),
    (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHATS, {"repetition_penalty": 10.5}, "repetition_penalty"),
    (COMPLETIONS, {"min_p": 1.5}, "min_p"),
    (CHATS, {"min_p": -0.1}, "min_p"),
    (COMPLETIONS, {"logit_bias": {"dragon": 5}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"-1": 5}}, "logit_bias"),
    (CHATS, {"logit_bias": {"5": 101}}, "logit_bias"),
    (CHATS, {"logit_bias": {"5": "up"}}, "logit_bias"),
    (CHATS, {"logit_bias": [5, 10]}, "logit_bias"),
    (CHATS, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"100000": 1}}, "logit_bias"),  # beyond the tiny vocabulary
    (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (COMPLETIONS, {"stop_token_ids": "2"}, "stop_token_ids"),
    (CHATS, {"stop_token_ids": [1] * 17}, "stop_token_ids"),
    (CHATS, {"stop_token_ids": [100000]}, "stop_token_ids"),  # beyond the tiny vocabulary
    (COMPLETIONS, {"min_tokens": -1}, "min_tokens"),
    (COMPLETIONS, {"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
    (CHATS, {"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"echo": "yes"}, "echo"),
    (COMPLETIONS, {"best_of": "two"}, "best_of"),
    (CHATS, {"logprobs": 5}, "logprobs"),
    (CHATS, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHATS, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHATS, {"top_logprobs": 3}, "top_logprobs"),  # OpenAI's rule: needs logprobs: true
    (CHATS, {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    (COMPLETIONS, {"response_format": "json"}, "response_format"),
    (CHATS, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHATS, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (COMPLETIONS, {"structured_outputs": ["regex"]}, "structured_outputs"),
    (CHATS, {"tools": {"type": "function"}}, "tools"),
    (CHATS, {"tools": ["lookup"]}, "tools[0]"),
    (CHATS, {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    (CHATS, {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    (CHATS, {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    (CHATS, {"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
    (CHATS, {"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
    (CHATS, {"tool_choice": "maybe"}, "tool_choice"),
    (CHATS, {"tool_choice": "required"}, "tool_choice"),  # and no tools
    (CHATS, {"tool_choice": {"type": "function"}}, "tool_choice"),
    (CHATS, {"tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    (COMPLETIONS, {"user": 5}, "user"),
    (CHATS, {"store": "yes"}, "store"),
    (CHATS, {"service_tier": "gold"}, "service_tier"),
    (CHATS, {"metadata": {"level": 5}}, "metadata"),
    (CHATS, {"metadata": {str(i): "x" for i in range(17)}}, "metadata"),
    (CHATS, {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (CHATS, {"prompt_cache_key": 1}, "prompt_cache_key"),
])
def test_a_wrong_value_is_a_400_naming_its_field(served, fake_redis, path, fields, param):
    api, _ = served
    openai_error(api.post(path, json=_body(path, **fields)), 400, param=param)
    _nothing_queued(fake_redis)


CALL = {"id": "call_1", "type": "function", "function": {"name": "open_gate", "arguments": "{\"gate\": 3}"}}


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),  # null only beside tool_calls
    ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": CALL}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 7}]}], "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "x"}]}],
     "messages[0].tool_calls[0].type"),
    ([CHAT[0], {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name"),
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([CHAT[0], {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "open"}],
     "messages[2].tool_call_id"),
    ([{"role": "tool", "content": "open", "tool_call_id": 3}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name"),
])
def test_a_wrong_message_is_a_400_naming_where(served, messages, param):
    api, _ = served
    openai_error(api.post(CHATS, json={"model": MODEL, "messages": messages}), 400, param=param)


# Accepted: no-op values, metadata, and what the fields turn into

NO_OPS = {
    COMPLETIONS: dict(logprobs=None, echo=False, suffix="", best_of=1, presence_penalty=0, frequency_penalty=0,
                      repetition_penalty=1, min_p=0, logit_bias={}, stop_token_ids=[], min_tokens=0, n=1,
                      response_format={"type": "text"}, structured_outputs=None, user="player-7", store=False,
                      metadata={"quest": "gate"}, service_tier="auto"),
    CHATS: dict(logprobs=False, top_logprobs=0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                min_p=0.0, logit_bias={}, response_format={"type": "text"}, n=1, tools=[], tool_choice="none",
                parallel_tool_calls=True, modalities=["text"], audio=None, prediction=None, web_search_options=None,
                reasoning_effort=None, verbosity=None, functions=[], function_call="none", user="player-7",
                metadata={"quest": "gate"}, store=True, service_tier="default", prompt_cache_key="npc",
                safety_identifier="abc"),
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHATS])
def test_no_op_values_and_metadata_are_accepted_and_change_nothing(fake_redis, path):
    queue = register_worker(fake_redis)  # the static engine: no features, none needed
    api = create_app(Settings(request_timeout=5), client=fake_redis).test_client()
    sent = []
    for fields in ({}, NO_OPS[path]):
        answer_in_background(fake_redis, queue)
        response = api.post(path, json=_body(path, seed=5, max_tokens=2, **fields))
        assert response.status_code == 200, response.get_data(as_text=True)
        sent.append(params_json(seen_jobs[0].params))
    assert sent[0] == sent[1] == {"max_tokens": 2, "seed": 5}


def test_completion_fields_become_sampling_params():
    req = parse_completion(_body(COMPLETIONS, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                                 min_p=0.05, logit_bias={"007": -100, "42": 2.5}, stop_token_ids=[2, 3],
                                 min_tokens=4, max_tokens=8, logprobs=3, echo=True, best_of=1))
    params = req.params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == \
        (0.5, -1.0, 1.2, 0.05)
    assert params.logit_bias == {"7": -100.0, "42": 2.5}
    assert params.stop_token_ids == [2, 3] and params.min_tokens == 4
    assert params.logprobs == 3 and params.prompt_logprobs == 3 and req.echo
    assert parse_completion(_body(COMPLETIONS, logprobs=0)).params.prompt_logprobs is None  # no echo
    assert parse_completion(_body(COMPLETIONS, echo=True)).params.prompt_logprobs is None   # no logprobs
    assert parse_completion(_body(COMPLETIONS, n=3, best_of=3)).n == 3


def test_chat_logprobs_and_constraints_land_on_the_request():
    assert parse_chat(_body(CHATS, logprobs=True)).params.logprobs == 0
    assert parse_chat(_body(CHATS, logprobs=True, top_logprobs=20)).params.logprobs == 20
    assert parse_chat(_body(CHATS, logprobs=False)).params.logprobs is None
    schema = {"type": "json_schema", "json_schema": {"name": "npc", "schema": {"type": "object"}}}
    req = parse_chat(_body(CHATS, response_format=schema, structured_outputs={"regex": "[a-z]+"}))
    assert req.response_format == schema and req.structured_outputs == {"regex": "[a-z]+"}
    assert parse_chat(_body(CHATS, response_format={"type": "text"})).response_format is None
    tools = [{"type": "function", "function": {"name": "open_gate", "parameters": {"type": "object"}}}]
    assert parse_chat(_body(CHATS, tools=tools)).tool_choice == "auto"  # OpenAI's default with tools
    named = {"type": "function", "function": {"name": "open_gate"}}
    req = parse_chat(_body(CHATS, tools=tools, tool_choice=named))
    assert req.tools == tools and req.tool_choice == named
    assert parse_chat(_body(CHATS)).tools is None and parse_chat(_body(CHATS)).tool_choice is None
    completion = parse_completion(_body(COMPLETIONS, response_format={"type": "json_object"}))
    assert completion.response_format == {"type": "json_object"}


def test_a_tool_call_history_keeps_its_calls_and_ids():
    messages = [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "the gate opens", "tool_call_id": "call_1", "name": "open_gate"},
                {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "then?"}]}]
    assert parse_chat({"model": MODEL, "messages": messages}).messages == [
        CHAT[0], {"role": "assistant", "tool_calls": [CALL], "content": None},
        {"role": "tool", "content": "the gate opens", "tool_call_id": "call_1", "name": "open_gate"},
        {"role": "user", "content": "And then?"}]


# Features: refused unless every live worker of the model announces them

@pytest.mark.parametrize("path, fields, feature, param", [
    (COMPLETIONS, {"presence_penalty": 0.5}, FEATURE_PENALTIES, "presence_penalty"),
    (CHATS, {"repetition_penalty": 1.1}, FEATURE_PENALTIES, "repetition_penalty"),
    (CHATS, {"min_p": 0.1}, FEATURE_PENALTIES, "min_p"),
    (COMPLETIONS, {"logit_bias": {"5": -100}}, FEATURE_PENALTIES, "logit_bias"),
    (COMPLETIONS, {"stop_token_ids": [2]}, FEATURE_PENALTIES, "stop_token_ids"),
    (CHATS, {"min_tokens": 1}, FEATURE_PENALTIES, "min_tokens"),
    (COMPLETIONS, {"logprobs": 0}, FEATURE_LOGPROBS, "logprobs"),
    (CHATS, {"logprobs": True}, FEATURE_LOGPROBS, "logprobs"),
    (COMPLETIONS, {"logprobs": 2, "echo": True}, FEATURE_PROMPT_LOGPROBS, "echo"),
    (CHATS, {"response_format": {"type": "json_object"}}, FEATURE_GRAMMAR, "response_format"),
    (COMPLETIONS, {"structured_outputs": {"choice": ["yes", "no"]}}, FEATURE_GRAMMAR, "structured_outputs"),
    (CHATS, {"tools": [{"type": "function", "function": {"name": "f"}}]}, FEATURE_GRAMMAR, "tools"),
])
def test_each_feature_is_required_by_its_fields(path, fields, feature, param):
    req = (parse_completion if path == COMPLETIONS else parse_chat)(_body(path, **fields))
    assert required_features(req)[feature] == param
    without = [_worker("w1", [f for f in FEATURES if f != feature])]
    with pytest.raises(ApiError) as refused:
        check_features(req, without)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, "unsupported_parameter")
    assert "not supported by the workers serving" in refused.value.message and feature in refused.value.message
    check_features(req, [_worker("w1", FEATURES), _worker("w2", FEATURES)])  # all announce it: accepted
    with pytest.raises(ApiError):  # one of two lacks it: it might take the job
        check_features(req, [_worker("w1", FEATURES), without[0]])


def test_plain_requests_need_no_feature():
    tools = [{"type": "function", "function": {"name": "f"}}]
    for req in (parse_completion(_body(COMPLETIONS, **{**NO_OPS[COMPLETIONS], "echo": True})),
                parse_chat(_body(CHATS, **NO_OPS[CHATS])), parse_chat(_body(CHATS, tools=tools, tool_choice="none"))):
        assert required_features(req) == {}
        check_features(req, [_worker("w1", [])])


def test_one_table_says_which_sampling_field_needs_which_feature():
    """shared/protocol.PARAM_FEATURES is read by the API (which feature to ask the workers for) and by
    the static engine (what it refuses): every field is either in it or plain sampling."""
    plain = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert set(PARAM_FEATURES) == set(names) - plain and set(PARAM_FEATURES.values()) == set(FEATURES)
    assert features_needed(SamplingParams(temperature=0, top_k=5, stop=["x"], seed=1)) == {}
    params = SamplingParams(min_p=0.1, presence_penalty=0.5, logprobs=0, grammar="ab")
    assert features_needed(params) == {FEATURE_PENALTIES: "presence_penalty", FEATURE_LOGPROBS: "logprobs",
                                       FEATURE_GRAMMAR: "grammar"}
    assert unsupported_params(params) == ["presence_penalty", "min_p", "logprobs", "grammar"]


def _worker(worker_id: str, features) -> WorkerInfo:
    return WorkerInfo(id=worker_id, model=MODEL, context_window=64, engine="static", batch=4, device="cpu",
                      dtype="float32", tokenizer_digest="x", pid=1, host="test", started=0.0, features=list(features))


def test_a_static_worker_s_model_refuses_a_feature_at_the_route(fake_redis):
    register_worker(fake_redis)  # announces no features, as the static engine
    api = create_app(Settings(request_timeout=5), client=fake_redis).test_client()
    error = openai_error(api.post(COMPLETIONS, json=_body(COMPLETIONS, logprobs=2)), 400, param="logprobs",
                         code="unsupported_parameter")
    assert f"serving {MODEL}" in error["message"] and "1 of its 1 live workers (static)" in error["message"]
    openai_error(api.post(CHATS, json=_body(CHATS, frequency_penalty=1)), 400, param="frequency_penalty",
                 code="unsupported_parameter")
    _nothing_queued(fake_redis)


def test_a_feature_its_workers_announce_reaches_the_job(served, fake_redis):
    api, queue = served
    answer_in_background(fake_redis, queue)
    response = api.post(COMPLETIONS, json=_body(COMPLETIONS, presence_penalty=0.5, stop_token_ids=[2],
                                                logit_bias={"5": -100}, max_tokens=2))
    assert response.status_code == 200, response.get_data(as_text=True)
    params = seen_jobs[0].params
    assert (params.presence_penalty, params.stop_token_ids, params.logit_bias) == (0.5, [2], {"5": -100.0})


# Batch lines: the same rules

def _batch_line(body: dict, url: str = CHATS) -> bytes:
    return (json.dumps({"custom_id": "npc-1", "method": "POST", "url": url, "body": body}) + "\n").encode()


def test_a_batch_line_with_an_unknown_field_is_refused_unless_lenient():
    line = _batch_line(_body(CHATS, foo=1))
    with pytest.raises(ApiError) as refused:
        parse_file(line)
    assert refused.value.code == "invalid_file" and "line 1" in refused.value.message
    assert "Unrecognized request argument supplied: foo" in refused.value.message
    assert parse_file(line, lenient=True)[0].body["foo"] == 1
    for body, url in [(_body(COMPLETIONS, suffix="x"), COMPLETIONS), (_body(CHATS, presence_penalty=3), CHATS)]:
        with pytest.raises(ApiError) as refused:
            parse_file(_batch_line(body, url), lenient=True)
        assert refused.value.code == "invalid_file"
    assert parse_file(_batch_line(_body(CHATS, **NO_OPS[CHATS])))[0].custom_id == "npc-1"


@pytest.mark.parametrize("lenient", [False, True])
def test_a_batch_upload_follows_the_lenient_setting(fake_redis, lenient):
    api = create_app(Settings(lenient=lenient), client=fake_redis).test_client()
    response = api.post("/v1/files", data={"purpose": "batch",
                                           "file": (io.BytesIO(_batch_line(_body(CHATS, x=1))), "lore.jsonl")})
    if lenient:
        assert response.status_code == 200, response.get_data(as_text=True)
    else:
        assert "Unrecognized request argument supplied: x" in openai_error(response, 400, param="file")["message"]


# The description lists exactly the fields the routes know

def test_the_description_lists_exactly_each_route_s_fields():
    schemas = document()["components"]["schemas"]
    assert set(schemas["CompletionRequest"]["properties"]) == COMPLETION_FIELDS
    assert set(schemas["ChatCompletionRequest"]["properties"]) == CHAT_FIELDS
    assert schemas["CompletionRequest"]["additionalProperties"] is False


# Through the official api, against a real stack

def test_the_openai_client_gets_a_400_naming_an_unknown_field(client):  # noqa: F811
    for call in (lambda **kw: client.completions.create(model="tiny-llama", prompt="Once", max_tokens=2, **kw),
                 lambda **kw: client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=2, **kw)):
        with pytest.raises(openai.BadRequestError) as refused:
            call(extra_body={"temperatur": 0.5})
        assert refused.value.param == "temperatur" and refused.value.code == "unknown_parameter"
        assert "Unrecognized request argument supplied: temperatur" in refused.value.message


def test_the_openai_client_gets_a_400_naming_an_unsupported_field(client):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=2, reasoning_effort="low")
    assert refused.value.param == "reasoning_effort" and refused.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny-llama", prompt="Once", max_tokens=2, suffix="The end.")
    assert refused.value.param == "suffix"


def test_the_openai_client_s_metadata_and_no_op_fields_are_accepted(client):  # noqa: F811
    reply = client.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=3, user="player-7", metadata={"quest": "gate"}, store=False,
        service_tier="auto", parallel_tool_calls=True, logprobs=False, presence_penalty=0, n=1,
        response_format={"type": "text"}, seed=1)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1


def test_a_tool_call_history_goes_through_the_chat_template(client):  # noqa: F811
    messages = [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "the gate opens", "tool_call_id": "call_1"}]
    reply = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=3, seed=1)
    assert reply.usage.prompt_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length")


PRESENCE, FREQUENCY = 1.5, 1.0  # within OpenAI's bounds (±2), large against the tiny model's logits


def _greedy_with_logprobs(client, **penalties):  # noqa: F811
    """(text, each written token's logprob entry): greedy, 24 tokens whatever it writes, with the
    20 likeliest tokens of each step, as the model scores them (before penalties)."""
    reply = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=24, temperature=0,
                                           logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True},
                                           **penalties)
    choice = reply.choices[0]
    assert len(choice.logprobs.content) == 24 == reply.usage.completion_tokens
    return choice.message.content, choice.logprobs.content


def test_the_openai_client_s_penalties_are_honoured_by_the_stack_s_workers(client):  # noqa: F811
    """Greedy with presence and frequency penalties writes, at every step, the token whose
    penalised score is the highest, OpenAI's l - f * c(t) - p * (c(t) > 0) (c: times t was written
    so far in this reply) over the model's own logprobs, which the reply reports (before penalties:
    worker/logprobs.py). The same request without them repeats tokens (greedy on the tiny random
    model loops), so the penalties change the text. A token is known by its bytes (byte-level BPE:
    one token each)."""
    # Needs the worker to announce FEATURE_PENALTIES (the continuous engine does).
    plain_text, plain = _greedy_with_logprobs(client)
    assert len({bytes(e.bytes) for e in plain}) < len(plain), plain_text  # it repeats itself unpenalised
    text, written = _greedy_with_logprobs(client, presence_penalty=PRESENCE, frequency_penalty=FREQUENCY)
    assert text != plain_text
    counts: dict[bytes, int] = {}

    def penalised(entry) -> float:
        count = counts.get(bytes(entry.bytes), 0)
        return entry.logprob - FREQUENCY * count - PRESENCE * (count > 0)

    for step, entry in enumerate(written):
        best = max(entry.top_logprobs, key=penalised)
        assert penalised(entry) >= penalised(best) - 1e-4, (step, entry.token, best.token, text)
        counts[bytes(entry.bytes)] = counts.get(bytes(entry.bytes), 0) + 1
    # And the penalties did pick against the model's own choice at least once.
    assert any(entry.logprob < max(t.logprob for t in entry.top_logprobs) - 1e-4 for entry in written), text


def test_a_static_engine_pool_refuses_features_through_redis(stack, client, tiny_model_dirs, tmp_path):  # noqa: F811
    """A real static-engine worker's heartbeat (in redis-server) announces no features: its model's
    requests that need one are refused, the plain ones answered."""
    worker = start(["worker", "--model", tiny_model_dirs["llama"], "--model-name", "tiny-static", "--engine", "static",
                    "--dtype", "float32", "--batch", "4"], tmp_path, "static-worker", REDIS_URL=stack.redis_server.url)
    try:
        wait_until(lambda: "tiny-static" in models_served(stack.port), [worker], "/v1/models to list tiny-static")
        for ask in (dict(logprobs=True), dict(frequency_penalty=0.5), dict(response_format={"type": "json_object"})):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="tiny-static", messages=CHAT, max_tokens=2, **ask)
            assert refused.value.code == "unsupported_parameter" and refused.value.param == next(iter(ask))
            assert "1 of its 1 live workers (static)" in refused.value.message
        reply = client.chat.completions.create(model="tiny-static", messages=CHAT, max_tokens=2, logprobs=False,
                                               temperature=0)  # greedy: a draw may end at once
        assert reply.usage.completion_tokens >= 1
    finally:
        stop(worker)
