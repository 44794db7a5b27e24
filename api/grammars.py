"""Structured output at the API: a request's constraint as an llguidance grammar, checked against
the model's tokenizer before any job is queued, and stored once in Redis under its hash.

A request has at most one constraint:
- `response_format`: {"type": "json_object"} (any JSON object) or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}} ({"type": "text"}: none);
- `structured_outputs`, in vLLM's names: exactly one of `json` (a JSON Schema, as an object or its
  text), `regex`, `choice` (a list of strings), `grammar` (Lark as llguidance reads it, or GBNF,
  told apart by its `::=`), `json_object` (true);
- `tools` with tool_choice "auto", "required" or a named function (api/tools.py says what each allows),
  in the model's call format (api/tool_formats.py).

The grammar text is what llguidance.LLMatcher takes (LLMatcher.grammar_from_json_schema /
grammar_from_lark / grammar_from_regex); its sha256 hex is `params.grammar`, and the text lies at
keys.grammar(model, digest) for GRAMMAR_TTL_S after its last use: it crosses Redis once, not in
every job, and the worker compiles it once per digest (with its own logit width).

JSON is written compact (no whitespace between tokens, llguidance's whitespace_flexible off), so
a small model cannot wander into endless blank lines; a schema's own "x-guidance" options
(llguidance's, e.g. {"whitespace_flexible": true}) override that. A schema is read as
api/schemas.py says (objects closed unless they say otherwise, integers within JavaScript's safe
range). `strict: true` enforces it whole or refuses it naming the keyword; without it, what
llguidance cannot enforce is relaxed (LENIENT) and named (Grammar.relaxed, the answer's
`unenforced`). A `regex` reads \\d and \\w as ASCII, as a schema's `pattern` does.

Cost (SmolLM2's 49,152 tokens, this 2-core machine; docs/serving.md, Structured output): a
typical schema checks in 0.2-2 ms, a 20 KB grammar in ~9 ms, a 48 KB one in ~28 ms, so a grammar is
at most MAX_GRAMMAR_BYTES (~40 ms); llguidance drops Python's lock while it checks, and under gevent
one of OFF_LOOP_BYTES or more is checked on gevent's thread pool, so the process' other players go
on meanwhile. A grammar checked once is remembered (per tokenizer) by its hash. The LLTokenizer it
is checked against is built once per tokenizer (api/tokenizers.py, ~0.4 s, holding the lock).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from api import schemas, tool_formats, tools
from api.errors import bad_request
from shared import keys

MAX_GRAMMAR_BYTES = 64 * 1024  # a grammar's text at most (a schema's JSON, a regex, a Lark grammar)
OFF_LOOP_BYTES = 8 * 1024      # from this size on, a check leaves gevent's loop (~3 ms and up)
MAX_CHECKED = 4096             # grammars remembered as good, per tokenizer
JSON_DEFAULTS = {"whitespace_flexible": False}
# Where strict was not asked: what llguidance cannot enforce is left out (uniqueItems, not,
# if/then, unknown formats), oneOf is read as anyOf, and the answer names them (Grammar.relaxed).
LENIENT = {**JSON_DEFAULTS, "lenient": True, "coerce_one_of": True}
SCHEMA_NAME_MAX = 64
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_SCHEMA_FIELDS = ("name", "schema", "strict", "description")


@dataclass(frozen=True)
class Grammar:
    text: str    # what llguidance.LLMatcher takes as its grammar
    digest: str  # sha256 hex of the text: params.grammar, and the Redis key's last part
    relaxed: tuple = ()  # what of the schema is not enforced (strict not asked): the answer's `unenforced`


def for_request(req, tokenizer, tool_spec: Optional[tools.ToolSpec], open_objects: bool = False) -> Optional[Grammar]:
    """The request's constraint, compiled and checked, or None; a 400 naming the field otherwise.
    `req` is an api.validation.CompletionRequest, `tokenizer` an api.tokenizers.Tokenizer;
    `open_objects` (Settings.open_objects): schemas' objects as JSON Schema reads them, not closed
    (api/schemas.py, which also bounds integers)."""
    given = req.constraints
    if len(given) > 1:
        raise bad_request(f"'{given[0]}' and '{given[1]}' cannot be used together: a reply follows "
                          f"one constraint (with tools, leave tool_choice \"none\" to use "
                          f"'{given[0]}')", param=given[1], code="invalid_value")
    if not given:
        return None
    closing = functools.partial(schemas.read, open_objects=open_objects)
    if given == ["tools"]:  # tool_spec is then api/tools.spec's for the request
        return _tools(tool_spec, tokenizer, closing)
    if req.response_format is not None:
        text, param = _response_format(req.response_format, closing)
    else:
        text, param = _structured_outputs(req.structured_outputs, closing)
    return check(text, param, tokenizer)


def _json_grammar(schema, param: str, strict: bool = True) -> str:
    """The schema's grammar; where strict was not asked and llguidance cannot enforce all of it, the
    lenient one (a schema it can enforce whole gets the same text either way, so the same hash)."""
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if strict or _enforceable(text):
            return text
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=LENIENT)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"'{param}' is not a JSON Schema object: {exc}", param=param, code="invalid_value")


@functools.lru_cache(maxsize=MAX_CHECKED)
def _enforceable(text: str) -> bool:
    """Whether llguidance enforces all of a JSON grammar (no tokenizer needed to tell): remembered,
    as the check is, so a schema's later requests do not compile it again (0.8 ms, up to 4)."""
    return not llguidance.LLMatcher.validate_grammar(text, None)


