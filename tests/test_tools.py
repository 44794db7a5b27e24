"""Tools on chat (api/tools.py): how SmolLM2's template, which knows no tools, is shown them; the
history with tool calls and tool results through the template; the grammar's replies read back as
calls, whole and streamed (split at every point); a template that reads `tools` gets them itself."""
from __future__ import annotations

import copy
import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest

from api import grammars, tools
from api.errors import ApiError
from api.tokenizers import Tokenizer
from api.validation import parse_chat
from tests.tiny_models import tiny_tokenizer
from tests.tool_templates import GOLD, WEATHER

SHRUG = {"type": "function", "function": {"name": "shrug"}}  # no parameters: arguments {}
TOOLS = [WEATHER, GOLD, SHRUG]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "You are the innkeeper."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Rome","unit":"celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain, 14"},
    {"role": "assistant", "content": "Sun in Paris, rain in Rome."},
    {"role": "user", "content": "Give me 5 gold."},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer):
    return Tokenizer(smollm2_tokenizer)


def _request(messages=ASK, **fields):
    return parse_chat({"model": "m", "messages": messages, **fields})


def _spec(tool_choice="auto", tool_list=TOOLS):
    req = _request(tools=tool_list, tool_choice=tool_choice)
    return tools.spec(req.tools, req.tool_choice)


def _prompt(tokenizer: Tokenizer, req) -> str:
    ids = tokenizer.encode_chat(req.messages, tools.spec(req.tools, req.tool_choice))
    return tokenizer._tok.decode(ids)


# The prompt ---------------------------------------------------------------------------------------

def test_smollm2s_template_knows_no_tools_so_the_api_shows_them_in_a_system_message(smollm2):
    assert not smollm2.takes_tools
    prompt = _prompt(smollm2, _request(tools=TOOLS))
    system = prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    listing = json.loads(system.splitlines()[1])
    assert [f["name"] for f in listing] == ["get_weather", "give_gold", "shrug"]
    assert listing[0]["parameters"] == WEATHER["function"]["parameters"]
    assert listing[2]["parameters"] == {"type": "object", "properties": {}, "additionalProperties": False}
    assert '{"name":<the function\'s name>,"arguments":' in system and "Otherwise answer in words" in system
    # Ours takes the place of the template's default system prompt; the user's turn follows.
    assert "SmolLM" not in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_the_rule_says_what_the_choice_allows(smollm2):
    required = _prompt(smollm2, _request(tools=TOOLS, tool_choice="required"))
    named = _prompt(smollm2, _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "give_gold"}}))
    none = _prompt(smollm2, _request(tools=TOOLS, tool_choice="none"))
    assert "You must call one of them" in required
    assert "You must call give_gold" in named
    assert "get_weather" not in none and "You are a helpful AI assistant named SmolLM" in none


def test_a_conversation_with_tool_calls_and_results_round_trips_through_the_template(smollm2):
    req = _request(messages=HISTORY, tools=TOOLS)
    assert req.messages[2]["content"] is None and req.messages[3]["tool_call_id"] == "call_1"
    turns = _prompt(smollm2, req).split("<|im_start|>")[1:]
    system, user, calls, results, answer, ask, reply = turns
    # The tools go after the conversation's own system message, in the same turn.
    assert system.startswith("system\nYou are the innkeeper.\n\nYou can call these functions")
    # Each call as the model is asked to write one, a line each, arguments as compact JSON.
    assert calls == ('assistant\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n'
                     '{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}<|im_end|>\n')
    # Both results in one user turn, each naming its call and the function.
    assert results == ("user\nThe call call_1 to get_weather returned:\nsunny, 21\n\n"
                       "The call call_2 to get_weather returned:\nrain, 14<|im_end|>\n")
    assert answer == "assistant\nSun in Paris, rain in Rome.<|im_end|>\n"
    assert ask == "user\nGive me 5 gold.<|im_end|>\n" and reply == "assistant\n"


def test_the_history_renders_without_tools_in_the_request_too(smollm2):
    prompt = _prompt(smollm2, _request(messages=HISTORY))
    assert '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}' in prompt
    assert "You can call these functions" not in prompt


