"""A completions or chat request's way from its body to its answer: Answerer.answer, one named
step a line, in the order a request takes them, which is also the order its mistakes are reported in:

  parse      the body alone: each field's type, range and shape (api/validation.py)
  workers    the model's live workers: 404 for a model none serves, 503 when none runs (api/broker.py)
  check      what only the workers know: their features, the context window, the vocabulary (api/checks.py)
  admit      the model's queue against its cap: a 429 before the costly steps, so a crowd hears it at once
  tokenize   the prompts, with the model's tokenizer (a chat's tools shown to the model: api/tools.py)
  constrain  the request's one constraint as a grammar, compiled against the tokenizer (api/grammars.py)
  room       each prompt must leave room to write, and sets its jobs' max_tokens (api/checks.py)
  jobs       one per prompt and choice, each with its own seed
  route      each job's note for its answer, and the worker it is offered to first (api/routing.py;
             off with --affinity-wait 0)
  submit     the grammar stored, then the jobs' channels subscribed and the jobs queued (api/broker.py)
  answer     whole (here), or as server-sent events (api/streaming.py)

Everything is checked before anything is queued: a refused request leaves nothing behind.
"""
from __future__ import annotations

import json
import random
import uuid
from dataclasses import replace
from typing import Optional

from flask import Response, jsonify, request

from api import checks, grammars, metrics, routing, streaming, tools
from api.broker import Broker, Pending
from api.errors import bad_request, failure_error
from api.logprobs import Rendering
from api.openai_format import Shape
from api.tokenizers import TokenizerCache
from api.validation import CompletionRequest, parse_chat, parse_completion
from shared.protocol import Failure, Final, Job
from shared.settings import Settings


