"""The request bodies' part of the OpenAPI description (api/openapi.py): completions' and chat's
fields, each with the range api/validation.py checks, and the constraints' shapes (response_format,
structured_outputs, tools).

Each request schema is closed (additionalProperties: false), as the routes are: a field they do not
know is a 400 `unknown_parameter`.
"""
from __future__ import annotations

from api import validation
from api.chat_fields import CHAT_ROLES, MAX_MESSAGES, MAX_TOOLS, TOOL_CHOICES
from api.tools import NAME_PATTERN
from api.validation import (LOGIT_BIAS_RANGE, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PROMPTS,
                            MAX_REPETITION_PENALTY, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, MAX_TOKEN_ID,
                            MAX_TOTAL_CHOICES, PENALTY_RANGE, SERVICE_TIERS, UNSUPPORTED)
from shared.protocol import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN

# A seed is offset by the choice index and must still fit in 64 bits (see validation._sampling).
SEED_LIMIT = 2**63 - MAX_CHOICES - 1


def ref(kind: str, name: str) -> dict:
    return {"$ref": f"#/components/{kind}/{name}"}


def nullable(schema: dict, description: str = "") -> dict:
    """An optional field: null means the same as leaving it out."""
    out = {"anyOf": [schema, {"type": "null"}]}
    if description:
        out["description"] = description
    return out


def _sampling_properties() -> dict:
    """The fields completions and chat share."""
    number = {"type": "number"}
    token_id = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
    return {
        "model": {"type": "string", "description": "a model served here: see GET /v1/models"},
        "max_tokens": nullable({"type": "integer", "minimum": 1},
                                "most tokens to write (completions: 16 when left out; chat: all the room). "
                                "More than the model's context window is a 400; more than the room the "
                                "prompt leaves is cut to that room."),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}, "0 is greedy; default 1"),
        "top_p": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "default 1"),
        "top_k": nullable({"type": "integer", "minimum": -1}, "-1 or 0: off (default)"),
        "n": nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
                       f"choices per prompt (default 1); completions: n x prompts at most {MAX_TOTAL_CHOICES}"),
        "stop": nullable({"anyOf": [
            ref("schemas", "StopSequence"),
            {"type": "array", "maxItems": MAX_STOPS, "items": ref("schemas", "StopSequence")},
        ]}, "text that ends a choice (not included in it)"),
        "seed": nullable({"type": "integer", "minimum": -SEED_LIMIT, "maximum": SEED_LIMIT},
                          "same seed, same text (choice i uses seed + i)"),
        "stream": nullable({"type": "boolean"}, "answer as server-sent events (default false)"),
        "stream_options": nullable({
            "type": "object",
            "properties": {"include_usage": nullable({"type": "boolean"},
                                                      "a last chunk with the usage, before [DONE]")}}),
        "presence_penalty": nullable({**number, "minimum": PENALTY_RANGE[0], "maximum": PENALTY_RANGE[1]},
                                      "subtracted from a token's logit once it has been written (default 0)"),
        "frequency_penalty": nullable({**number, "minimum": PENALTY_RANGE[0], "maximum": PENALTY_RANGE[1]},
                                       "subtracted from a token's logit per time it has been written (default 0)"),
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                                 "additionalProperties": {**number, "minimum": LOGIT_BIAS_RANGE[0],
                                                          "maximum": LOGIT_BIAS_RANGE[1]}},
                                "token id (as a string) -> added to its logit; -100 bans it, 100 all but "
                                "forces it. Ids beyond the model's vocabulary are a 400."),
        "response_format": nullable(ref("schemas", "ResponseFormat")),
        "structured_outputs": nullable(ref("schemas", "StructuredOutputs")),
        # vLLM's extensions
        "ignore_eos": nullable({"type": "boolean"}, "keep writing past end-of-text (vLLM's field)"),
        "priority": nullable({"type": "integer", "minimum": PRIORITY_MIN, "maximum": PRIORITY_MAX},
                              f"lower is served first (vLLM's field); default {PRIORITY_DEFAULT}"),
        "repetition_penalty": nullable({**number, "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY},
                                        "vLLM's (CTRL's): the logit of a token in the prompt or the answer "
                                        "is divided by it (multiplied, if negative); 1 (default) is off"),
        "min_p": nullable({**number, "minimum": 0, "maximum": 1},
                           "vLLM's: drop tokens less likely than min_p times the likeliest (default 0)"),
        "stop_token_ids": nullable({"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": token_id},
                                    "vLLM's: the choice ends (finish_reason stop) on any of these tokens, "
                                    "which are not in its text"),
        "min_tokens": nullable({"type": "integer", "minimum": 0},
                                "vLLM's: end-of-text and stop_token_ids cannot end the choice before this "
                                "many tokens (at most max_tokens)"),
        # Metadata: checked, then without effect here (but user and prompt_cache_key, which route)
        "user": nullable({"type": "string"}, "keeps a player's requests together on the worker that holds their "
                         "history, where prompt_cache_key is not given (docs/scaling.md, routing)"),
        "metadata": nullable({"type": "object", "maxProperties": validation.MAX_METADATA,
                               "propertyNames": {"maxLength": validation.MAX_METADATA_KEY},
                               "additionalProperties": {"type": "string",
                                                        "maxLength": validation.MAX_METADATA_VALUE}},
                              "metadata: accepted, without effect (nothing is stored)"),
        "store": nullable({"type": "boolean"}, "metadata: accepted, without effect (nothing is stored)"),
        "service_tier": nullable({"type": "string", "enum": list(SERVICE_TIERS)},
                                  "metadata: accepted, without effect (one tier; `priority` orders requests)"),
        "prompt_cache_key": nullable({"type": "string"},
                                      "requests that share a prefix (a conversation): routed to the worker "
                                      "whose prefix cache holds it (docs/scaling.md, routing)"),
        "safety_identifier": nullable({"type": "string"}, "metadata: accepted, without effect"),
    }


