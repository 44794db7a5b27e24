"""A streamed answer: server-sent events, a chunk per piece of text as the workers write it, then
[DONE]. The last step of api/answer.py's pipeline when the request asked for `stream`.

Once the first event is sent the status is 200, so an error after it (a worker's failure, Redis
gone) is sent as an event in OpenAI's error shape, and the stream ends.
"""
from __future__ import annotations

from typing import Optional

import redis
from flask import Response

from api import metrics, tools
from api.broker import Pending
from api.errors import ApiError, failure_error, unavailable
from api.logprobs import StreamState
from api.openai_format import SSE_DONE, Shape, sse, usage
from shared.protocol import Failure, Final, TextDelta
from shared.redis_client import unavailable_because


def response(pending: Pending, shape: Shape, include_usage: bool, prompt_tokens: int,
             counted: metrics.Answer) -> Response:
    return Response(events(pending, shape, include_usage, prompt_tokens, counted),
                    mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


def unsent(sent: str, offset: int, text: str) -> Optional[str]:
    """What of `text`, which starts at `offset` of the answer, was not sent yet.

    A job written again after its worker died repeats text already sent: that part is skipped,
    and if it differs from what was sent, None says the stream cannot go on.
    """
    if offset > len(sent):
        return ""  # a message was missed; the final answer carries the whole text
    seen = sent[offset:offset + len(text)]
    if text[:len(seen)] != seen:
        return None
    return text[len(seen):]


def events(pending: Pending, shape: Shape, include_usage: bool, prompt_tokens: int,
           counted: metrics.Answer):
    """The stream's events, each an SSE line (api/openai_format.sse)."""
    sent = [""] * len(pending.jobs)
    finals: list[Optional[Final]] = [None] * len(pending.jobs)
    readers = [tools.CallReader(shape.tool_spec) for _ in pending.jobs] if shape.tool_spec else None
    rendering, streamed = shape.rendering, StreamState(len(pending.jobs))  # api/logprobs.py
    asked = rendering is not None and rendering.asked

    def unsent_logprobs(index: int) -> Optional[dict]:
        return rendering.piece(index, streamed.flush(index)) if asked else None
    try:
        if shape.chat:
            for index in range(len(pending.jobs)):
                yield sse(shape.chunk(index, first=True))
        for index, result in pending.results():
            if isinstance(result, Failure):
                yield sse(counted.failed(failure_error(result)).body())
                return
            if rendering is not None and rendering.echo and not streamed.echoed[index]:
                streamed.echoed[index] = True  # completions' echo: the prompt (and its logprobs) first
                yield sse(shape.chunk(index, rendering.echo[index],
                                      logprobs=rendering.echo_piece(index, result.prompt_logprobs)))
            new = unsent(sent[index], result.offset if isinstance(result, TextDelta) else 0, result.text)
            if new is None:
                yield sse(counted.failed(ApiError(500, "the worker writing this answer died, and the worker "
                                                  "that wrote it again wrote different text",
                                                  code="retry_diverged")).body())
                return
            sent[index] += new
            if new:
                counted.text_sent()
            if isinstance(result, Final):
                finals[index] = result
            if asked:  # the entries of the text it carries, those already sent skipped as its text is
                streamed.take(index, result.logprobs, result.logprobs_start if isinstance(result, TextDelta) else 0)
            if readers:  # a chat with tools: the reply as text, or as a tool call's deltas
                chunks = _tool_chunks(shape, index, readers[index], new, result)
                if chunks and asked:  # the first chunk of a piece carries its logprobs
                    chunks[0]["choices"][0]["logprobs"] = unsent_logprobs(index)
                for chunk in chunks:
                    yield sse(chunk)
            elif isinstance(result, Final):
                yield sse(shape.chunk(index, new or None, finish_reason=result.finish_reason,
                                      logprobs=unsent_logprobs(index)))
            elif new or streamed.waiting[index]:
                yield sse(shape.chunk(index, new, logprobs=unsent_logprobs(index)))
        counted.answered(usage(prompt_tokens, finals, shape.n))
        if include_usage:
            yield sse(shape.usage_chunk(finals, prompt_tokens))
        yield SSE_DONE
    except ApiError as exc:
        yield sse(counted.failed(exc).body())
    except redis.RedisError as exc:
        yield sse(counted.failed(unavailable(unavailable_because(exc))).body())
    finally:  # also when the client went away: its jobs are cancelled
        pending.close()


def _tool_chunks(shape: Shape, index: int, reader: tools.CallReader, new: str, result) -> list[dict]:
    """The chunks a piece of a reply with tools gives: content, or OpenAI's tool-call deltas; the
    last piece's last chunk carries the finish_reason ("tool_calls" for a whole call)."""
    deltas = reader.feed(new) if new else []
    if not isinstance(result, Final):
        return [shape.chunk(index, fields=delta) for delta in deltas]
    last, finish_reason = reader.finish(result.finish_reason)
    deltas += last
    chunks = [shape.chunk(index, fields=delta) for delta in deltas[:-1]]
    chunks.append(shape.chunk(index, fields=deltas[-1] if deltas else None, finish_reason=finish_reason))
    return chunks