def _response_format(response_format: dict, closing) -> tuple[str, str]:
    kind = response_format["type"]  # json_object or json_schema (api/validation.py checked it)
    _only_fields(response_format, ("type", "json_schema") if kind == "json_schema" else ("type",),
                 "response_format")
    if kind == "json_object":
        return _json_grammar({"type": "object"}, "response_format"), "response_format"
    spec = response_format["json_schema"]
    where = "response_format.json_schema"
    _only_fields(spec, JSON_SCHEMA_FIELDS, where)
    name = spec.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= SCHEMA_NAME_MAX
            and tools.NAME_PATTERN.fullmatch(name)):
        raise bad_request(f"'{where}.name' must be 1-{SCHEMA_NAME_MAX} letters, digits, '_' or '-', got {name!r}",
                          param=f"{where}.name",
                          code="missing_required_parameter" if name is None else "invalid_value")
    for field, kind_ok, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if spec.get(field) is not None and not isinstance(spec[field], kind_ok):
            raise bad_request(f"'{where}.{field}' must be {what}", param=f"{where}.{field}", code="invalid_type")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON Schema object", param=f"{where}.schema",
                          code="invalid_type")
    return _json_grammar(closing(schema), f"{where}.schema", spec.get("strict") is True), f"{where}.schema"


def _regex_grammar(regex: str) -> str:
    """A regex as a JSON schema's `pattern` reads it (ECMA-262): \\d and \\w are ASCII ([0-9],
    [0-9a-zA-Z_]), \\s any Unicode space; a Unicode class is still there written out (\\p{Nd}).
    Left to Rust's regex crate, \\d would take any script's digits (a date came back in 🯸)."""
    return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(regex, use_ascii='dw')}/")


def _structured_outputs(options: dict, closing) -> tuple[str, str]:
    for key in options:
        if key not in STRUCTURED_KINDS:
            raise bad_request(f"'structured_outputs.{key}' is not supported by this server (it takes one of "
                              f"{', '.join(STRUCTURED_KINDS)})", param=f"structured_outputs.{key}",
                              code="unsupported_parameter")
    kinds = [k for k in STRUCTURED_KINDS if options.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(f"'structured_outputs' must set exactly one of {', '.join(STRUCTURED_KINDS)}, "
                          f"got {', '.join(kinds) or 'none'}", param="structured_outputs", code="invalid_value")
    kind = kinds[0]
    value, param = options[kind], f"structured_outputs.{kind}"

    def wrong(what: str):
        return bad_request(f"'{param}' must be {what}", param=param, code="invalid_type")

    if kind == "json_object":
        if value is not True:
            raise wrong("true")
        return _json_grammar({"type": "object"}, param), param
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"'{param}' is not valid JSON: {exc}", param=param, code="invalid_value")
        if not isinstance(value, dict):
            raise wrong("a JSON Schema (an object, or its JSON text)")
        return _json_grammar(closing(value), param, strict=False), param  # vLLM's field has no strict
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise wrong("a non-empty string (a regular expression)")
        return _regex_grammar(value), param
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise wrong("a non-empty array of non-empty strings")
        # A Lark string literal reads JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)), param
    if not isinstance(value, str) or not value.strip():
        raise wrong("a non-empty string (a Lark or GBNF grammar)")
    if "::=" in value:  # GBNF (llama.cpp's); Lark writes rules with ':'
        try:
            value = gbnf_to_lark(value)
        except Exception as exc:  # the converter raises its own error kinds
            raise bad_request(f"'{param}' is not a GBNF grammar llguidance can read: {exc}", param=param,
                              code="invalid_value")
    return llguidance.LLMatcher.grammar_from_lark(value), param