def _refused(no_op: dict, name: str) -> dict:
    """One of OpenAI's fields this server cannot honour: only its value that asks for nothing."""
    reason = UNSUPPORTED[name][1]
    return nullable(no_op, f"not supported ({reason}): accepted only at its no-op value; any other is a "
                           f"400 `unsupported_parameter`")


STRICT = {"type": "boolean", "description": (
    "true: the schema is enforced whole, and one with a keyword the grammar cannot enforce (uniqueItems, "
    "not, if/then, an unknown format, an ambiguous oneOf) is a 400 naming it; otherwise such keywords "
    "are relaxed and the answer's `unenforced` names them")}


def constraint_schemas() -> dict:
    """response_format, vLLM's structured_outputs, chat's tools: what the reply must look like."""
    name = {"type": "string", "pattern": f"^{NAME_PATTERN.pattern}$"}
    schema = {"type": "object", "description": "a JSON Schema"}
    json_schema = {"type": "object", "required": ["name"], "additionalProperties": False,
                   "properties": {"name": name, "description": nullable({"type": "string"}),
                                  "schema": nullable(schema), "strict": nullable(STRICT)}}
    function = {"type": "object", "required": ["name"],
                "properties": {"name": name, "description": nullable({"type": "string"}),
                               "parameters": nullable({**schema, "description": "a JSON Schema of the arguments"}),
                               "strict": nullable(STRICT)}}
    return {
        "ResponseFormat": {
            "description": "text (the default: no constraint), any JSON object, or JSON valid against a schema; "
                           "a schema that cannot be compiled is a 400",
            "anyOf": [{"type": "object", "required": ["type"],
                       "properties": {"type": {"type": "string", "enum": ["text"]}, "json_schema": {"type": "object"}}},
                      {"type": "object", "required": ["type"], "additionalProperties": False,
                       "properties": {"type": {"type": "string", "enum": ["json_object"]}}},
                      {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
                       "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                                      "json_schema": json_schema}}]},
        "StructuredOutputs": {
            "description": "vLLM's constraints: exactly one of `json` (a JSON Schema, or its text), `regex`, "
                           "`choice` (one of the strings), `grammar` (Lark, or GBNF), `json_object` (true); one "
                           "that cannot be compiled is a 400",
            "type": "object", "minProperties": 1, "additionalProperties": False,
            "properties": {"json": nullable({"anyOf": [{"type": "object"}, {"type": "string"}]}),
                           "regex": nullable({"type": "string", "minLength": 1}),
                           "choice": nullable({"type": "array", "minItems": 1,
                                               "items": {"type": "string", "minLength": 1}}),
                           "grammar": nullable({"type": "string", "minLength": 1}),
                           "json_object": nullable({"type": "boolean"})}},
        "Tool": {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"type": "string", "enum": ["function"]}, "function": function}},
        "ToolChoice": {
            "description": "none: write text; auto (the default with tools): text or a call; required: a call; "
                           "a named function: a call of it, its arguments valid against its parameters",
            "anyOf": [{"type": "string", "enum": list(TOOL_CHOICES)},
                      {"type": "object", "required": ["type", "function"],
                       "properties": {"type": {"type": "string", "enum": ["function"]},
                                      "function": {"type": "object", "required": ["name"],
                                                   "properties": {"name": {"type": "string", "minLength": 1}}}}}]},
        "ToolCall": {"type": "object", "required": ["id", "function"],
                     "properties": {"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                                    "function": {"type": "object", "required": ["name", "arguments"],
                                                 "properties": {"name": {"type": "string", "minLength": 1},
                                                                "arguments": {"type": "string",
                                                                              "description": "JSON text"}}}}},
    }


