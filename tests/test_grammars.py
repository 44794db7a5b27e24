"""Structured output at the API (api/grammars.py) on SmolLM2's tokenizer: each way to ask compiles
to a grammar that allows what it should and refuses what it should not; each mistake is a 400
naming its field; a grammar is stored once under its hash with a TTL (fakeredis and redis-server);
through the app, the job carries only the hash and a stand-in worker held to the stored grammar
(tests/fake_workers.reply_within_grammar) writes a reply it allows and refuses one it rejects; a
large grammar's check leaves gevent's loop free (told by the order of events)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import llguidance
import pytest

from api import grammars
from api.app import create_app
from api.errors import ApiError
from api.tokenizers import Tokenizer
from api.validation import parse_chat, parse_completion
from shared import keys
from shared.protocol import FEATURES
from shared.settings import Settings
from tests.fake_workers import register_worker, reply_within_grammar
from tests.processes import ROOT

MODEL = "smol"
NPC = {"type": "object",
       "properties": {"line": {"type": "string", "minLength": 1, "maxLength": 40},
                      "mood": {"enum": ["grumpy", "cheerful", "scared"]},
                      "gold_offered": {"type": "integer", "minimum": 0, "maximum": 100}},
       "required": ["line", "mood", "gold_offered"], "additionalProperties": False}
GOOD_NPC = '{"line":"Go away.","mood":"grumpy","gold_offered":40}'
BAD_NPC = '{"line":"Go away.","mood":"grumpy","gold_offered":400}'
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "npc_reply", "schema": NPC, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer):
    return Tokenizer(smollm2_tokenizer)


def _chat(**fields):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields})


def _grammar(smollm2, req):
    from api import tools
    return grammars.for_request(req, smollm2, tools.spec(req.tools, req.tool_choice))


def _allows(smollm2, grammar: str, text: str) -> bool:
    ll = smollm2.llguidance()
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    return matcher.consume_tokens(ll.tokenize_str(text)) and matcher.consume_token(ll.eos_token)


CASES = [  # (request fields, a reply it allows, one it does not)
    ({"response_format": {"type": "json_object"}}, '{"a":[1,2]}', "[1,2]"),
    ({"response_format": JSON_SCHEMA}, GOOD_NPC, BAD_NPC),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}}, '{"b":true}', "true"),
    ({"structured_outputs": {"json": NPC}}, GOOD_NPC, '{"line":"","mood":"grumpy","gold_offered":4}'),
    ({"structured_outputs": {"json": json.dumps(NPC)}}, GOOD_NPC, '{"line":"x","mood":"sad","gold_offered":4}'),
    ({"structured_outputs": {"json_object": True}}, "{}", '"text"'),
    ({"structured_outputs": {"regex": "(north|south)-[0-9]{2}"}}, "north-12", "east-12"),
    ({"structured_outputs": {"choice": ["yes", "no", 'say "maybe"']}}, 'say "maybe"', "maybe"),
    ({"structured_outputs": {"grammar": 'start: "go " DIR\nDIR: "north" | "south"'}}, "go north", "go west"),
    ({"structured_outputs": {"grammar": 'root ::= "go " dir\ndir ::= "north" | "south"'}}, "go south", "go"),
    ({"tools": [WEATHER], "tool_choice": "required"}, '{"name":"get_weather","arguments":{"city":"Rome"}}',
     "Rome"),
    ({"tools": [WEATHER]}, "Rome", '{"name":"get_weather","arguments":{}}'),
]


@pytest.mark.parametrize("fields, good, bad", CASES)
def test_each_way_to_ask_compiles_to_a_grammar_that_means_it(smollm2, fields, good, bad):
    grammar = _grammar(smollm2, _chat(**fields))
    assert grammar.digest == hashlib.sha256(grammar.text.encode()).hexdigest()
    assert llguidance.LLMatcher.validate_grammar(grammar.text, smollm2.llguidance()) == ""
    assert _allows(smollm2, grammar.text, good)
    assert not _allows(smollm2, grammar.text, bad)


def test_json_is_compact_unless_the_schema_asks_otherwise(smollm2):
    compact = _grammar(smollm2, _chat(response_format={"type": "json_object"}))
    assert not _allows(smollm2, compact.text, '{"a": 1}')
    loose = _grammar(smollm2, _chat(structured_outputs={"json": {"type": "object",
                                                                 "x-guidance": {"whitespace_flexible": True}}}))
    assert _allows(smollm2, loose.text, '{"a": 1}')


def test_a_regexs_classes_mean_what_a_json_schemas_pattern_means(smollm2):
    """\\d and \\w are ASCII, as in a schema's `pattern` (ECMA-262): SmolLM2 once filled
    \\d{4}-\\d{2}-\\d{2} with mathematical digits. A Unicode class, written out, is still there."""
    date = _grammar(smollm2, _chat(structured_outputs={"regex": r"\d{4}-\d{2}-\d{2}"})).text
    assert _allows(smollm2, date, "2026-12-03")
    assert not _allows(smollm2, date, "\U0001FBF8" * 4 + "-" + "\U0001FBF8" * 2 + "-" + "\U0001FBF8" * 2)
    assert not _allows(smollm2, date, "\u0662\u0660\u0662\u0666-12-03")  # Arabic-Indic digits
    word = _grammar(smollm2, _chat(structured_outputs={"regex": r"\w+/\W\s\D"})).text
    assert _allows(smollm2, word, "ab_9/- x") and not _allows(smollm2, word, "caf\u00e9/- x")
    assert _allows(smollm2, word, "ab/-\u00a0x")  # \\s: any space, as ECMA-262 has it
    written_out = _grammar(smollm2, _chat(structured_outputs={"regex": r"\p{Nd}+"})).text
    assert _allows(smollm2, written_out, "\u0662\u0660") and _allows(smollm2, written_out, "20")


ORDER = {"type": "object", "properties": {  # a real-world shape: nothing says additionalProperties
    "item": {"type": "string"}, "count": {"type": "integer"},
    "ship_to": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "notes": {"type": "object"},  # declares no properties: any object, as written
    "extra": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
    "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                       {"type": "object", "properties": {"y": {"type": "integer"}}}]}},
    "required": ["item", "count"]}


def test_objects_are_closed_unless_the_schema_says_otherwise(smollm2):
    """Properties a schema does not declare are not written (xgrammar's and Outlines' reading), in
    schemas and in tools' parameters; what a schema says explicitly stands; OPEN_OBJECTS=1 restores
    JSON Schema's own reading."""
    def allowed(text: str, open_objects: bool = False, **fields) -> bool:
        req = _chat(**(fields or _schema(ORDER)))
        spec = __import__("api.tools", fromlist=["spec"]).spec(req.tools, req.tool_choice)
        return _allows(smollm2, grammars.for_request(req, smollm2, spec, open_objects).text, text)

    good = '{"item":"rope","count":2,"ship_to":{"city":"Rome"},"notes":{"any":[1]},"extra":{"a":1,"b":2},' \
           '"both":{"x":1,"y":2}}'
    assert allowed(good)
    for stray in ('{"item":"rope","count":2,"colour":"red"}',  # at the top
                  '{"item":"rope","count":2,"ship_to":{"city":"Rome","zip":"00100"}}'):  # nested
        assert not allowed(stray), stray
        assert allowed(stray, open_objects=True), stray
    # an allOf's parts stay open: closing them (or the whole) would refuse each other's properties
    assert allowed('{"item":"rope","count":2,"both":{"x":1,"z":3}}')
    # an integer without bounds stays within JavaScript's safe integers (SmolLM2 wrote digits until max_tokens)
    assert allowed('{"item":"rope","count":-9007199254740991}')
    assert not allowed('{"item":"rope","count":9007199254740992}')
    tool = {"tools": [WEATHER], "tool_choice": "required"}
    assert allowed('{"name":"get_weather","arguments":{"city":"Rome"}}', **tool)
    assert not allowed('{"name":"get_weather","arguments":{"city":"Rome","description":"x"}}', **tool)
    assert allowed('{"name":"get_weather","arguments":{"city":"Rome","description":"x"}}', True, **tool)
    assert allowed('{"x":{"y":1}}', response_format={"type": "json_object"})  # any object, as asked