def _only_fields(obj: dict, known: tuple, where: str) -> None:
    for key in obj:
        if key not in known:
            raise bad_request(f"Unrecognized argument supplied: '{where}.{key}'", param=f"{where}.{key}",
                              code="unknown_parameter")


def _tools(tool_spec: tools.ToolSpec, tokenizer, closing) -> Grammar:
    """Calls of the allowed functions in the model's format (api/tool_formats.py), or (auto) text or
    calls. Each parameter schema is checked on its own first, so a fault is named by its place in
    `tools` (inside an anyOf, llguidance would quietly drop a function whose schema nothing
    satisfies)."""
    relax = False  # whether a function's schema (not strict) was relaxed
    for i, function in enumerate(tool_spec.functions):
        param = f"tools[{i}].function.parameters"
        strict = function["name"] in tool_spec.strict
        relax |= bool(check(_json_grammar(closing(function["parameters"]), param, strict), param, tokenizer).relaxed)
    fmt = tool_spec.format
    # A strict function's schema passed whole above: relaxing the call's schema relaxes only the others'.
    options = LENIENT if relax else JSON_DEFAULTS
    if fmt is not tool_formats.JSON:  # the spacing its template writes
        options = {**options, "item_separator": fmt.item_separator, "key_separator": fmt.key_separator}
    schema = {**closing(tools.call_schema(tool_spec)), "x-guidance": options}
    if fmt.opener:
        text = llguidance.LLMatcher.grammar_from_lark(_tagged_calls(fmt, schema, tool_spec, tokenizer))
    elif tool_spec.required:
        text = _json_grammar(schema, "tools", not relax)
    else:  # text that does not start with "{" (after whitespace), or a call, which may follow some
        text = llguidance.LLMatcher.grammar_from_lark(
            "start: TEXT | call\n"
            "TEXT: /[ \\t\\r\\n]*[^{ \\t\\r\\n][\\s\\S]*/\n"
            "WS: /[ \\t\\r\\n]+/\n"
            f"call: WS? %json {json.dumps(schema)}\n")
    return check(text, "tools", tokenizer)


def _tagged_calls(fmt, schema: dict, tool_spec: tools.ToolSpec, tokenizer) -> str:
    """Lark for calls each in the format's tags (Qwen's `<tool_call>\\n{...}\\n</tool_call>`, one
    after another where parallel); auto: text without the opening tag, or text and then calls.
    Text must hold something besides whitespace, as in the fallback.

    Qwen's vocabulary holds each tag as one added token, which llguidance counts as special: no
    text matches it, only a reference to the token (`<tool_call>` outside quotes) does, so a tag
    that is one token is written so and the model writes it as it was trained to; a tag that is
    not (a tokenizer without it) is text, and text before the first call is then a lazy lexeme
    that ends at the tag."""
    opener, closer = (_tag(tag, tokenizer) for tag in (fmt.opener, fmt.closer))
    between = json.dumps(fmt.between)
    more = f"({between} call)*" if tool_spec.parallel else ""
    lines = [f'call: {opener} "\\n" body "\\n" {closer}', f"body: %json {json.dumps(schema)}"]
    tag = re.escape(fmt.opener)
    no_tag = f"~/(?s:.*){tag}(?s:.*)/"
    if tool_spec.required:
        lines.insert(0, f"start: call {more}")
    elif opener.startswith("<"):  # the tag is a token of its own
        # A thought in tags that are tokens (Qwen3's <think>) may come first: text could not
        # write those tokens.
        thought = [_tag(t, tokenizer) for t in fmt.thought]
        thinks = len(thought) == 2 and all(t.startswith("<") for t in thought)
        lines[:0] = [f"start: {'thought? ' if thinks else ''}(TEXT | BEFORE? call {more})",
                     f"TEXT: /[ \\t\\r\\n]*[^ \\t\\r\\n](?s:.*)/ & {no_tag}",
                     f"BEFORE: /(?s:.*)/ & {no_tag}"]
        if thinks:
            lines += [f"thought: {thought[0]} THOUGHT {thought[1]}", "THOUGHT: /(?s:.*)/"]
    else:
        lines[:0] = [f'start: TEXT | first "\\n" body "\\n" {closer} {more}',
                     f"TEXT: /[ \\t\\r\\n]*[^ \\t\\r\\n](?s:.*)/ & {no_tag}",
                     f"first[lazy]: /(?s:.*){tag}/"]
    return "\n".join(lines) + "\n"


