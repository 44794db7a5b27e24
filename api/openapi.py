"""The API's OpenAPI 3.2 description, served at /openapi.json.

Built as Python data from the limits the code enforces (api/validation.py, the batch API's), so a
changed limit changes the description too; tests/test_openapi_fuzz.py checks the running API against
it. 3.2, not 3.1: its `itemSchema` describes a stream's server-sent events one by one.
"""
from __future__ import annotations

from api.batch_input import ENDPOINTS as BATCH_ENDPOINTS
from api.batch_store import COMPLETION_WINDOWS
from api.batches import MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE
from api.errors import _TYPES as ERROR_TYPES
from api.file_store import PURPOSE_INPUT
from api.openapi_requests import constraint_schemas, nullable as _nullable, ref as _ref, request_schemas


def _error_response(description: str, retry_after: str = "") -> dict:
    """`retry_after`: "" (no header), "optional" or "required"."""
    response = {"description": description,
                "content": {"application/json": {"schema": _ref("schemas", "Error")}}}
    if retry_after:
        response["headers"] = {"Retry-After": {"description": "seconds to wait before trying again",
                                               "required": retry_after == "required",
                                               "schema": {"type": "integer", "minimum": 0}}}
    return response


def _responses() -> dict:
    return {
        "BadRequest": _error_response(
            "A field is wrong: `param` names it (e.g. `prompt`, `messages[2].content`, `stop`); "
            "`code` is `invalid_type`, `invalid_value`, `missing_required_parameter`, `invalid_json`, "
            "`context_length_exceeded` (the prompt leaves no room to write), `unknown_parameter` (a field "
            "this API does not know) or `unsupported_parameter` (a field this server, or the workers "
            "serving the model, cannot honour, at a value that asks for something)."),
        "Unauthorized": _error_response(
            "API keys are configured and the request has no valid `Authorization: Bearer <key>` "
            "(`code`: `invalid_api_key`)."),
        "NotFound": _error_response("No live worker serves this model (`code`: `model_not_found`, "
                                    "`param`: `model`; the message lists the models served), or no such file "
                                    "(`file_not_found`) or batch (`batch_not_found`)."),
        "Conflict": _error_response("The batch is over: only a validating or in-progress batch can be "
                                    "cancelled (`code`: `batch_not_cancellable`)."),
        "PayloadTooLarge": _error_response("The body is larger than the API reads: 4 MiB, or for a batch "
                                           "input file --batch-file-limit (`code`: `file_too_large`)."),
        "TooManyRequests": _error_response(
            "Too much waiting: the model's queue is full (`code`: `queue_full`) or this API key made "
            "too many requests this minute (`code`: `rate_limit_exceeded`). Retry after the header's "
            "seconds.", retry_after="required"),
        "ServerError": _error_response("The worker failed to write the answer, or an unexpected error."),
        "NotImplemented": _error_response("Not with this Redis: batches run on RQ, which does not work "
                                          "with a Redis Cluster (`code`: `unsupported_with_redis_cluster`)."),
        "Unavailable": _error_response(
            "Redis is unreachable, no worker is running, or the model's workers went away "
            "(`code`: `service_unavailable`).", retry_after="optional"),
        "Timeout": _error_response("The answer was not written within the request timeout "
                                   "(`code`: `timeout`)."),
    }


def _error_schemas() -> dict:
    return {
        "Error": {
            "type": "object", "required": ["error"], "additionalProperties": False,
            "properties": {"error": {
                "type": "object", "additionalProperties": False,
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string", "enum": sorted(set(ERROR_TYPES.values()) | {"api_error"})},
                    "param": {"type": ["string", "null"], "description": "the field at fault, if one is"},
                    "code": {"type": ["string", "null"]},
                }}},
        },
    }


UNENFORCED = {"type": "array", "items": {"type": "string"}, "description": (
    "present when the request's JSON schema was not asked to be strict and holds keywords the grammar "
    "cannot enforce: they were left out (\"uniqueItems\", \"not\", \"format: uri-reference\") or read "
    "more loosely (\"oneOf (as anyOf)\"), and the reply may break them. With strict: true such a "
    "schema is a 400 naming the keyword instead (docs/structured-output.md)")}