def test_reading_a_schema_leaves_the_clients_schema_as_it_was():
    from api import schemas
    before = json.dumps(ORDER)
    after = schemas.read(ORDER)
    assert json.dumps(ORDER) == before and after["additionalProperties"] is False
    assert after["properties"]["count"] == {"type": "integer", "minimum": -(2 ** 53 - 1), "maximum": 2 ** 53 - 1}
    assert schemas.read({"type": "integer", "exclusiveMinimum": 0}) == {"type": "integer", "exclusiveMinimum": 0,
                                                                         "maximum": 2 ** 53 - 1}
    assert schemas.read(ORDER, open_objects=True)["properties"]["ship_to"] == \
        {**ORDER["properties"]["ship_to"]}  # open: objects as written
    assert after["properties"]["ship_to"]["additionalProperties"] is False
    assert "additionalProperties" not in after["properties"]["notes"]
    assert after["properties"]["extra"]["additionalProperties"] is True
    assert all("additionalProperties" not in part for part in after["properties"]["both"]["allOf"])
    defs = schemas.read({"$defs": {"P": {"properties": {"a": {}}}}, "items": [{"properties": {"b": {}}}],
                           "anyOf": [{"properties": {"c": {}}}]})
    assert defs["$defs"]["P"]["additionalProperties"] is False and defs["items"][0]["additionalProperties"] is False
    assert defs["anyOf"][0]["additionalProperties"] is False