def _tag(text: str, tokenizer) -> str:
    """A tag in Lark: a reference to its token where the tokenizer has it as one special token,
    else a string."""
    ll = tokenizer.llguidance()
    ids = ll.tokenize_str(text)
    return text if len(ids) == 1 and ll.is_special_token(ids[0]) else json.dumps(text)


# Checking -------------------------------------------------------------------------------------

_checked: "weakref.WeakKeyDictionary[object, OrderedDict]" = weakref.WeakKeyDictionary()
_checked_lock = threading.Lock()


def check(text: str, param: str, tokenizer) -> Grammar:
    """The grammar if llguidance compiles it for the tokenizer; else a 400 naming `param`."""
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise bad_request(f"'{param}' makes a grammar of {size} bytes, more than this server's "
                          f"{MAX_GRAMMAR_BYTES}", param=param, code="invalid_value")
    digest = hashlib.sha256(text.encode()).hexdigest()
    with _checked_lock:
        good = _checked.setdefault(tokenizer, OrderedDict())
        if digest in good:
            good.move_to_end(digest)
            return Grammar(text, digest, good[digest])
    ll_tokenizer = tokenizer.llguidance()
    validate = llguidance.LLMatcher.validate_grammar_with_warnings
    failed, messages = (_off_loop(validate, text, ll_tokenizer) if size >= OFF_LOOP_BYTES
                        else validate(text, ll_tokenizer))
    if failed:
        raise bad_request(f"'{param}' cannot be compiled: {' '.join(messages).strip()[:1000]}", param=param,
                          code="invalid_value")
    grammar = Grammar(text, digest, relaxed(messages))
    with _checked_lock:
        good[digest] = grammar.relaxed
        while len(good) > MAX_CHECKED:
            good.popitem(last=False)
    return grammar


def relaxed(warnings: list[str]) -> tuple[str, ...]:
    """llguidance's warnings on a lenient grammar as the keywords it did not enforce: 'Unimplemented
    keys: ["not"]' -> not, 'Unknown format: url' -> format: url, oneOf's -> oneOf (as anyOf)."""
    words = set()
    for warning in warnings:
        if warning.startswith("Unimplemented keys:"):
            try:
                words.update(json.loads(warning.split(":", 1)[1]))
                continue
            except ValueError:
                pass
        if warning.startswith("Unknown format:"):
            words.add("format: " + warning.split(":", 1)[1].strip())
        elif warning.startswith("oneOf"):
            words.add("oneOf (as anyOf)")
        else:
            words.add(warning.strip())
    return tuple(sorted(words))


def _off_loop(function, *args):
    """`function(*args)` on a real thread when gevent has patched this process (gunicorn's gevent
    worker), so its other greenlets run meanwhile: llguidance drops Python's lock while it
    compiles. Elsewhere (a gthread worker, tests) each request has its own thread already."""
    if "gevent" in sys.modules:
        from gevent import get_hub, monkey
        if monkey.is_module_patched("threading"):
            return get_hub().threadpool.apply(function, args)
    return function(*args)


def store(client, model: str, grammar: Grammar) -> None:
    """Keep the grammar at keys.grammar(model, digest) for GRAMMAR_TTL_S more: its text is sent only
    when Redis does not have it (a refresh is one EXPIRE)."""
    key = keys.grammar(model, grammar.digest)
    if not client.expire(key, keys.GRAMMAR_TTL_S):
        client.set(key, grammar.text, ex=keys.GRAMMAR_TTL_S)