def _answer_schemas() -> dict:
    count = {"type": "integer", "minimum": 0}
    finish = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None],
              "description": "stop: end-of-text, a stop string or token, or a constraint's end; length: "
                             "max_tokens or the context window; tool_calls: the reply is a call"}
    logprob = {"type": "number", "maximum": 0}
    completion_logprobs = {
        "description": "with `logprobs`: per token of `text` (with `echo`, the prompt's first), its text, "
                       "log-probability (null for the prompt's first), the likeliest tokens' and where it "
                       "starts in `text`",
        "anyOf": [{"type": "null"}, {
            "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                           "token_logprobs": {"type": "array", "items": {"anyOf": [logprob, {"type": "null"}]}},
                           "top_logprobs": {"type": "array", "items": {"anyOf": [
                               {"type": "object", "additionalProperties": logprob}, {"type": "null"}]}},
                           "text_offset": {"type": "array", "items": count}}}]}
    completion_choice = {"type": "object", "required": ["text", "index", "finish_reason"],
                         "properties": {"text": {"type": "string"}, "index": count,
                                        "logprobs": completion_logprobs, "finish_reason": finish}}
    token_bytes = {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": 255}}
    top = {"type": "object", "required": ["token", "logprob", "bytes"],
           "properties": {"token": {"type": "string"}, "logprob": logprob, "bytes": token_bytes}}
    chat_logprobs = {
        "description": "with `logprobs: true`: per token written, its text, log-probability, bytes (UTF-8) "
                       "and the `top_logprobs` likeliest",
        "anyOf": [{"type": "null"}, {
            "type": "object", "required": ["content"],
            "properties": {"content": {"type": ["array", "null"], "items": {
                "type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"],
                "properties": {**top["properties"], "top_logprobs": {"type": "array", "items": top}}}},
                "refusal": {"type": ["array", "null"]}}}]}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": ["assistant"]},
                              "content": {"type": ["string", "null"], "description": "null beside tool_calls"},
                              "tool_calls": {"type": "array", "items": _ref("schemas", "ToolCall")}}}
    tool_call_delta = {"type": "object", "required": ["index"],
                       "properties": {"index": count, "id": {"type": "string"},
                                      "type": {"type": "string", "enum": ["function"]},
                                      "function": {"type": "object",
                                                   "properties": {"name": {"type": "string"},
                                                                  "arguments": {"type": "string"}}}}}
    delta = {"type": "object", "properties": {"role": {"type": "string", "enum": ["assistant"]},
                                              "content": {"type": ["string", "null"]},
                                              "tool_calls": {"type": "array", "items": tool_call_delta}}}

    def envelope(object_name: str, choice: dict, usage_required: bool) -> dict:
        return {"type": "object",
                "required": ["id", "object", "created", "model", "choices"] + (["usage"] if usage_required else []),
                "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": [object_name]},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "items": choice}, "usage": _ref("schemas", "Usage"),
                               "unenforced": UNENFORCED}}

    def chat_choice(body_name: str, body: dict) -> dict:
        return {"type": "object", "required": ["index", body_name, "finish_reason"],
                "properties": {"index": count, body_name: body, "logprobs": chat_logprobs,
                               "finish_reason": finish}}

    return {
        "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
                                 "prompt_tokens_details": {
                                     "type": "object", "properties": {"cached_tokens": {
                                         **count, "description": "prompt tokens the prefix cache held"}}}}},
        "Completion": envelope("text_completion", completion_choice, usage_required=True),
        "ChatCompletion": envelope("chat.completion", chat_choice("message", message), usage_required=True),
        # Streamed: a chunk per piece of text; with include_usage, a last chunk with no choices and the usage.
        "CompletionChunk": envelope("text_completion", completion_choice, usage_required=False),
        "ChatCompletionChunk": envelope("chat.completion.chunk", chat_choice("delta", delta), usage_required=False),
        "ModelList": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by", "context_window"],
                "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
                               "created": {"type": "integer"}, "owned_by": {"type": "string"},
                               "context_window": {"type": "integer", "minimum": 1,
                                                  "description": "prompt and answer tokens together"},
                               "workers": count,
                               "numerics": {"type": "array", "items": {"type": "string"}, "description":
                                            "the live workers' numerics fingerprints: workers of one "
                                            "write the same tokens for the same request; '+invariant' "
                                            "where they do not depend on the other requests in a step"}}}}}},
        "Health": {
            "type": "object", "required": ["status", "workers", "models"],
            "properties": {"status": {"type": "string"}, "workers": count,
                           "models": {"type": "array", "items": {"type": "string"}}}},
    }


