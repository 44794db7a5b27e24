"""Structured output and tools through the whole stack, the way a game asks: the official `openai`
client, `python -m api`, a real redis-server and real `python -m worker` processes.

On the tiny random model (tests/test_integration.py's stack), whose free text is noise, so only the
mask makes its replies fit: 50 sampled replies to a JSON schema with an enum, an integer range and
a bounded string are all valid JSON of the schema; regex and choice likewise, on both routes,
streamed too; a reply cut by max_tokens says "length". On the packaged SmolLM2 (slow: its chat
template and context hold the tools' system message): a named tool's and "required"'s calls'
arguments match their schema, whole and streamed; with "auto", after a conversation that
had a call, the greedy reply is a valid call and sampled replies are text or valid calls, both
happening; a conversation with a call and its result goes through.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import jsonschema
import pytest

from tests.live_stack import client, stack  # noqa: F401 (a real stack's fixtures, reused)
from tests.processes import MODEL, RedisServer, default_worker, holding, make_client, start_api, stop, wait_until
from worker.model_loader import PACKAGED_NAME

pytestmark = pytest.mark.timeout(300)

NPC = {"type": "object",
       "properties": {"line": {"type": "string", "minLength": 1, "maxLength": 12},
                      "mood": {"enum": ["grumpy", "cheerful", "scared"]},
                      "gold_offered": {"type": "integer", "minimum": 0, "maximum": 100}},
       "required": ["line", "mood", "gold_offered"], "additionalProperties": False}
NPC_FORMAT = {"type": "json_schema", "json_schema": {"name": "npc_reply", "schema": NPC, "strict": True}}
ASK = [{"role": "user", "content": "The innkeeper answers:"}]
SAMPLED = dict(temperature=1.0, max_tokens=100)


def _parallel(function, count: int) -> list:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(function, range(count)))


def test_fifty_sampled_replies_to_a_json_schema_are_all_valid(client):
    def ask(i: int):
        if i % 2:
            done = client.chat.completions.create(model=MODEL, messages=ASK, n=5, seed=100 + i,
                                                  response_format=NPC_FORMAT, **SAMPLED)
            return [(c.message.content, c.finish_reason) for c in done.choices]
        done = client.completions.create(model=MODEL, prompt="The innkeeper answers:", n=5, seed=100 + i,
                                         extra_body={"response_format": NPC_FORMAT}, **SAMPLED)
        return [(c.text, c.finish_reason) for c in done.choices]

    replies = [reply for replies in _parallel(ask, 10) for reply in replies]
    assert len(replies) == 50
    for text, finish_reason in replies:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), NPC)
    assert len({text for text, _ in replies}) > 10  # sampled: not one reply over and over


def test_regex_and_choice_replies_match(client):
    regex = r"(north|south|east|west)-[0-9]{2}"
    choices = ["attack", "flee", "bargain with the troll"]

    def ask(i: int):
        constraint = {"regex": regex} if i % 2 else {"choice": choices}
        done = client.chat.completions.create(model=MODEL, messages=ASK, n=5, seed=i, **SAMPLED,
                                              extra_body={"structured_outputs": constraint})
        return constraint, [(c.message.content, c.finish_reason) for c in done.choices]

    for constraint, replies in _parallel(ask, 8):
        for text, finish_reason in replies:
            assert finish_reason == "stop"
            assert re.fullmatch(regex, text) if "regex" in constraint else text in choices, text


def test_a_streamed_reply_is_valid_json_too(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, seed=7, stream=True,
                                            response_format=NPC_FORMAT, **SAMPLED)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), NPC)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_reply_cut_by_max_tokens_says_length(client):
    done = client.chat.completions.create(model=MODEL, messages=ASK, seed=3, max_tokens=4,
                                          response_format=NPC_FORMAT)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 4
    assert choice.message.content.startswith('{"')  # what the schema allows so far, not whole JSON
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


def test_what_a_lenient_schema_leaves_unenforced_is_named_in_the_answer(client):
    """No strict: keywords the grammar cannot enforce are relaxed and named (`unenforced`, in the
    whole answer and in each streamed chunk); strict: true, a 400 naming the keyword."""
    import openai
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True,
                                                      "maxItems": 2}}, "required": ["tags"]}
    loose = {"type": "json_schema", "json_schema": {"name": "tags", "schema": tags}}
    done = client.chat.completions.create(model=MODEL, messages=ASK, seed=3, max_tokens=12, response_format=loose)
    assert done.model_extra["unenforced"] == ["uniqueItems"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, seed=3, max_tokens=12, stream=True,
                                                 response_format=loose))
    assert chunks and all(c.model_extra["unenforced"] == ["uniqueItems"] for c in chunks)
    assert "unenforced" not in client.chat.completions.create(model=MODEL, messages=ASK, seed=3, max_tokens=4,
                                                              response_format=NPC_FORMAT).model_extra
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "tags", "schema": tags, "strict": True}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in caught.value.body["message"]


def test_a_bad_schema_is_a_400_naming_it(client):
    import openai
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer", "minimum": 3,
                                                                           "maximum": 1}}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"


# Tools, on SmolLM2 -----------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
GOLD = {"type": "function", "function": {
    "name": "give_gold", "description": "Hand the player gold",
    "parameters": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 50}},
                   "required": ["amount"], "additionalProperties": False}}}
TOOLS = [WEATHER, GOLD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, kernel):
    """A stack of its own: a redis-server, the API and one default worker (the packaged SmolLM2)."""
    directory = tmp_path_factory.mktemp("smollm2-stack")
    server = RedisServer(str(directory))
    server.start()
    port, api = start_api(server, directory, "api")
    worker = default_worker(server.url, directory, "worker")
    try:
        wait_until(lambda: worker.pid in holding(server.client(), PACKAGED_NAME), [api, worker],
                   "the SmolLM2 worker to load", timeout=180)
        with make_client(port) as c:
            yield c
    finally:
        stop(api), stop(worker), server.stop()


def _valid_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_required_or_named_call_matches_its_schema(smollm2, tool_choice):
    done = smollm2.chat.completions.create(model=PACKAGED_NAME, messages=WEATHER_ASK, tools=TOOLS, n=6, seed=1,
                                           tool_choice=tool_choice, temperature=1.0, max_tokens=60)
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        _valid_call(call)
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_weather"


MAX_SCHEMA_TOKENS = 128  # half what bench.schema_collection asks: 57 of its 62 valid replies fit
MIN_VALID = 40  # measured here: 57 within 128 tokens (62 within 256; 34 before objects closed and keywords relaxed)
QUEST = {"type": "function", "function": {  # as most real tools are written: nothing of additionalProperties
    "name": "create_quest", "description": "Give the player a new quest",
    "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "reward_gold": {"type": "integer"}},
                   "required": ["title", "reward_gold"]}}}


QUEST_ASK = "Create a quest where the player must greet the blacksmith, with a title, a reward and a long description."


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "create_quest"}}],
                         ids=["required", "named"])
def test_a_tool_that_says_nothing_of_additional_properties_still_ends_its_call(smollm2, tool_choice):
    """SmolLM2, greedy, used to fill such a call's object with keys of its own until max_tokens
    ({"title":"Greeting","reward_gold":100,"description":{"description":{...): no tool_calls, and
    finish_reason "length" (seen again with OPEN_OBJECTS=1 on this ask: '..."reward_gold":100,"d...').
    Its objects are closed now (api/schemas.py): the call ends, and its arguments hold the declared
    keys only."""
    done = smollm2.chat.completions.create(
        model=PACKAGED_NAME, messages=[{"role": "user", "content": QUEST_ASK}],
        tools=[QUEST], tool_choice=tool_choice, temperature=0, max_tokens=120)
    (choice,) = done.choices
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, {**QUEST["function"]["parameters"], "additionalProperties": False})


@pytest.mark.slow
def test_real_world_schemas_are_answered_valid_cut_or_refused_never_invalid(smollm2):
    """The collection of tests/data/real_world_schemas.json (121 schemas: function signatures,
    configuration files, API payloads, Kubernetes objects, analytics events; 53 hard), each asked
    once, greedy, through the openai client, 8 at a time: every reply is valid, cut by max_tokens,
    breaks only what its answer named `unenforced`, or was refused with a reason; none invalid,
    none an error. bench.schema_collection counts them against JSON Schema's reading."""
    from bench.schema_collection import ask_all, load_collection, summary
    entries = load_collection()
    outcomes = ask_all(smollm2, PACKAGED_NAME, entries, strict=False, max_tokens=MAX_SCHEMA_TOKENS, concurrency=8)
    counts = summary(outcomes)
    print("real-world schemas:", counts)
    assert len(outcomes) == len(entries) >= 100
    wrong = [o for o in outcomes if o["kind"] in ("invalid", "error") or o["kind"] == "refused" and not o["why"]]
    assert not wrong, wrong
    assert all(o["unenforced"] for o in outcomes if o["kind"] == "relaxed")
    assert counts["valid"] >= MIN_VALID, counts


MEETING = {"type": "object", "properties": {"frequency": {"type": "string"}, "days": {"type": "array"},
                                            "start": {"type": "string", "format": "date"}},
           "if": {"properties": {"frequency": {"const": "weekly"}}}, "then": {"required": ["days"]}}


@pytest.mark.parametrize("reply, unenforced, kind", [
    ('{"frequency":"weekly","days":["MO"]}', [], "valid"),
    # a `then` not enforced: its `required` breaks under it (seen: schedule_recurring_meeting, on a bf16 CPU)
    ('{"frequency":"weekly"}', ["if", "then"], "relaxed"),
    ('{"frequency":"weekly"}', [], "invalid"),
    ('{"frequency":"weekly","days":["MO"],"start":"Monday"}', ["format: date"], "relaxed"),
    ('{"frequency":"weekly","days":"MO"}', ["if", "then"], "invalid"),  # a type break, whatever was relaxed
    ('{"frequency":', [], "invalid"),
])
def test_the_collections_judge_lets_pass_only_what_the_answer_named(reply, unenforced, kind):
    from bench.schema_collection import judge
    assert judge({"schema": MEETING}, reply, "stop", unenforced)[0] == kind


@pytest.mark.slow
def test_a_streamed_call_comes_in_tool_call_deltas(smollm2):
    stream = smollm2.chat.completions.create(model=PACKAGED_NAME, messages=WEATHER_ASK, tools=TOOLS, seed=2,
                                             tool_choice="required", temperature=0.7, max_tokens=60, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name in SCHEMAS
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS[deltas[0].function.name])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def _weather_turn(call_id: str, city: str, result: str, answer: Optional[str]) -> list[dict]:
    """A past turn in which the assistant answered a weather question by a call (and then, if
    `answer`, in words)."""
    turn = [{"role": "user", "content": f"What is the weather in {city} today?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]
    return turn + ([{"role": "assistant", "content": answer}] if answer else [])


# With "auto" the reply's first token decides between text and a call ('{'). SmolLM2 asked about
# Paris with no history never calls (it writes prose); after past calls it does, by a margin that
# the history sets. Measured on the packaged model with the defaults (2026-12-02):
# - two answered calls (London, Rome): '{"' at -0.12, the likeliest text token ('"') at -3.6, a
#   margin no change of numerics or CPU flips (one answered call, the history this test had
#   until then, gives '{"' -2.55 against '"' -1.55 here: CI's machine called on adc334c, this
#   one wrote text on the same commit);
# - one call whose result was not answered in words, then a question the tool only half answers
#   ("tomorrow"; the tool tells today's weather): 10 of 32 sampled replies called (n=8, seeds 3-6),
#   so 16 hold both kinds but by a chance of about 1 in 300 (0.69^16).
CALLED_TWICE = (_weather_turn("call_1", "London", "rain, 12 degrees", "It is raining in London, 12 degrees.")
                + _weather_turn("call_2", "Rome", "sunny, 21 degrees", "It is sunny in Rome, 21 degrees."))
CALLED_ONCE = _weather_turn("call_1", "Rome", "sunny, 21 degrees", None)
TOMORROW_ASK = [{"role": "user", "content": "Will it rain in Paris tomorrow?"}]


@pytest.mark.slow
def test_with_auto_the_model_calls_the_tool_when_it_chooses_to(smollm2):
    """"auto" lets the model call: the greedy reply is a call, parsed into tool_calls, its
    arguments valid against the function's parameters (and naming the city asked about)."""
    done = smollm2.chat.completions.create(model=PACKAGED_NAME, messages=CALLED_TWICE + WEATHER_ASK, tools=TOOLS,
                                           tool_choice="auto", temperature=0, max_tokens=60)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid_call(call)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"


@pytest.mark.slow
def test_with_auto_every_reply_is_text_or_a_valid_call(smollm2):
    """Sampled, with "auto": each reply is either text (not a call's JSON) or one valid call, and
    both happen among the 16 (two requests of n=8, the most a request may ask)."""
    choices = [choice for seed in (3, 4) for choice in smollm2.chat.completions.create(
        model=PACKAGED_NAME, messages=CALLED_ONCE + TOMORROW_ASK, tools=TOOLS, n=8, seed=seed,
        temperature=1.0, max_tokens=60).choices]
    kinds = []
    for choice in choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            _valid_call(call)
        else:
            assert choice.message.tool_calls is None and choice.message.content
            assert not choice.message.content.lstrip().startswith("{")
        kinds.append(choice.finish_reason == "tool_calls")
    assert any(kinds) and not all(kinds), [c.message for c in choices]


@pytest.mark.slow
def test_a_conversation_with_a_call_and_its_result_goes_through(smollm2):
    messages = [*WEATHER_ASK,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]
    done = smollm2.chat.completions.create(model=PACKAGED_NAME, messages=messages, tools=TOOLS, seed=4,
                                           tool_choice="none", temperature=0, max_tokens=30)
    choice = done.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert done.usage.prompt_tokens > 40  # the call and its result are in the prompt