class Answerer:
    """The completions and chat routes, past Flask: one per app, shared by its requests."""

    def __init__(self, settings: Settings, client, broker: Broker, tokenizers: TokenizerCache):
        self.settings, self.client, self.broker, self.tokenizers = settings, client, broker, tokenizers

    def answer(self, chat: bool) -> Response:
        req = parse(chat, self.settings.lenient)
        workers = self.broker.workers_for(req.model)
        tokenizer = self.tokenizers.get(workers[0])
        checks.check(req, workers, tokenizer)
        cap = self.admit(req, workers)
        tool_spec = tools.spec(req.tools, req.tool_choice, tokenizer.tool_format, req.parallel_tool_calls)
        prompts = tokenize(req, tokenizer, tool_spec)
        grammar = self.constrain(req, tokenizer, tool_spec)
        max_tokens = checks.room(req, prompts, workers[0].context_window)
        request_id = uuid.uuid4().hex[:24]
        jobs, offer_wait_s = self.route(req, prompts, workers,
                                        make_jobs(req, prompts, max_tokens, request_id, self.settings.request_timeout))
        shape = answer_shape(req, request_id, tokenizer, tool_spec, grammar)
        pending = self.submit(req.model, jobs, grammar, cap, offer_wait_s)
        prompt_tokens = sum(len(p) for p in prompts)
        counted = metrics.Answer(req.model)
        if req.stream:
            return streaming.response(pending, shape, req.include_usage, prompt_tokens, counted)
        return whole(pending, shape, prompt_tokens, counted)

    def admit(self, req: CompletionRequest, workers) -> int:
        """The model's cap on waiting jobs, after a 429 if the request's jobs would pass it now.
        (The push itself checks again, atomically: api/admission.py.)"""
        cap = self.broker.admission.cap(workers)
        self.broker.admission.check(req.model, req.choices, cap)
        return cap

    def constrain(self, req: CompletionRequest, tokenizer,
                  tool_spec: Optional[tools.ToolSpec]) -> Optional[grammars.Grammar]:
        grammar = grammars.for_request(req, tokenizer, tool_spec, self.settings.open_objects)
        if grammar is not None:  # the jobs carry only its hash; its text waits in Redis
            req.params = replace(req.params, grammar=grammar.digest)
        return grammar

    def route(self, req: CompletionRequest, prompts: list[list[int]], workers,
              jobs: list[Job]) -> tuple[list[Job], float]:
        """Each job's note for its answer, and the worker it is offered to first: the one whose
        prefix cache holds its conversation (api/routing.py), with how long the offer lasts (0: not
        offered); the jobs as they were with --affinity-wait 0."""
        routed = metrics.ROUTED.labels(req.model)  # the model's series from its first request, at 0 too
        if self.settings.affinity_wait <= 0:
            return jobs, 0.0
        own, offer = routing.plan(self.client, req.model, prompts, req.routing_key, workers)
        jobs = [replace(job, route=own[i // req.n], offer=offer or "") for i, job in enumerate(jobs)]
        if not offer:
            return jobs, 0.0
        routed.inc()
        return jobs, routing.offer_wait(offer, workers, self.settings.affinity_wait)

    def submit(self, model: str, jobs: list[Job], grammar: Optional[grammars.Grammar], cap: int,
               offer_wait_s: float = 0.0) -> Pending:
        if grammar is not None:
            grammars.store(self.client, model, grammar)  # before the jobs: a worker fetches it
        return self.broker.submit(jobs, cap, offer_wait_s)


def parse(chat: bool, lenient: bool) -> CompletionRequest:
    body = request.get_json(force=True, silent=True)  # curl -d sends another Content-Type
    if body is None:
        raise bad_request("the body is not valid JSON",
                          code="invalid_json")
    try:  # a \ud800 escape decodes to a lone surrogate, which no tokenizer or Redis key takes
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("the body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode",
                          code="invalid_json")
    return parse_chat(body, lenient) if chat else parse_completion(body, lenient)


def tokenize(req: CompletionRequest, tokenizer, tool_spec: Optional[tools.ToolSpec] = None) -> list[list[int]]:
    """Each prompt's token ids (a chat's conversation is one prompt, through the chat template)."""
    if req.chat:
        try:
            return [tokenizer.encode_chat(req.messages, tool_spec)]
        except ValueError as exc:
            raise bad_request(str(exc), param="messages")
    prompts = [tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt) for prompt in req.prompts]
    if not all(prompts):  # text the tokenizer makes nothing of
        raise bad_request("'prompt' must not be empty", param="prompt", code="invalid_value")
    return prompts


def make_jobs(req: CompletionRequest, prompts: list[list[int]], max_tokens: list[int],
              request_id: str, timeout_s: float) -> list[Job]:
    """n jobs per prompt, in the order the answer lists its choices; `max_tokens`: each prompt's."""
    jobs = []
    # Always a seed: a job written again after its worker died then writes the same text.
    base_seed = req.params.seed if req.params.seed is not None else random.getrandbits(48)
    for prompt, most in zip(prompts, max_tokens):
        for choice in range(req.n):
            params = replace(req.params, max_tokens=most, seed=base_seed + choice)
            jobs.append(Job(id=f"{request_id}-{len(jobs)}", model=req.model, prompt_ids=prompt,
                            params=params, timeout_s=timeout_s, stream=req.stream, priority=req.priority))
    return jobs


def answer_shape(req: CompletionRequest, request_id: str, tokenizer, tool_spec: Optional[tools.ToolSpec],
                 grammar: Optional[grammars.Grammar]) -> Shape:
    shape = Shape(request_id, req.model, req.chat, tool_spec)
    shape.n = req.n
    shape.unenforced = grammar.relaxed if grammar is not None else ()
    if req.params.logprobs is not None or req.echo:
        shape.rendering = Rendering(tokenizer, req.chat, req.params.logprobs is not None,
                                    _echo_texts(req, tokenizer) if req.echo else None)
    return shape


def _echo_texts(req: CompletionRequest, tokenizer) -> list[str]:
    """Completions' echo: each choice's prompt (in the jobs' order), as given or its ids decoded."""
    return [prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            for prompt in req.prompts for _ in range(req.n)]


def whole(pending: Pending, shape: Shape, prompt_tokens: int, counted: metrics.Answer) -> Response:
    try:
        body = shape.whole(_collect(pending), prompt_tokens)
        counted.answered(body["usage"])
        return jsonify(body)
    finally:
        pending.close()


def _collect(pending: Pending) -> list[Final]:
    finals: list[Optional[Final]] = [None] * len(pending.jobs)
    for index, result in pending.results():
        if isinstance(result, Failure):
            raise failure_error(result)
        if isinstance(result, Final):
            finals[index] = result
    return finals