LOOSE = {"type": "object", "properties": {  # keywords llguidance cannot enforce
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "home": {"type": "string", "format": "uri-reference"},
    "id": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "name": {"type": "string", "not": {"const": ""}}}, "required": ["tags", "id"]}


def test_where_strict_was_not_asked_what_cannot_be_enforced_is_relaxed_and_named(smollm2):
    """strict: true keeps the refusal naming the keyword; without it the schema is compiled
    leniently and the grammar names what it left out (the answer's `unenforced`)."""
    with pytest.raises(ApiError) as refused:
        _grammar(smollm2, _chat(**_strict(LOOSE)))
    assert refused.value.param == "response_format.json_schema.schema"
    words = ("format: uri-reference", "not", "oneOf (as anyOf)", "uniqueItems")
    for fields in (_schema(LOOSE), {"structured_outputs": {"json": LOOSE}}):
        grammar = _grammar(smollm2, _chat(**fields))
        assert grammar.relaxed == words
        assert _allows(smollm2, grammar.text, '{"tags":["a","a"],"home":"x y","id":3}')  # in the schema's order
        assert not _allows(smollm2, grammar.text, '{"tags":["a"]}')  # what it can enforce, it does
    assert _grammar(smollm2, _chat(**_schema(NPC))).relaxed == ()
    loose_tool = {"type": "function", "function": {"name": "tag", "parameters": LOOSE}}
    assert _grammar(smollm2, _chat(tools=[loose_tool], tool_choice="required")).relaxed == words
    strict_tool = {"type": "function", "function": {"name": "tag", "parameters": LOOSE, "strict": True}}
    with pytest.raises(ApiError) as refused:
        _grammar(smollm2, _chat(tools=[WEATHER, strict_tool], tool_choice="required"))
    assert refused.value.param == "tools[1].function.parameters"


def test_completions_take_a_constraint_too(smollm2):
    req = parse_completion({"model": MODEL, "prompt": "The answer:", "response_format": JSON_SCHEMA})
    assert _grammar(smollm2, req) == _grammar(smollm2, _chat(response_format=JSON_SCHEMA))
    assert _grammar(smollm2, parse_completion({"model": MODEL, "prompt": "x"})) is None
    assert _grammar(smollm2, _chat(response_format={"type": "text"})) is None


def _schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _strict(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}}


BIG = {"type": "object", "properties": {f"field_{i}": {"enum": [f"value_{i}_{j}" for j in range(20)]}
                                        for i in range(300)}}


@pytest.mark.parametrize("fields, param", [
    (_schema({"type": "wat"}), "response_format.json_schema.schema"),
    (_schema({"type": "integer", "minimum": 5, "maximum": 1}), "response_format.json_schema.schema"),
    (_strict({"type": "string", "format": "no-such-format"}), "response_format.json_schema.schema"),
    (_strict({"type": "array", "uniqueItems": True}), "response_format.json_schema.schema"),
    (_schema([1]), "response_format.json_schema.schema"),
    (_schema(BIG), "response_format.json_schema.schema"),  # over MAX_GRAMMAR_BYTES
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": NPC}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schemas": NPC}}},
     "response_format.json_schema.schemas"),
    ({"response_format": {"type": "json_object", "schema": NPC}}, "response_format.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": 'root ::= "yes'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "wat"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "tools"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 2}}, "required": ["n"]}}}]},
     "tools[1].function.parameters"),
])
def test_a_constraint_that_cannot_be_compiled_is_a_400_naming_its_field(smollm2, fields, param):
    with pytest.raises(ApiError) as caught:
        _grammar(smollm2, _chat(**fields))
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert caught.value.code in ("invalid_value", "invalid_type", "missing_required_parameter",
                                 "unknown_parameter", "unsupported_parameter")