def _event(chunk_schema: str) -> dict:
    """One server-sent event of a stream: a chunk, or an error if the answer fails mid-way, then [DONE]."""
    return {
        "type": "object", "required": ["data"],
        "properties": {
            "event": {"type": "string", "enum": ["message"]},
            "data": {"type": "string",
                     "if": {"const": "[DONE]"},
                     "else": {"contentMediaType": "application/json",
                              "contentSchema": {"anyOf": [_ref("schemas", chunk_schema), _ref("schemas", "Error")]}}},
        }}


_ERRORS = {"400": "BadRequest", "401": "Unauthorized", "404": "NotFound", "409": "Conflict",
           "413": "PayloadTooLarge", "429": "TooManyRequests", "500": "ServerError", "501": "NotImplemented",
           "503": "Unavailable",
           "504": "Timeout"}


def _operation(summary: str, answer: dict, errors: str, body: dict | None = None, path_id: str = "") -> dict:
    """`answer`: the 200's content by media type; `errors`: the other statuses it may answer."""
    operation = {"summary": summary, "responses": {"200": {"description": "OK", "content": answer}}}
    for status in errors.split():
        operation["responses"][status] = _ref("responses", _ERRORS[status])
    if body is not None:
        operation["requestBody"] = {"required": True, "content": body}
    if path_id:
        operation["parameters"] = [{"name": path_id, "in": "path", "required": True, "schema": {"type": "string"}}]
    return operation


def _v1(summary: str, answer: dict, errors: str, **kwargs) -> dict:
    """A /v1 route: behind the API keys and the rate limit (api/auth.py), reading Redis."""
    operation = _operation(summary, answer, f"401 429 500 503 {errors}", **kwargs)
    operation["security"] = [{"bearer": []}, {}]
    return operation


def _json(schema_name: str) -> dict:
    return {"application/json": {"schema": _ref("schemas", schema_name)}}


def _generate(summary: str, request_schema: str, answer_schema: str) -> dict:
    answer = {**_json(answer_schema), "text/event-stream": {"itemSchema": _event(answer_schema + "Chunk")}}
    operation = _v1(summary, answer, "400 404 413 504", body=_json(request_schema))
    operation["responses"]["200"]["description"] = ("the answer; with `stream: true`, server-sent events, "
                                                    "the last `data: [DONE]`")
    return operation


def _batch_paths() -> dict:
    """The batch API (api/batches.py): a JSONL file of requests in, a batch run later, files out."""
    file_upload = {"multipart/form-data": {"schema": _ref("schemas", "FileUpload")}}
    return {
        "/v1/files": {"post": _v1("Upload a batch input file", _json("File"), "400 413", body=file_upload)},
        "/v1/files/{file_id}": {
            "get": _v1("A file's object", _json("File"), "404", path_id="file_id"),
            "delete": _v1("Delete a file", _json("FileDeleted"), "404", path_id="file_id")},
        "/v1/files/{file_id}/content": {"get": _v1(
            "A file's bytes", {"application/jsonl": {"schema": {"type": "string"}}}, "404", path_id="file_id")},
        "/v1/batches": {"post": _v1("Run a file's requests", _json("Batch"), "400 413 501",
                                    body=_json("BatchRequest"))},
        "/v1/batches/{batch_id}": {"get": _v1("A batch's status and files", _json("Batch"), "404",
                                              path_id="batch_id")},
        "/v1/batches/{batch_id}/cancel": {"post": _v1("Stop sending a batch's requests", _json("Batch"),
                                                      "404 409", path_id="batch_id")},
    }