def test_an_assistant_message_with_text_and_a_call_keeps_both(smollm2):
    messages = [*ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "shrug", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "name": "shrug", "content": "ok"}]
    prompt = _prompt(smollm2, _request(messages=messages))
    assert 'assistant\nLet me look.\n{"name":"shrug","arguments":{}}<|im_end|>' in prompt
    assert "user\nThe call c to shrug returned:\nok<|im_end|>" in prompt


def test_a_template_that_reads_tools_renders_them_its_own_way():
    hf = tiny_tokenizer()
    hf.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tokenizer = Tokenizer(hf)
    assert tokenizer.takes_tools
    prompt = _prompt(tokenizer, _request(messages=HISTORY[1:4], tools=TOOLS))
    # The tools as the template lists them, the calls' arguments as objects, no system text of ours.
    assert prompt == ("<tools>get_weather;give_gold;shrug;</tools>[user]Weather in Paris and Rome?"
                      "[assistant]get_weather(Paris)get_weather(Rome)[tool]sunny, 21[assistant]")


@pytest.mark.parametrize("tool, param", [
    ({"type": "function", "function": {"name": "look around"}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "x" * 65}}, "tools[0].function.name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
     "tools[0].function.parameters.type"),
])
def test_a_tool_the_call_format_cannot_carry_is_a_400(tool, param):
    with pytest.raises(ApiError) as caught:
        _spec(tool_list=[tool])
    assert caught.value.status == 400 and caught.value.param == param


def test_tool_choice_none_asks_for_nothing():
    assert _spec("none") is None and tools.spec(None, None) is None


# Reading the reply ------------------------------------------------------------------------------

CALL = '{"name":"get_weather","arguments":{"city":"Pa}r\\"is{","unit":"celsius"}}'
CALL_ARGUMENTS = '{"city":"Pa}r\\"is{","unit":"celsius"}'


def test_a_whole_call_is_read_as_tool_calls():
    for choice in ("auto", "required"):
        content, calls, finish_reason = tools.read_reply(CALL, "stop", _spec(choice))
        assert content is None and finish_reason == "tool_calls"
        (call,) = calls
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": CALL_ARGUMENTS}
        assert json.loads(call["function"]["arguments"]) == {"city": 'Pa}r"is{', "unit": "celsius"}


def test_text_is_content_and_a_call_cut_short_is_a_call_with_what_was_written():
    """As OpenAI answers a call max_tokens cut: tool_calls with the arguments so far, "length"
    (the whole reply says what its stream said)."""
    assert tools.read_reply("It is sunny.", "stop", _spec()) == ("It is sunny.", None, "stop")
    content, calls, reason = tools.read_reply(CALL[:40], "length", _spec("required"))
    assert content is None and reason == "length"
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": CALL[CALL.index('{"city'):40]}]
    # A whole call that ran into max_tokens at its very end is still what OpenAI calls "length".
    content, calls, reason = tools.read_reply(CALL, "length", _spec("required"))
    assert reason == "length" and calls[0]["function"]["arguments"] == CALL_ARGUMENTS
    # Cut inside the head, before the name: no call was written, so the text is content.
    assert tools.read_reply(CALL[:10], "length", _spec("required")) == (CALL[:10], None, "length")


def test_a_named_function_reads_only_its_own_calls():
    named = _spec({"type": "function", "function": {"name": "give_gold"}})
    assert tools.read_reply('{"name":"give_gold","arguments":{"amount":5}}', "stop", named)[2] == "tool_calls"
    assert tools.read_reply(CALL, "stop", named) == (CALL, None, "stop")


def _stream(spec, pieces, finish_reason="stop"):
    reader = tools.CallReader(spec)
    deltas = [d for piece in pieces for d in reader.feed(piece)]
    last, reason = reader.finish(finish_reason)
    return deltas + last, reason