def test_a_tools_constraint_gives_way_to_tool_choice_none(smollm2):
    assert _grammar(smollm2, _chat(tools=[WEATHER], tool_choice="none")) is None
    req = _chat(tools=[WEATHER], tool_choice="none", response_format=JSON_SCHEMA)
    assert _grammar(smollm2, req) == _grammar(smollm2, _chat(response_format=JSON_SCHEMA))


# Stored once, under its hash --------------------------------------------------------------------


def test_a_grammar_is_stored_once_under_its_hash_with_a_ttl(smollm2, any_redis):
    grammar = _grammar(smollm2, _chat(response_format=JSON_SCHEMA))
    again = _grammar(smollm2, _chat(structured_outputs={"json": json.dumps(NPC)}))
    assert again == grammar  # the same schema, however it came: the same text and hash
    key = keys.grammar(MODEL, grammar.digest)
    assert key.startswith(f"storyteller:{keys.tag(MODEL)}:")  # the model's slot in a cluster
    grammars.store(any_redis, MODEL, grammar)
    assert any_redis.get(key).decode() == grammar.text
    assert keys.GRAMMAR_TTL_S - 5 <= any_redis.ttl(key) <= keys.GRAMMAR_TTL_S
    any_redis.expire(key, 30)
    grammars.store(any_redis, MODEL, again)  # each use refreshes it
    assert any_redis.ttl(key) > keys.GRAMMAR_TTL_S - 5
    other = _grammar(smollm2, _chat(response_format={"type": "json_object"}))
    grammars.store(any_redis, MODEL, other)
    assert sorted(any_redis.keys(keys.grammar(MODEL, "*"))) == sorted(
        k.encode() for k in (key, keys.grammar(MODEL, other.digest)))


# Through the app, with a stand-in worker ----------------------------------------------------------

@pytest.fixture
def served(any_redis, smollm2_tokenizer):
    register_worker(any_redis, MODEL, tokenizer=smollm2_tokenizer, context_window=2048, engine="continuous",
                    features=FEATURES)
    return create_app(Settings(request_timeout=10), client=any_redis).test_client()


def _post(app_client, body: dict):
    """POST a chat body as a client sends it: Flask's own json= would sort its keys, and a schema's
    properties are written in their order (so the order is part of the grammar and its hash)."""
    return app_client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json")


