"""The model's own tool format (api/tool_formats.py): detected from its chat template; the tools and
the history rendered by the template; the grammar asks for the template's call syntax (Qwen's
`<tool_call>` tags, Llama 3's `{"name", "parameters"}` JSON) and refuses the fallback's; the readers
turn such replies, whole and streamed in any pieces, into OpenAI's tool_calls; and through the app
with the official openai client.

The templates (tests/tool_templates.py) are written here after the vendors' documented formats;
the tokenizer is the tiny one of tests/tiny_models.py carrying them, so nothing is downloaded.
"""
from __future__ import annotations

import json
import random

import httpx2
import jsonschema
import llguidance
import numpy as np
import openai
import pytest

from api import grammars, tool_formats, tools
from api.app import create_app
from api.tokenizers import Tokenizer
from api.validation import parse_chat
from shared import keys
from shared.protocol import FEATURES
from shared.settings import Settings
from tests.fake_workers import register_worker, reply_in_pieces
from tests.tiny_models import tiny_tokenizer
from tests.tool_templates import (ASK, FALLBACK_PARIS, HISTORY, LLAMA3_TEMPLATE, LLAMA_PARIS, PARIS, QWEN_GOLD,
                                    QWEN_PARIS, QWEN_TEMPLATE, TOOLS, WEATHER)

def _tokenizer(template) -> Tokenizer:
    hf = tiny_tokenizer()
    hf.chat_template = template
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def qwen():
    return _tokenizer(QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def qwen_tags():
    """Qwen's template on a tokenizer that, as Qwen3's vocabulary does, holds each tag (the calls'
    and the thought's) as one added (not special) token."""
    hf = tiny_tokenizer()
    hf.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    hf.chat_template = QWEN_TEMPLATE
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def llama3():
    return _tokenizer(LLAMA3_TEMPLATE)


def _request(messages=ASK, **fields):
    return parse_chat({"model": "m", "messages": messages, **fields})


def _spec(tokenizer: Tokenizer, tool_choice="auto", **fields):
    req = _request(tools=TOOLS, tool_choice=tool_choice, **fields)
    return tools.spec(req.tools, req.tool_choice, tokenizer.tool_format, req.parallel_tool_calls)


def _prompt(tokenizer: Tokenizer, req) -> str:
    spec = tools.spec(req.tools, req.tool_choice, tokenizer.tool_format)
    return tokenizer._tok.decode(tokenizer.encode_chat(req.messages, spec))


# Detection --------------------------------------------------------------------------------------

def test_the_format_is_told_by_the_templates_text(qwen, llama3):
    assert qwen.tool_format is tool_formats.HERMES and llama3.tool_format is tool_formats.LLAMA3
    # SmolLM2's kind of template knows no tools: the fallback, which the API shows the model itself.
    assert _tokenizer(None).tool_format is tool_formats.JSON
    assert tiny_tokenizer().chat_template and _tokenizer(tiny_tokenizer().chat_template).tool_format is tool_formats.JSON
    # A template that reads tools in a syntax of its own that is neither: the fallback (today's).
    assert tool_formats.detect("{% for t in tools %}[TOOL]{{ t | tojson }}{% endfor %}", True) is tool_formats.JSON
    # Qwen3-Coder's calls are XML inside the same tags: not JSON, so not this format.
    coder = "{{ tools }}<tool_call>\n<function=name>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    assert tool_formats.detect(coder, True) is tool_formats.JSON
    # Llama 3.2's pythonic variant has the headers but no "parameters" key: not this format either.
    assert tool_formats.detect("<|start_header_id|>{{ tools }}[func_name1(params_name1=params_value1)]", True) \
        is tool_formats.JSON
    # The markers count only in a template that reads `tools`.
    assert tool_formats.detect("<tool_call>{{ messages }}", False) is tool_formats.JSON
    # Of several templates by name, the one transformers renders tools with.
    assert tool_formats.detect({"default": "plain", "tool_use": QWEN_TEMPLATE}, True) is tool_formats.HERMES


def test_the_command_line_names_a_models_format(tmp_path, capsys):
    hf = tiny_tokenizer()
    hf.chat_template = LLAMA3_TEMPLATE
    hf.save_pretrained(tmp_path)
    assert tool_formats.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "llama3"


# The prompt -------------------------------------------------------------------------------------

def test_qwens_template_lists_the_tools_in_its_tags_and_renders_the_history_in_its_syntax(qwen):
    prompt = _prompt(qwen, _request(messages=HISTORY, tools=TOOLS))
    system = prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    assert system.startswith("You are the innkeeper.\n\n# Tools")
    listing = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listing] == ["get_weather", "give_gold"]
    assert json.loads(listing[0])["function"]["parameters"] == WEATHER["function"]["parameters"]
    assert "You can call these functions" not in prompt  # the API's own text is for the fallback
    # The history's call as Qwen writes one (arguments re-spaced by the template's tojson), the
    # result as its tool_response in a user turn.
    assert f"<|im_start|>assistant\n{QWEN_PARIS}<|im_end|>\n" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21\n</tool_response><|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>user\nGive me 5 gold.<|im_end|>\n<|im_start|>assistant\n")