def _splits(text: str):
    """`text` cut at every point, at every pair of points, and a character at a time."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(0)
    for _ in range(200):
        i, j = sorted(rng.sample(range(len(text) + 1), 2))
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("reply", [CALL, "  \n" + CALL, '{ "name" : "get_weather" ,\n "arguments" : ' + CALL_ARGUMENTS + " }"])
def test_a_streamed_call_is_the_same_call_however_its_text_is_split(choice, reply):
    for pieces in _splits(reply):
        deltas, reason = _stream(_spec(choice), pieces)
        assert reason == "tool_calls"
        assert all(set(d) == {"tool_calls"} for d in deltas), deltas
        first, *rest = [d["tool_calls"][0] for d in deltas]
        assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": "get_weather", "arguments": ""}
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
        assert "".join(d["function"]["arguments"] for d in rest) == CALL_ARGUMENTS


@pytest.mark.parametrize("reply", ["It is sunny in Paris {today}.", "  \n sunny", "x"])
def test_streamed_text_is_the_same_text_however_it_is_split(reply):
    for pieces in _splits(reply):
        deltas, reason = _stream(_spec("auto"), pieces)
        assert reason == "stop" and all(set(d) == {"content"} for d in deltas)
        assert "".join(d["content"] for d in deltas) == reply


def test_a_streamed_call_cut_short_keeps_its_finish_reason():
    deltas, reason = _stream(_spec("required"), [CALL[:40]], "length")
    assert reason == "length"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == CALL[CALL.index('{"city'):40]
    # Cut inside the head: nothing was sent as a call yet, so the text comes out as content.
    deltas, reason = _stream(_spec("required"), [CALL[:10]], "length")
    assert reason == "length" and deltas == [{"content": CALL[:10]}]


def test_a_reply_that_is_no_call_goes_out_as_content():
    """Not expected under the grammar (a worker that ignored it): nothing is lost."""
    deltas, reason = _stream(_spec("required"), ['{"name":"fly', '","arguments":{}}'])
    assert reason == "stop" and "".join(d["content"] for d in deltas) == '{"name":"fly","arguments":{}}'


# The grammar and the reader agree -----------------------------------------------------------------

def _sample(ll_tokenizer, grammar: str, rng: random.Random, max_tokens: int = 200) -> str:
    """A random reply the grammar allows: each token drawn uniformly among those its mask allows."""
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    tokens = []
    while not matcher.is_stopped() and len(tokens) < max_tokens:
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[:ll_tokenizer.vocab_size])
        token = int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    assert matcher.is_stopped(), "the grammar did not end"
    return ll_tokenizer.decode_str([t for t in tokens if t != ll_tokenizer.eos_token])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_every_reply_the_call_grammar_allows_is_read_as_a_valid_call(smollm2, choice):
    spec = _spec(choice)
    grammar = grammars.for_request(_request(tools=TOOLS, tool_choice=choice), smollm2, spec)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "maxProperties": 0}
               for t in TOOLS}
    rng = random.Random(1)
    names = set()
    for _ in range(12):
        text = _sample(smollm2.llguidance(), grammar.text, rng)
        content, calls, reason = tools.read_reply(text, "stop", spec)
        assert reason == "tool_calls" and content is None, text
        function = calls[0]["function"]
        jsonschema.validate(json.loads(function["arguments"]), schemas[function["name"]])
        streamed, _ = _stream(spec, list(text))
        assert "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in streamed) == function["arguments"]
        names.add(function["name"])
    assert names <= {f["name"] for f in spec.allowed} and (len(names) > 1 or isinstance(choice, dict))


def test_auto_allows_text_or_a_call_and_nothing_else(smollm2):
    spec = _spec("auto")
    grammar = grammars.for_request(_request(tools=TOOLS), smollm2, spec)
    ll = smollm2.llguidance()

    def allowed(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar.text)
        return matcher.consume_tokens(ll.tokenize_str(text)) and matcher.consume_token(ll.eos_token)

    for text in ("It is sunny.", " \n Sunny {or not}", CALL, "\n" + CALL, '{"name":"shrug","arguments":{}}'):
        assert allowed(text), text
        assert (tools.read_reply(text, "stop", spec)[2] == "tool_calls") == ("get_weather" in text or "shrug" in text)
    for text in ('{"name":"fly","arguments":{}}', '{"city":"Paris"}', CALL[:-1], "", "  ",
                 '{"name":"give_gold","arguments":{"amount":500}}'):
        assert not allowed(text), text


def test_a_spec_leaves_the_request_unchanged():
    tool_list = copy.deepcopy(TOOLS)
    _spec("required", tool_list)
    assert tool_list == TOOLS