def test_the_job_carries_only_the_grammars_hash_and_the_grammar_waits_in_redis(served, any_redis, smollm2):
    seen = []
    reply_within_grammar(any_redis, [GOOD_NPC], seen, smollm2.llguidance(), MODEL)
    response = _post(served, {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": JSON_SCHEMA})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert json.loads(response.get_json()["choices"][0]["message"]["content"])["gold_offered"] == 40
    (job, raw, stored, allowed), = seen
    expected = _grammar(smollm2, _chat(response_format=JSON_SCHEMA))
    assert job.params.grammar == expected.digest and stored.decode() == expected.text
    assert expected.text.encode() not in raw and len(raw) < 1000  # the text is not in the job
    assert allowed  # the stand-in matched its reply against the stored grammar


def test_a_reply_the_grammar_rejects_is_not_written(served, any_redis, smollm2):
    """The stand-in worker is held to the job's grammar: a reply outside the schema (400 gold, over
    its maximum of 100) is refused, and the request fails instead of returning it."""
    seen = []
    reply_within_grammar(any_redis, [BAD_NPC], seen, smollm2.llguidance(), MODEL)
    response = _post(served, {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": JSON_SCHEMA})
    assert response.status_code >= 500, response.get_data(as_text=True)
    assert "breaks the job's grammar" in response.get_json()["error"]["message"]
    (_, _, stored, allowed), = seen
    assert stored and allowed is False


def test_a_bad_schema_queues_nothing(served, any_redis):
    response = _post(served, {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "response_format": _schema({"type": "wat"})[
            "response_format"]})
    assert response.status_code == 400
    assert response.get_json()["error"]["param"] == "response_format.json_schema.schema"
    assert not any(any_redis.llen(name) for name in keys.queues(MODEL))
    assert not any_redis.keys(keys.grammar(MODEL, "*"))


CALL = '{"name":"get_weather","arguments":{"city":"Rome"}}'


def test_a_call_comes_back_as_tool_calls(served, any_redis, smollm2):
    seen = []
    reply_within_grammar(any_redis, [CALL], seen, smollm2.llguidance(), MODEL)
    response = _post(served, {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    choice = response.get_json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    (job, _, stored, allowed), = seen
    assert job.params.grammar and stored and allowed  # the named function's grammar allows the call


def _events(response) -> list[dict]:
    lines = [line for line in response.get_data(as_text=True).split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_streamed_call_comes_as_tool_call_deltas(served, any_redis, smollm2):
    pieces = ['{"name":"get', '_weather","argu', 'ments":{"ci', 'ty":"Ro', 'me"}', "}"]
    seen = []
    reply_within_grammar(any_redis, pieces, seen, smollm2.llguidance(), MODEL)
    response = _post(served, {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER],
        "tool_choice": "required", "stream": True})
    events = _events(response)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"city":"Rome"}'
    assert not any(d.get("content") for d in deltas)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["tool_calls"]
    assert seen[0][3]  # "required"'s grammar allows the call


def test_streamed_text_with_tools_is_content(served, any_redis, smollm2):
    seen = []
    reply_within_grammar(any_redis, ["It is ", "sunny."], seen, smollm2.llguidance(), MODEL)
    response = _post(served, {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "stream": True})
    events = _events(response)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "It is sunny."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert seen[0][3]  # "auto"'s grammar allows text


# Off gevent's loop --------------------------------------------------------------------------------

GEVENT_CHECK = r"""
from gevent import monkey; monkey.patch_all()
import json, sys, time, gevent
from api import grammars
from api.tokenizers import Tokenizer
from shared.settings import Settings
from worker.model_loader import PACKAGED_FILE, _tokenizer, packaged_model_dir
tokenizer = Tokenizer(_tokenizer(packaged_model_dir(), {"gguf_file": PACKAGED_FILE}, Settings().cache_dir))
tokenizer.llguidance()
ticks, state = [], {"stop": False}
def ticker():
    while not state["stop"]:
        gevent.sleep(0.001)
        ticks.append(time.perf_counter())
if sys.argv[1] == "inline":
    grammars.OFF_LOOP_BYTES = 10**9
result = {"during": [], "after": []}
for salt in range(3):
    schema = {"type": "object", "properties": {f"f{salt}_{i}": (
        {"type": "string", "maxLength": 40} if i % 3 == 0 else {"type": "integer", "minimum": -i, "maximum": 1000 + i}
        if i % 3 == 1 else {"enum": [f"v{i}_{j}" for j in range(20)]}) for i in range(480)}}
    text = grammars._json_grammar(schema, "x")
    runner = gevent.spawn(ticker); gevent.sleep(0.02); ticks.clear()
    started = time.perf_counter(); grammars.check(text, "x", tokenizer); finished = time.perf_counter()
    gevent.sleep(0.02)  # the ticker's turns after the check: it was running all along
    state["stop"] = True; runner.join(); state["stop"] = False
    result["during"].append(sum(started < t < finished for t in ticks))
    result["after"].append(sum(t > finished for t in ticks))
print(json.dumps(result))
"""


def _gevent_run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", GEVENT_CHECK, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_large_grammars_check_leaves_gevents_loop_running():
    """Under gunicorn's gevent worker, a ~53 KB grammar's check (tens of ms) runs on gevent's thread
    pool: another greenlet, ticking every millisecond, gets turns between the check's start and its
    end. Inline, as the control shows, it gets none: the loop waits for the check. Told by the order
    of events (ticks counted between the check's start and end), not by a ratio of times, which a
    loaded machine skews: a check of tens of ms on the pool leaves room for at least one 1 ms tick
    however slow the machine, and an inline one leaves room for none however fast."""
    inline, pooled = _gevent_run("inline"), _gevent_run("pool")
    assert inline["during"] == [0, 0, 0] and all(inline["after"]), inline  # it ticked again once the loop was free
    assert all(pooled["during"]), pooled