def _batch_schemas() -> dict:
    count = {"type": "integer", "minimum": 0}
    time = {"type": ["integer", "null"]}
    metadata = {"type": "object", "maxProperties": MAX_METADATA, "propertyNames": {"maxLength": MAX_METADATA_KEY},
                "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE}}
    return {
        "FileUpload": {
            "type": "object", "required": ["file", "purpose"],
            "properties": {
                "file": {"type": "string", "contentMediaType": "application/octet-stream",
                         "description": "JSONL, one request a line: {\"custom_id\", \"method\": \"POST\", "
                                        "\"url\", \"body\"}, each body checked as the route checks it"},
                "purpose": {"type": "string", "enum": [PURPOSE_INPUT]}}},
        "File": {
            "type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["file"]},
                           "bytes": count, "created_at": {"type": "integer"}, "filename": {"type": "string"},
                           "purpose": {"type": "string"}, "status": {"type": "string"}, "expires_at": time}},
        "FileDeleted": {
            "type": "object", "required": ["id", "object", "deleted"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["file"]},
                           "deleted": {"type": "boolean"}}},
        "BatchRequest": {
            "type": "object", "required": ["input_file_id", "endpoint"],
            "properties": {
                "input_file_id": {"type": "string", "description": "an uploaded file, purpose batch"},
                "endpoint": {"type": "string", "enum": sorted(BATCH_ENDPOINTS),
                             "description": "every line's url must be this"},
                "completion_window": _nullable({"type": "string", "enum": sorted(COMPLETION_WINDOWS)}),
                "metadata": _nullable(metadata)}},
        "Batch": {
            "type": "object",
            "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status",
                         "created_at", "request_counts"],
            "properties": {
                "id": {"type": "string"}, "object": {"type": "string", "enum": ["batch"]},
                "endpoint": {"type": "string"}, "errors": {"type": ["object", "null"]},
                "input_file_id": {"type": "string"}, "completion_window": {"type": "string"},
                "status": {"type": "string", "enum": ["validating", "in_progress", "finalizing", "completed",
                                                      "failed", "expired", "cancelling", "cancelled"]},
                "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
                **{name: time for name in ("created_at", "in_progress_at", "expires_at", "finalizing_at",
                                           "completed_at", "failed_at", "expired_at", "cancelling_at",
                                           "cancelled_at")},
                "request_counts": {"type": "object", "required": ["total", "completed", "failed"],
                                   "properties": {"total": count, "completed": count, "failed": count}},
                "metadata": {"type": ["object", "null"]}}},
    }


def document() -> dict:
    return {
        "openapi": "3.2.0",
        "info": {
            "title": "Storyteller",
            "version": "1",
            "description": "OpenAI-shaped completions, written by a pool of model workers behind Redis, "
                           "and OpenAI's Batch API. Every error, on any path or method (404, 405 too), is "
                           "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`.",
        },
        "paths": {
            "/v1/completions": {"post": _generate("Complete prompts", "CompletionRequest", "Completion")},
            "/v1/chat/completions": {"post": _generate("Answer a conversation", "ChatCompletionRequest",
                                                       "ChatCompletion")},
            "/v1/models": {"get": _v1("The models with a live worker", _json("ModelList"), "")},
            **_batch_paths(),
            "/health": {"get": _operation("Redis reachable and the live workers", _json("Health"), "500 503")},
            "/openapi.json": {"get": _operation("This description",
                                                {"application/json": {"schema": {"type": "object"}}}, "500")},
        },
        "components": {
            "schemas": {**_error_schemas(), **request_schemas(), **constraint_schemas(),
                        **_answer_schemas(), **_batch_schemas()},
            "responses": _responses(),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "needed only when the API is started with --api-keys or --api-keys-file"}},
        },
    }