def test_llama3s_template_puts_the_tools_in_the_first_user_message_and_results_under_ipython(llama3):
    prompt = _prompt(llama3, _request(messages=HISTORY, tools=TOOLS))
    user = prompt.split("<|start_header_id|>user<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>", 1)[0]
    assert '"parameters": dictionary of argument name' in user and user.endswith("Weather in Paris?")
    assert json.dumps({"type": "function", "function": tools.spec(TOOLS, "auto").functions[0]}, indent=4) in user
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{LLAMA_PARIS}<|eot_id|>" in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21<|eot_id|>" in prompt


def test_tool_choice_none_renders_the_history_in_the_templates_syntax_without_the_tools(qwen):
    prompt = _prompt(qwen, _request(messages=HISTORY, tools=TOOLS, tool_choice="none"))
    assert "<tools>" not in prompt and QWEN_PARIS in prompt and "<tool_response>" in prompt


# The grammar ------------------------------------------------------------------------------------

def _grammar(tokenizer: Tokenizer, tool_choice="auto", **fields) -> str:
    req = _request(tools=TOOLS, tool_choice=tool_choice, **fields)
    return grammars.for_request(req, tokenizer, _spec(tokenizer, tool_choice, **fields)).text


def _allows(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    ll = tokenizer.llguidance()
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    return matcher.consume_tokens(ll.tokenize_str(text)) and matcher.consume_token(ll.eos_token)


NAMED_GOLD = {"type": "function", "function": {"name": "give_gold"}}


@pytest.mark.parametrize("choice, allowed, refused", [
    ("required", [QWEN_PARIS, QWEN_PARIS + "\n" + QWEN_GOLD],
     [FALLBACK_PARIS, "<tool_call>\n" + FALLBACK_PARIS + "\n</tool_call>", "Sunny.", "Hm.\n" + QWEN_PARIS,
      QWEN_PARIS.replace("Paris", "P" * 13)]),
    (NAMED_GOLD, [QWEN_GOLD, QWEN_GOLD + "\n" + QWEN_GOLD], [QWEN_PARIS, LLAMA_PARIS]),
    ("auto", ["Sunny today.", QWEN_PARIS, "Let me look.\n" + QWEN_PARIS + "\n" + QWEN_GOLD, "<think>\n</think>\n\nHi"],
     ["", " \n", "Sunny <tool_call> maybe", "Let me look.\n" + QWEN_PARIS.replace('"celsius"', '"kelvin"'),
      QWEN_PARIS[:-1]]),
])
def test_qwens_grammar_asks_for_calls_in_its_tags(qwen, choice, allowed, refused):
    grammar = _grammar(qwen, choice)
    for text in allowed:
        assert _allows(qwen, grammar, text), text
    for text in refused:
        assert not _allows(qwen, grammar, text), text


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_tag_that_is_one_token_is_asked_for_as_that_token(qwen_tags, choice):
    """What the model writes is the tag's own token, as in its training (llguidance counts an added
    token as special: a string in the grammar would not match it)."""
    grammar = _grammar(qwen_tags, choice)
    ll = qwen_tags.llguidance()
    if choice == "auto":
        assert _allows(qwen_tags, grammar, "Sunny.") and not _allows(qwen_tags, grammar, "")
        for text in ("<think>\nHm.\n</think>\n\nSunny.", QWEN_PARIS, "Let me look.\n" + QWEN_PARIS):
            ids = qwen_tags._tok(text, add_special_tokens=False).input_ids
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
            assert matcher.consume_tokens(ids) and matcher.consume_token(ll.eos_token), (text, matcher.get_error())
    # With auto, Qwen3's thought first (its tags tokens too), then the calls.
    reply = ("<think>\nParis first.\n</think>\n\n" if choice == "auto" else "") + QWEN_PARIS + "\n" + QWEN_GOLD
    ids = qwen_tags._tok(reply, add_special_tokens=False).input_ids
    tags = qwen_tags._tok.convert_tokens_to_ids(["<tool_call>", "<think>"])
    assert ids.count(tags[0]) == 2 and ids.count(tags[1]) == (choice == "auto")
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert matcher.consume_tokens(ids) and matcher.consume_token(ll.eos_token), matcher.get_error()
    # What the worker then sends back (its text, the tags decoded) reads as the two calls.
    text = qwen_tags._tok.decode(ids, skip_special_tokens=True)
    content, calls, _ = tools.read_reply(text, "stop", _spec(qwen_tags, choice))
    assert text == reply and len(calls) == 2 and content == ("<think>\nParis first.\n</think>" if choice == "auto" else None)


def test_parallel_tool_calls_false_allows_one_call(qwen):
    grammar = _grammar(qwen, "required", parallel_tool_calls=False)
    assert _allows(qwen, grammar, QWEN_PARIS) and not _allows(qwen, grammar, QWEN_PARIS + "\n" + QWEN_GOLD)


@pytest.mark.parametrize("choice, allowed, refused", [
    ("required", [LLAMA_PARIS], [FALLBACK_PARIS, LLAMA_PARIS.replace(", ", ",").replace(": ", ":"),
                                 '{"name": "get_weather", "arguments": ' + PARIS + "}", QWEN_PARIS, "Sunny."]),
    ("auto", ["Sunny.", LLAMA_PARIS, " \n" + LLAMA_PARIS], [FALLBACK_PARIS, "{Sunny}", LLAMA_PARIS + LLAMA_PARIS]),
])
def test_llama3s_grammar_asks_for_its_json_with_parameters(llama3, choice, allowed, refused):
    grammar = _grammar(llama3, choice)
    for text in allowed:
        assert _allows(llama3, grammar, text), text
    for text in refused:
        assert not _allows(llama3, grammar, text), text


# Reading the reply ------------------------------------------------------------------------------

def _stream(spec, pieces, finish_reason="stop"):
    reader = tools.CallReader(spec)
    deltas = [d for piece in pieces for d in reader.feed(piece)]
    last, reason = reader.finish(finish_reason)
    return deltas + last, reason


def _splits(text: str, count: int = 150):
    """`text` whole, cut at every point, at random pairs of points, and a character at a time."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(0)
    for _ in range(count):
        i, j = sorted(rng.sample(range(len(text) + 1), 2))
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def _streamed_calls(deltas) -> tuple[str, list[dict]]:
    """(the content, the calls) that OpenAI's client would put together from the deltas."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if "id" in part:
                assert part["index"] == len(calls) and part["type"] == "function"
                calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, calls


QWEN_REPLIES = [  # (a reply, its content, its calls' names and arguments)
    (QWEN_PARIS, None, [("get_weather", PARIS)]),
    ("Let me look.\n" + QWEN_PARIS + "\n" + QWEN_GOLD, "Let me look.",
     [("get_weather", PARIS), ("give_gold", '{"amount": 5}')]),
    ("<think>\nParis < Rome? <tool\n</think>\n\n" + QWEN_GOLD, "<think>\nParis < Rome? <tool\n</think>",
     [("give_gold", '{"amount": 5}')]),
]


@pytest.mark.parametrize("reply, content, calls", QWEN_REPLIES)
def test_a_qwen_reply_is_read_as_its_calls_whole_and_streamed(qwen, reply, content, calls):
    spec = _spec(qwen)
    whole_content, whole_calls, reason = tools.read_reply(reply, "stop", spec)
    assert (whole_content, reason) == (content, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in whole_calls)
    assert len({c["id"] for c in whole_calls}) == len(calls)
    for pieces in _splits(reply):
        deltas, reason = _stream(spec, pieces)
        streamed_content, streamed_calls = _streamed_calls(deltas)
        assert reason == "tool_calls" and streamed_content == (content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == calls, pieces


@pytest.mark.parametrize("reply", ["Sunny, <b>21</b> <tool_ca", "a < b", "<tool_call>\n<tool_call>"])
def test_qwen_text_without_a_whole_tag_stays_the_same_text(qwen, reply):
    spec = _spec(qwen)
    assert tools.read_reply(reply, "stop", spec) == (reply, None, "stop")
    for pieces in _splits(reply, 30):
        deltas, reason = _stream(spec, pieces)
        assert reason == "stop" and _streamed_calls(deltas) == (reply, []), pieces


def test_a_qwen_call_cut_short_keeps_its_finish_reason(qwen):
    spec = _spec(qwen, "required")
    cut = QWEN_PARIS + "\n" + QWEN_GOLD[:52]  # into the second call's arguments
    content, calls, reason = tools.read_reply(cut, "length", spec)
    assert content is None and reason == "length"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "give_gold"]
    deltas, reason = _stream(spec, list(cut), "length")
    assert reason == "length" and [c["name"] for c in _streamed_calls(deltas)[1]] == ["get_weather", "give_gold"]


def test_a_llama3_reply_is_read_as_its_call_whole_and_streamed(llama3):
    for choice in ("auto", "required"):
        spec = _spec(llama3, choice)
        content, (call,), reason = tools.read_reply(LLAMA_PARIS, "stop", spec)
        assert content is None and reason == "tool_calls"
        assert call["function"] == {"name": "get_weather", "arguments": PARIS}
        for pieces in _splits(LLAMA_PARIS):
            deltas, reason = _stream(spec, pieces)
            assert reason == "tool_calls" and _streamed_calls(deltas)[1][0]["arguments"] == PARIS
    # The fallback's key is no call of Llama 3's.
    fallback = '{"name": "get_weather", "arguments": ' + PARIS + "}"
    assert tools.read_reply(fallback, "stop", _spec(llama3)) == (fallback, None, "stop")


# The grammar and the readers agree ----------------------------------------------------------------

def _sample(tokenizer: Tokenizer, grammar: str, rng: random.Random, max_tokens: int = 1500) -> str:
    """A random reply the grammar allows: each token drawn uniformly among those its mask allows;
    its text as the worker decodes it."""
    ll_tokenizer = tokenizer.llguidance()
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    tokens = []
    while not matcher.is_stopped() and len(tokens) < max_tokens:
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        token = int(rng.choice(np.flatnonzero(mask[:ll_tokenizer.vocab_size])))
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    assert matcher.is_stopped(), "the grammar did not end"
    return tokenizer.decode([t for t in tokens if t != ll_tokenizer.eos_token])


@pytest.mark.parametrize("template", ["qwen", "qwen_tags", "llama3"])
def test_every_call_the_grammar_allows_is_read_as_valid_calls(template, request):
    tokenizer = request.getfixturevalue(template)
    spec = _spec(tokenizer, "required")
    grammar = _grammar(tokenizer, "required")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng, names, counts = random.Random(1), set(), set()
    for _ in range(10):
        text = _sample(tokenizer, grammar, rng)
        content, calls, reason = tools.read_reply(text, "stop", spec)
        assert reason == "tool_calls" and content is None, text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
            names.add(call["function"]["name"])
        _, streamed = _streamed_calls(_stream(spec, list(text))[0])
        assert [c["arguments"] for c in streamed] == [c["function"]["arguments"] for c in calls]
        counts.add(len(calls))
    assert names == {"get_weather", "give_gold"}
    assert counts == {1} if template == "llama3" else len(counts) > 1  # Qwen's: one call or several


# Through the app, with the official client --------------------------------------------------------

MODEL = "qwen-tiny"


def _serve(fake_redis, template) -> openai.OpenAI:
    """The app on fakeredis with a stand-in worker of a model whose template is `template`, and the
    official openai client talking to it in-process."""
    hf = tiny_tokenizer()
    hf.chat_template = template
    register_worker(fake_redis, MODEL, tokenizer=hf, context_window=4096, engine="continuous", features=FEATURES)
    app = create_app(Settings(request_timeout=10), client=fake_redis)
    http = openai.DefaultHttpx2Client(transport=httpx2.WSGITransport(app=app))
    return openai.OpenAI(base_url="http://api/v1", api_key="none", http_client=http, max_retries=0)


@pytest.fixture
def served(fake_redis):
    return _serve(fake_redis, QWEN_TEMPLATE)


REPLY = "Let me look.\n" + QWEN_PARIS + "\n" + QWEN_GOLD


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_qwens_calls_as_tool_calls(served, fake_redis, qwen, stream):
    seen: list = []
    reply_in_pieces(fake_redis, [REPLY[i:i + 7] for i in range(0, len(REPLY), 7)], seen, MODEL)
    asked = served.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=stream)
    if stream:
        chunks = list(asked)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls: dict = {}
        for chunk in chunks:
            for part in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(part.index, {"name": part.function.name, "arguments": ""})
                call["arguments"] += part.function.arguments or ""
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        calls = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    else:
        message = asked.choices[0].message
        content, reasons = message.content, [asked.choices[0].finish_reason]
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c.type == "function" and c.id.startswith("call_") for c in message.tool_calls)
    assert content == "Let me look." and reasons == ["tool_calls"]
    assert calls == [("get_weather", PARIS), ("give_gold", '{"amount": 5}')]
    (job, _, grammar), = seen
    grammar = grammar.decode()
    prompt = qwen._tok.decode(job.prompt_ids)
    assert "<tools>\n" in prompt and '"name": "give_gold"' in prompt  # the template showed the tools
    assert grammar == _grammar(qwen) and _allows(qwen, grammar, REPLY)  # the job's grammar is Qwen's


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(fake_redis):
    """Llama 3's template raises for two calls in one assistant turn; a template's own refusal is the
    client's mistake, said in the template's words, not a server error."""
    client = _serve(fake_redis, "{% if messages | length > 1 %}{{ raise_exception('one message only!') }}"
                                "{% endif %}{{ messages[0].content }}")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HISTORY[:2])
    assert caught.value.body["param"] == "messages" and "one message only!" in caught.value.body["message"]
    assert not fake_redis.llen(keys.queue(MODEL))  # nothing queued
