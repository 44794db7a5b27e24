"""The Flask app: OpenAI's completions and chat routes, in front of the Redis queue.

A request's path: validate the body -> find a live worker of the model -> tokenize and check the
context window -> subscribe to each job's channel, push the jobs -> answer whole or as a stream.
"""
from __future__ import annotations

import json
import logging
import os
import random
import uuid
from dataclasses import replace
from typing import Optional

import redis
from flask import Flask, Response, jsonify, request
from flask.json.provider import DefaultJSONProvider
from redis.exceptions import RedisClusterException
from redis.sentinel import SentinelConnectionPool
from werkzeug.exceptions import HTTPException

from api import auth, batches, grammars, tools
from api import metrics
from api.broker import Broker, Pending
from api.errors import ApiError, bad_request, unavailable
from api.openai_format import SSE_DONE, Shape, sse, usage
from api.openapi import document
from api.tokenizers import TokenizerCache
from api.features import check_features
from api.logprobs import Rendering, StreamState
from api.validation import CompletionRequest, check_max_tokens, check_token_ids, parse_chat, parse_completion
from shared.protocol import Failure, Final, Job, TextDelta, WorkerInfo
from shared.redis_client import connect, explain, is_cluster, is_sentinel
from shared.settings import Settings

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(settings: Optional[Settings] = None, client: Optional[redis.Redis] = None) -> Flask:
    settings = settings or Settings.from_env()
    client = client or redis_client(settings)
    broker = Broker(client, settings.worker_grace, settings.max_queue)
    tokenizers = TokenizerCache(client)
    app = Flask(__name__)
    app.json = _JsonProvider(app)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    metrics.install(app, client)  # first: a request refused by auth is counted too
    auth.install(app, settings, client)
    app.register_blueprint(batches.blueprint(settings, client))  # the batch API: api/batches.py

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError):
        return exc.response()

    @app.errorhandler(redis.RedisError)
    @app.errorhandler(RedisClusterException)  # a cluster's own (a pipeline's: no node holds a slot)
    def redis_down(exc):
        return unavailable(f"the job queue (Redis) is not reachable: {explain(exc)}").response()

    @app.errorhandler(LookupError)
    def tokenizer_missing(exc):
        return unavailable(f"the worker has not stored its tokenizer in Redis yet: {exc}").response()

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        body, status, headers = ApiError(exc.code or 500, exc.description or exc.name).response()
        # A 405 must name the methods the path takes (RFC 9110): werkzeug's Allow header is kept.
        headers.update((name, value) for name, value in exc.get_headers() if name == "Allow")
        return body, status, headers

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    description = document()

    @app.get("/openapi.json")
    def openapi():
        return jsonify(description)

    @app.get("/health")
    def health():
        client.ping()
        workers = broker.live_workers()
        return jsonify({"status": "ok", "workers": len(workers), "models": sorted({w.model for w in workers})})

    @app.get("/v1/models")
    def models():
        by_model: dict[str, list[WorkerInfo]] = {}
        for worker in broker.live_workers():
            if worker.draining:
                continue
            by_model.setdefault(worker.model, []).append(worker)
        data = [{"id": model, "object": "model", "created": int(min(w.started for w in workers)),
                 "owned_by": "storyteller", "context_window": workers[0].context_window,
                 "workers": len(workers), "numerics": sorted({w.numerics for w in workers if w.numerics})}
                for model, workers in sorted(by_model.items())]
        return jsonify({"object": "list", "data": data})

    @app.post("/v1/completions")
    def completions():
        return _answer(parse_completion(_json_body(), settings.lenient), chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _answer(parse_chat(_json_body(), settings.lenient), chat=True)

    def _answer(req: CompletionRequest, chat: bool):
        workers = broker.workers_for(req.model)
        check_features(req, workers)  # a field its workers cannot honour: refused, not dropped
        check_max_tokens(req, workers[0].context_window)
        check_token_ids(req, tokenizers.get(workers[0]).vocab_size)
        cap = broker.admission.cap(workers)
        # A full queue is refused before the costly part (tokenizing), so a crowd hears it at once.
        broker.admission.check(req.model, req.n * (1 if chat else len(req.prompts)), cap)
        tokenizer = tokenizers.get(workers[0])
        tool_spec = (tools.spec(req.tools, req.tool_choice, tokenizer.tool_format, req.parallel_tool_calls)
                     if chat else None)
        prompts = _tokenize(req, tokenizer, chat, tool_spec)
        # The constraint, checked before anything is queued; its jobs carry only its hash.
        grammar = grammars.for_request(req, tokenizer, tool_spec, settings.open_objects)
        if grammar is not None:
            req.params = replace(req.params, grammar=grammar.digest)
        request_id = uuid.uuid4().hex[:24]
        jobs = _jobs(req, prompts, workers[0], request_id, settings.request_timeout)
        prompt_tokens = sum(len(p) for p in prompts)
        shape = Shape(request_id, req.model, chat, tool_spec)
        shape.n = req.n
        shape.unenforced = grammar.relaxed if grammar is not None else ()
        if req.params.logprobs is not None or req.echo:
            shape.rendering = Rendering(tokenizer, chat, req.params.logprobs is not None,
                                        _echo_texts(req, tokenizer) if req.echo else None)
        if grammar is not None:
            grammars.store(client, req.model, grammar)  # before the jobs: a worker fetches it
        pending = broker.submit(jobs, cap)
        counted = metrics.Answer(req.model)
        if req.stream:
            return Response(_stream(pending, shape, req.include_usage, prompt_tokens, counted),
                            mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            body = shape.whole(_collect(pending), prompt_tokens)
            counted.answered(body["usage"])
            return jsonify(body)
        finally:
            pending.close()

    return app


# How long a Redis command waits for one of the process's connections when all are in use.
POOL_WAIT_S = 10


def redis_client(settings: Settings) -> redis.Redis:
    """This API process's Redis client: at most settings.redis_connections connections.

    A waiting request holds none of them (it waits on the process's one subscriber: api/broker.py),
    so a few dozen carry thousands of players; a burst that wants more at once waits for a free
    one (redis-py's BlockingConnectionPool) rather than failing. Each connection is named after
    the process (CLIENT LIST shows which process holds what).
    """
    # Short timeouts: with Redis down, a request must get its 503 in a second or two, not hang.
    options = dict(socket_connect_timeout=1, socket_timeout=5, max_connections=settings.redis_connections,
                   client_name=f"storyteller-api-{os.getpid()}")
    if is_sentinel(settings.redis_url):
        # connect() hands these options to redis-py's Sentinel.master_for, which takes the pool's class.
        return connect(settings.redis_url, connection_pool_class=_WaitingSentinelPool, timeout=POOL_WAIT_S,
                       **options)
    if is_cluster(settings.redis_url):
        # A pool per node, each of this bound (the subscriber's connection to a node counts in that
        # node's); redis-py hands the pool class no options of its own, so the wait is the class's.
        return connect(settings.redis_url, connection_pool_class=_WaitingNodePool, **options)
    client = connect(settings.redis_url, **options)
    pool = client.connection_pool  # redis-py's plain pool, which fails past its bound: made waiting
    return redis.Redis(connection_pool=redis.BlockingConnectionPool(
        max_connections=settings.redis_connections, timeout=POOL_WAIT_S,
        connection_class=pool.connection_class, **pool.connection_kwargs))


class _WaitingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool of connections to the current primary that, past its bound, waits for a free
    connection as BlockingConnectionPool does (redis-py has no such pool of its own)."""


class _WaitingNodePool(redis.BlockingConnectionPool):
    """A Redis Cluster node's pool that waits POOL_WAIT_S for a free connection past its bound."""

    def __init__(self, **options):
        super().__init__(timeout=POOL_WAIT_S, **options)


class _JsonProvider(DefaultJSONProvider):
    """Flask's JSON, except that a body nested deeper than Python's stack ([[[[...]]]]) is invalid
    JSON, which every route answers with a 400, not a RecursionError's 500; and keys keep their
    order (Flask sorts them by default): completions' top_logprobs list the likeliest token first,
    as OpenAI's do."""

    sort_keys = False

    def loads(self, s, **kwargs):
        try:
            return super().loads(s, **kwargs)
        except RecursionError:
            raise ValueError("the JSON nests too deeply") from None


def _json_body():
    body = request.get_json(force=True, silent=True)  # curl -d sends another Content-Type
    if body is None:
        raise bad_request("the body is not valid JSON",
                          code="invalid_json")
    try:  # a \ud800 escape decodes to a lone surrogate, which no tokenizer or Redis key takes
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("the body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode",
                          code="invalid_json")
    return body


def _tokenize(req: CompletionRequest, tokenizer, chat: bool,
              tool_spec: Optional[tools.ToolSpec] = None) -> list[list[int]]:
    if chat:
        try:
            return [tokenizer.encode_chat(req.messages, tool_spec)]
        except ValueError as exc:
            raise bad_request(str(exc), param="messages")
    prompts = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            prompts.append(tokenizer.encode(prompt))
        elif max(prompt) >= tokenizer.vocab_size:
            raise bad_request(f"token id {max(prompt)} is outside the vocabulary "
                              f"(size {tokenizer.vocab_size})", param="prompt", code="invalid_value")
        else:
            prompts.append(list(prompt))
    if not all(prompts):
        raise bad_request("'prompt' must not be empty", param="prompt", code="invalid_value")
    return prompts


def _echo_texts(req: CompletionRequest, tokenizer) -> list[str]:
    """Completions' echo: each choice's prompt (in the jobs' order), as given or its ids decoded."""
    return [prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            for prompt in req.prompts for _ in range(req.n)]


def _jobs(req: CompletionRequest, prompts: list[list[int]], worker: WorkerInfo,
          request_id: str, timeout_s: float) -> list[Job]:
    jobs = []
    # Always a seed: a job written again after its worker died then writes the same text.
    base_seed = req.params.seed if req.params.seed is not None else random.getrandbits(48)
    for prompt in prompts:
        room = worker.context_window - len(prompt)
        if room < 1:
            raise bad_request(
                f"this model's maximum context length is {worker.context_window} tokens, and the prompt "
                f"has {len(prompt)} tokens, which leaves no room to write: shorten the prompt",
                param="messages" if req.messages else "prompt", code="context_length_exceeded")
        # As the seed does: max_tokens beyond the room left is cut to the room.
        max_tokens = min(req.max_tokens or room, room)
        for choice in range(req.n):
            params = replace(req.params, max_tokens=max_tokens, seed=base_seed + choice)
            jobs.append(Job(id=f"{request_id}-{len(jobs)}", model=req.model, prompt_ids=prompt,
                            params=params, timeout_s=timeout_s, stream=req.stream, priority=req.priority))
    return jobs


def _collect(pending: Pending) -> list[Final]:
    finals: list[Optional[Final]] = [None] * len(pending.jobs)
    for index, result in pending.results():
        if isinstance(result, Failure):
            raise _failure_error(result)
        if isinstance(result, Final):
            finals[index] = result
    return finals


def _failure_error(failure: Failure) -> ApiError:
    return ApiError(504 if failure.code == "timeout" else 500, failure.message, code=failure.code)


def _unsent(sent: str, offset: int, text: str) -> Optional[str]:
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


def _stream(pending: Pending, shape: Shape, include_usage: bool, prompt_tokens: int,
            counted: metrics.Answer):
    """Server-sent events: a chunk per piece of text as the worker writes it, then [DONE]."""
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
                yield sse(counted.failed(_failure_error(result)).body())
                return
            if rendering is not None and rendering.echo and not streamed.echoed[index]:
                streamed.echoed[index] = True  # completions' echo: the prompt (and its logprobs) first
                yield sse(shape.chunk(index, rendering.echo[index],
                                      logprobs=rendering.echo_piece(index, result.prompt_logprobs)))
            new = _unsent(sent[index], result.offset if isinstance(result, TextDelta) else 0, result.text)
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
        yield sse(counted.failed(unavailable(f"the job queue (Redis) is not reachable: {exc}")).body())
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