def request_schemas() -> dict:
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                 "description": "token ids, each below the model's vocabulary size"}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    optional_name = nullable({"type": "string"})
    text = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}],
            "description": "text, or text parts (joined)"}
    sampling = _sampling_properties()
    logprobs_k = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}
    return {
        "StopSequence": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
        "TokenIds": token_ids,
        "Prompt": {
            "description": "a string, token ids, or an array of either: one prompt each",
            "anyOf": [
                {"type": "string", "minLength": 1},
                ref("schemas", "TokenIds"),
                {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                 "items": {"anyOf": [{"type": "string", "minLength": 1}, ref("schemas", "TokenIds")]}},
            ]},
        "Message": {
            "description": "a system, user or developer message: its text; an assistant's: its text, or its "
                           "tool_calls (content null); a tool's: the result of the call it names (tool_call_id)",
            "anyOf": [
                {"type": "object", "required": ["role", "content"],
                 "properties": {"role": {"type": "string", "enum": [r for r in CHAT_ROLES if r not in
                                                                    ("assistant", "tool")]},
                                "content": text, "name": optional_name, "tool_calls": {"type": "null"}}},
                {"type": "object", "required": ["role"],
                 "properties": {"role": {"type": "string", "enum": ["assistant"]},
                                "content": {"anyOf": [text, {"type": "null"}]}, "name": optional_name,
                                "tool_calls": nullable({"type": "array", "items": ref("schemas", "ToolCall")},
                                                       "the calls a reply made")},
                 "anyOf": [{"required": ["content"], "properties": {"content": text}},
                           {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}}]},
                {"type": "object", "required": ["role", "content", "tool_call_id"],
                 "properties": {"role": {"type": "string", "enum": ["tool"]}, "content": text,
                                "name": optional_name, "tool_call_id": {"type": "string", "minLength": 1},
                                "tool_calls": {"type": "null"}}},
            ]},
        "CompletionRequest": {
            "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "description": "any other field is a 400 `unknown_parameter` (or, with --lenient, ignored and logged)",
            "properties": {
                **sampling, "prompt": ref("schemas", "Prompt"),
                "logprobs": nullable({"anyOf": [logprobs_k, {"type": "boolean", "enum": [False]}]},
                                      "each written token's log-probability (the model's own log-softmax, "
                                      "before temperature, penalties and constraints) with this many "
                                      "likeliest tokens beside it"),
                "echo": nullable({"type": "boolean"}, "the prompt comes back before the text (with logprobs: "
                                                       "the prompt's too, the first token's null)"),
                "best_of": nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
                                     "accepted only equal to n (default 1): choosing among more is not supported"),
                "suffix": _refused({"type": "string", "enum": [""]}, "suffix"),
            },
        },
        "ChatCompletionRequest": {
            "type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "description": "any other field is a 400 `unknown_parameter` (or, with --lenient, ignored and logged)",
            "properties": {
                **sampling,
                "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                             "items": ref("schemas", "Message"),
                             "description": "rendered with the model's chat template"},
                "max_completion_tokens": nullable({"type": "integer", "minimum": 1},
                                                   "OpenAI's newer name for max_tokens; wins when both are given"),
                "logprobs": nullable({"type": "boolean"}, "each written token's log-probability (the model's "
                                                           "own log-softmax, before temperature, penalties and "
                                                           "constraints)"),
                "top_logprobs": nullable(logprobs_k, "the likeliest tokens beside each (needs logprobs: true)"),
                "tools": nullable({"type": "array", "maxItems": MAX_TOOLS, "items": ref("schemas", "Tool")}),
                "tool_choice": nullable(ref("schemas", "ToolChoice")),
                "parallel_tool_calls": nullable({"type": "boolean"}, "several calls a reply where the model's format has them"),
                "modalities": _refused({"type": "array", "items": {"type": "string", "enum": ["text"]},
                                        "minItems": 1, "maxItems": 1}, "modalities"),
                **{name: _refused({"not": {}}, name) for name in ("audio", "prediction", "web_search_options",
                                                                  "reasoning_effort", "verbosity")},
                "functions": _refused({"type": "array", "maxItems": 0}, "functions"),
                "function_call": _refused({"type": "string", "enum": ["none"]}, "function_call"),
            },
        },
    }
